//! Where each pod's network namespace is, as the runtime told us in CNI ADD (`CNI_NETNS`), kept
//! as one small file per pod UID under `<CNI_AGENT_RUN_DIR>/netns/`.
//!
//! Istio finds the namespaces of running pods only by scanning /proc, which depends on cgroup
//! layouts and needs a process in the pod. A hint is checked before use exactly like a /proc
//! candidate (it must be a network namespace holding one of the pod's IPs), so a stale or reused
//! path can never pair a pod with another pod's namespace; /proc stays the fallback. The run dir is
//! a tmpfs on the host, so hints survive an agent's crash and restart but not node reboots, like
//! the namespaces they point to. Every requested stop (upgrade, uninstall) deletes them
//! ([`NetnsHints::clear`]): the next agent may be Istio's, which would leave them behind.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use dataplane::netns::Netns;

use crate::procfs::{HostNetns, NetnsOpener};

#[derive(Clone)]
pub struct NetnsHints {
    dir: PathBuf,
    /// When this agent started: hints written since are its own.
    since: std::time::SystemTime,
    /// Hints that could not be written (full run dir): uid → path, written again at the next
    /// drift check, so a pod enrolled while the disk was full is still found without /proc by an
    /// agent started after that. They live in this agent's memory only: one killed before then
    /// takes them along, and the next agent finds those pods under /proc alone.
    unwritten: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>,
}

/// The journal of pods found in sync by nftables generation (`dataplane::nft::generations`), in
/// the run dir beside the hints' directory (which holds hints only): it is about the same
/// namespaces and goes with them at every requested stop.
const GENERATIONS: &str = "nft-generations";

/// Pod UIDs become file names: anything but `[A-Za-z0-9-]` is refused.
fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

impl NetnsHints {
    pub fn new(run_dir: &Path) -> Self {
        NetnsHints {
            dir: run_dir.join("netns"),
            // File times come from the kernel's coarse clock, up to a tick behind ours.
            since: std::time::SystemTime::now() - std::time::Duration::from_millis(50),
            unwritten: Default::default(),
        }
    }

    /// Remembers the namespace path of a pod's sandbox. A failed write is retried by
    /// [`write_pending`](Self::write_pending); until then it costs only the shortcut.
    pub fn record(&self, uid: &str, netns_path: &str) {
        if !valid_uid(uid) {
            return;
        }
        let mut unwritten = self.unwritten.lock().unwrap();
        if self.write(uid, netns_path) {
            unwritten.remove(uid);
        } else {
            unwritten.insert(uid.to_string(), netns_path.to_string());
        }
    }

    /// Writes the hints that failed before (the run dir was full); returns how many remain.
    pub fn write_pending(&self) -> usize {
        let mut unwritten = self.unwritten.lock().unwrap();
        unwritten.retain(|uid, path| !self.write(uid, path));
        unwritten.len()
    }

