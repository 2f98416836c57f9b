//! The `install-cni` node agent: installer, ambient enrollment, ZDS server, repair and HTTP.

pub mod agent;
pub mod ambient;
pub mod cli;
pub mod config;
pub mod dataplane_cli;
pub mod handover;
pub mod hostfs;
pub mod http;
pub mod install;
pub mod kube_client;
pub mod logging;
pub mod logsock;
pub mod metrics;
pub mod netns_cache;
pub mod pinned_netns;
pub mod procfs;
pub mod repair;
pub mod uds;
pub mod zds;
