//! The churn harness of issue #14: pod create/delete cycles on a node while faults are injected at
//! random moments, with the mesh invariants checked after every cycle and, with every fault healed,
//! at quiet points and at the end. Seeded: the same seed replays the same schedule of actions
//! and faults (not the same timings).
//!
//! The node is behind [`ChurnNode`] so the same driver runs on the emulated node
//! ([`emulated::EmulatedNode`]: the node test kit) and on a real kubelet + containerd node
//! ([`real::RealChurnNode`]: `scripts/real-node`). Each node says which faults it can inject;
//! the report lists the others as not supported.
//!
//! Fail-closed semantics checked: while a fault is active an ADD may fail (the runtime retries it
//! with a new sandbox) but a pod whose ADD succeeded must be redirected and known to the peer.

pub mod conflist;
pub mod emulated;
pub mod real;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Every fault the harness can inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// SIGKILL between two pod operations, then a restart.
    AgentKill,
    /// SIGKILL while a pod's CNI ADD is in flight, then a restart.
    AgentKillMidAdd,
    /// The peer (ztunnel) process restarts: a new connection, every workload handed again.
    PeerRestart,
    /// The peer refuses Adds for a while (a proxy that cannot start).
    PeerNack,
    /// The peer acks Adds late, within the agent's deadline.
    PeerSlowAck,
    /// The peer acks one Add after the agent's deadline.
    PeerAckTimeout,
    /// The peer drops the connection instead of answering an Add.
    PeerCrashOnAdd,
    /// The peer closes its connection (a stream reset) and reconnects.
    PeerDisconnect,
    /// kube-apiserver is killed and started again.
    ApiRestart,
    /// Every API request gets 429 or a 5xx for a while.
    ApiErrorBurst,
    /// Another writer rewrites the primary CNI config (without our entry) in a loop.
    ConflistRewriter,
    /// The agent's run dir has no free space.
    DiskFull,
    /// The agent's pod deleted (gracefully or forced); its DaemonSet makes a new one.
    AgentPodDelete,
    /// kubelet stopped and started again.
    KubeletRestart,
    /// containerd stopped and started again (running containers keep running in their shims).
    ContainerdRestart,
    /// Every new API connection waits seconds before it reaches the server, for a while.
    ApiSlowAnswers,
    /// Every open API connection is reset at once: watch streams cut mid-stream, requests in
    /// flight lost.
    ApiConnectionReset,
}

impl FaultKind {
    pub const ALL: [FaultKind; 17] = [
        FaultKind::AgentKill,
        FaultKind::AgentKillMidAdd,
        FaultKind::PeerRestart,
        FaultKind::PeerNack,
        FaultKind::PeerSlowAck,
        FaultKind::PeerAckTimeout,
        FaultKind::PeerCrashOnAdd,
        FaultKind::PeerDisconnect,
        FaultKind::ApiRestart,
        FaultKind::ApiErrorBurst,
        FaultKind::ConflistRewriter,
        FaultKind::DiskFull,
        FaultKind::AgentPodDelete,
        FaultKind::KubeletRestart,
        FaultKind::ContainerdRestart,
        FaultKind::ApiSlowAnswers,
        FaultKind::ApiConnectionReset,
    ];

    /// Faults that stay active over cycles until healed; the others happen once. An ack
    /// timeout or a crash on Add lasts one cycle (every Add in it meets the fault).
    pub fn lasts(self) -> bool {
        matches!(
            self,
            FaultKind::PeerNack
                | FaultKind::PeerSlowAck
                | FaultKind::PeerAckTimeout
                | FaultKind::PeerCrashOnAdd
                | FaultKind::ApiErrorBurst
                | FaultKind::ApiSlowAnswers
                | FaultKind::ConflistRewriter
                | FaultKind::DiskFull
        )
    }

