//! One pod delete, one ZDS `Del`: a deleted ambient pod is removed from ztunnel exactly once.
//!
//! kubelet deletes a pod in two steps the agent sees: once its containers have stopped it posts
//! the pod's terminal phase (`Succeeded`/`Failed`), then it removes the object. Istio's agent
//! removes the pod from the mesh at both (its reconcile rules: terminal update, then delete), so
//! ztunnel reads `Del` twice for the same UID and acks the second as unknown. Ours sends it once,
//! and a pod deleted without a terminal phase first still gets its one `Del`.
//!
//! Emulated node (real kube-apiserver, the agent process, the CNI chain, the ZDS peer); root only.

use std::time::Duration;

use kube::api::{DeleteParams, Patch, PatchParams};
use serde_json::json;
use testbed::node::{Backend, TestNode, TestPod};
use testbed::zds_peer::{PeerConfig, ZdsPeer};

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// Processed delete events (`nodeagent_reconcile_events_total{type="delete"}`).
fn deletes_processed(node: &TestNode) -> u64 {
    node.metrics()
        .lines()
        .find_map(|l| l.strip_prefix("nodeagent_reconcile_events_total{type=\"delete\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// What kubelet does to a pod it was asked to delete: graceful delete requested, containers
/// stopped, terminal phase posted (kubelet >= 1.27), and once the node is done with the pod (here:
/// once ztunnel has dropped it), the object removed.
async fn delete_as_kubelet_does(node: &TestNode, peer: &ZdsPeer, pod: &TestPod) {
    let api = node.pods(&pod.namespace);
    api.delete(&pod.name, &DeleteParams::default().grace_period(30))
        .await
        .unwrap();
    let status = json!({"status": {"phase": "Succeeded"}});
    api.patch_status(&pod.name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    peer.wait_for("the terminated pod drained", Duration::from_secs(10), |s| {
        !s.workloads.contains_key(&pod.uid)
    })
    .await
    .unwrap();
    api.delete(&pod.name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
}

fn dels(peer: &ZdsPeer, uid: &str) -> usize {
    let want = format!("del {uid}");
    peer.status().log.iter().filter(|e| **e == want).count()
}

async fn wait_deleted(node: &TestNode, pod: &TestPod, deletes_before: u64) {
    let api = node.pods(&pod.namespace);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    // The object is gone and the agent processed its delete event.
    while api.get_opt(&pod.name).await.unwrap().is_some()
        || deletes_processed(node) <= deletes_before
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{}/{} delete not processed\n{}",
            pod.namespace,
            pod.name,
            node.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anything the delete event was going to send has gone out by now.
    tokio::time::sleep(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_enrolled_pod_sends_one_del() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let node = TestNode::start(Backend::Nftables).await;
    let peer = ZdsPeer::start(PeerConfig::new(node.path("zt/ztunnel.sock")));
    peer.wait_for("snapshot", Duration::from_secs(10), |s| s.snapshot_received)
        .await
        .unwrap();
    node.create_namespace("mesh", &[AMBIENT]).await;

    let (pod, result) = node.create_pod("mesh", "app", &[]).await;
    result.unwrap_or_else(|e| panic!("ambient ADD failed: {e}\n{}", node.agent_log()));
    node.wait_redirection(&pod, Some("enabled")).await;

    let before = deletes_processed(&node);
    delete_as_kubelet_does(&node, &peer, &pod).await;
    wait_deleted(&node, &pod, before).await;
    let log = peer.status().log;
    assert_eq!(
        dels(&peer, &pod.uid),
        1,
        "peer log: {log:?}\n{}",
        node.agent_log()
    );

    // Deleted without a terminal phase first (a force delete): its one Del still goes out.
    let (forced, result) = node.create_pod("mesh", "forced", &[]).await;
    result.unwrap();
    node.wait_redirection(&forced, Some("enabled")).await;
    let before = deletes_processed(&node);
    node.delete_pod(&forced).await;
    wait_deleted(&node, &forced, before).await;
    peer.wait_for("the forced pod drained", Duration::from_secs(10), |s| {
        !s.workloads.contains_key(&forced.uid)
    })
    .await
    .unwrap();
    assert_eq!(dels(&peer, &forced.uid), 1, "{:?}", peer.status().log);
}
