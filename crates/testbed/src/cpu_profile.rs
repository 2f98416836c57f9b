//! Where a real node's CPU time goes: every process of the node's PID namespace and their
//! descendants (its components, containerd's shims, the pods' containers in namespaces of their
//! own), by name, from `/proc/<pid>/stat`, between two snapshots. A process's own time is
//! `utime + stime`; the time of the children it reaped (`cutime + cstime`) is reported apart,
//! because that is where short-lived processes end up: containerd's CNI plugin execs, the shims'
//! `runc` calls.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// One process at one moment.
#[derive(Clone, Debug, PartialEq)]
struct Sample {
    comm: String,
    ppid: u32,
    /// Its PID namespace (`/proc/<pid>/ns/pid`).
    pidns: String,
    /// Clock ticks of the process itself, and of the children it has waited for.
    own: u64,
    reaped: u64,
}

/// Parses `/proc/<pid>/stat`; `None` for a line that does not have the kernel's layout.
fn parse_stat(stat: &str) -> Option<Sample> {
    // The name is in parentheses and may itself hold spaces and parentheses: the last ')' ends it.
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_string();
    let rest: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    // Fields after the name, from 0: state, ppid, …, utime (11), stime, cutime, cstime (14).
    let field = |i: usize| rest.get(i)?.parse::<u64>().ok();
    Some(Sample {
        comm,
        pidns: String::new(),
        ppid: field(1)? as u32,
        own: field(11)? + field(12)?,
        reaped: field(13)? + field(14)?,
    })
}

/// The processes under one root, at one moment, and the machine's busy and total CPU time.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    processes: HashMap<u32, Sample>,
    machine_busy: u64,
    machine_total: u64,
}

/// The processes in the PID namespace of `member` and their descendants, from the machine's
/// `/proc`. (A node's components are started into its namespace by `nsenter`, so they are not
/// descendants of its init.)
pub fn snapshot(member: u32) -> Snapshot {
    let all = processes();
    let pidns = all
        .get(&member)
        .map(|s| s.pidns.clone())
        .unwrap_or_default();
    with_machine(under(all, |_, s| s.pidns == pidns))
}

/// `root` and every process whose parent chain reaches it: a bench and what it started (the API
/// server, the agent, and in `root`'s reaped time the plugin execs it waited for).
pub fn snapshot_tree(root: u32) -> Snapshot {
    with_machine(under(processes(), |pid, _| pid == root))
}

fn processes() -> HashMap<u32, Sample> {
    let mut all = HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        // A process may exit between the listing and the read: skipped.
        if let Some(mut s) = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|s| parse_stat(&s))
        {
            s.pidns = std::fs::read_link(entry.path().join("ns/pid"))
                .map(|l| l.to_string_lossy().into_owned())
                .unwrap_or_default();
            all.insert(pid, s);
        }
    }
    all
}

fn with_machine(processes: HashMap<u32, Sample>) -> Snapshot {
    let (machine_busy, machine_total) = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| machine_times(&s))
        .unwrap_or_default();
    Snapshot {
        processes,
        machine_busy,
        machine_total,
    }
}

/// Keeps the processes for which `is_root` holds and those whose parent chain reaches one.
fn under(
    mut all: HashMap<u32, Sample>,
    is_root: impl Fn(u32, &Sample) -> bool,
) -> HashMap<u32, Sample> {
    let reaches = |mut pid: u32, all: &HashMap<u32, Sample>| {
        // Bounded: a parent chain cannot be longer than the process table.
        for _ in 0..=all.len() {
            let Some(s) = all.get(&pid) else { return false };
            if is_root(pid, s) {
                return true;
            }
            if s.ppid == 0 || s.ppid == pid {
                return false;
            }
            pid = s.ppid;
        }
        false
    };
    let keep: HashSet<u32> = all.keys().copied().filter(|p| reaches(*p, &all)).collect();
    all.retain(|pid, _| keep.contains(pid));
    all
}

/// (busy, total) ticks of all CPUs from the `cpu` line of `/proc/stat`; idle and iowait are
/// not busy.
fn machine_times(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4)?;
    Some((total - idle, total))
}

/// CPU time of one process name between two snapshots.
#[derive(Clone, Debug, PartialEq)]
pub struct Usage {
    pub comm: String,
    pub own: Duration,
    /// Of the children these processes waited for (execs that came and went).
    pub reaped: Duration,
}

impl Usage {
    pub fn total(&self) -> Duration {
        self.own + self.reaped
    }
}

/// What the node used between `before` and `after`, by process name, largest first.
pub struct Profile {
    pub by_name: Vec<Usage>,
    /// The machine's busy share over the interval, 0–1 (all CPUs).
    pub machine_busy: f64,
}