    /// How likely the kind is drawn, relative to the others: API restarts cost seconds each.
    fn weight(self) -> u64 {
        match self {
            FaultKind::ApiRestart | FaultKind::KubeletRestart | FaultKind::ContainerdRestart => 1,
            FaultKind::AgentKill | FaultKind::AgentKillMidAdd => 3,
            _ => 2,
        }
    }
}

/// A pod's CNI ADD as the runtime saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddOutcome {
    /// The chain (with our plugin) succeeded.
    Added,
    /// The chain succeeded but the config read for it had no `istio-cni` entry: another writer
    /// had just replaced the file and the installer had not chained it again yet.
    AddedWithoutPlugin,
    /// The chain failed (the runtime will retry with a new sandbox).
    Failed(String),
}

/// A sample of the agent process.
#[derive(Debug, Clone, Copy)]
pub struct AgentSample {
    /// Which agent process (incremented at every restart).
    pub incarnation: u64,
    /// Open fds that are not pod network namespaces (those follow the number of pods).
    pub other_fds: u64,
    pub netns_fds: u64,
    pub rss_kib: u64,
}

/// What the harness needs from a node. Pods are named by the harness; the node keeps their
/// objects, sandboxes and UIDs.
#[allow(
    async_fn_in_trait,
    reason = "the harness is generic over its node; no dyn, no Send bound needed"
)]
pub trait ChurnNode {
    fn supports(&self, kind: FaultKind) -> bool;
    /// Creates the pod (API object in an ambient namespace) and runs its first sandbox ADD.
    /// `kill_agent_after`: SIGKILL the agent that long after the ADD started (and restart it).
    async fn create_pod(&mut self, name: &str, kill_agent_after: Option<Duration>) -> AddOutcome;
    /// A new sandbox for a pod whose ADD failed: the old one is torn down (CNI DEL, netns gone)
    /// and the chain runs again, as the runtime retries.
    async fn retry_pod(&mut self, name: &str) -> AddOutcome;
    /// Deletes the pod: sandbox torn down and API object deleted (in a random order, as a
    /// kubelet's force delete and graceful delete differ).
    async fn delete_pod(&mut self, name: &str, sandbox_first: bool);
    /// Violations right after a successful ADD: the pod's rules read back from its namespace are
    /// in sync, and the peer holds it with that namespace.
    async fn check_added(&self, name: &str) -> Vec<String>;
    /// Every invariant of the whole node, once faults are healed and the agent had time to
    /// converge: running pods redirected, annotated, in the probe set and known to the peer;
    /// nothing for deleted pods (peer workloads, probe-set entries, netns hints, agent netns fds);
    /// the conflist valid and chained.
    async fn check_converged(&self) -> Vec<String>;
    /// Damaged CNI configs seen by the continuous reader so far (each is a violation), and reads.
    fn conflist_reads(&self) -> (u64, Vec<String>);
    fn sample(&self) -> Option<AgentSample>;
    /// Times the agent exited on its own and was started again (as the kubelet restarts a
    /// DaemonSet container).
    fn agent_exits(&self) -> u64;
    /// What the node wants the report to say about how its faults landed (e.g. how many
    /// mid-enrollment kills met a running ADD).
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
    async fn inject(&mut self, kind: FaultKind, rng: &mut Rng);
    async fn heal(&mut self, kind: FaultKind);
    /// After every heal: agent ready, peer connected with a full snapshot.
    async fn wait_healthy(&mut self);
}

/// SplitMix64: small, seedable, good enough to schedule faults.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

#[derive(Debug, Clone)]
pub struct ChurnConfig {
    pub cycles: u64,
    pub seed: u64,
    /// Live pods the harness keeps around; each cycle creates one and, above this, deletes one.
    pub population: usize,
    /// Percent chance per cycle to inject a fault.
    pub fault_percent: u64,
    /// A quiet point (all faults healed, full check) at least this often.
    pub quiet_every: u64,
    /// The faults drawn (`None`: every one the node supports); a focused run, as the real
    /// node's API fault test.
    pub kinds: Option<Vec<FaultKind>>,
}

