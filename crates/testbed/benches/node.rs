//! Node-level benchmarks (root): ambient CNI ADD end to end — the plugin's exec until it prints
//! its result (the agent's lookup, netns, rules, ZDS ack, probe set and `pods/status` patch inside
//! it), alone and 100 at once, with the whole runtime-side chain and non-mesh pods as baselines —
//! agent memory idle and with 250 enrolled pods, and agent restart → every pod handed to ztunnel
//! again. Uses the e2e kit against a real kube-apiserver; binaries must be built in release
//! first: `cargo build --release --workspace --bins`. The bursts and the restarts also report the
//! CPU each part used (the agent, kube-apiserver with etcd, the plugin execs, the bench itself)
//! and their sum spread over every CPU: the least time they could take on this machine.
//!
//! Run: `cargo bench -p testbed --bench node`. Prints one markdown table for BENCHMARKS.md.
//!
//! With `ISTIO_BIN` (a directory holding Istio's `install-cni` and `istio-cni`, as
//! `tools/istio/build.sh install-cni istio-cni` prints it) the same bench runs on Istio's agent
//! and plugin too, alternating with ours for `BENCH_ROUNDS` rounds (default 3), each round on a
//! fresh node and API server, and the table has a column per agent (the median over the rounds)
//! and their ratio. `scripts/bench-node --against-istio` does that.
//!
//! With `BENCH_FILL=<namespaces>:<pods>` each round's API server is first filled to that size
//! (namespaces, and pods bound to absent nodes, as `benches/scale.rs` fills it): the ADDs and
//! their floors (the bench's own `pods/status` patches) measured in a cluster that large.
//!
//! The agent's own CPU per ADD is read from its process CPU clock (every thread, exited ones
//! too, in nanoseconds) from before a burst of 100 to [`AFTER_BURST`] after it. With
//! `BENCH_BURSTS=<n>` a round is only that: `n` bursts of 100 ambient and of 100 non-mesh ADDs
//! on one node, the agent's CPU per ADD of each, for before/after pairs of two agent builds
//! (`AGENT_BIN`) alternated at the same load.

use std::time::{Duration, Instant};

use futures::future::join_all;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use testbed::cluster_fill;
use testbed::cpu_profile;
use testbed::kube::KubeTestEnv;
use testbed::node::{Agent, Backend, NodeOptions, TestNode, TestPod, plugin_binary};
use testbed::zds_peer::{PeerConfig, ZdsPeer};

/// How long after a burst the agent's CPU clock is read again: the watch events of its own
/// patches come back and are handled within it.
const AFTER_BURST: Duration = Duration::from_millis(300);

/// How long a restarted agent gets to hand every pod over again.
const RESTART_WAIT: Duration = Duration::from_secs(30);

/// Agent restarts per run; the figure is their median.
const RESTARTS: usize = 5;

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

/// Mean of a histogram from the agent's `/metrics` (`_sum / _count`), in ms.
fn mean_ms(metrics: &str, name: &str) -> Option<f64> {
    let value = |suffix: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{suffix}")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let (sum, count) = (value("_sum"), value("_count"));
    (count > 0.0).then(|| sum / count * 1000.0)
}

/// Milliseconds, for the table.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One measurement of one run: a number in `unit`, or why this agent cannot be measured so.
#[derive(Clone)]
enum Figure {
    Value(f64),
    NotApplicable(String),
}

