//! Finds the network namespace of a running (crash-looping) pod for in-place repair: the path the
//! runtime gave in CNI ADD when the agent recorded one, else a scan of the host's /proc, else the
//! namespaces the runtime pinned in the netns directory. Every way the namespace must hold one of
//! the pod's IPs, so a reused path or a stray process can never pair the pod with another pod's
//! namespace.
//!
//! The pinned directory ([`crate::pinned_netns`]) is the last resort for a sandbox no process
//! lives in: CRI-O with `drop_infra_ctr=true` runs no pause process, so while the pod's only
//! containers (its validation init container) crash-loop, /proc has nothing in the namespace, and
//! a pod created while the agent was away has no hint either (istio/istio#60478).

use std::collections::HashMap;
use std::path::PathBuf;

use cni_core::zds::WorkloadInfo;
use dataplane::netns::{Netns, NetnsId};
use k8s_openapi::api::core::v1::Pod;

use crate::ambient::hints::NetnsHints;
use crate::pinned_netns::{self, PinnedError};
use crate::procfs::{HostNetns, ProcScanner, WantedPod};

#[derive(Debug, thiserror::Error)]
pub enum FindError {
    #[error("pod has no UID")]
    NoUid,
    #[error("pod has no IP yet: its namespace cannot be verified")]
    NoIps,
    #[error("no namespace holding the pod's IPs found (hint, /proc or the pinned netns directory)")]
    NotFound,
    #[error("several pinned namespaces hold the pod's IPs: {0:?}")]
    Ambiguous(Vec<PathBuf>),
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
    /// Where the runtime pins pod namespaces, as the agent sees it (`<host_prefix>/var/run/netns`,
    /// the chart's `cniNetnsDir` mount).
    pub netns_dir: PathBuf,
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
        let netns_dir = self.netns_dir.clone();
        tokio::task::spawn_blocking(move || {
            let found = ProcScanner::with_host(&proc_dir, host)
                .find(&HostNetns, &wanted)
                .map_err(|e| FindError::Scan(proc_dir, e.to_string()))?;
            if let Some(f) = found.into_values().next() {
                return Ok(f.netns);
            }
            let ips = &wanted[&uid].ips;
            match pinned_netns::holding(&netns_dir, host, ips) {
                Ok(found) => found.ok_or(FindError::NotFound),
                Err(PinnedError::Ambiguous(paths)) => Err(FindError::Ambiguous(paths)),
                Err(PinnedError::Read(dir, e)) => Err(FindError::Scan(dir, e)),
            }
        })
        .await
        .map_err(|e| FindError::Scan(self.proc_dir.clone(), e.to_string()))?
    }
}

#[cfg(test)]
mod tests {
    use dataplane::test_support::TestNetns;
    use serde_json::json;

    use super::*;
    use crate::pinned_netns::test_support::{Pin, pod_namespace};

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
            netns_dir: run.path().join("no-pinned-netns"),
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

    /// CRI-O's `drop_infra_ctr=true` (istio/istio#60478): no process in the sandbox and no hint,
    /// only the runtime's pin. The pinned namespace holding the pod's IP is found; other files
    /// and namespaces in the directory are passed over; two namespaces holding it are refused.
    #[tokio::test]
    async fn a_sandbox_without_a_process_is_found_by_its_pinned_namespace() {
        dataplane::require_root!();
        let pod_ns = pod_namespace("repair-pin", "10.251.4.7");
        let other_ns = pod_namespace("repair-pin", "10.251.4.8");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("not-a-netns"), b"x").unwrap();
        let _pins = [
            Pin::new(&pod_ns, dir.path(), "pod"),
            Pin::new(&other_ns, dir.path(), "other"),
        ];
        let run = tempfile::tempdir().unwrap();
        let empty_proc = tempfile::tempdir().unwrap();
        let finder = PodNetnsFinder {
            hints: NetnsHints::new(run.path()),
            host_prefix: "/".into(),
            proc_dir: empty_proc.path().to_path_buf(),
            host: Netns::current().unwrap().id(),
            netns_dir: dir.path().to_path_buf(),
        };
        let found = finder.find(&pod("uid-1", "10.251.4.7")).await.unwrap();
        assert_eq!(found.id(), pod_ns.open().id());
        assert!(matches!(
            finder.find(&pod("uid-1", "10.251.4.9")).await,
            Err(FindError::NotFound)
        ));

        // A second namespace with the same IP (a leaked sandbox): neither is guessed.
        let twin = pod_namespace("repair-pin", "10.251.4.7");
        let _twin_pin = Pin::new(&twin, dir.path(), "twin");
        assert!(matches!(
            finder.find(&pod("uid-1", "10.251.4.7")).await,
            Err(FindError::Ambiguous(paths)) if paths.len() == 2
        ));
    }
}
