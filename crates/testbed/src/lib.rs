//! Test kit: real components wired the way a node wires them (never mocks of them). Compiled only
//! for tests and with the `testing` feature; never part of the shipped agent.

pub mod api_proxy;
pub mod apiserver_metrics;
pub mod churn;
pub mod cluster_fill;
pub mod cni_runtime;
pub mod cpu_profile;
pub mod istio_agent;
pub mod istio_mesh;
pub mod kube;
pub mod manifests;
pub mod migrate;
pub mod node;
pub mod pod_proxy;
pub mod ports;
pub mod real_node;
pub mod registry;
pub mod relay;
pub mod switch;
pub mod zds_peer;