/// The measurements of one run, in table order: (what, unit, figure).
type Figures = Vec<(String, &'static str, Figure)>;

/// Pods added one at a time. Each ADD runs the primary plugins first, then the plugin under test
/// with their result, timed apart; then the bench patches the pod's status itself, timed, the
/// same annotation merge patch on `pods/status` the agent makes (the floor under an ambient
/// ADD). Returns (pods, whole chain, plugin exec → result, status patch), all sorted.
async fn add_one_by_one(
    node: &TestNode,
    namespace: &str,
    prefix: &str,
    n: usize,
) -> (Vec<TestPod>, Vec<Duration>, Vec<Duration>, Vec<Duration>) {
    let (mut pods, mut chain, mut ours, mut patches) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let mut pod = node
            .create_pod_object(namespace, &format!("{prefix}-{i}"), &[])
            .await;
        let started = Instant::now();
        let prev = node.sandbox_add_primary(&pod).await.expect("primary ADD");
        let plugin_started = Instant::now();
        let result = node
            .sandbox_add_ours(&pod, prev)
            .await
            .unwrap_or_else(|e| panic!("ADD failed: {e}\n{}", node.agent_log()));
        ours.push(plugin_started.elapsed());
        chain.push(started.elapsed());
        let patch =
            json!({"metadata": {"annotations": {"bench.istio-cni-rs/patch": i.to_string()}}});
        let patch_started = Instant::now();
        node.pods(namespace)
            .patch_status(&pod.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("status patch");
        patches.push(patch_started.elapsed());
        node.report_running(&mut pod, &result).await;
        pods.push(pod);
    }
    chain.sort();
    ours.sort();
    patches.sort();
    (pods, chain, ours, patches)
}

/// `n` pods whose sandboxes are added all at once. `whole`: time the whole chain of every pod;
/// otherwise the primary plugins run first, untimed, and only the plugin's execs are timed.
/// Also returns the CPU the bench and what it started used in the timed part, and the agent's
/// CPU clock from before the burst to [`AFTER_BURST`] after it.
async fn add_at_once(
    node: &TestNode,
    namespace: &str,
    prefix: &str,
    n: usize,
    whole: bool,
) -> (Vec<TestPod>, Duration, CpuSplit, Option<Duration>) {
    let mut pods = Vec::new();
    for i in 0..n {
        pods.push(
            node.create_pod_object(namespace, &format!("{prefix}-{i}"), &[])
                .await,
        );
    }
    let prevs = if whole {
        vec![None; n]
    } else {
        let added = join_all(pods.iter().map(|p| node.sandbox_add_primary(p))).await;
        added
            .into_iter()
            .map(|r| Some(r.expect("primary ADD")))
            .collect()
    };
    let cpu_before = cpu_profile::snapshot_tree(std::process::id());
    let agent_before = node.agent_cpu_time();
    let started = Instant::now();
    let results = join_all(pods.iter().zip(prevs).map(|(pod, prev)| async move {
        match prev {
            Some(prev) => node.sandbox_add_ours(pod, prev).await,
            None => {
                let prev = node.sandbox_add_primary(pod).await?;
                node.sandbox_add_ours(pod, prev).await
            }
        }
    }))
    .await;
    let took = started.elapsed();
    let cpu = CpuSplit::between(&cpu_before);
    tokio::time::sleep(AFTER_BURST).await;
    let agent_clock = node.agent_cpu_since(agent_before);
    for (pod, r) in pods.iter_mut().zip(results) {
        let result = r.unwrap_or_else(|e| panic!("ADD at once failed: {e}\n{}", node.agent_log()));
        node.report_running(pod, &result).await;
    }
    (pods, took, cpu, agent_clock)
}

/// The agent's CPU per ADD of a burst of `n`, in ms, from its CPU clock.
fn per_add(clock: Option<Duration>, n: usize) -> Figure {
    match clock {
        Some(c) => Figure::Value(ms(c) / n as f64),
        None => Figure::NotApplicable("the agent's CPU clock could not be read".into()),
    }
}

/// CPU time, in ms, of the bench and the processes it started, between a snapshot and now.
struct CpuSplit {
    /// The agent under test (ours and Istio's are both `install-cni`).
    agent: f64,
    api_server_and_etcd: f64,
    /// Of the processes the bench started and waited for: the plugin execs.
    plugin_execs: f64,
    /// The bench itself: its client and the ZDS peer.
    bench: f64,
}

impl CpuSplit {
    fn between(before: &cpu_profile::Snapshot) -> CpuSplit {
        let profile = cpu_profile::between(before, &cpu_profile::snapshot_tree(std::process::id()));
        let bench_comm = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
        let of = |comm: &str| profile.by_name.iter().find(|u| u.comm == comm);
        let own = |comm: &str| of(comm).map_or(0.0, |u| ms(u.own));
        CpuSplit {
            agent: own("install-cni"),
            api_server_and_etcd: own("kube-apiserver") + own("etcd"),
            plugin_execs: of(bench_comm.trim()).map_or(0.0, |u| ms(u.reaped)),
            bench: own(bench_comm.trim()),
        }
    }

    fn total(&self) -> f64 {
        self.agent + self.api_server_and_etcd + self.plugin_execs + self.bench
    }
}

/// `BENCH_FILL`: namespaces and other nodes' pods to fill the cluster with first.
fn fill() -> Option<(usize, usize)> {
    let spec = std::env::var("BENCH_FILL").ok()?;
    let parse = |v: &str| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("BENCH_FILL: {v:?} in {spec:?} is not a number"))
    };
    let (namespaces, pods) = spec
        .split_once(':')
        .unwrap_or_else(|| panic!("BENCH_FILL: {spec:?} is not namespaces:pods"));
    Some((parse(namespaces), parse(pods)))
}

