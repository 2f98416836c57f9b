//! Pure logic of istio-cni-rs. Nothing in this crate performs I/O or needs privileges, so every
//! wire format and rule set it renders is tested byte for byte without root.

pub mod cgroup;
pub mod conflist;
pub mod redirect;
pub mod zds;
