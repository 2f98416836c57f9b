//! The network namespaces the runtime pinned in its netns directory (`/var/run/netns`, the
//! chart's `cniNetnsDir`), searched for a pod's: the last way to find a sandbox no process lives
//! in. CRI-O with `drop_infra_ctr=true` runs no pause process, so while a pod's containers are all
//! down (crash-looping, restarting) /proc has nothing in its namespace, and after an agent's
//! upgrade no hint either (istio/istio#60478; Istio looks in /proc only). Both the ambient mesh's
//! discovery and repair look here after /proc.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use dataplane::netns::{Netns, NetnsId};

use crate::procfs::{addresses, addresses_contain_any};

#[derive(Debug, thiserror::Error)]
pub enum PinnedError {
    #[error("several pinned namespaces hold the pod's IPs: {0:?}")]
    Ambiguous(Vec<PathBuf>),
    #[error("reading {0}: {1}")]
    Read(PathBuf, String),
}

/// The one namespace pinned in `dir` that holds one of `ips` (several files may pin the same
/// namespace). Entries that are not network namespaces, whose addresses cannot be read, or that
/// pin `host` (CRI-O pins the node's own namespace for each host-network pod) are skipped; two
/// different namespaces holding the IPs are refused rather than guessed between.
pub fn holding(dir: &Path, host: NetnsId, ips: &[IpAddr]) -> Result<Option<Netns>, PinnedError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(PinnedError::Read(dir.to_path_buf(), e.to_string())),
    };
    let mut found: Option<(Netns, Vec<PathBuf>)> = None;
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(ns) = Netns::open(&path) else { continue };
        if ns.id() == host || !addresses(&ns).is_ok_and(|a| addresses_contain_any(&a, ips)) {
            continue;
        }
        match &mut found {
            None => found = Some((ns, vec![path])),
            Some((f, paths)) => {
                paths.push(path);
                if f.id() != ns.id() {
                    return Err(PinnedError::Ambiguous(std::mem::take(paths)));
                }
            }
        }
    }
    Ok(found.map(|(ns, _)| ns))
}

#[cfg(test)]
pub mod test_support {
    use dataplane::test_support::TestNetns;

    /// A namespace pinned by a bind mount in a directory of our own, like the runtime's pin in
    /// /var/run/netns; unmounted on drop (before the namespace's own pin goes).
    pub struct Pin(std::path::PathBuf);

    impl Pin {
        pub fn new(ns: &TestNetns, dir: &std::path::Path, name: &str) -> Self {
            let path = dir.join(name);
            std::fs::write(&path, b"").unwrap();
            dataplane::test_support::run(
                "mount",
                &[
                    "--bind",
                    &ns.path().display().to_string(),
                    &path.display().to_string(),
                ],
            );
            Pin(path)
        }
    }

    impl Drop for Pin {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }

    /// A pod-like namespace: an `eth0` holding `ip`/24.
    pub fn pod_namespace(prefix: &str, ip: &str) -> TestNetns {
        let ns = TestNetns::new(prefix);
        ns.exec(
            "ip",
            &[
                "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
            ],
        );
        ns.exec("ip", &["addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
        ns
    }
}
