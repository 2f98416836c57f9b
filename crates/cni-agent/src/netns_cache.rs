//! Pod UID → open network namespace, the agent's memory of every pod it enrolled.
//!
//! Each entry keeps its netns fd open for as long as the pod is enrolled: the same namespace is
//! handed to every ztunnel that connects later (the ZDS snapshot reads this cache), and an open fd
//! is the only handle that survives the runtime unmounting `/var/run/netns/<name>`. An entry
//! without a netns (`ensure`) is a pod we consider enrolled but whose namespace we could not find,
//! e.g. after an agent restart; the snapshot sends those as Keep so ztunnel does not tear them down.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use cni_core::zds::WorkloadInfo;
use dataplane::netns::{Netns, NetnsError, NetnsId};

#[derive(Debug, thiserror::Error)]
pub enum NetnsCacheError {
    #[error("netns path {0:?} must be absolute and must not contain '..'")]
    BadPath(String),
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// Redirecting the host's own namespace would capture the node's traffic.
    #[error("netns path {0:?} is the host's network namespace, not a pod's")]
    HostNetns(String),
}

/// What the cache knows about one pod.
#[derive(Debug, Clone, Default)]
pub struct PodEntry {
    pub workload: Option<WorkloadInfo>,
    pub netns: Option<Arc<Netns>>,
}

/// One snapshot item for a freshly connected ztunnel.
#[derive(Debug, Clone)]
pub struct SnapshotEntry {
    pub uid: String,
    pub entry: PodEntry,
}

#[derive(Debug)]
pub struct NetnsCache {
    host_prefix: PathBuf,
    pods: Mutex<HashMap<String, PodEntry>>,
}