    fn write(&self, uid: &str, netns_path: &str) -> bool {
        let hint = self.dir.join(uid);
        let result = self.create(&hint, netns_path).or_else(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => self.replace(uid, &hint, netns_path),
            _ => Err(e),
        });
        match result {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(uid, error = %e, "cannot record netns hint; will retry");
                false
            }
        }
    }

    /// A pod's first hint (every ambient ADD writes one): created in place, as no reader can
    /// mistake it for another. A reader sees no file, an empty one (treated as no hint, as an
    /// agent killed between the create and the write leaves it) or the whole path, written at
    /// once; a tmp file and a rename cost the ADD twice as much for nothing more. The directory
    /// is made at first need.
    fn create(&self, hint: &Path, netns_path: &str) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::DirBuilderExt;
        let open = || std::fs::File::create_new(hint);
        let mut file = match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&self.dir)?;
                open()?
            }
            opened => opened?,
        };
        file.write_all(netns_path.as_bytes()).inspect_err(|_| {
            // A full run dir fails the write after creating the file: nothing may stay.
            let _ = std::fs::remove_file(hint);
        })
    }

    /// A hint already there: kept when it names the same path (a retried ADD), else replaced
    /// (the pod's sandbox was recreated) through a tmp file and a rename, so a reader (a restart
    /// checking hints) sees the old path or the new one, never a cut one, and a failure leaves
    /// the old hint as it was.
    fn replace(&self, uid: &str, hint: &Path, netns_path: &str) -> std::io::Result<()> {
        if std::fs::read(hint).is_ok_and(|held| held == netns_path.as_bytes()) {
            return Ok(());
        }
        let tmp = self.dir.join(format!(".{uid}.tmp"));
        std::fs::write(&tmp, netns_path)
            .and_then(|()| std::fs::rename(&tmp, hint))
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&tmp);
            })
    }

    /// Deletes the hints of pods that are gone (deleted while no agent was running to see it)
    /// and half-written leftovers: every file not named after a UID in `pods`, unless this agent
    /// wrote it (for a pod the caller may not know yet).
    pub fn retain(&self, pods: &std::collections::HashSet<String>) {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if pods.contains(name.as_ref()) {
                continue;
            }
            let fresh = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t > self.since);
            if !fresh && std::fs::remove_file(entry.path()).is_ok() {
                tracing::info!(file = %name, "removed the netns hint of a pod that is gone");
            }
        }
    }

    /// Deletes every hint, their directory and the generations journal; returns how many files
    /// went. Every requested stop
    /// (upgrade, uninstall, reboot) does it: the next agent may be Istio's, which neither reads
    /// nor removes them, so after a rollback and a final uninstall nothing of ours would be left
    /// otherwise. Our next agent finds the running pods through /proc, as Istio's does.
    pub fn clear(&self) -> usize {
        self.unwritten.lock().unwrap().clear();
        // `remove_file` unlinks: a symlink planted here is removed, never followed.
        let journal = usize::from(std::fs::remove_file(self.journal_path()).is_ok());
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return journal;
        };
        let removed = journal
            + dir
                .flatten()
                .filter(|e| std::fs::remove_file(e.path()).is_ok())
                .count();
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the netns hint directory");
        }
        removed
    }

    /// The generations journal, opened for reading and appending (created when missing, in the
    /// run dir the agent's sockets already created). A symlink in its place is refused: the run
    /// dir is on the host.
    pub fn generations_journal(&self) -> std::io::Result<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.journal_path())
    }

    fn journal_path(&self) -> PathBuf {
        self.dir.with_file_name(GENERATIONS)
    }

    pub fn forget(&self, uid: &str) {
        self.unwritten.lock().unwrap().remove(uid);
        if valid_uid(uid) {
            let _ = std::fs::remove_file(self.dir.join(uid));
        }
    }

    /// The UIDs that have a hint.
    pub fn uids(&self) -> Vec<String> {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        dir.flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|name| valid_uid(name))
            .collect()
    }

    /// Opens the hinted namespace (under `host_prefix`) if it is a network namespace that holds
    /// one of `ips`; `None` otherwise (no hint, gone, reused by another pod, or no IPs to check).
    pub fn open_verified(&self, uid: &str, ips: &[IpAddr], host_prefix: &Path) -> Option<Netns> {
        if ips.is_empty() {
            tracing::debug!(uid, "no netns hint check: no pod IPs");
            return None;
        }
        let netns = self.open_unverified(uid, host_prefix)?;
        verified(uid, HostNetns.owns(&netns, ips)).then_some(netns)
    }

    /// The hinted namespace, opened but not yet checked: the caller must check it holds one of
    /// the pod's IPs ([`verified`]) before using it, as [`open_verified`](Self::open_verified)
    /// does; for callers that run that check on threads of their own.
    pub fn open_unverified(&self, uid: &str, host_prefix: &Path) -> Option<Netns> {
        if !valid_uid(uid) {
            tracing::debug!(uid, "no netns hint check: invalid uid");
            return None;
        }
        let path = std::fs::read_to_string(self.dir.join(uid)).ok()?;
        let relative = Path::new(path.trim()).strip_prefix("/").ok()?;
        if relative
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return None;
        }
        match HostNetns.open(&host_prefix.join(relative)) {
            Ok(ns) => Some(ns),
            Err(e) => {
                tracing::debug!(uid, path = %path.trim(), error = %e, "netns hint not usable");
                None
            }
        }
    }
}

