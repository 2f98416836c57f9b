//! A whole node, end to end: real kube-apiserver, the real `install-cni` agent process (installer +
//! ambient agent), Debian's bridge/host-local/portmap chained with our `istio-cni` by the installer,
//! pods as network namespaces created through that chain, and a ztunnel-like ZDS peer.
//! Root only (real namespaces); run by `scripts/test`.

use std::time::Duration;

use cni_agent::testing::node::{Backend, TestNode};
use cni_agent::testing::zds_peer::{AddReply, PeerConfig, ZdsPeer};

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// Both iptables variants: the agent uses whichever the host uses.
fn iptables_rules(netns: &dataplane::test_support::TestNetns) -> String {
    format!(
        "{}{}",
        netns.exec("iptables-legacy-save", &[]),
        netns.exec("iptables-nft-save", &[])
    )
}

fn peer(node: &TestNode) -> ZdsPeer {
    ZdsPeer::start(PeerConfig::new(node.path("zt/ztunnel.sock")))
}

async fn wait_peer_has(peer: &ZdsPeer, uid: &str, present: bool) {
    let what = format!("workload {uid} present={present}");
    peer.wait_for(&what, Duration::from_secs(15), |s| {
        s.workloads.contains_key(uid) == present
    })
    .await
    .unwrap();
}

async fn enrolls_on_cni_add(backend: Backend) {
    let node = TestNode::start(backend).await;
    let peer = peer(&node);
    peer.wait_for("snapshot", Duration::from_secs(10), |s| s.snapshot_received)
        .await
        .unwrap();
    node.create_namespace("mesh", &[AMBIENT]).await;
    node.create_namespace("plain", &[]).await;

    let (pod, result) = node.create_pod("mesh", "app-1", &[]).await;
    result.unwrap_or_else(|e| panic!("ambient ADD failed: {e}\n{}", node.agent_log()));
    // The ADD returned only after the ack: ztunnel already holds the pod's own namespace.
    let st = peer.status();
    let w = st
        .workloads
        .get(&pod.uid)
        .unwrap_or_else(|| panic!("peer never got the pod: {st:#?}"));
    assert_eq!(
        w.netns(),
        pod.netns.open().id(),
        "ztunnel got another namespace"
    );
    assert_eq!(
        (
            w.name.as_str(),
            w.namespace.as_str(),
            w.service_account.as_str()
        ),
        ("app-1", "mesh", "default")
    );
    node.wait_redirection(&pod, Some("enabled")).await;
    let rules = match backend {
        Backend::Iptables => iptables_rules(&pod.netns),
        Backend::Nftables => pod.netns.exec("nft", &["list", "ruleset"]),
    };
    assert!(
        rules.contains("15001"),
        "no outbound redirect in the pod:\n{rules}"
    );

    let (plain, result) = node.create_pod("plain", "web-1", &[]).await;
    result.unwrap();
    assert_eq!(node.redirection(&plain).await, None);
    assert!(!peer.status().workloads.contains_key(&plain.uid));
    let rules = iptables_rules(&plain.netns);
    assert!(!rules.contains("ISTIO"), "non-mesh pod got rules:\n{rules}");

    let metrics = node.metrics();
    assert!(
        metrics
            .lines()
            .any(|l| l == "istio_cni_plugin_requests_total{response_code=\"200\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.lines().any(|l| l == "ztunnel_connected 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambient_pod_enrolled_on_cni_add_iptables() {
    dataplane::require_root!();
    enrolls_on_cni_add(Backend::Iptables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambient_pod_enrolled_on_cni_add_nftables() {
    dataplane::require_root!();
    enrolls_on_cni_add(Backend::Nftables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_label_enrolls_and_unenrolls_running_pods() {
    dataplane::require_root!();
    let node = TestNode::start(Backend::Iptables).await;
    let peer = peer(&node);
    node.create_namespace("late", &[]).await;
    let (pod, result) = node.create_pod("late", "app", &[]).await;
    result.unwrap();
    assert_eq!(node.redirection(&pod).await, None);

    node.label_namespace("late", AMBIENT.0, Some(AMBIENT.1))
        .await;
    node.wait_redirection(&pod, Some("enabled")).await;
    wait_peer_has(&peer, &pod.uid, true).await;
    assert!(iptables_rules(&pod.netns).contains("ISTIO_OUTPUT"));

    node.label_pod(&pod, AMBIENT.0, Some("none")).await;
    node.wait_redirection(&pod, None).await;
    wait_peer_has(&peer, &pod.uid, false).await;
    let rules = iptables_rules(&pod.netns);
    assert!(!rules.contains("ISTIO"), "rules left behind:\n{rules}");
    let ip_rules = pod.netns.exec("ip", &["rule"]);
    assert!(
        !ip_rules.contains("0x111"),
        "fwmark rule left behind:\n{ip_rules}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_fails_the_add_and_leaves_pending() {
    dataplane::require_root!();
    let node = TestNode::start(Backend::Iptables).await;
    let peer = peer(&node);
    peer.set_add_reply(None, AddReply::Nack("failure to start proxy".into()));
    peer.wait_for("snapshot", Duration::from_secs(10), |s| s.snapshot_received)
        .await
        .unwrap();
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (pod, result) = node.create_pod("mesh", "refused", &[]).await;
    let err = result
        .expect_err("ADD must fail when ztunnel refuses the pod")
        .to_string();
    assert!(err.contains("failure to start proxy"), "{err}");
    assert_eq!(node.redirection(&pod).await.as_deref(), Some("pending"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_down_fails_closed_for_ambient_pods_only() {
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Iptables).await;
    let _peer = peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    node.create_namespace("plain", &[]).await;
    node.kill_agent();

    let (_, ambient) = node.create_pod("mesh", "waits", &[]).await;
    let err = ambient
        .expect_err("an ambient pod must not start without the agent")
        .to_string();
    assert!(err.contains("unredirected"), "{err}");
    let (_, plain) = node.create_pod("plain", "starts", &[]).await;
    plain.expect("a non-mesh pod starts while the agent is down");
}