/// Nodes the fill's pods are bound to (none exists), as in the scale bench.
const FILL_NODES: usize = 500;

/// The agent's run dir tmpfs (a few hundred pods' hints take a few KiB).
const RUN_DIR_BYTES: u64 = 16 << 20;

/// `DRIFT_CHECK_INTERVAL_SECONDS` as the agent and the chart ship it.
const SHIPPED_DRIFT_SECONDS: &str = "30";

/// A fresh node running `agent` (in a cluster filled first with `BENCH_FILL`), its ZDS peer
/// holding the snapshot, and the ambient namespace `bench`.
async fn start_node(agent: Agent) -> (TestNode, ZdsPeer) {
    let options = NodeOptions {
        agent,
        // As on a node: the run dir (the netns hints) is a tmpfs, and enrolled pods are checked
        // for drift at the shipped interval, not the test node's every second, so a burst's
        // window holds its ADDs' work alone.
        run_dir_tmpfs: Some(RUN_DIR_BYTES),
        extra_env: vec![(
            "DRIFT_CHECK_INTERVAL_SECONDS".into(),
            SHIPPED_DRIFT_SECONDS.into(),
        )],
        ..NodeOptions::default()
    };
    let node = TestNode::start_on(KubeTestEnv::start().await, Backend::Nftables, options).await;
    if let Some((namespaces, pods)) = fill() {
        let (admin, started) = (node.kube.client(), Instant::now());
        cluster_fill::namespaces(&admin, 0, namespaces)
            .await
            .expect("fill namespaces");
        cluster_fill::pods_on_nodes(&admin, 0, pods, namespaces, "elsewhere", FILL_NODES)
            .await
            .expect("fill pods");
        eprintln!(
            "bench: filled {namespaces} namespaces and {pods} pods on other nodes in {:.0}s (load {})",
            started.elapsed().as_secs_f64(),
            load()
        );
    }
    let mut cfg = PeerConfig::new(node.path("zt/ztunnel.sock"));
    cfg.max_backoff = Duration::from_millis(50);
    let peer = ZdsPeer::start(cfg);
    peer.wait_for("snapshot", Duration::from_secs(30), |s| s.snapshot_received)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    node.create_namespace("bench", &[AMBIENT]).await;
    (node, peer)
}

/// `BENCH_BURSTS`: bursts of 100 ambient and 100 non-mesh ADDs on one node, the agent's CPU per
/// ADD of each (its CPU clock), after one ADD of each kind has paid the one-time costs. Before
/// each, the agent's CPU in a second with no ADD: what of a burst's window is not the ADDs'.
async fn run_bursts(agent: Agent, bursts: usize) -> Figures {
    let (node, _peer) = start_node(agent).await;
    node.create_namespace("plain", &[]).await;
    add_one_by_one(&node, "bench", "first", 1).await;
    add_one_by_one(&node, "plain", "first", 1).await;
    let (mut ambient, mut plain, mut idle) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..bursts {
        let before = node.agent_cpu_time();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let quiet = node.agent_cpu_since(before);
        let (_, took, _, clock) =
            add_at_once(&node, "bench", &format!("burst{i}"), 100, false).await;
        let (_, plain_took, _, plain_clock) =
            add_at_once(&node, "plain", &format!("burst{i}"), 100, false).await;
        let at = |c: Option<Duration>| c.map_or(f64::NAN, |c| ms(c) / 100.0);
        eprintln!(
            "bench: burst {}/{bursts} (load {}): agent CPU {:.1} ms in the idle second before; \
             per ADD {:.3} ms ambient ({:.1} ms all done), {:.3} ms non-mesh ({:.1} ms)",
            i + 1,
            load(),
            at(quiet) * 100.0,
            at(clock),
            ms(took),
            at(plain_clock),
            ms(plain_took)
        );
        ambient.push(per_add(clock, 100));
        plain.push(per_add(plain_clock, 100));
        idle.push(per_add(quiet, 1));
    }
    let mut out: Figures = Vec::new();
    for (i, f) in idle.into_iter().enumerate() {
        out.push((
            format!(
                "the agent's CPU in the second with no ADD before burst {}",
                i + 1
            ),
            "ms",
            f,
        ));
    }
    for (kind, figures) in [("ambient", ambient), ("non-mesh", plain)] {
        for (i, f) in figures.into_iter().enumerate() {
            out.push((
                format!(
                    "the agent's CPU per {kind} ADD, burst {} of 100 at once (its CPU clock, \
                     the burst and {} ms after)",
                    i + 1,
                    AFTER_BURST.as_millis()
                ),
                "ms",
                f,
            ));
        }
    }
    out
}