impl ChurnConfig {
    pub fn new(cycles: u64, seed: u64) -> Self {
        ChurnConfig {
            cycles,
            seed,
            population: 12,
            fault_percent: 20,
            quiet_every: 50,
            kinds: None,
        }
    }
}

#[derive(Debug, Default)]
pub struct ChurnReport {
    pub cycles: u64,
    pub seed: u64,
    pub duration: Duration,
    pub pods_created: u64,
    pub pods_deleted: u64,
    pub adds_ok: u64,
    /// Failed ADDs while a fault was active or being recovered from.
    pub add_failures_during_faults: u64,
    /// Failed ADDs with no fault lately (retried; a pod stuck after faults healed is a violation).
    pub add_failures_without_fault: u64,
    pub adds_without_plugin: u64,
    pub faults: BTreeMap<FaultKind, u64>,
    /// Faults this node cannot inject: never drawn, never counted as survived.
    pub unsupported: Vec<FaultKind>,
    pub notes: Vec<String>,
    pub quiet_checks: u64,
    pub agent_exits: u64,
    pub conflist_reads: u64,
    pub violations: Vec<String>,
    pub samples: Vec<AgentSample>,
}

impl ChurnReport {
    /// The first and last tenth of the samples: (median other fds, median RSS KiB) each.
    pub fn windows(&self) -> Option<((u64, u64), (u64, u64))> {
        let n = self.samples.len();
        if n < 10 {
            return None;
        }
        let w = (n / 10).max(3);
        let median = |s: &[AgentSample]| {
            let mut fds: Vec<u64> = s.iter().map(|x| x.other_fds).collect();
            let mut rss: Vec<u64> = s.iter().map(|x| x.rss_kib).collect();
            fds.sort_unstable();
            rss.sort_unstable();
            (fds[fds.len() / 2], rss[rss.len() / 2])
        };
        Some((median(&self.samples[..w]), median(&self.samples[n - w..])))
    }

    /// Flatness of fds and RSS as violations: other fds may not grow by more than 8, RSS by more
    /// than half plus 4 MiB (allocator noise and restarts at different uptimes).
    fn check_flat(&mut self) {
        if let Some(((fd0, rss0), (fd1, rss1))) = self.windows() {
            if fd1 > fd0 + 8 {
                self.violations.push(format!(
                    "agent fds not flat: median {fd0} in the first window, {fd1} in the last"
                ));
            }
            if rss1 > rss0 + rss0 / 2 + 4096 {
                self.violations.push(format!(
                    "agent RSS not flat: median {rss0} KiB in the first window, {rss1} KiB in the last"
                ));
            }
        }
    }

