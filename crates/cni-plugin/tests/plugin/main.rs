//! The `istio-cni` plugin binary exec'd as a runtime does: ambient and sidecar pods, the agent's
//! socket and the API server fallback, sidecar rules in a real pod namespace (root).
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time, each as it did alone.

mod exec;
mod sidecar_exec;
mod support;
