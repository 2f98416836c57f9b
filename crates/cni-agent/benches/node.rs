//! Node-level benchmarks (root): ambient CNI ADD end to end through the runtime-side chain, 100
//! ADDs at once, agent memory idle and with 250 enrolled pods, and agent restart → every pod
//! handed to ztunnel again. Uses the e2e kit against a real kube-apiserver; binaries must be built
//! in release first: `cargo build --release --workspace --bins --features cni-agent/testing`.
//! Run: `cargo bench -p cni-agent --bench node`. Prints one markdown table for BENCHMARKS.md.

use std::time::{Duration, Instant};

use cni_agent::testing::node::{Backend, TestNode, TestPod};
use cni_agent::testing::zds_peer::{PeerConfig, ZdsPeer};

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

async fn add_pods(node: &TestNode, prefix: &str, n: usize) -> (Vec<TestPod>, Vec<Duration>) {
    let mut pods = Vec::new();
    let mut times = Vec::new();
    for i in 0..n {
        let mut pod = node
            .create_pod_object("bench", &format!("{prefix}-{i}"), &[])
            .await;
        let started = Instant::now();
        let r = node.sandbox_add(&mut pod).await;
        times.push(started.elapsed());
        r.unwrap_or_else(|e| panic!("ADD failed: {e}\n{}", node.agent_log()));

        pods.push(pod);
    }
    times.sort();
    (pods, times)
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
    let idle = node.agent_rss_kib().unwrap_or(0);

    // Baseline: the same chain for pods that are not ambient (bridge + portmap + our plugin asking
    // the agent and passing through), so the ambient cost can be told apart from the chain's.
    node.create_namespace("plain", &[]).await;
    let mut plain = Vec::new();
    for i in 0..20 {
        let mut pod = node
            .create_pod_object("plain", &format!("plain-{i}"), &[])
            .await;
        let started = Instant::now();
        node.sandbox_add(&mut pod).await.unwrap();
        plain.push(started.elapsed());
    }
    plain.sort();
    let mut plain_burst_pods = Vec::new();
    for i in 0..100 {
        plain_burst_pods.push(
            node.create_pod_object("plain", &format!("plain-burst-{i}"), &[])
                .await,
        );
    }
    let started = Instant::now();
    for r in
        futures::future::join_all(plain_burst_pods.iter_mut().map(|p| node.sandbox_add(p))).await
    {
        r.expect("non-mesh burst ADD");
    }
    let plain_burst = started.elapsed();

    let (mut pods, alone) = add_pods(&node, "seq", 50).await;
    let sequential_metrics = node.metrics();

    // 100 sandboxes at once, as a node does after a reboot or a big rollout.
    let mut objects = Vec::new();
    for i in 0..100 {
        objects.push(
            node.create_pod_object("bench", &format!("burst-{i}"), &[])
                .await,
        );
    }
    let started = Instant::now();
    let results = futures::future::join_all(objects.iter_mut().map(|p| node.sandbox_add(p))).await;
    let burst = started.elapsed();
    for r in &results {
        if let Err(e) = r {
            panic!("burst ADD failed: {e}");
        }
    }
    drop(results);
    pods.extend(objects);
    let (more, _) = add_pods(&node, "fill", 100).await;
    pods.extend(more);
    for pod in &pods {
        node.wait_redirection(pod, Some("enabled")).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let loaded = node.agent_rss_kib().unwrap_or(0);
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
    println!(
        "| ambient CNI ADD, whole chain (bridge+portmap+istio-cni), one at a time, n=50 | p50 {:.1} ms, p99 {:.1} ms |",
        pct(&alone, 0.5),
        pct(&alone, 0.99)
    );
    println!(
        "| same chain for a non-mesh pod (baseline), n=20 | p50 {:.1} ms, p99 {:.1} ms |",
        pct(&plain, 0.5),
        pct(&plain, 0.99)
    );
    println!(
        "| 100 ambient CNI ADDs at once, all done | {:.0} ms |",
        burst.as_secs_f64() * 1000.0
    );
    println!(
        "| 100 non-mesh CNI ADDs at once (baseline), all done | {:.0} ms |",
        plain_burst.as_secs_f64() * 1000.0
    );
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
        "| agent RSS with {n} enrolled pods | {:.1} MiB |",
        loaded as f64 / 1024.0
    );
    println!(
        "| agent restart → {n} pods re-verified and re-handed to ztunnel | {:.0} ms |",
        restart.as_secs_f64() * 1000.0
    );
}
