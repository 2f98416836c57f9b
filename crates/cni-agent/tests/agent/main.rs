//! The `install-cni` binary's integration tests: the installer, a live backend switch in real
//! namespaces (root), and our log records against Istio's own logger.
//! (`sidecar_traffic` is a binary of its own: its main doubles as the proxy process.)
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time, each as it did alone.

mod backend_switch;
mod install;
mod log_format;