    pub fn markdown(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let restarts = self.samples.last().map_or(0, |s| s.incarnation);
        let _ = writeln!(out, "| measurement | result |\n|---|---|");
        let _ = writeln!(out, "| seed | {} |", self.seed);
        let _ = writeln!(
            out,
            "| cycles | {} in {:.0} s |",
            self.cycles,
            self.duration.as_secs_f64()
        );
        let _ = writeln!(
            out,
            "| pods created / deleted | {} / {} |",
            self.pods_created, self.pods_deleted
        );
        let _ = writeln!(out, "| successful ambient ADDs | {} |", self.adds_ok);
        let _ = writeln!(
            out,
            "| ADD failures during faults (retried by the runtime) | {} |",
            self.add_failures_during_faults
        );
        let _ = writeln!(
            out,
            "| ADD failures with no fault in the last {RECOVERY_CYCLES} cycles (retried) | {} |",
            self.add_failures_without_fault
        );
        let _ = writeln!(
            out,
            "| ADDs whose chain had no istio-cni (other writer's window) | {} |",
            self.adds_without_plugin
        );
        let total: u64 = self.faults.values().sum();
        let kinds: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k:?} {n}"))
            .collect();
        let _ = writeln!(out, "| faults injected | {total}: {} |", kinds.join(", "));
        let unsupported: Vec<String> = self.unsupported.iter().map(|k| format!("{k:?}")).collect();
        let _ = writeln!(
            out,
            "| faults not supported on this node (not injected) | {} |",
            if unsupported.is_empty() {
                "none".to_string()
            } else {
                unsupported.join(", ")
            }
        );
        let _ = writeln!(out, "| agent restarts | {restarts} |");
        let _ = writeln!(
            out,
            "| of which the agent exited on its own (restarted like the kubelet does) | {} |",
            self.agent_exits
        );
        let _ = writeln!(
            out,
            "| full checks with faults healed | {} |",
            self.quiet_checks
        );
        let _ = writeln!(
            out,
            "| conflist reads by the continuous checker | {} |",
            self.conflist_reads
        );
        if let Some(((fd0, rss0), (fd1, rss1))) = self.windows() {
            let _ = writeln!(
                out,
                "| agent fds besides pod netns, median first → last tenth | {fd0} → {fd1} |"
            );
            let _ = writeln!(
                out,
                "| agent RSS, median first → last tenth | {:.1} → {:.1} MiB |",
                rss0 as f64 / 1024.0,
                rss1 as f64 / 1024.0
            );
        }
        for n in &self.notes {
            let _ = writeln!(out, "| note | {n} |");
        }
        let _ = writeln!(out, "| invariant violations | {} |", self.violations.len());
        for v in self.violations.iter().take(30) {
            let _ = writeln!(out, "\n- {v}");
        }
        out
    }
}

/// The whole churn on the node `start` brings up, on a 2-worker runtime like the agent's;
/// violations come with `log(node)` (the agent's log tail) on stderr.
pub fn run_on<N: ChurnNode>(
    cfg: &ChurnConfig,
    start: impl std::future::Future<Output = N>,
    log: impl Fn(&N) -> String,
) -> ChurnReport {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut node = start.await;
        let report = run(&mut node, cfg).await;
        if !report.violations.is_empty() {
            eprintln!("agent log (tail):\n{}", log(&node));
        }
        report
    })
}

