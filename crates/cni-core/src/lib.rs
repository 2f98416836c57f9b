//! Pure logic of istio-cni-rs. Nothing in this crate performs I/O or needs privileges, so every
//! wire format and rule set it renders is tested byte for byte without root.

pub mod cgroup;
pub mod cmdadd;
pub mod cni;
pub mod conflist;
pub mod enroll;
pub mod kubeconfig;
pub mod plugin_conf;
pub mod reconcile;
pub mod redirect;
pub mod zds;
