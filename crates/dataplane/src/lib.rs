//! Privileged side effects of istio-cni-rs: the only crate that enters network namespaces, speaks
//! netlink, runs iptables and touches address sets.

pub mod inpod;
pub mod iptables;
pub mod netlink;
pub mod netns;
pub mod nft;
pub mod routes;
pub mod test_support;