/// Whether a hinted namespace may be used, given the check that it holds one of the pod's IPs
/// ([`NetnsOpener::owns`]); a failed or negative check is logged.
pub fn verified(uid: &str, owns: Result<bool, String>) -> bool {
    match owns {
        Ok(true) => true,
        Ok(false) => {
            tracing::warn!(uid, "netns hint no longer holds the pod's IPs; ignoring it");
            false
        }
        Err(e) => {
            tracing::warn!(uid, error = %e, "cannot check netns hint");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_uids_that_are_not_file_names() {
        for bad in ["", "../x", "a/b", ".", "a b"] {
            assert!(!valid_uid(bad), "{bad:?}");
        }
        assert!(valid_uid("863b91d4-4b68-4efa-917f-4b560e3e86aa"));
    }

    /// The names in `dir`, sorted.
    fn file_names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_failed_write_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let hints = NetnsHints::new(dir.path());
        hints.record("uid-1", "/proc/self/ns/net");
        // A directory in the hint's place fails the rename after the temp file was written, as
        // a full run dir fails the write after the file was created.
        std::fs::create_dir(dir.path().join("netns/uid-2")).unwrap();
        hints.record("uid-2", "/proc/self/ns/net");
        assert_eq!(
            file_names(&dir.path().join("netns")),
            ["uid-1", "uid-2"],
            "a temp file was left behind"
        );

        // Written once there is room again.
        std::fs::remove_dir(dir.path().join("netns/uid-2")).unwrap();
        assert_eq!(hints.write_pending(), 0);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("netns/uid-2")).unwrap(),
            "/proc/self/ns/net"
        );
        // A forgotten pod's failed hint is not written later.
        std::fs::create_dir(dir.path().join("netns/uid-3")).unwrap();
        hints.record("uid-3", "/proc/self/ns/net");
        hints.forget("uid-3");
        std::fs::remove_dir(dir.path().join("netns/uid-3")).unwrap();
        assert_eq!(hints.write_pending(), 0);
        assert!(!dir.path().join("netns/uid-3").exists());
    }

    /// A hint naming the same namespace is not written again; one naming another is replaced
    /// whole; an empty one (an agent killed between creating and writing it) is no hint.
    #[test]
    fn a_hint_is_written_only_when_it_changes() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let hints = NetnsHints::new(dir.path());
        let file = dir.path().join("netns/uid-1");
        hints.record("uid-1", "/var/run/netns/cni-a");
        let first = std::fs::metadata(&file).unwrap().ino();
        hints.record("uid-1", "/var/run/netns/cni-a");
        assert_eq!(
            std::fs::metadata(&file).unwrap().ino(),
            first,
            "rewritten with the same path"
        );
        hints.record("uid-1", "/var/run/netns/cni-b");
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "/var/run/netns/cni-b"
        );

        std::fs::write(dir.path().join("netns/uid-2"), "").unwrap();
        assert!(hints.open_unverified("uid-2", Path::new("/")).is_none());
        hints.record("uid-2", "/proc/self/ns/net");
        assert!(hints.open_unverified("uid-2", Path::new("/")).is_some());
        assert_eq!(
            file_names(&dir.path().join("netns")),
            ["uid-1", "uid-2"],
            "a temp file was left behind"
        );
    }

    #[test]
    fn retain_drops_gone_pods_and_leftovers_but_not_fresh_hints() {
        let dir = tempfile::tempdir().unwrap();
        let before = NetnsHints::new(dir.path());
        for uid in ["live", "gone"] {
            before.record(uid, "/proc/self/ns/net");
        }
        std::fs::write(dir.path().join("netns/.half.tmp"), "/proc/").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        // The next agent: what it writes itself stays, even for a pod not in its list.
        let hints = NetnsHints::new(dir.path());
        hints.record("fresh", "/proc/self/ns/net");
        let live = std::collections::HashSet::from(["live".to_string()]);
        hints.retain(&live);
        let mut names: Vec<String> = std::fs::read_dir(dir.path().join("netns"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["fresh", "live"]);
    }

    #[test]
    fn the_generations_journal_lives_and_goes_with_the_hints() {
        let dir = tempfile::tempdir().unwrap();
        let hints = NetnsHints::new(dir.path());
        hints.record("live", "/proc/self/ns/net");
        drop(hints.generations_journal().unwrap());
        std::thread::sleep(std::time::Duration::from_millis(100));
        let next = NetnsHints::new(dir.path());
        next.retain(&std::collections::HashSet::from(["live".to_string()]));
        assert!(dir.path().join(GENERATIONS).exists());
        assert_eq!(next.uids(), ["live"]);
        assert_eq!(next.clear(), 2);
        assert!(!dir.path().join(GENERATIONS).exists());

        // Planted as a symlink, it is not followed.
        let target = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, dir.path().join(GENERATIONS)).unwrap();
        assert!(next.generations_journal().is_err());
        assert!(!target.exists());
    }

    #[test]
    fn clear_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let hints = NetnsHints::new(dir.path());
        for uid in ["a", "b"] {
            hints.record(uid, "/proc/self/ns/net");
        }
        std::fs::write(dir.path().join("netns/.half.tmp"), "/proc/").unwrap();
        // Pending (unwritten) hints are dropped too: nothing is written after a stop.
        std::fs::create_dir(dir.path().join("netns/c")).unwrap();
        hints.record("c", "/proc/self/ns/net");
        std::fs::remove_dir(dir.path().join("netns/c")).unwrap();
        assert_eq!(hints.clear(), 3);
        assert!(!dir.path().join("netns").exists());
        assert_eq!(hints.write_pending(), 0);
        assert!(!dir.path().join("netns").exists());
        assert_eq!(hints.clear(), 0, "clearing nothing");
        // The run dir itself (Istio's files live there too) stays.
        assert!(dir.path().exists());
    }

    #[test]
    fn unknown_or_ipless_pods_have_no_hint() {
        let dir = tempfile::tempdir().unwrap();
        let hints = NetnsHints::new(dir.path());
        hints.record("uid-1", "/proc/self/ns/net");
        assert!(
            hints
                .open_verified("uid-2", &["10.0.0.1".parse().unwrap()], Path::new("/"))
                .is_none()
        );
        assert!(hints.open_verified("uid-1", &[], Path::new("/")).is_none());
        // This process's namespace does not hold a TEST-NET address: the hint is not trusted.
        assert!(
            hints
                .open_verified("uid-1", &["192.0.2.77".parse().unwrap()], Path::new("/"))
                .is_none()
        );
        hints.forget("uid-1");
        assert!(!dir.path().join("netns/uid-1").exists());
    }
}
