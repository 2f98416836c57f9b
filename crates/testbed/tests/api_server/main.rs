//! Integration tests against a real kube-apiserver and etcd (`K8S_TESTENV_DIR`): the shipped
//! deployment, the repair controller, the agent's watches, the API fault proxy. Some need root.
//!
//! Each module is a former test binary of its own, and its tests enter the group gate
//! (`dataplane::enter_test_group!`), so modules still run one at a time, each as it did alone.

mod deploy;
mod fault_injection;
mod kube_testenv;
mod repair;
mod watch_relist;
