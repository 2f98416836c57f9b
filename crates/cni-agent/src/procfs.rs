//! Finds the network namespaces of pods that were already running when the agent started, by
//! walking the host's `/proc` (istio-cni.md §4.6).
//!
//! A process's cgroup names its pod, but a process can sit in another pod's namespace (a debug
//! container, a CNI helper), so a candidate namespace is accepted only when one of its interface
//! addresses is one of the pod's IPs. Pods without IPs are skipped: without that check we would
//! rather not enroll than enroll the wrong namespace. When several namespaces qualify, the one
//! of the oldest process wins (the sandbox's pause process starts first).

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use cni_core::cgroup::{parse_cgroups, parse_starttime};
use cni_core::zds::WorkloadInfo;
use dataplane::netns::{Netns, NetnsId};

/// Default location of the host's `/proc` inside the agent container.
pub const DEFAULT_PROC: &str = "/host/proc";

/// A pod we want a namespace for.
#[derive(Debug, Clone)]
pub struct WantedPod {
    pub workload: WorkloadInfo,
    pub ips: Vec<IpAddr>,
}

/// A namespace accepted for a pod.
#[derive(Debug)]
pub struct FoundNetns<H> {
    pub uid: String,
    pub netns: H,
    pub id: NetnsId,
    pub pid: u32,
    /// Start time of the owning process, in clock ticks since boot.
    pub starttime: u64,
    pub workload: WorkloadInfo,
}

/// How a candidate namespace is opened and checked. [`HostNetns`] is the real thing; tests
/// substitute fixture handles.
pub trait NetnsOpener {
    type Handle;
    fn open(&self, path: &Path) -> Result<Self::Handle, String>;
    /// Whether an interface in the namespace carries one of `ips` (already unmapped).
    fn owns(&self, netns: &Self::Handle, ips: &[IpAddr]) -> Result<bool, String>;
}

/// Opens real namespaces and lists their addresses from inside (on a throwaway thread).
#[derive(Debug, Default, Clone, Copy)]
pub struct HostNetns;

impl NetnsOpener for HostNetns {
    type Handle = Netns;

    fn open(&self, path: &Path) -> Result<Netns, String> {
        Netns::open(path).map_err(|e| e.to_string())
    }

    fn owns(&self, netns: &Netns, ips: &[IpAddr]) -> Result<bool, String> {
        Ok(addresses_contain_any(&addresses(netns)?, ips))
    }
}

/// Every address of every interface in `netns`.
pub fn addresses(netns: &Netns) -> Result<Vec<IpAddr>, String> {
    netns
        .run(|| {
            nix::ifaddrs::getifaddrs().map(|it| {
                it.filter_map(|ifa| ifa.address)
                    .filter_map(|a| {
                        if let Some(v4) = a.as_sockaddr_in() {
                            Some(IpAddr::V4(v4.ip()))
                        } else {
                            a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
                        }
                    })
                    .collect::<Vec<_>>()
            })
        })
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("listing addresses: {e}"))
}

/// True when any address equals any pod IP, comparing IPv4-mapped IPv6 as IPv4.
pub fn addresses_contain_any(addrs: &[IpAddr], ips: &[IpAddr]) -> bool {
    addrs
        .iter()
        .any(|a| ips.iter().any(|ip| a.to_canonical() == ip.to_canonical()))
}

/// Reads `<pid dir>/cgroup`; replaceable because tests cannot give real processes fake cgroups.
pub type CgroupReader = Box<dyn Fn(&Path) -> io::Result<String> + Send + Sync>;

pub struct ProcScanner {
    proc_dir: PathBuf,
    host: NetnsId,
    read_cgroup: CgroupReader,
}

fn stat_id(path: &Path) -> io::Result<NetnsId> {
    let m = fs::metadata(path)?;
    Ok(NetnsId {
        dev: m.dev(),
        ino: m.ino(),
    })
}

impl ProcScanner {
    /// Fails when the host namespace (`<proc>/1/ns/net`) cannot be identified: scanning without
    /// that guard could pair a pod with the host's namespace (istio#55139).
    pub fn new(proc_dir: impl Into<PathBuf>) -> io::Result<Self> {
        Self::with_cgroup_reader(
            proc_dir,
            Box::new(|pid_dir| fs::read_to_string(pid_dir.join("cgroup"))),
        )
    }

