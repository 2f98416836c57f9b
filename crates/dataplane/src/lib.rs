//! Privileged side effects of istio-cni-rs: the only crate that enters network namespaces, speaks
//! netlink, runs iptables and touches address sets.

pub mod backend;
pub mod brancheni;
pub mod heap;
pub mod host;
pub mod inpod;
pub mod iptables;
pub mod leftovers;
pub mod logfile;
pub mod netlink;
pub mod netns;
pub mod nft;
pub mod node;
pub mod pod;
pub mod routes;
pub mod sidecar;
pub mod test_support;

pub use backend::{BackendError, BackendOptions, RuleBackend};
