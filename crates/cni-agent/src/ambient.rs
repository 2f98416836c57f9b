//! Ambient mode: which pods of this node are in the mesh, and making it so. `cluster` watches the
//! API server, `reconciler` applies Istio's rules to each change, `mesh` runs the add and remove
//! pipelines, `cni_server` answers the plugin during CNI ADD.

pub mod cluster;
pub mod cni_server;
pub mod config;
pub mod explain;
pub mod hints;
pub mod mesh;
pub mod node;
pub mod reconciler;
pub mod upgrade;
pub mod watched;
