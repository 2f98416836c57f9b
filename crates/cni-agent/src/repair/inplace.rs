//! In-place repair (`REPAIR_REPAIR_PODS`): program the sidecar redirection the plugin would have
//! programmed at ADD, inside the running pod's namespace, so the next restart of its validation
//! container succeeds without deleting the pod. The settings come from the pod object exactly as
//! the plugin derives them, and the rules go through the same backends.

use std::sync::Arc;

use cni_core::redirect::sidecar::{Detection, detect, has_ipv6};
use dataplane::netns::Netns;
use dataplane::sidecar::SidecarBackend;
use k8s_openapi::api::core::v1::Pod;

use super::netns::{FindError, PodNetnsFinder};
use crate::ambient::config::AmbientArgs;
use crate::ambient::hints::NetnsHints;
use crate::install::config::InstallArgs;

#[derive(Debug, thiserror::Error)]
pub enum InPlaceError {
    #[error("finding the pod's netns: {0}")]
    Find(#[from] FindError),
    #[error("sidecar settings: {0}")]
    Settings(#[from] cni_core::redirect::sidecar::SidecarError),
    #[error("not a sidecar pod the plugin would redirect: {0}")]
    NotSidecar(String),
    #[error("host netns: {0}")]
    Host(String),
    #[error("programming the redirection: {0}")]
    Program(#[from] dataplane::sidecar::SidecarError),
    #[error("{0}")]
    Task(String),
}

pub struct InPlaceRepair {
    pub finder: PodNetnsFinder,
    /// `nftables` with `NATIVE_NFTABLES`, else `iptables`.
    pub backend: &'static str,
    /// `FORCE_IPTABLES_BINARY`
    pub force_iptables_binary: Option<String>,
    /// The host's namespace, where the iptables variant is detected (`None`: this process's).
    pub host: Option<Arc<Netns>>,
}

impl InPlaceRepair {
    /// The agent's settings: host namespace as ambient mode chooses it (`HOST_NETNS`, else
    /// `<HOST_PREFIX>/proc/1/ns/net` with `ALLOW_SWITCH_TO_HOST_NS`, else our own), netns hints
    /// from `CNI_AGENT_RUN_DIR`.
    pub fn from_args(install: &InstallArgs, a: &AmbientArgs) -> Result<Self, InPlaceError> {
        let host_path = match a.host_netns.as_ref().filter(|p| !p.as_os_str().is_empty()) {
            Some(p) => Some(p.clone()),
            None if a.allow_switch_to_host_ns => Some(a.host_prefix.join("proc/1/ns/net")),
            None => None,
        };
        let host = match &host_path {
            Some(p) => {
                Netns::open(p).map_err(|e| InPlaceError::Host(format!("{}: {e}", p.display())))?
            }
            None => Netns::current().map_err(|e| InPlaceError::Host(e.to_string()))?,
        };
        Ok(InPlaceRepair {
            finder: PodNetnsFinder {
                hints: NetnsHints::new(&install.cni_agent_run_dir),
                host_prefix: a.host_prefix.clone(),
                proc_dir: a.host_prefix.join("proc"),
                host: host.id(),
                netns_dir: a.host_prefix.join("var/run/netns"),
            },
            backend: if install.native_nftables {
                "nftables"
            } else {
                "iptables"
            },
            force_iptables_binary: a.force_iptables_binary.clone().filter(|f| !f.is_empty()),
            host: host_path.map(|_| Arc::new(host)),
        })
    }

    /// Programs the redirection in `pod`'s namespace. Re-applying an unchanged pod is a no-op.
    pub async fn repair(&self, pod: &Pod) -> Result<(), InPlaceError> {
        let ips = crate::ambient::cluster::pod_ips(pod.status.as_ref());
        let object = serde_json::to_value(pod).map_err(|e| InPlaceError::Task(e.to_string()))?;
        let cfg = match detect(&object, has_ipv6(ips.iter().copied()))? {
            Detection::Sidecar(cfg) => cfg,
            Detection::Skip(why) => return Err(InPlaceError::NotSidecar(why)),
        };
        let netns = self.finder.find(pod).await?;
        let (backend, force, host) = (
            self.backend,
            self.force_iptables_binary.clone(),
            self.host.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let ipv6 = cfg.ipv6;
            let make = move || SidecarBackend::new(backend, force.as_deref(), ipv6);
            let backend = match host {
                Some(h) => h
                    .run(make)
                    .map_err(|e| InPlaceError::Host(e.to_string()))??,
                None => make()?,
            };
            backend.apply(&netns, &cfg)?;
            Ok(())
        })
        .await
        .map_err(|e| InPlaceError::Task(e.to_string()))?
    }
}