/// The whole bench on a fresh node running `agent`.
async fn run(agent: Agent) -> Figures {
    let istio = matches!(agent, Agent::Istio(_));
    let (mut node, peer) = start_node(agent).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = node.agent_memory_kib("VmRSS").unwrap_or(0);

    // Baseline: the same chain for pods that are not ambient (the plugin finds out and passes
    // the result through), so the ambient cost can be told apart from the chain's.
    node.create_namespace("plain", &[]).await;
    let (_, plain_chain, plain_ours, _) = add_one_by_one(&node, "plain", "plain", 20).await;
    let (_, plain_burst, plain_burst_cpu, plain_burst_clock) =
        add_at_once(&node, "plain", "plain-burst", 100, false).await;
    let (_, plain_burst_chain, _, _) = add_at_once(&node, "plain", "plain-chain", 100, true).await;

    // The first ambient ADD after the agent started pays one-time costs (its first connection
    // for writes to the API server, first rules in a pod); reported on its own.
    let (first_pod, _, first, _) = add_one_by_one(&node, "bench", "first", 1).await;
    let (mut pods, chain, ours, patches) = add_one_by_one(&node, "bench", "seq", 49).await;
    pods.extend(first_pod);
    let sequential_metrics = node.metrics();

    // 100 sandboxes at once, as a node does after a reboot or a big rollout.
    let (more, burst, burst_cpu, burst_clock) =
        add_at_once(&node, "bench", "burst", 100, false).await;
    // The floor under that burst: the same 100 annotation patches on `pods/status` by the bench
    // itself, at most 8 in flight as the agent's client sends them (`MAX_IN_FLIGHT`).
    let burst_patches = {
        use futures::StreamExt;
        let started = Instant::now();
        let api = node.pods("bench");
        // Futures collected first: a closure inside the stream makes the spawned future lose
        // `Send` (a higher-ranked lifetime limit).
        let patches: Vec<_> = more
            .iter()
            .map(|pod| {
                let (api, name) = (api.clone(), pod.name.clone());
                let patch = json!({"metadata": {"annotations": {"bench.istio-cni-rs/burst": "1"}}});
                async move {
                    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .expect("status patch")
                }
            })
            .collect();
        futures::stream::iter(patches)
            .buffer_unordered(cni_agent::kube_client::MAX_IN_FLIGHT)
            .collect::<Vec<_>>()
            .await;
        started.elapsed()
    };
    pods.extend(more);
    let (more, burst_chain, _, _) = add_at_once(&node, "bench", "chain", 100, true).await;
    pods.extend(more);
    for pod in &pods {
        node.wait_redirection(pod, Some("enabled")).await;
    }
    // Steady state: past our agent's periodic heap trim (every 10 s), like a node between
    // rollouts; the peak during the bursts is reported as well.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let mem = |field| node.agent_memory_kib(field).unwrap_or(0) as f64 / 1024.0;
    let (loaded, peak, anon, file) = (mem("VmRSS"), mem("VmHWM"), mem("RssAnon"), mem("RssFile"));
    let metrics = node.metrics();

    // Restart: kill -9, start, until the peer holds every pod again, each handed over with its
    // namespace (an Add) in the new connection's snapshot. Several times, the median reported:
    // one restart is a third of a second, within reach of a single busy moment of the machine.
    let n = pods.len();
    let mut restarts = Vec::new();
    let mut restart = None;
    let mut last_start = std::time::SystemTime::now();
    // Per restart: a killed agent's time goes to the bench that reaps it, so each restart is
    // measured on its own, from the kill to the last pod handed over (the new agent's time).
    let mut restart_cpu = Vec::new();
    for _ in 0..RESTARTS {
        let cpu_before = cpu_profile::snapshot_tree(std::process::id());
        let before = peer.status();
        let (connects, log_len) = (before.connects, before.log.len());
        node.kill_agent();
        let started = Instant::now();
        last_start = std::time::SystemTime::now();
        node.start_agent();
        let adds = |s: &testbed::zds_peer::PeerStatus| {
            s.log[log_len.min(s.log.len())..]
                .iter()
                .filter(|e| e.starts_with("add "))
                .count()
        };
        let restarted = peer
            .wait_for("all pods re-handed", RESTART_WAIT, |s| {
                s.connects > connects
                    && s.snapshot_received
                    && s.workloads.len() == n
                    && adds(s) == n
            })
            .await;
        if restarted.is_ok() {
            restarts.push(ms(started.elapsed()));
            restart_cpu.push(CpuSplit::between(&cpu_before));
            continue;
        }
        let s = peer.status();
        let keeps = s.log[log_len.min(s.log.len())..]
            .iter()
            .filter(|e| e.starts_with("keep "))
            .count();
        restart = Some(Figure::NotApplicable(format!(
            "after {}s the new connection's snapshot had handed {} of {n} pods over with \
             their namespace ({keeps} kept without one){}",
            RESTART_WAIT.as_secs(),
            adds(&s),
            if istio {
                ": Istio finds a running pod's namespace only through a process in the \
                 pod's cgroup (`/host/proc/*/cgroup` naming the pod UID); the emulated \
                 pods are namespaces without processes"
            } else {
                ""
            }
        )));
        break;
    }
    eprintln!("bench: restarts (ms): {restarts:.1?}");
    let restart = restart.unwrap_or_else(|| Figure::Value(median(&mut restarts)));
    // Where the time went, from the agent's own log (stderr, not the table): a few ADDs with
    // their stages, and the restarted agent's steps.
    if !istio {
        let log = std::fs::read_to_string(node.path("agent.log")).unwrap_or_default();
        let adds: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("pod enrolled in the ambient mesh") && l.contains("/seq-"))
            .collect();
        for line in adds.iter().step_by(16) {
            eprintln!("bench: agent: {line}");
        }
        let steps = [
            "host probe rules in place",
            "hinted namespaces checked",
            "watches synced",
            "restored enrolled pods",
            "enrolled pods' rules checked",
            "CNI ambient server marking ready",
            "ztunnel hello",
            "snapshot sent",
        ];
        let restart_lines: Vec<&str> = log
            .lines()
            .filter(|l| steps.iter().any(|s| l.contains(s)))
            .collect();
        for line in &restart_lines[restart_lines.len().saturating_sub(steps.len())..] {
            eprintln!("bench: agent: {line}");
        }
        eprintln!(
            "bench: the restart's agent was started at unix {:.3}",
            last_start
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0)
        );
    }
    drop(node);

    let mut out: Figures = Vec::new();
    let mut push = |what: String, unit, f| out.push((what, unit, f));
    for (what, times) in [
        (
            "ambient CNI ADD, plugin exec → result, one at a time, n=49",
            &ours,
        ),
        ("the same for a non-mesh pod (baseline), n=20", &plain_ours),
        (
            "ambient, whole chain (bridge+portmap+istio-cni), one at a time, n=49",
            &chain,
        ),
        ("the same for a non-mesh pod (baseline), n=20", &plain_chain),
        (
            "`pods/status` annotation patch by the bench itself (the floor of an ambient ADD), n=49",
            &patches,
        ),
    ] {
        push(format!("{what}: p50"), "ms", Figure::Value(pct(times, 0.5)));
        push(
            format!("{what}: p99"),
            "ms",
            Figure::Value(pct(times, 0.99)),
        );
    }
    push(
        "the first ambient CNI ADD after the agent started (plugin exec)".into(),
        "ms",
        Figure::Value(ms(first[0])),
    );
    for (what, took) in [
        (
            "100 ambient CNI ADDs at once (plugin execs), all done",
            burst,
        ),
        ("the same for non-mesh pods (baseline)", plain_burst),
        (
            "the same 100 `pods/status` patches by the bench itself, 8 in flight (the floor)",
            burst_patches,
        ),
        ("100 ambient whole chains at once, all done", burst_chain),
        ("the same for non-mesh pods (baseline)", plain_burst_chain),
    ] {
        push(what.into(), "ms", Figure::Value(ms(took)));
    }
    // Whether the bursts are bound by this machine's CPUs: everything the bench's processes
    // spent in the timed part, spread over every CPU, is the least the burst can take here.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    for (what, cpu) in [
        ("100 ambient CNI ADDs at once", &burst_cpu),
        ("100 non-mesh CNI ADDs at once", &plain_burst_cpu),
    ] {
        for (part, v) in [
            ("the agent", cpu.agent),
            ("kube-apiserver + etcd", cpu.api_server_and_etcd),
            ("the plugin execs", cpu.plugin_execs),
            ("the bench (its client, the ZDS peer)", cpu.bench),
        ] {
            push(
                format!("CPU during the {what}: {part}"),
                "ms",
                Figure::Value(v),
            );
        }
        push(
            format!("CPU during the {what}: all of it ÷ {cpus} CPUs (the least it can take here)"),
            "ms",
            Figure::Value(cpu.total() / cpus),
        );
    }
    for (kind, clock) in [("ambient", burst_clock), ("non-mesh", plain_burst_clock)] {
        push(
            format!(
                "the agent's CPU per {kind} CNI ADD, 100 at once (its CPU clock, the burst and \
                 {} ms after)",
                AFTER_BURST.as_millis()
            ),
            "ms",
            per_add(clock, 100),
        );
    }
    let mean = |of: fn(&CpuSplit) -> f64| {
        (!restart_cpu.is_empty())
            .then(|| restart_cpu.iter().map(of).sum::<f64>() / restart_cpu.len() as f64)
    };
    for (part, v) in [
        ("the agent", mean(|c| c.agent)),
        ("kube-apiserver + etcd", mean(|c| c.api_server_and_etcd)),
        (
            "the bench (the ZDS peer, waiting for it)",
            mean(|c| c.bench),
        ),
        ("all of it ÷ CPUs", mean(CpuSplit::total).map(|t| t / cpus)),
    ] {
        let f = v.map_or_else(
            || Figure::NotApplicable("no restart completed".into()),
            Figure::Value,
        );
        push(format!("CPU per agent restart, mean: {part}"), "ms", f);
    }
    for (phase, m) in [
        ("one at a time", &sequential_metrics),
        ("all phases incl. the burst", &metrics),
    ] {
        for (label, metric) in [
            (
                "agent-side ADD (request → 200)",
                "istio_cni_add_duration_seconds",
            ),
            ("netns resolve", "istio_cni_netns_resolve_duration_seconds"),
            (
                "routes + rules apply",
                "istio_cni_rule_apply_duration_seconds",
            ),
            ("ZDS Add → ack", "istio_cni_zds_ack_duration_seconds"),
        ] {
            let f = match mean_ms(m, metric) {
                Some(v) => Figure::Value(v),
                None if istio => {
                    Figure::NotApplicable("Istio's agent exports no histogram of this stage".into())
                }
                None => Figure::NotApplicable(format!("no {metric} in /metrics")),
            };
            push(format!("stage mean ({phase}): {label}"), "ms", f);
        }
    }
    push(
        "agent RSS idle".into(),
        "MiB",
        Figure::Value(idle as f64 / 1024.0),
    );
    push(
        format!("agent RSS with {n} enrolled + 220 non-mesh pods, steady"),
        "MiB",
        Figure::Value(loaded),
    );
    push("… of it anonymous".into(), "MiB", Figure::Value(anon));
    push(
        "… of it file-backed (code)".into(),
        "MiB",
        Figure::Value(file),
    );
    push(
        "agent peak RSS (bursts included)".into(),
        "MiB",
        Figure::Value(peak),
    );
    push(
        format!(
            "agent restart (kill -9) → {n} pods re-verified and re-handed to the peer, \
             median of {RESTARTS}"
        ),
        "ms",
        restart,
    );
    out
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// One cell: the median over the rounds (and every round's value), or n/a.
fn cell(runs: &[Figures], row: usize, unit: &str) -> (Option<f64>, String) {
    let mut values = Vec::new();
    for r in runs {
        match &r[row].2 {
            Figure::Value(v) => values.push(*v),
            Figure::NotApplicable(why) => return (None, format!("n/a: {why}")),
        }
    }
    let all = values
        .iter()
        .map(|v| format!("{v:.1}"))
        .collect::<Vec<_>>()
        .join(" / ");
    let m = median(&mut values);
    if runs.len() > 1 {
        (Some(m), format!("**{m:.1} {unit}** ({all})"))
    } else {
        (Some(m), format!("{m:.1} {unit}"))
    }
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("node benchmarks need root; skipped");
        return;
    }
    // Before any thread: the run dir tmpfs is mounted in a mount namespace of this process's
    // own, which the agents it starts share and which goes with it.
    testbed::node::private_mount_namespace().expect("unshare(CLONE_NEWNS)");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(bench());
}

