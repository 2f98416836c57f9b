//! `istio-cni`: the CNI plugin the container runtime runs for every pod sandbox. Synchronous and
//! small (no async runtime): it is exec'd on the pod start path.

mod add;
mod agent;
mod http;
mod kube;
mod log;
mod run;
mod sidecar;
mod tls;

use cni_core::cni::EnvSource;

/// The real process environment.
struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

fn main() {
    std::process::exit(run::main(&ProcessEnv));
}
