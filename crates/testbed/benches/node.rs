//! Node-level benchmarks (root): ambient CNI ADD end to end — our plugin's exec until it prints
//! its result (the agent's lookup, netns, rules, ZDS ack, probe set and `pods/status` patch inside
//! it), alone and 100 at once, with the whole runtime-side chain and non-mesh pods as baselines —
//! agent memory idle and with 250 enrolled pods, and agent restart → every pod handed to ztunnel
//! again. Uses the e2e kit against a real kube-apiserver; binaries must be built in release
//! first: `cargo build --release --workspace --bins`.
//! Run: `cargo bench -p testbed --bench node`. Prints one markdown table for BENCHMARKS.md.

use std::time::{Duration, Instant};

use futures::future::join_all;

use testbed::node::{Backend, TestNode, TestPod, plugin_binary};
use testbed::zds_peer::{PeerConfig, ZdsPeer};

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

/// Pods added one at a time. Each ADD runs the primary plugins first, then our plugin with their
/// result, timed apart: (pods, whole chain, our plugin's exec → result), both sorted.
async fn add_one_by_one(
    node: &TestNode,
    namespace: &str,
    prefix: &str,
    n: usize,
) -> (Vec<TestPod>, Vec<Duration>, Vec<Duration>) {
    let (mut pods, mut chain, mut ours) = (Vec::new(), Vec::new(), Vec::new());
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
        node.report_running(&mut pod, &result).await;
        pods.push(pod);
    }
    chain.sort();
    ours.sort();
    (pods, chain, ours)
}

/// `n` pods whose sandboxes are added all at once. `whole`: time the whole chain of every pod;
/// otherwise the primary plugins run first, untimed, and only our plugin's execs are timed.
async fn add_at_once(
    node: &TestNode,
    namespace: &str,
    prefix: &str,
    n: usize,
    whole: bool,
) -> (Vec<TestPod>, Duration) {
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
    for (pod, r) in pods.iter_mut().zip(results) {
        let result = r.unwrap_or_else(|e| panic!("ADD at once failed: {e}\n{}", node.agent_log()));
        node.report_running(pod, &result).await;
    }
    (pods, took)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("node benchmarks need root; skipped");
        return;
    }
    let mut node = TestNode::start(Backend::Nftables).await;
    let mut cfg = PeerConfig::new(node.path("zt/ztunnel.sock"));
    cfg.max_backoff = Duration::from_millis(50);
    let peer = ZdsPeer::start(cfg);
    peer.wait_for("snapshot", Duration::from_secs(10), |s| s.snapshot_received)
        .await
        .unwrap();
    node.create_namespace("bench", &[AMBIENT]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = node.agent_memory_kib("VmRSS").unwrap_or(0);

    // Baseline: the same chain for pods that are not ambient (our plugin asks the agent and
    // passes the result through), so the ambient cost can be told apart from the chain's.
    node.create_namespace("plain", &[]).await;
    let (_, plain_chain, plain_ours) = add_one_by_one(&node, "plain", "plain", 20).await;
    let (_, plain_burst) = add_at_once(&node, "plain", "plain-burst", 100, false).await;
    let (_, plain_burst_chain) = add_at_once(&node, "plain", "plain-chain", 100, true).await;

    // The first ambient ADD after the agent started pays one-time costs (its first connection
    // for writes to the API server, first rules in a pod); reported on its own.
    let (first_pod, _, first) = add_one_by_one(&node, "bench", "first", 1).await;
    let (mut pods, chain, ours) = add_one_by_one(&node, "bench", "seq", 49).await;
    pods.extend(first_pod);
    let sequential_metrics = node.metrics();

    // 100 sandboxes at once, as a node does after a reboot or a big rollout.
    let (more, burst) = add_at_once(&node, "bench", "burst", 100, false).await;
    pods.extend(more);
    let (more, burst_chain) = add_at_once(&node, "bench", "chain", 100, true).await;
    pods.extend(more);
    for pod in &pods {
        node.wait_redirection(pod, Some("enabled")).await;
    }
    // Steady state: past the agent's periodic heap trim (every 10 s), like a node between
    // rollouts; the peak during the bursts is reported as well.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let mem = |field| node.agent_memory_kib(field).unwrap_or(0) as f64 / 1024.0;
    let (loaded, peak, anon, file) = (mem("VmRSS"), mem("VmHWM"), mem("RssAnon"), mem("RssFile"));
    let metrics = node.metrics();

    // Restart: kill -9, start, until the peer holds every pod again with its own namespace.
    let connects = peer.status().connects;
    node.kill_agent();
    let started = Instant::now();
    node.start_agent();
    let n = pods.len();
    peer.wait_for("all pods re-handed", Duration::from_secs(60), |s| {
        s.connects > connects && s.snapshot_received && s.workloads.len() == n
    })
    .await
    .unwrap();
    let restart = started.elapsed();

    println!("| measurement | result |");
    println!("|---|---|");
    println!("| our plugin binary | {} |", plugin_binary().display());
    for (what, times) in [
        (
            "ambient CNI ADD, our plugin exec → result, one at a time, n=49",
            &ours,
        ),
        ("the same for a non-mesh pod (baseline), n=20", &plain_ours),
        (
            "ambient, whole chain (bridge+portmap+istio-cni), one at a time, n=49",
            &chain,
        ),
        ("the same for a non-mesh pod (baseline), n=20", &plain_chain),
    ] {
        println!(
            "| {what} | p50 {:.1} ms, p99 {:.1} ms |",
            pct(times, 0.5),
            pct(times, 0.99)
        );
    }
    println!(
        "| the first ambient CNI ADD after the agent started (our plugin) | {:.1} ms |",
        ms(first[0])
    );
    for (what, took) in [
        (
            "100 ambient CNI ADDs at once (our plugin's execs), all done",
            burst,
        ),
        ("the same for non-mesh pods (baseline)", plain_burst),
        ("100 ambient whole chains at once, all done", burst_chain),
        ("the same for non-mesh pods (baseline)", plain_burst_chain),
    ] {
        println!("| {what} | {:.0} ms |", ms(took));
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
            if let Some(ms) = mean_ms(m, metric) {
                println!("| stage mean ({phase}): {label} | {ms:.2} ms |");
            }
        }
    }
    println!("| agent RSS idle | {:.1} MiB |", idle as f64 / 1024.0);
    println!(
        "| agent RSS with {n} enrolled pods, steady | {loaded:.1} MiB ({anon:.1} anonymous, {file:.1} file-backed: code) |"
    );
    println!("| agent peak RSS (bursts included) | {peak:.1} MiB |");
    println!(
        "| agent restart → {n} pods re-verified and re-handed to ztunnel | {:.0} ms |",
        ms(restart)
    );
}