async fn bench() {
    let istio_bin = testbed::istio_agent::istio_bin();
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(if istio_bin.is_some() { 3 } else { 1 });
    let bursts: Option<usize> = std::env::var("BENCH_BURSTS").ok().map(|v| {
        v.trim()
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or_else(|| panic!("BENCH_BURSTS: {v:?} is not a positive number of bursts"))
    });
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let mut istio_failed: Option<String> = None;
    for round in 1..=rounds {
        // Alternate which agent goes first, so a drift in the machine's load hits both alike.
        let mut order = vec![Agent::Ours];
        if let Some(bin) = istio_bin.as_ref().filter(|_| istio_failed.is_none()) {
            order.push(Agent::Istio(bin.clone()));
            if round % 2 == 0 {
                order.reverse();
            }
        }
        // `BENCH_ONLY=istio` or `ours`: one agent (to debug a setup).
        match std::env::var("BENCH_ONLY").as_deref() {
            Ok("istio") => order.retain(|a| matches!(a, Agent::Istio(_))),
            Ok("ours") => order.retain(|a| matches!(a, Agent::Ours)),
            _ => {}
        }
        for agent in order {
            let istio = matches!(agent, Agent::Istio(_));
            eprintln!(
                "round {round}/{rounds}: {} agent (load {})",
                if istio { "Istio's" } else { "our" },
                load()
            );
            // A failing setup of Istio's agent ends its rounds, not the bench.
            let round = match bursts {
                Some(n) => tokio::spawn(run_bursts(agent, n)),
                None => tokio::spawn(run(agent)),
            };
            match round.await {
                Ok(figures) => if istio { &mut theirs } else { &mut ours }.push(figures),
                Err(e) if istio => {
                    eprintln!("Istio's agent failed this round: {e}");
                    istio_failed = Some(e.to_string());
                }
                Err(e) => panic!("our agent's run failed: {e}"),
            }
        }
    }
    eprintln!("done (load {})", load());
    if let Some((namespaces, pods)) = fill() {
        println!(
            "cluster filled first: {namespaces} namespaces, {pods} pods on {FILL_NODES} other nodes"
        );
    }

    println!("our plugin: {}", plugin_binary().display());
    if let Some(bin) = &istio_bin {
        println!("Istio's agent and plugin: {}", bin.display());
        println!();
        println!(
            "| measurement (median of {rounds}, every round in brackets) | Istio | ours | ours ÷ Istio |"
        );
        println!("|---|---|---|---|");
    } else {
        println!();
        println!("| measurement | result |");
        println!("|---|---|");
    }
    if let Some(why) = &istio_failed {
        println!("Istio's agent failed (see stderr): {why}");
    }
    if ours.is_empty() || (istio_bin.is_some() && theirs.is_empty()) {
        // One side only (BENCH_ONLY): print it alone.
        let only = if ours.is_empty() { &theirs } else { &ours };
        for (row, (what, unit, _)) in only[0].iter().enumerate() {
            println!("| {what} | {} |", cell(only, row, unit).1);
        }
        return;
    }
    for (row, (what, unit, _)) in ours[0].iter().enumerate() {
        let (o, ours_cell) = cell(&ours, row, unit);
        if istio_bin.is_none() {
            println!("| {what} | {ours_cell} |");
            continue;
        }
        // Both runs print the same rows in the same order (some share a name).
        let theirs_row = (theirs[0].get(row).map(|(w, _, _)| w) == Some(what)).then_some(row);
        let (t, theirs_cell) = match theirs_row {
            Some(r) => cell(&theirs, r, unit),
            None => (None, "n/a".into()),
        };
        let ratio = match (o, t) {
            (Some(o), Some(t)) if t > 0.0 => format!("{:.2}", o / t),
            _ => "n/a".into(),
        };
        println!("| {what} | {theirs_cell} | {ours_cell} | {ratio} |");
    }
}
