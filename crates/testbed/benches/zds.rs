//! ZDS server benchmarks against the in-process ztunnel-like peer (which acks at once):
//! - Add round trip: `pod_added` with a netns fd until its ack, median and p99;
//! - snapshot: 250 cached pods (250 fds) replayed to a freshly connected peer.
//!
//! Run: `cargo bench -p testbed --bench zds`

use std::sync::Arc;
use std::time::{Duration, Instant};

use cni_agent::netns_cache::NetnsCache;
use cni_agent::zds::{ZdsConfig, ZdsServer};
use cni_core::zds::WorkloadInfo;
use dataplane::netns::Netns;
use testbed::zds_peer::{PeerConfig, ZdsPeer};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{what}: n={} median={:?} p99={:?} max={:?}",
        samples.len(),
        percentile(&samples, 0.5),
        percentile(&samples, 0.99),
        samples[samples.len() - 1]
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ztunnel.sock");
    let cfg = ZdsConfig {
        socket_path: path.clone(),
        accept_interval: Duration::ZERO,
        ..Default::default()
    };
    let cache = Arc::new(NetnsCache::new("/"));
    let (server, zds) = ZdsServer::bind(cfg, cache.clone()).unwrap();
    tokio::spawn(server.serve(std::future::pending()));
    let netns = Netns::current().unwrap();
    let info = |i: usize| WorkloadInfo::new(format!("pod-{i}"), "bench", "default");

    let peer = ZdsPeer::start(PeerConfig::new(&path));
    while zds.synced() < 1 {
        tokio::task::yield_now().await;
    }
    for i in 0..200 {
        zds.pod_added(&format!("warm-{i}"), info(i), &netns)
            .await
            .unwrap();
    }
    let mut samples = Vec::new();
    for i in 0..5000 {
        let uid = format!("uid-{i}");
        let started = Instant::now();
        zds.pod_added(&uid, info(i), &netns).await.unwrap();
        samples.push(started.elapsed());
    }
    report("add round trip (fd + ack)", samples);
    drop(peer);
    while zds.connected() > 0 {
        tokio::task::yield_now().await;
    }

    for i in 0..250 {
        cache.upsert(&format!("snap-{i}"), info(i), netns.try_clone().unwrap());
    }
    let mut samples = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        let peer = ZdsPeer::start(PeerConfig::new(&path));
        while zds.synced() < 1 {
            tokio::task::yield_now().await;
        }
        samples.push(started.elapsed());
        assert_eq!(peer.status().workloads.len(), 250);
        drop(peer);
        while zds.connected() > 0 {
            tokio::task::yield_now().await;
        }
    }
    report(
        "snapshot of 250 pods to a fresh peer (connect → SnapshotSent acked)",
        samples,
    );
}
