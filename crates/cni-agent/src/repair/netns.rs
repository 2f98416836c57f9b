//! Finds the network namespace of a running (crash-looping) pod for in-place repair: the path the
//! runtime gave in CNI ADD when the agent recorded one, else a scan of the host's /proc. Either
//! way the namespace must hold one of the pod's IPs, so a reused path or a stray process can never
//! pair the pod with another pod's namespace.

use std::collections::HashMap;
use std::path::PathBuf;

use cni_core::zds::WorkloadInfo;
use dataplane::netns::{Netns, NetnsId};
use k8s_openapi::api::core::v1::Pod;

use crate::ambient::hints::NetnsHints;
use crate::procfs::{HostNetns, ProcScanner, WantedPod};

#[derive(Debug, thiserror::Error)]
pub enum FindError {
    #[error("pod has no UID")]
    NoUid,
    #[error("pod has no IP yet: its namespace cannot be verified")]
    NoIps,
    #[error("no namespace holding the pod's IPs found (hint or /proc)")]
    NotFound,
    #[error("scanning {0}: {1}")]
    Scan(PathBuf, String),
}

pub struct PodNetnsFinder {
    pub hints: NetnsHints,
    /// Where the host's filesystem is mounted (`CNI_NETNS` hint paths resolve beneath it).
    pub host_prefix: PathBuf,
    /// `<host_prefix>/proc`
    pub proc_dir: PathBuf,
    /// The host's own namespace, never a pod's.
    pub host: NetnsId,
}

impl PodNetnsFinder {
    pub async fn find(&self, pod: &Pod) -> Result<Netns, FindError> {
        let uid = pod.metadata.uid.clone().ok_or(FindError::NoUid)?;
        let ips = crate::ambient::cluster::pod_ips(pod.status.as_ref());
        if ips.is_empty() {
            return Err(FindError::NoIps);
        }
        if let Some(ns) = self.hints.open_verified(&uid, &ips, &self.host_prefix) {
            return Ok(ns);
        }
        let workload = WorkloadInfo::new(
            pod.metadata.name.clone().unwrap_or_default(),
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_default(),
        );
        let wanted = HashMap::from([(uid.clone(), WantedPod { workload, ips })]);
        let (proc_dir, host) = (self.proc_dir.clone(), self.host);
        let found = tokio::task::spawn_blocking(move || {
            ProcScanner::with_host(&proc_dir, host)
                .find(&HostNetns, &wanted)
                .map_err(|e| FindError::Scan(proc_dir, e.to_string()))
        })
        .await
        .map_err(|e| FindError::Scan(self.proc_dir.clone(), e.to_string()))??;
        found
            .into_values()
            .next()
            .map(|f| f.netns)
            .ok_or(FindError::NotFound)
    }
}

#[cfg(test)]
mod tests {
    use dataplane::test_support::TestNetns;
    use serde_json::json;

    use super::*;

    fn pod(uid: &str, ip: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "apps", "uid": uid},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}]}
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn a_hint_is_used_only_when_its_namespace_holds_the_pod_ip() {
        dataplane::require_root!();
        let ns = TestNetns::new("repair-find");
        ns.exec(
            "ip",
            &[
                "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
            ],
        );
        ns.exec("ip", &["addr", "add", "10.251.3.7/24", "dev", "eth0"]);
        let run = tempfile::tempdir().unwrap();
        let empty_proc = tempfile::tempdir().unwrap();
        let hints = NetnsHints::new(run.path());
        hints.record("uid-1", &ns.path().display().to_string());
        let finder = PodNetnsFinder {
            hints,
            host_prefix: "/".into(),
            proc_dir: empty_proc.path().to_path_buf(),
            host: Netns::current().unwrap().id(),
        };
        let found = finder.find(&pod("uid-1", "10.251.3.7")).await.unwrap();
        assert_eq!(found.id(), ns.open().id());
        // Same hint, but the pod's IP is elsewhere: the hint is refused and /proc has nothing.
        assert!(matches!(
            finder.find(&pod("uid-1", "10.251.3.8")).await,
            Err(FindError::NotFound)
        ));
        assert!(matches!(
            finder.find(&pod("uid-2", "")).await,
            Err(FindError::NoIps)
        ));
    }
}
