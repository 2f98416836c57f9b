//! The body of each cargo-fuzz target in `fuzz/`: what one input goes through. Here rather than
//! in the targets so the kept corpus can be replayed on stable (`tests/corpus.rs`, in CI) by the
//! same code libFuzzer drives (`scripts/fuzz`, nightly). A module per target, named as it is.

pub mod annotations;
pub mod cmdadd_body;
pub mod cni_invocation;
pub mod conflist_edit;
pub mod iptables_save;
pub mod kubeconfig;
pub mod netlink_decode;
pub mod nft_dump;
pub mod proc_parsers;
pub mod route_dump;
pub mod zds_decode;

/// A target's name and its body.
pub type Target = (&'static str, fn(&[u8]));

/// Every target.
pub const TARGETS: [Target; 11] = [
    ("annotations", annotations::run),
    ("cmdadd_body", cmdadd_body::run),
    ("cni_invocation", cni_invocation::run),
    ("conflist_edit", conflist_edit::run),
    ("iptables_save", iptables_save::run),
    ("kubeconfig", kubeconfig::run),
    ("netlink_decode", netlink_decode::run),
    ("nft_dump", nft_dump::run),
    ("proc_parsers", proc_parsers::run),
    ("route_dump", route_dump::run),
    ("zds_decode", zds_decode::run),
];