    /// Scanner with the host namespace given by the caller (an agent configured with an explicit
    /// host netns, or where `<proc>/1` is not readable).
    pub fn with_host(proc_dir: impl Into<PathBuf>, host: NetnsId) -> Self {
        ProcScanner {
            proc_dir: proc_dir.into(),
            host,
            read_cgroup: Box::new(|pid_dir| fs::read_to_string(pid_dir.join("cgroup"))),
        }
    }

    pub fn with_cgroup_reader(
        proc_dir: impl Into<PathBuf>,
        read_cgroup: CgroupReader,
    ) -> io::Result<Self> {
        let proc_dir = proc_dir.into();
        let host = stat_id(&proc_dir.join("1/ns/net"))?;
        Ok(ProcScanner {
            proc_dir,
            host,
            read_cgroup,
        })
    }

    pub fn host_netns(&self) -> NetnsId {
        self.host
    }

    /// Scans every process once and returns at most one namespace per wanted pod UID. Losing
    /// candidates are dropped (closed) before returning.
    pub fn find<O: NetnsOpener>(
        &self,
        opener: &O,
        wanted: &HashMap<String, WantedPod>,
    ) -> io::Result<HashMap<String, FoundNetns<O::Handle>>> {
        let mut pids: Vec<u32> = fs::read_dir(&self.proc_dir)?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
            .collect();
        pids.sort_unstable();
        let mut accepted = HashSet::new();
        let mut found: HashMap<String, FoundNetns<O::Handle>> = HashMap::new();
        for pid in pids {
            let cand = match self.candidate(opener, wanted, &accepted, pid) {
                Ok(Some(c)) => c,
                Ok(None) => continue,
                Err(why) => {
                    tracing::debug!(pid, %why, "skipping process");
                    continue;
                }
            };
            let uid = cand.uid.clone();
            accepted.insert(cand.id);
            if let Some(existing) = found.get(&uid) {
                tracing::warn!(
                    uid,
                    pid,
                    "several namespaces for one pod; keeping the oldest process's"
                );
                if existing.starttime <= cand.starttime {
                    continue;
                }
            }
            found.insert(uid, cand);
        }
        Ok(found)
    }