/// Runs the churn on `node`; the report carries every violation (none means it passed).
pub async fn run<N: ChurnNode>(node: &mut N, cfg: &ChurnConfig) -> ChurnReport {
    let started = Instant::now();
    let mut rng = Rng::new(cfg.seed);
    let mut report = ChurnReport {
        cycles: cfg.cycles,
        seed: cfg.seed,
        ..ChurnReport::default()
    };
    let (mut kinds, unsupported): (Vec<FaultKind>, Vec<FaultKind>) =
        FaultKind::ALL.into_iter().partition(|k| node.supports(*k));
    report.unsupported = unsupported;
    if let Some(only) = &cfg.kinds {
        kinds.retain(|k| only.contains(k));
    }
    let weights: u64 = kinds.iter().map(|k| k.weight()).sum();
    // Lasting faults and the cycle they heal at.
    let mut active: BTreeMap<FaultKind, u64> = BTreeMap::new();
    let mut kill_next_add = false;
    let mut running: Vec<String> = Vec::new();
    let mut failed: BTreeSet<String> = BTreeSet::new();
    let mut last_quiet = 0;
    // The last cycle a fault was active: recoveries (reconnects, watch backoffs) outlast it.
    let mut last_fault: Option<u64> = None;
    let mut seen = BTreeSet::new();

    for cycle in 0..cfg.cycles {
        // Faults: heal the due ones, maybe inject one.
        let due: Vec<FaultKind> = active
            .iter()
            .filter(|(_, until)| **until <= cycle)
            .map(|(k, _)| *k)
            .collect();
        for k in due {
            active.remove(&k);
            node.heal(k).await;
        }
        if !kinds.is_empty() && rng.chance(cfg.fault_percent) {
            let mut pick = rng.below(weights);
            let kind = *kinds
                .iter()
                .find(|k| {
                    let w = k.weight();
                    let hit = pick < w;
                    pick = pick.saturating_sub(w);
                    hit
                })
                .expect("weights cover the kinds");
            // A lasting fault already active is not injected twice.
            let fresh = !active.contains_key(&kind);
            if fresh {
                *report.faults.entry(kind).or_default() += 1;
                // A one-off fault (a kill, a restart) has its recovery too: ADDs may fail
                // until the restarted process serves again.
                last_fault = Some(cycle);
                if kind == FaultKind::AgentKillMidAdd {
                    kill_next_add = true;
                } else {
                    node.inject(kind, &mut rng).await;
                    if kind.lasts() {
                        let cycles = match kind {
                            FaultKind::PeerAckTimeout | FaultKind::PeerCrashOnAdd => 1,
                            _ => 1 + rng.below(6),
                        };
                        active.insert(kind, cycle + cycles);
                    }
                }
            }
        }
        if !active.is_empty() || kill_next_add {
            last_fault = Some(cycle);
        }
        let faulty = last_fault.is_some_and(|c| cycle - c <= RECOVERY_CYCLES);

        // The runtime retries sandboxes that failed.
        for name in failed.clone() {
            let outcome = node.retry_pod(&name).await;
            record_add(
                node,
                &mut report,
                &name,
                outcome,
                faulty,
                &mut running,
                &mut failed,
            )
            .await;
        }

        // One new pod per cycle; above the population, one random pod goes.
        let name = format!("churn-{cycle}");
        let kill = kill_next_add.then(|| rng.millis(0, 40));
        kill_next_add = false;
        let outcome = node.create_pod(&name, kill).await;
        report.pods_created += 1;
        record_add(
            node,
            &mut report,
            &name,
            outcome,
            faulty || kill.is_some(),
            &mut running,
            &mut failed,
        )
        .await;
        if running.len() + failed.len() > cfg.population {
            let i = rng.below((running.len() + failed.len()) as u64) as usize;
            let gone = if i < running.len() {
                running.swap_remove(i)
            } else {
                let n = failed.iter().nth(i - running.len()).cloned().unwrap();
                failed.remove(&n);
                n
            };
            node.delete_pod(&gone, rng.chance(50)).await;
            report.pods_deleted += 1;
        }
        if let Some(s) = node.sample() {
            report.samples.push(s);
        }

        // Quiet point: every fault healed, failed pods retried, the whole node checked.
        let last = cycle + 1 == cfg.cycles;
        if last
            || cycle - last_quiet >= cfg.quiet_every
            || (active.is_empty() && cycle - last_quiet >= 10)
        {
            for k in std::mem::take(&mut active).into_keys() {
                node.heal(k).await;
            }
            node.wait_healthy().await;
            // As the runtime does, a few times: a peer reconnecting after a late ack is healthy
            // but has no connection for a moment.
            for attempt in 0..QUIET_ADD_TRIES {
                if failed.is_empty() {
                    break;
                }
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                for name in failed.clone() {
                    let outcome = node.retry_pod(&name).await;
                    let recovering = attempt + 1 < QUIET_ADD_TRIES;
                    record_add(
                        node,
                        &mut report,
                        &name,
                        outcome,
                        recovering,
                        &mut running,
                        &mut failed,
                    )
                    .await;
                }
            }
            let mut found: Vec<String> = failed
                .iter()
                .map(|name| format!("pod {name} cannot be added with every fault healed"))
                .collect();
            found.extend(node.check_converged().await);
            // A state that stays wrong is one violation, not one per quiet point.
            for v in found {
                if seen.insert(v.clone()) {
                    report.violations.push(format!("cycle {cycle}: {v}"));
                }
            }
            report.quiet_checks += 1;
            last_quiet = cycle;
            tracing::info!(
                cycle,
                running = running.len(),
                violations = report.violations.len(),
                "churn: quiet point checked"
            );
        }
    }
    report.agent_exits = node.agent_exits();
    report.notes = node.notes();
    let (reads, damaged) = node.conflist_reads();
    report.conflist_reads = reads;
    report.violations.extend(damaged);
    report.check_flat();
    report.duration = started.elapsed();
    report
}