impl NetnsCache {
    /// `host_prefix` is where the host's root is mounted in the agent container (`/host`); the
    /// runtime's `CNI_NETNS` paths are resolved beneath it.
    pub fn new(host_prefix: impl Into<PathBuf>) -> Self {
        NetnsCache {
            host_prefix: host_prefix.into(),
            pods: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, PodEntry>> {
        // A panic while holding the lock cannot leave a half-written map entry behind.
        self.pods
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Opens the runtime-reported `CNI_NETNS` beneath the host prefix, refusing anything that is
    /// not a network namespace, any path that could climb out of the prefix, and the host's own
    /// namespace `host` however it is reached (`/proc/1/ns/net`, a symlink to it).
    pub fn open_netns(&self, cni_netns: &str, host: NetnsId) -> Result<Netns, NetnsCacheError> {
        let path = Path::new(cni_netns);
        if !path.is_absolute() || path.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(NetnsCacheError::BadPath(cni_netns.to_string()));
        }
        let relative = path.strip_prefix("/").unwrap_or(path);
        let netns = Netns::open(self.host_prefix.join(relative))?;
        if netns.id() == host {
            return Err(NetnsCacheError::HostNetns(cni_netns.to_string()));
        }
        Ok(netns)
    }

    /// Records `netns` for `uid`. When the cached namespace is the same one (same nsfs inode and
    /// device) the cached handle is kept and the new one closed, so fds do not pile up on repeated
    /// adds; a different namespace (sandbox recreated) replaces it. Returns the handle in use.
    pub fn upsert(&self, uid: &str, workload: WorkloadInfo, netns: Netns) -> Arc<Netns> {
        let mut pods = self.lock();
        let entry = pods.entry(uid.to_string()).or_default();
        entry.workload = Some(workload);
        match &entry.netns {
            Some(cached) if cached.id() == netns.id() => cached.clone(),
            _ => {
                let netns = Arc::new(netns);
                entry.netns = Some(netns.clone());
                netns
            }
        }
    }

    /// Makes `uid` known without a netns (kept as-is when already present).
    pub fn ensure(&self, uid: &str) {
        self.lock().entry(uid.to_string()).or_default();
    }

    /// Same as [`ensure`](Self::ensure), remembering the workload identity too.
    pub fn ensure_with(&self, uid: &str, workload: WorkloadInfo) {
        self.lock().entry(uid.to_string()).or_default().workload = Some(workload);
    }

    /// Removes `uid`; its netns fd closes when the last user (e.g. an in-flight send) drops it.
    pub fn take(&self, uid: &str) -> Option<PodEntry> {
        self.lock().remove(uid)
    }

    pub fn get(&self, uid: &str) -> Option<PodEntry> {
        self.lock().get(uid).cloned()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A consistent copy of every entry; the Arcs keep the fds open while a snapshot is sent
    /// without holding the lock.
    pub fn snapshot(&self) -> Vec<SnapshotEntry> {
        self.lock()
            .iter()
            .map(|(uid, entry)| SnapshotEntry {
                uid: uid.clone(),
                entry: entry.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> WorkloadInfo {
        WorkloadInfo::new("pod", "ns", "sa")
    }

    #[test]
    fn same_namespace_keeps_the_cached_handle() {
        let cache = NetnsCache::new("/");
        let first = cache.upsert("u", info(), Netns::current().unwrap());
        let again = Netns::current().unwrap();
        let kept = cache.upsert("u", info(), again);
        assert!(Arc::ptr_eq(&first, &kept));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn ensure_then_take() {
        let cache = NetnsCache::new("/");
        cache.ensure("u");
        let entry = cache.get("u").unwrap();
        assert!(entry.netns.is_none() && entry.workload.is_none());
        assert!(cache.take("u").is_some());
        assert!(cache.take("u").is_none());
        assert!(cache.is_empty());
    }

    /// An id no namespace has, for tests that are not about the host check.
    fn elsewhere() -> NetnsId {
        NetnsId { dev: 0, ino: 0 }
    }

    #[test]
    fn open_resolves_beneath_the_prefix_and_refuses_escapes() {
        let cache = NetnsCache::new("/proc/self");
        let ns = cache.open_netns("/ns/net", elsewhere()).unwrap();
        assert_eq!(ns.id(), Netns::current().unwrap().id());
        assert!(matches!(
            cache.open_netns("/../self/ns/net", elsewhere()),
            Err(NetnsCacheError::BadPath(_))
        ));
        assert!(matches!(
            cache.open_netns("ns/net", elsewhere()),
            Err(NetnsCacheError::BadPath(_))
        ));
        assert!(matches!(
            cache.open_netns("/ns/mnt", elsewhere()),
            Err(NetnsCacheError::Netns(NetnsError::NotNetns { .. }))
        ));
    }

    /// `CNI_NETNS` tricks on `/cmdadd`: the host namespace by its /proc path or through a
    /// symlink, and a regular file, are refused before anything is programmed.
    #[test]
    fn host_namespace_and_plain_files_are_refused() {
        let host = Netns::current().unwrap().id();
        let cache = NetnsCache::new("/");
        let err = cache.open_netns("/proc/self/ns/net", host).unwrap_err();
        assert!(matches!(err, NetnsCacheError::HostNetns(_)), "{err}");
        assert!(err.to_string().contains("/proc/self/ns/net"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("cni-1234");
        std::os::unix::fs::symlink("/proc/self/ns/net", &link).unwrap();
        assert!(matches!(
            cache.open_netns(link.to_str().unwrap(), host),
            Err(NetnsCacheError::HostNetns(_))
        ));

        let file = dir.path().join("not-a-netns");
        std::fs::write(&file, b"").unwrap();
        assert!(matches!(
            cache.open_netns(file.to_str().unwrap(), host),
            Err(NetnsCacheError::Netns(NetnsError::NotNetns { .. }))
        ));
    }

    #[test]
    fn different_namespace_replaces_the_handle() {
        dataplane::require_root!();
        let a = dataplane::test_support::TestNetns::new("cache-a");
        let b = dataplane::test_support::TestNetns::new("cache-b");
        let cache = NetnsCache::new("/");
        let first = cache.upsert("u", info(), a.open());
        let second = cache.upsert("u", info(), b.open());
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(cache.get("u").unwrap().netns.unwrap().id(), b.open().id());
        let via_path = cache
            .open_netns(b.path().to_str().unwrap(), elsewhere())
            .unwrap();
        assert_eq!(via_path.id(), b.open().id());
    }
}
