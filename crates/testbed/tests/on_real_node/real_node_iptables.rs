//! Our agent on the real node with the iptables backend (`global.nativeNftables=false`): the
//! image carries Debian's iptables (legacy and nft), and the agent runs them inside its container
//! against the node and the pods. The nftables backend is `tests/on_real_node/real_node.rs`.
//!
//! Needs root, the node binaries (`tools/k8s-node/build.sh`) and the images (`scripts/node-images`,
//! or `REAL_NODE_IMAGES`).

use std::time::Duration;

use testbed::migrate::{
    Rules, agent_log, make_node_legacy, node_rules, peer_workloads, pod_rules, redirected_now,
};
use testbed::real_node::{
    CONFLIST, REDIRECTION, RealNode, annotation, create, wait_running, witness, witness_pod,
};

/// One node at a time: a node is several hundred MB of processes and most of a core to start.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The node's kubelet marks its iptables variant with `KUBE-IPTABLES-HINT` in mangle; the
/// node's `iptables` is Debian's default, nft.
fn assert_kubelet_uses_nft(rules: &Rules) {
    assert!(
        rules.nft.contains(":KUBE-IPTABLES-HINT"),
        "kubelet's hint not in nft:\n{}",
        rules.nft
    );
    assert!(!rules.legacy.contains("KUBE-"), "{}", rules.legacy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_backend_redirects_kubelets_pods_with_the_nodes_variant_then_uninstall_cleans_up()
{
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    let before = node.read(CONFLIST).expect("the node's bridge conflist");
    let host_before = node_rules(&node);
    assert_kubelet_uses_nft(&host_before);
    node.install_chart(&["--set", "global.nativeNftables=false"])
        .await;

    // The agent picked the variant kubelet uses, and says why.
    let log = agent_log(&node);
    let chosen = log
        .lines()
        .find(|l| l.contains("iptables variant chosen"))
        .unwrap_or_else(|| panic!("no variant in the agent's log:\n{log}"));
    assert!(chosen.contains("iptables-nft"), "{chosen}");
    let host = node_rules(&node);
    assert!(
        host.nft.contains("-A POSTROUTING -j ISTIO_POSTRT"),
        "{}",
        host.nft
    );
    assert!(!host.legacy.contains("ISTIO"), "{}", host.legacy);

    node.namespace("mesh", true).await;
    node.namespace("plain", false).await;
    let server = create(
        &node,
        "mesh",
        witness_pod(
            "server",
            "mkdir /www; echo hello > /www/index.html; httpd -f -p 8080 -h /www",
        ),
    )
    .await;
    let client = create(&node, "mesh", witness_pod("client", "sleep 3600")).await;
    let plain = create(&node, "plain", witness_pod("plain", "sleep 3600")).await;
    let server_pod = wait_running(&node, "mesh", "server").await;
    wait_running(&node, "mesh", "client").await;
    wait_running(&node, "plain", "plain").await;

    for (name, uid) in [("server", &server), ("client", &client)] {
        let p = testbed::real_node::get(&node, "mesh", name).await.unwrap();
        assert_eq!(annotation(&p, REDIRECTION).as_deref(), Some("enabled"));
        assert_eq!(witness(&node, "mesh", name), "REDIRECTED", "{name}");
        // In-pod rules are iptables ones, in the node's variant, and no nftables table of ours.
        let rules = pod_rules(&node, uid);
        for want in [
            "-A PREROUTING -j ISTIO_PRERT",
            "-A OUTPUT -j ISTIO_OUTPUT",
            "--to-ports 15001",
            "--to-ports 15006",
        ] {
            assert!(
                rules.nft.contains(want),
                "{name}: no {want:?} in\n{}",
                rules.nft
            );
        }
        assert!(!rules.legacy.contains("ISTIO"), "{name}: {}", rules.legacy);
        let netns = node.pod_netns(uid).unwrap();
        let tables = testbed::migrate::netns_exec(&netns, "nft", &["list", "tables"]);
        assert!(!tables.contains("inet istio"), "{name}: {tables}");
    }
    assert_eq!(witness(&node, "plain", "plain"), "DIRECT");
    assert!(!pod_rules(&node, &plain).nft.contains("ISTIO"));
    let w = peer_workloads(&node);
    assert!(w.contains_key(&server) && w.contains_key(&client), "{w:?}");
    assert!(!w.contains_key(&plain), "{w:?}");

    // App traffic through the peer's in-pod listeners: out of the client's 15001, into the
    // server's 15006.
    let ip = server_pod.status.unwrap().pod_ip.unwrap();
    let response = node.kubectl(&[
        "-n",
        "mesh",
        "exec",
        "client",
        "--",
        "sh",
        "-c",
        &format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {ip} 8080"),
    ]);
    assert!(response.ends_with("\r\n\r\nhello\n"), "{response:?}");
    node.eventually(
        "the request counted by the peer's in-pod listeners",
        Duration::from_secs(10),
        || async {
            let w = peer_workloads(&node);
            (w[&client] >= 2 && w[&server] >= 2).then_some(())
        },
    )
    .await;
    assert!(redirected_now(&node, "mesh", "client"));

    // helm uninstall: the conflist as it was, the host chains gone, kubelet's untouched.
    node.kubectl(&["-n", "istio-system", "delete", "ds", "ztunnel"]);
    node.helm(&["uninstall", "istio-cni", "-n", "istio-system", "--wait"]);
    node.eventually("conflist restored", Duration::from_secs(60), || async {
        (node.read(CONFLIST).as_deref() == Some(before.as_str())).then_some(())
    })
    .await;
    let host = node_rules(&node);
    assert!(!host.nft.contains("ISTIO"), "{}", host.nft);
    assert_kubelet_uses_nft(&host);
}

/// On a node whose kubelet uses legacy iptables, the same image's agent picks legacy, and the
/// pods' redirect rules are legacy ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_backend_follows_a_legacy_node() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    make_node_legacy(&node).await;
    node.install_chart(&["--set", "global.nativeNftables=false"])
        .await;
    let log = agent_log(&node);
    let chosen = log
        .lines()
        .find(|l| l.contains("iptables variant chosen"))
        .unwrap_or_else(|| panic!("no variant in the agent's log:\n{log}"));
    assert!(chosen.contains("iptables-legacy"), "{chosen}");
    let host = node_rules(&node);
    assert!(
        host.legacy.contains("-A POSTROUTING -j ISTIO_POSTRT"),
        "{}",
        host.legacy
    );
    assert!(!host.nft.contains("ISTIO"), "{}", host.nft);

    node.namespace("mesh", true).await;
    let uid = create(&node, "mesh", witness_pod("app", "sleep 3600")).await;
    wait_running(&node, "mesh", "app").await;
    testbed::real_node::wait_redirection(&node, "mesh", "app", Some("enabled")).await;
    assert_eq!(witness(&node, "mesh", "app"), "REDIRECTED");
    let rules = pod_rules(&node, &uid);
    assert!(
        rules.legacy.contains("-A OUTPUT -j ISTIO_OUTPUT") && rules.legacy.contains("15001"),
        "{}",
        rules.legacy
    );
    assert!(!rules.nft.contains("ISTIO"), "{}", rules.nft);
    assert!(peer_workloads(&node).contains_key(&uid));
}
