//! Integration tests on the emulated node (root, network namespaces): the CNI chain, real traffic
//! through the redirection, the ZDS server and its peer, and the whole node end to end with a real
//! kube-apiserver, the agent process and the runtime emulator.
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time, each as it did alone.

mod add_overlap;
mod cni_chain;
mod explain;
mod hostile_peers;
mod node_e2e;
mod redirect_traffic;
mod zds;
mod zds_pod_delete;