/// ADD attempts per failed pod at a quiet point before it is a violation.
const QUIET_ADD_TRIES: u32 = 3;

/// Cycles after a fault during which a failed ADD still counts as the fault's.
const RECOVERY_CYCLES: u64 = 3;

async fn record_add<N: ChurnNode>(
    node: &N,
    report: &mut ChurnReport,
    name: &str,
    outcome: AddOutcome,
    faulty: bool,
    running: &mut Vec<String>,
    failed: &mut BTreeSet<String>,
) {
    match outcome {
        AddOutcome::Added => {
            report.adds_ok += 1;
            failed.remove(name);
            running.push(name.to_string());
            for v in node.check_added(name).await {
                report.violations.push(format!("after ADD of {name}: {v}"));
            }
        }
        AddOutcome::AddedWithoutPlugin => {
            report.adds_without_plugin += 1;
            failed.remove(name);
            running.push(name.to_string());
        }
        AddOutcome::Failed(why) => {
            if faulty {
                report.add_failures_during_faults += 1;
            } else {
                report.add_failures_without_fault += 1;
                tracing::warn!(pod = name, error = %why, "ADD failed with no fault active");
            }
            failed.insert(name.to_string());
        }
    }
}

/// The network namespaces (inodes) among the process's fds, and how many other fds it has. An fd
/// of a namespace opened by path reads back as that path, so fds are told apart by their file
/// system: every namespace lives on nsfs.
pub fn process_fds(pid: u32) -> Option<(Vec<u64>, u64)> {
    use std::os::unix::fs::MetadataExt;
    let nsfs = std::fs::metadata("/proc/self/ns/net").ok()?.dev();
    let mut netns = Vec::new();
    let mut other = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).ok()? {
        let Ok(entry) = entry else { continue };
        match std::fs::metadata(entry.path()) {
            Ok(m) if m.dev() == nsfs && m.file_type().is_file() => netns.push(m.ino()),
            _ => other += 1,
        }
    }
    Some((netns, other))
}

/// Writes `path` until its file system is full, to the last byte.
pub fn fill(path: &std::path::Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    let block = vec![0u8; 64 * 1024];
    while f.write_all(&block).is_ok() {}
    // Whatever fits in the last partial block.
    while f.write_all(&[0]).is_ok() {}
}

/// The inode of a namespace file (or any file).
pub fn netns_ino(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`).
pub fn process_memory_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_schedule() {
        let draw = |seed| {
            let mut r = Rng::new(seed);
            (0..32).map(|_| r.below(1000)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let mut r = Rng::new(1);
        assert!((0..1000).all(|_| r.millis(5, 9) >= Duration::from_millis(5)));
    }

    fn sample(other_fds: u64, rss_kib: u64) -> AgentSample {
        AgentSample {
            incarnation: 0,
            other_fds,
            netns_fds: 0,
            rss_kib,
        }
    }

    #[test]
    fn growing_fds_or_rss_are_violations_and_flat_ones_are_not() {
        let mut flat = ChurnReport {
            samples: (0..100).map(|i| sample(30 + i % 3, 9000 + i % 7)).collect(),
            ..ChurnReport::default()
        };
        flat.check_flat();
        assert!(flat.violations.is_empty(), "{:?}", flat.violations);

        let mut leaking = ChurnReport {
            samples: (0..100)
                .map(|i| sample(30 + i / 5, 9000 + i * 100))
                .collect(),
            ..ChurnReport::default()
        };
        leaking.check_flat();
        assert_eq!(leaking.violations.len(), 2, "{:?}", leaking.violations);
    }
}
