//! `install-cni explain` as an operator runs it on a node: `--node` lists every pod the agent
//! watches (meshed or why not, and the error of a pod whose add keeps failing), `-o json` gives
//! the same as JSON. Against the real agent on an emulated node (kube-apiserver, CNI runtime,
//! a ZDS peer for ztunnel).

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use testbed::node::{Backend, TestNode, binary_dir};
use testbed::zds_peer::{PeerConfig, ZdsPeer};

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// `install-cni explain <args>` on the node's agent: (exit success, stdout, stderr).
fn explain(node: &TestNode, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(binary_dir().join("install-cni"))
        .arg("explain")
        .args(args)
        .env("CNI_AGENT_RUN_DIR", node.path("run"))
        .output()
        .expect("run install-cni explain");
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn explain_ok(node: &TestNode, args: &[&str]) -> String {
    let (ok, out, err) = explain(node, args);
    assert!(ok, "explain {args:?}: {err}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_lists_the_node_and_speaks_json() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let node = TestNode::start(Backend::Nftables).await;
    let mut peer = PeerConfig::new(node.path("zt/ztunnel.sock"));
    peer.max_backoff = Duration::from_millis(200);
    let _peer = ZdsPeer::start(peer);
    node.create_namespace("mesh", &[AMBIENT]).await;
    node.create_namespace("plain", &[]).await;
    let (web, r) = node.create_pod("mesh", "web", &[]).await;
    r.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    node.wait_redirection(&web, Some("enabled")).await;
    let (_, r) = node.create_pod("plain", "web", &[]).await;
    r.unwrap();
    // Its own settings name an interface Linux cannot have: every add of it fails.
    let long = "x".repeat(20);
    let mut bad = node
        .create_annotated_pod_object(
            "mesh",
            "bad-iface",
            &[],
            &[("istio.io/reroute-virtual-interfaces", &long)],
        )
        .await;
    assert!(node.sandbox_add(&mut bad).await.is_err());

    let text = explain_ok(&node, &["--node"]);
    let line = |pod: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{pod} ")))
            .unwrap_or_else(|| panic!("{pod} not listed:\n{text}"))
            .split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(
        text.starts_with("backend: nftables  ztunnel: 1 connected, 1 synced  pods: 3\n"),
        "{text}"
    );
    assert_eq!(line("mesh/web"), "yes -");
    assert!(line("plain/web").starts_with("NO not selected:"), "{text}");
    assert!(
        line("mesh/bad-iface").starts_with(
            "NO last error: invalid redirection override on pod mesh/bad-iface: annotation \
             istio.io/reroute-virtual-interfaces: invalid interface name"
        ),
        "{text}"
    );

    let json: Value = serde_json::from_str(&explain_ok(&node, &["--node", "-o", "json"])).unwrap();
    assert_eq!(json["backend"], "nftables");
    let pods = json["pods"].as_array().unwrap();
    let names: Vec<&str> = pods.iter().map(|p| p["pod"].as_str().unwrap()).collect();
    assert_eq!(names, ["mesh/bad-iface", "mesh/web", "plain/web"]);
    assert_eq!(pods[1]["meshed"], true);
    assert_eq!(pods[1]["last_error"], Value::Null);
    assert_eq!(pods[0]["meshed"], false);
    assert!(
        pods[0]["last_error"]
            .as_str()
            .unwrap()
            .contains("mesh/bad-iface")
    );

    let one: Value = serde_json::from_str(&explain_ok(&node, &["mesh/web", "-o", "json"])).unwrap();
    assert_eq!(one, pods[1]);

    for (args, says) in [
        (&["web"][..], "expected <namespace>/<pod>, got \"web\""),
        (&["mesh/web", "--node"][..], "cannot be used with"),
        (&["mesh/web", "-o", "yaml"][..], "invalid value 'yaml'"),
    ] {
        let (ok, _, err) = explain(&node, args);
        assert!(!ok && err.contains(says), "{args:?}: {err}");
    }
}