pub fn between(before: &Snapshot, after: &Snapshot) -> Profile {
    let tick = Duration::from_secs(1) / ticks_per_second();
    // A pid seen before under another name was reused: the process is new.
    let same = |pid: &u32, now: &Sample| before.processes.get(pid).filter(|t| t.comm == now.comm);
    // A process that ended in between handed all of its time to its reaper, also the part
    // spent before the first snapshot: that part is taken out of the reaper's growth.
    let mut spent_before: HashMap<u32, u64> = HashMap::new();
    for (pid, then) in &before.processes {
        if after
            .processes
            .get(pid)
            .is_none_or(|now| now.comm != then.comm)
        {
            *spent_before.entry(then.ppid).or_default() += then.own + then.reaped;
        }
    }
    let mut by_name: HashMap<&str, (u64, u64)> = HashMap::new();
    for (pid, now) in &after.processes {
        let (own0, reaped0) = same(pid, now).map_or((0, 0), |t| (t.own, t.reaped));
        let earlier = spent_before.get(pid).copied().unwrap_or(0);
        let e = by_name.entry(&now.comm).or_default();
        e.0 += now.own.saturating_sub(own0);
        e.1 += now.reaped.saturating_sub(reaped0).saturating_sub(earlier);
    }
    let mut by_name: Vec<Usage> = by_name
        .into_iter()
        .map(|(comm, (own, reaped))| Usage {
            comm: comm.to_string(),
            own: tick * own as u32,
            reaped: tick * reaped as u32,
        })
        .collect();
    by_name.sort_by_key(|u| std::cmp::Reverse(u.total()));
    let total = after.machine_total.saturating_sub(before.machine_total);
    let busy = after.machine_busy.saturating_sub(before.machine_busy);
    Profile {
        by_name,
        machine_busy: if total == 0 {
            0.0
        } else {
            busy as f64 / total as f64
        },
    }
}

/// The kernel reports these times in USER_HZ, which is 100 on x86_64 and arm64 alike.
fn ticks_per_second() -> u32 {
    100
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_with_spaces_and_parentheses() {
        let s = parse_stat("42 (a (b) c) S 7 42 42 0 -1 4194560 1 0 0 0 30 12 5 3 20 0 1 0 9 1 1")
            .unwrap();
        assert_eq!(s.comm, "a (b) c");
        assert_eq!(s.ppid, 7);
        assert_eq!((s.own, s.reaped), (42, 8));
        assert!(parse_stat("42 no parentheses").is_none());
        assert!(parse_stat("42 (x) S 7").is_none(), "a truncated line");
    }

    #[test]
    fn machine_busy_excludes_idle_and_iowait() {
        let stat = "cpu  10 1 9 70 10 0 0 0 0 0\ncpu0 5 0 5 35 5 0 0 0 0 0\n";
        assert_eq!(machine_times(stat), Some((20, 100)));
    }

    fn sample(comm: &str, ppid: u32, own: u64, reaped: u64) -> Sample {
        Sample {
            comm: comm.into(),
            pidns: "pid:[1]".into(),
            ppid,
            own,
            reaped,
        }
    }

    #[test]
    fn keeps_the_namespace_or_the_process_and_their_descendants() {
        let node = |mut s: Sample| {
            s.pidns = "pid:[2]".into();
            s
        };
        let all = HashMap::from([
            (1, sample("init", 0, 0, 0)),
            (10, node(sample("holder", 1, 0, 0))),
            // Started into the node's namespace from outside (nsenter's child).
            (11, node(sample("kubelet", 30, 0, 0))),
            // A container: a namespace of its own, under a shim of the node.
            (12, node(sample("shim", 10, 0, 0))),
            (13, sample("sleep", 12, 0, 0)),
            (20, sample("other", 1, 0, 0)),
            (30, sample("nsenter", 1, 0, 0)),
        ]);
        let mut kept: Vec<u32> = under(all.clone(), |_, s| s.pidns == "pid:[2]")
            .into_keys()
            .collect();
        kept.sort();
        assert_eq!(kept, [10, 11, 12, 13]);
        // A process tree: the root and its descendants, not its parent nor its siblings.
        let mut tree: Vec<u32> = under(all, |pid, _| pid == 10).into_keys().collect();
        tree.sort();
        assert_eq!(tree, [10, 12, 13]);
    }

    #[test]
    fn sums_growth_by_name_and_treats_reused_pids_as_new() {
        let before = Snapshot {
            processes: HashMap::from([
                (11, sample("containerd", 10, 100, 50)),
                (12, sample("sleep", 10, 7, 0)),
                // Ends in between: its 60 ticks reach its parent's reaped time, all of them
                // spent before the interval.
                (14, sample("shim", 11, 20, 40)),
            ]),
            machine_busy: 1000,
            machine_total: 4000,
        };
        let after = Snapshot {
            processes: HashMap::from([
                (11, sample("containerd", 10, 130, 150)),
                // pid 12 now another process: all of its time is new.
                (12, sample("kubelet", 10, 5, 0)),
                (13, sample("kubelet", 10, 20, 0)),
            ]),
            machine_busy: 1500,
            machine_total: 5000,
        };
        let p = between(&before, &after);
        let tick = Duration::from_secs(1) / ticks_per_second();
        assert_eq!(
            p.by_name,
            [
                Usage {
                    comm: "containerd".into(),
                    own: tick * 30,
                    reaped: tick * 40,
                },
                Usage {
                    comm: "kubelet".into(),
                    own: tick * 25,
                    reaped: Duration::ZERO,
                },
            ]
        );
        assert!((p.machine_busy - 0.5).abs() < 1e-9);
    }
}
