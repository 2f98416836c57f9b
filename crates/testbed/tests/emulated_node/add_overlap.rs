//! The ambient ADD overlaps its `pods/status` annotation patch and its host probe set entry with
//! the redirection (netns, rules, ZDS ack), yet answers the plugin only once all of them
//! succeeded, and a failure after they started puts the annotation back and takes the probe set
//! entry out again. The peer holds its ack on a gate, so what
//! the API server and the runtime see in the middle of an ADD is observed, not timed.
//! Root only (real namespaces); run by `scripts/test`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use testbed::node::{Backend, TestNode};
use testbed::zds_peer::{AddReply, Gate, PeerConfig, ZdsPeer};

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// The pod's redirection annotation as the API server has it.
async fn annotation(node: &TestNode, namespace: &str, name: &str) -> Option<String> {
    let pod = node.pods(namespace).get(name).await.unwrap();
    pod.metadata
        .annotations
        .and_then(|a| a.get(cni_core::reconcile::REDIRECTION_ANNOTATION).cloned())
}

/// Whether the node's host probe set holds an entry tagged with the pod `uid`.
fn probe_set_has(node: &TestNode, uid: &str) -> bool {
    dataplane::nft::host::ProbeSets { ipv6: false }
        .list(&node.node_netns.open())
        .unwrap()
        .iter()
        .any(|e| e.pod_uid == uid)
}

/// Runs one ambient ADD while ztunnel holds its ack; once the annotation reads `enabled` (the
/// patch went out before the ack, the overlap), the probe set holds the pod (also overlapped)
/// and the ADD is still unanswered (ordering), releases the ack with `reply`. Returns the ADD's
/// outcome, the annotation right after it and whether the probe set then holds the pod.
async fn add_with_held_ack(
    reply: AddReply,
    name: &str,
) -> (Result<(), String>, Option<String>, bool) {
    let node = TestNode::start(Backend::Nftables).await;
    let peer = ZdsPeer::start(PeerConfig::new(node.path("zt/ztunnel.sock")));
    peer.wait_for("snapshot", Duration::from_secs(10), |s| s.snapshot_received)
        .await
        .unwrap();
    node.create_namespace("mesh", &[AMBIENT]).await;
    let gate = Gate::new();
    peer.set_add_reply(None, AddReply::Hold(gate.clone()));

    let mut pod = node.create_pod_object("mesh", name, &[]).await;
    let pod_uid = pod.uid.clone();
    let answered = AtomicBool::new(false);
    let add = async {
        let r = node.sandbox_add(&mut pod).await;
        answered.store(true, Ordering::SeqCst);
        r.map(|_| ()).map_err(|e| e.to_string())
    };
    let observe = async {
        // The agent gives up on an ack after 5 s; the patch lands long before on any machine.
        let mut seen = None;
        for _ in 0..200 {
            seen = annotation(&node, "mesh", name).await;
            if seen.as_deref() == Some("enabled") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            seen.as_deref(),
            Some("enabled"),
            "the annotation patch did not go out while ztunnel held its ack: not overlapped\n{}",
            node.agent_log()
        );
        assert!(
            probe_set_has(&node, &pod_uid),
            "the probe set entry waited for ztunnel's ack: not overlapped\n{}",
            node.agent_log()
        );
        let status = peer.status();
        assert!(
            status.log.iter().any(|e| e.starts_with("add ")),
            "ztunnel has not been sent the Add yet: {:?}",
            status.log
        );
        assert!(
            !answered.load(Ordering::SeqCst),
            "the ADD was answered before ztunnel acked"
        );
        gate.release(reply);
    };
    let (result, ()) = tokio::join!(add, observe);
    let after = annotation(&node, "mesh", name).await;
    (result, after, probe_set_has(&node, &pod_uid))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_annotation_patch_overlaps_the_redirection_and_the_add_waits_for_both() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let (result, after, probed) = add_with_held_ack(AddReply::Ack, "overlapped").await;
    result.expect("the ADD succeeds once ztunnel acks");
    assert_eq!(after.as_deref(), Some("enabled"));
    assert!(probed, "the enrolled pod's probe set entry is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_after_the_patch_reverts_the_annotation_before_the_add_fails() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let (result, after, probed) =
        add_with_held_ack(AddReply::Nack("failure to start proxy".into()), "refused").await;
    let err = result.expect_err("the ADD fails when ztunnel refuses the pod");
    assert!(err.contains("failure to start proxy"), "{err}");
    // Already reverted when the runtime hears of the failure: never `enabled` for a pod whose
    // sandbox is going away.
    assert_eq!(after.as_deref(), Some("pending"));
    // Nor kubelet probes SNATed for it.
    assert!(!probed, "a failed ADD left its probe set entry behind");
}