    fn candidate<O: NetnsOpener>(
        &self,
        opener: &O,
        wanted: &HashMap<String, WantedPod>,
        accepted: &HashSet<NetnsId>,
        pid: u32,
    ) -> Result<Option<FoundNetns<O::Handle>>, String> {
        let dir = self.proc_dir.join(pid.to_string());
        let ns_path = dir.join("ns/net");
        let id = stat_id(&ns_path).map_err(|e| format!("stat ns/net: {e}"))?;
        if id == self.host || accepted.contains(&id) {
            return Ok(None);
        }
        let stat = fs::read_to_string(dir.join("stat")).map_err(|e| format!("read stat: {e}"))?;
        let starttime = parse_starttime(&stat).map_err(|e| e.to_string())?;
        let cgroup = (self.read_cgroup)(&dir).map_err(|e| format!("read cgroup: {e}"))?;
        let Some(pc) = parse_cgroups(&cgroup).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let Some(pod) = wanted.get(&pc.pod_uid) else {
            return Ok(None);
        };
        if pod.ips.is_empty() {
            tracing::debug!(
                uid = pc.pod_uid,
                "pod has no IPs yet; cannot verify its netns"
            );
            return Ok(None);
        }
        let netns = opener.open(&ns_path)?;
        match opener.owns(&netns, &pod.ips) {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(
                    uid = pc.pod_uid,
                    pid,
                    "netns holds none of the pod's IPs; not pairing them"
                );
                return Ok(None);
            }
            Err(e) => return Err(format!("ownership check: {e}")),
        }
        let workload = pod.workload.clone();
        Ok(Some(FoundNetns {
            uid: pc.pod_uid,
            netns,
            id,
            pid,
            starttime,
            workload,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const CID: &str = "9bca8d63d5fa610783847915bcff0ecac1273e5b4bed3f6fa1b07350e0135961";

    fn uid(n: u8) -> String {
        format!("{n:08x}-b29f-11e7-9350-020968147796")
    }

    fn cgroup_of(uid: &str) -> String {
        format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{CID}.scope\n",
            uid.replace('-', "_")
        )
    }

    fn wanted(entries: &[(String, &[&str])]) -> HashMap<String, WantedPod> {
        entries
            .iter()
            .map(|(uid, ips)| {
                let pod = WantedPod {
                    workload: WorkloadInfo::new(format!("pod-{uid}"), "ns", "sa"),
                    ips: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
                };
                (uid.clone(), pod)
            })
            .collect()
    }

    /// Fixture namespaces are plain files; the addresses "inside" them are a table.
    struct FixtureOpener {
        addrs: HashMap<NetnsId, Vec<IpAddr>>,
        opened: Arc<AtomicUsize>,
        closed: Arc<AtomicUsize>,
    }

    struct FixtureHandle {
        id: NetnsId,
        closed: Arc<AtomicUsize>,
    }

    impl Drop for FixtureHandle {
        fn drop(&mut self) {
            self.closed.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl NetnsOpener for FixtureOpener {
        type Handle = FixtureHandle;

        fn open(&self, path: &Path) -> Result<FixtureHandle, String> {
            let id = stat_id(path).map_err(|e| e.to_string())?;
            self.opened.fetch_add(1, Ordering::SeqCst);
            Ok(FixtureHandle {
                id,
                closed: self.closed.clone(),
            })
        }

        fn owns(&self, netns: &FixtureHandle, ips: &[IpAddr]) -> Result<bool, String> {
            let addrs = self.addrs.get(&netns.id).ok_or("cannot enter")?;
            Ok(addresses_contain_any(addrs, ips))
        }
    }

    fn process(root: &Path, pid: &str, netns: &Path, starttime: u64, cgroup: &str) {
        let dir = root.join(pid);
        fs::create_dir_all(dir.join("ns")).unwrap();
        symlink(netns, dir.join("ns/net")).unwrap();
        let stat = format!(
            "{pid} (sle ep) S 1 1 1 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 {starttime} 1 1 1"
        );
        fs::write(dir.join("stat"), stat).unwrap();
        fs::write(dir.join("cgroup"), cgroup).unwrap();
    }

    #[test]
    fn fixture_proc_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("proc");
        let ns = tmp.path().join("ns");
        fs::create_dir_all(&ns).unwrap();
        for name in ["host", "a", "b", "c"] {
            fs::write(ns.join(name), name).unwrap();
        }
        let id = |name: &str| stat_id(&ns.join(name)).unwrap();
        process(&root, "1", &ns.join("host"), 1, "0::/init.scope\n");
        process(&root, "10", &ns.join("a"), 500, &cgroup_of(&uid(1)));
        process(&root, "11", &ns.join("host"), 100, &cgroup_of(&uid(1)));
        process(&root, "12", &ns.join("b"), 300, &cgroup_of(&uid(1)));
        process(&root, "13", &ns.join("a"), 50, &cgroup_of(&uid(1)));
        process(&root, "14", &ns.join("c"), 10, &cgroup_of(&uid(2)));
        process(&root, "15", &ns.join("c"), 20, &cgroup_of(&uid(3)));
        process(&root, "16", &ns.join("b"), 20, &cgroup_of(&uid(4)));
        process(&root, "17", &ns.join("c"), 20, "broken\n");
        process(&root, "18", &ns.join("a"), 20, &cgroup_of(&uid(5)));
        fs::create_dir_all(root.join("self/ns")).unwrap();
        fs::write(root.join("uptime"), "1 1").unwrap();

        let opener = FixtureOpener {
            addrs: HashMap::from([
                (id("a"), vec!["10.0.0.1".parse().unwrap()]),
                (id("b"), vec!["::ffff:10.0.0.1".parse().unwrap()]),
                (
                    id("c"),
                    vec!["fd00::3".parse().unwrap(), "10.0.0.3".parse().unwrap()],
                ),
            ]),
            opened: Arc::new(AtomicUsize::new(0)),
            closed: Arc::new(AtomicUsize::new(0)),
        };
        let scanner = ProcScanner::new(&root).unwrap();
        assert_eq!(scanner.host_netns(), id("host"));
        let pods = wanted(&[
            (uid(1), &["10.0.0.1"]),
            (uid(2), &["10.0.0.2"]),
            (uid(3), &["fd00::3"]),
            (uid(4), &[]),
        ]);
        let found = scanner.find(&opener, &pods).unwrap();

        let one = &found[&uid(1)];
        assert_eq!(
            (one.id, one.pid, one.starttime),
            (id("b"), 12, 300),
            "oldest owning process wins"
        );
        assert_eq!(one.workload.name, format!("pod-{}", uid(1)));
        // pid 14 (pod 2) sits in c, which holds pod 3's IP: refused, and c stays claimable.
        assert!(!found.contains_key(&uid(2)));
        assert_eq!((found[&uid(3)].id, found[&uid(3)].pid), (id("c"), 15));
        assert!(!found.contains_key(&uid(4)), "no IPs, no pairing");
        assert_eq!(found.len(), 2);
        // Opened: a (10), b (12), c (14), c (15); 11 is the host, 13 an accepted inode.
        assert_eq!(opener.opened.load(Ordering::SeqCst), 4);
        assert_eq!(
            opener.closed.load(Ordering::SeqCst),
            2,
            "losing and refused candidates are closed"
        );
        drop(found);
        assert_eq!(opener.closed.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn no_host_netns_no_scanner() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(ProcScanner::new(tmp.path()).is_err());
    }

    #[test]
    fn mapped_addresses_compare_as_ipv4() {
        let mapped: IpAddr = "::ffff:10.0.0.5".parse().unwrap();
        let v4: IpAddr = "10.0.0.5".parse().unwrap();
        assert!(addresses_contain_any(&[mapped], &[v4]));
        assert!(addresses_contain_any(&[v4], &[mapped]));
        assert!(!addresses_contain_any(
            &["10.0.0.6".parse().unwrap()],
            &[v4]
        ));
        assert!(addresses_contain_any(
            &["fd00::1".parse().unwrap(), v4],
            &["fd00::1".parse().unwrap()]
        ));
    }

    /// Real processes in real namespaces, found through the real /proc; only their cgroups are
    /// supplied, since a test cannot place a process in a kubepods cgroup.
    #[test]
    fn real_processes_in_real_netns() {
        dataplane::require_root!();
        use dataplane::test_support::{TestNetns, run};
        let pod_ns = TestNetns::new("procfs-pod");
        let foreign_ns = TestNetns::new("procfs-foreign");
        run(
            "ip",
            &[
                "-n",
                &pod_ns.name,
                "addr",
                "add",
                "10.251.7.9/32",
                "dev",
                "lo",
            ],
        );
        let spawn_in = |ns: &TestNetns| {
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("30");
            ns.open().spawn(&mut cmd).unwrap()
        };
        // The foreign process is older: without the IP check it would win.
        let mut foreign = spawn_in(&foreign_ns);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut owner = spawn_in(&pod_ns);
        let pod_uid = uid(9);
        let fake: HashMap<u32, String> = HashMap::from([
            (owner.id(), cgroup_of(&pod_uid)),
            (foreign.id(), cgroup_of(&pod_uid)),
        ]);
        let reader: CgroupReader = Box::new(move |dir: &Path| {
            let pid: u32 = dir
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            match fake.get(&pid) {
                Some(c) => Ok(c.clone()),
                None => fs::read_to_string(dir.join("cgroup")),
            }
        });
        // The real processes' /proc entries, behind a root whose "1" is this process: pid 1 of a
        // test sandbox may be unreadable, and this process sits in the netns playing the host.
        let tmp = tempfile::tempdir().unwrap();
        symlink("/proc/self", tmp.path().join("1")).unwrap();
        for pid in [owner.id(), foreign.id(), std::process::id()] {
            symlink(format!("/proc/{pid}"), tmp.path().join(pid.to_string())).unwrap();
        }
        let scanner = ProcScanner::with_cgroup_reader(tmp.path(), reader).unwrap();
        let found = scanner.find(&HostNetns, &wanted(&[(pod_uid.clone(), &["10.251.7.9"])]));
        let _ = (owner.kill(), foreign.kill(), owner.wait(), foreign.wait());
        let found = found.unwrap();
        let hit = &found[&pod_uid];
        assert_eq!(hit.id, pod_ns.open().id());
        assert_eq!(hit.netns.id(), pod_ns.open().id());
        assert_eq!(hit.pid, owner.id());
    }
}
