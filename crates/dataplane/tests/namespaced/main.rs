//! The dataplane in real network namespaces (root): iptables (legacy and nft) and nftables over
//! netlink, pod enrollment, leftovers, the branch ENI's routes, rules Istio's agent programs.
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time, each as it did alone.

mod brancheni;
mod iptables_backend;
mod istio_migration;
mod leftovers;
mod nft;
mod pod_enroll;
