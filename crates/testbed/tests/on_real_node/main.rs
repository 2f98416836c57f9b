//! Integration tests on the real node (`scripts/real-node`: kubelet, containerd, runc in the
//! node's own namespaces; root, the node images): our chart with each backend, host drift,
//! two nodes, the monitoring kit. Minutes each.
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time (one real node or one
//! cluster at a time), each as it did alone.

mod observability;
mod real_node;
mod real_node_drift;
mod real_node_iptables;
mod two_nodes;
