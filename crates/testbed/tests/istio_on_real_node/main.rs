//! Integration tests with Istio's own parts on the real node: Istio's agent and the switch to
//! ours and back, the migration under a prober, Istio's installers, istiod's injector and
//! istioctl's tools. Minutes each; Istio's binaries are built from the pin (cached).
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time (one real node at a
//! time), each as it did alone. `istio_mesh` stays a binary of its own: its shared mesh lives
//! as long as its test process.

mod istio_agent;
mod istio_installers;
mod istio_tools;
mod migration;
