//! Two real nodes (`scripts/real-node up --nodes 2`: `real-node` and `real-node-2`, each with its
//! own containerd, kubelet and kube-proxy, pod CIDRs routed between them), the ZDS test peer as
//! ztunnel on each, and ambient traffic between pods on different nodes (issue #22):
//!
//! - our chart on both nodes: a pod on each node reaches the other's server by pod IP and through
//!   a ClusterIP Service, and the peer on each side saw the connection (the client's outbound on
//!   its 15001, to the original destination; the server's inbound on its 15006, from the client);
//! - a half-migrated cluster (docs/migrate-from-istio.md): Istio's chart with
//!   `updateStrategy: OnDelete`, `helm upgrade` of the same release to ours, and only node 2's
//!   agent pod replaced, so Istio's own agent serves node 1 and ours node 2; the same traffic,
//!   both ways;
//! - flannel in VXLAN mode as the primary CNI (`REAL_NODE_PRIMARY=flannel`, k3s's default): the
//!   same traffic through VXLAN, a sidecar pod, flannel rewriting its conflist while ambient pods
//!   start, and uninstall leaving flannel's conflist as it was (issue #41).
//!
//! Needs root, the node binaries (`tools/k8s-node/build.sh`) and the images (`scripts/node-images`,
//! or `REAL_NODE_IMAGES`), Istio's among them.

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, PostParams};
use serde_json::json;
use testbed::migrate::{
    ISTIO_IMAGE, ON_DELETE, PeerAccepted, agent_pod, agent_pod_image, helm_cni_with, install_peer,
    peer_accepted, replace_agent_pod, wait_peer_has,
};
use testbed::real_node::{
    Node, REDIRECTION, RealNode, annotation, busybox_pod, create, get, on_node, sidecar_pod,
    wait_redirection, wait_running, witness, witness_pod,
};

/// One cluster at a time: two nodes each are heavy enough on a small machine.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Our image as our chart renders it with the real node's values.
const OUR_IMAGE: &str = "localhost/istio-cni-rs/install-cni:dev";

const HTTPD: &str = "mkdir /www; echo hello > /www/index.html; exec httpd -f -p 8080 -h /www";

/// The pods of one node in namespace `ns`: an HTTP server `web-K` (behind Service `web-K`) and a
/// client `client-K`.
struct NodePods {
    web_uid: String,
    web_ip: String,
    service_ip: String,
    client: String,
    client_uid: String,
    client_ip: String,
}

/// Creates node `node`'s pods and Service in ambient namespace `ns` and waits until both pods
/// run, are annotated, started redirected and are known to the node's peer.
async fn node_pods(c: &RealNode, node: Node<'_>, ns: &str) -> NodePods {
    let k = node.index();
    let (web, client) = (format!("web-{k}"), format!("client-{k}"));
    let mut server = on_node(busybox_pod(&web, &["sh", "-c", HTTPD]), &node.name());
    server["metadata"]["labels"] = json!({"app": web});
    let web_uid = create(c, ns, server).await;
    let client_uid = create(
        c,
        ns,
        on_node(witness_pod(&client, "sleep 3600"), &node.name()),
    )
    .await;
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": web},
        "spec": {"selector": {"app": web}, "ports": [{"port": 80, "targetPort": 8080}]}
    }))
    .unwrap();
    let svc = Api::<Service>::namespaced(c.client(), ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let web_pod = wait_running(c, ns, &web).await;
    let client_pod = wait_running(c, ns, &client).await;
    for p in [&web_pod, &client_pod] {
        assert_eq!(
            p.spec.as_ref().unwrap().node_name.as_deref(),
            Some(node.name().as_str()),
            "{:?} not on its node",
            p.metadata.name
        );
    }
    for name in [&web, &client] {
        wait_redirection(c, ns, name, Some("enabled")).await;
    }
    assert_eq!(
        witness(c, ns, &client),
        "REDIRECTED",
        "{client}'s first connection"
    );
    wait_peer_has(node, &web_uid, true).await;
    wait_peer_has(node, &client_uid, true).await;
    let ip =
        |p: &k8s_openapi::api::core::v1::Pod| p.status.as_ref().unwrap().pod_ip.clone().unwrap();
    NodePods {
        web_uid,
        web_ip: ip(&web_pod),
        service_ip: svc.spec.unwrap().cluster_ip.unwrap(),
        client,
        client_uid,
        client_ip: ip(&client_pod),
    }
}

/// An HTTP GET from `client` to `addr` (`ip:port`): the response, or what went wrong.
fn get_from(c: &RealNode, ns: &str, client: &str, addr: &str) -> Result<String, String> {
    let (ip, port) = addr.rsplit_once(':').unwrap();
    let out = c.try_script(&[
        "kubectl",
        "-n",
        ns,
        "exec",
        client,
        "--",
        "sh",
        "-c",
        &format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {ip} {port}"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() && text.ends_with("\r\n\r\nhello\n") {
        Ok(text)
    } else {
        Err(format!("{text:?} {}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// How many connections the peer on `node` accepted for workload `uid` for which `want` holds.
fn accepted(node: Node<'_>, uid: &str, want: &impl Fn(&PeerAccepted) -> bool) -> usize {
    peer_accepted(node, uid).iter().filter(|a| want(a)).count()
}

/// Waits until the peer on `node` lists, for workload `uid`, more than `before` accepted
/// connections for which `want` holds; panics naming `what`.
async fn wait_accepted(
    c: &RealNode,
    node: Node<'_>,
    uid: &str,
    before: usize,
    what: &str,
    want: impl Fn(&PeerAccepted) -> bool,
) {
    c.eventually(what, Duration::from_secs(30), || async {
        (accepted(node, uid, &want) > before).then_some(())
    })
    .await
}

/// Ambient traffic between the two nodes' pods, both ways, by pod IP and by ClusterIP: each
/// request answered, and the peer on each side saw it (redirected on the client's node and on
/// the server's).
async fn cross_node_traffic(c: &RealNode, ns: &str) {
    c.namespace(ns, true).await;
    let (n1, n2) = (c.node(1), c.node(2));
    let pods = [node_pods(c, n1, ns).await, node_pods(c, n2, ns).await];
    for (from, to) in [(0, 1), (1, 0)] {
        let (src, dst) = (&pods[from], &pods[to]);
        let (src_node, dst_node) = (c.node(from + 1), c.node(to + 1));
        for (how, addr) in [
            ("pod IP", format!("{}:8080", dst.web_ip)),
            ("ClusterIP", format!("{}:80", dst.service_ip)),
        ] {
            let what = format!(
                "{} on {} gets web-{} on {} by {how} ({addr})",
                src.client,
                src_node.name(),
                to + 1,
                dst_node.name()
            );
            // The client's outbound, to where it was going, on its 15001; the server's inbound,
            // from the client's pod IP, on its 15006 (counted before: every case adds one).
            let outbound =
                |a: &PeerAccepted| a.port == 15001 && a.original_dst.as_deref() == Some(&addr);
            let inbound = |a: &PeerAccepted| {
                a.port == 15006
                    && a.peer.rsplit_once(':').map(|(ip, _)| ip) == Some(src.client_ip.as_str())
            };
            let outbound_before = accepted(src_node, &src.client_uid, &outbound);
            let inbound_before = accepted(dst_node, &dst.web_uid, &inbound);
            // kube-proxy programs a new Service within a moment: retried until then.
            c.eventually(&what, Duration::from_secs(30), || async {
                get_from(c, ns, &src.client, &addr).ok()
            })
            .await;
            wait_accepted(
                c,
                src_node,
                &src.client_uid,
                outbound_before,
                &format!("{what}: the client's outbound on its 15001"),
                outbound,
            )
            .await;
            wait_accepted(
                c,
                dst_node,
                &dst.web_uid,
                inbound_before,
                &format!(
                    "{what}: the server's inbound on its 15006 from {}",
                    src.client_ip
                ),
                inbound,
            )
            .await;
        }
    }
    for name in ["web-1", "client-1", "web-2", "client-2"] {
        let p = get(c, ns, name).await.unwrap();
        assert_eq!(
            annotation(&p, REDIRECTION).as_deref(),
            Some("enabled"),
            "{name}"
        );
    }
}

/// Our chart on both nodes: ambient pods on different nodes reach each other, by pod IP and by
/// ClusterIP, through both nodes' peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_agent_on_two_nodes_carries_cross_node_ambient_traffic() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_CLUSTER.lock().await;
    let c = RealNode::up_nodes(2).await;
    c.install_chart(&[]).await;
    for n in c.nodes() {
        assert_eq!(agent_pod_image(n), OUR_IMAGE, "{}", n.name());
        let conflist = n.read(testbed::real_node::CONFLIST).unwrap();
        assert!(
            conflist.contains("\"type\": \"istio-cni\""),
            "{}: {conflist}",
            n.name()
        );
    }
    cross_node_traffic(&c, "mesh").await;
}

/// A half-migrated cluster: Istio's own agent on node 1, ours on node 2 (one release, OnDelete,
/// node 2's agent pod replaced after the `helm upgrade` to our chart), ambient traffic both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istios_agent_on_one_node_and_ours_on_the_other_carry_ambient_traffic_both_ways() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_CLUSTER.lock().await;
    let c = RealNode::up_nodes(2).await;
    helm_cni_with(&c, "install", true, ON_DELETE).await;
    install_peer(&c).await;
    for n in c.nodes() {
        assert_eq!(agent_pod_image(n), ISTIO_IMAGE, "{}", n.name());
    }
    helm_cni_with(&c, "upgrade", false, ON_DELETE).await;
    assert_eq!(
        agent_pod_image(c.node(2)),
        ISTIO_IMAGE,
        "OnDelete: the upgrade alone replaces no agent"
    );
    replace_agent_pod(c.node(2)).await;
    assert_eq!(
        agent_pod_image(c.node(1)),
        ISTIO_IMAGE,
        "node 1 keeps Istio's"
    );
    assert_eq!(agent_pod_image(c.node(2)), OUR_IMAGE, "node 2 runs ours");
    cross_node_traffic(&c, "mixed").await;
    // Istio's agent ran under our chart's ClusterRoles since the upgrade (node 1's pods were
    // created after it, so it enrolled them under those): nothing it asked for was refused.
    let istio_log = c.kubectl(&[
        "-n",
        "istio-system",
        "logs",
        &agent_pod(c.node(1)),
        "--tail=-1",
    ]);
    assert!(
        !istio_log.to_lowercase().contains("forbidden"),
        "Istio's agent was refused something under our RBAC:\n{istio_log}"
    );
}

/// flannel's conflist as kube-flannel's install-cni (and `scripts/real-node`) writes it.
const FLANNEL_CONFLIST: &str = "/etc/cni/net.d/10-flannel.conflist";

/// Packets node `node` sent through its VXLAN device `flannel.1` (its /proc/net/dev line: eight
/// receive counters, then transmitted bytes and packets).
fn vxlan_tx_packets(node: Node<'_>) -> u64 {
    let dev = node.read("/proc/net/dev").expect("/proc/net/dev");
    let line = dev
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("flannel.1:"))
        .unwrap_or_else(|| panic!("{}: no flannel.1 in\n{dev}", node.name()));
    line.split_whitespace().nth(9).unwrap().parse().unwrap()
}

/// Ambient pods `flap-0..3` created on node 2 while flannel restarts there, which writes its
/// conflist again without our entry (as kube-flannel's install-cni does at each flannel pod
/// start): every pod runs redirected from its first connection (the chain held, or the ADD failed
/// closed and was retried), and the installer puts our entry back as it was.
async fn flannel_rewrites_while_pods_start(c: &RealNode, ns: &str, chained: &str) {
    let node2 = c.node(2);
    let names: Vec<String> = (0..4).map(|i| format!("flap-{i}")).collect();
    let create_all = async {
        for name in &names {
            create(
                c,
                ns,
                on_node(witness_pod(name, "sleep 3600"), &node2.name()),
            )
            .await;
        }
    };
    let reinstalls = || {
        let log = c.kubectl(&["-n", "istio-system", "logs", &agent_pod(node2), "--tail=-1"]);
        log.matches("writing CNI config:").count()
    };
    let before = reinstalls();
    tokio::join!(create_all, node2.restart("flannel"));
    for name in &names {
        wait_running(c, ns, name).await;
        wait_redirection(c, ns, name, Some("enabled")).await;
        assert_eq!(
            witness(c, ns, name),
            "REDIRECTED",
            "{name} started while flannel rewrote its conflist"
        );
    }
    c.eventually(
        "our entry back in flannel's conflist on node 2, as it was",
        Duration::from_secs(30),
        || async { (node2.read(FLANNEL_CONFLIST).as_deref() == Some(chained)).then_some(()) },
    )
    .await;
    assert!(
        reinstalls() > before,
        "node 2's agent never wrote its entry again after flannel's rewrite (no `writing CNI config:` line after the restart)"
    );
}

/// flannel in VXLAN mode, k3s's default primary (`REAL_NODE_PRIMARY=flannel`: flanneld on each
/// node, the kube subnet manager, the `flannel` CNI plugin), with our chart on both nodes
/// (issue #41):
///
/// - our entry chained into flannel's own conflist on each node;
/// - ambient traffic between the nodes' pods, both ways, by pod IP and ClusterIP
///   ([`cross_node_traffic`]), carried by VXLAN: each node's route to the other's pods is
///   `flannel.1`, whose transmit counter grew on both;
/// - a sidecar pod on node 2 redirected by the plugin's rules;
/// - flannel restarted on node 2, rewriting its conflist, while ambient pods start there: none
///   runs unredirected, and our entry comes back;
/// - helm uninstall: flannel's conflist on each node byte for byte as flannel wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flannel_vxlan_primary_carries_ambient_traffic_between_nodes_and_keeps_our_entry() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_CLUSTER.lock().await;
    let c = RealNode::up_nodes_with(2, &[("REAL_NODE_PRIMARY", "flannel")]).await;
    let flannel: Vec<String> = c
        .nodes()
        .into_iter()
        .map(|n| {
            n.read(FLANNEL_CONFLIST)
                .unwrap_or_else(|| panic!("{}: no {FLANNEL_CONFLIST}", n.name()))
        })
        .collect();
    for (n, other) in [(c.node(1), c.node(2)), (c.node(2), c.node(1))] {
        let pod_ip = other.pod_cidr().replace(".0/24", ".9");
        let route = n.exec(&["ip", "route", "get", &pod_ip]);
        assert!(
            route.contains("dev flannel.1"),
            "{}: {} pods not through VXLAN: {route}",
            n.name(),
            other.name()
        );
    }

    c.install_chart(&[]).await;
    let mut chained = Vec::new();
    for n in c.nodes() {
        let conflist = n.read(FLANNEL_CONFLIST).unwrap();
        let types: Vec<String> =
            serde_json::from_str::<serde_json::Value>(&conflist).unwrap()["plugins"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["type"].as_str().unwrap().to_string())
                .collect();
        assert_eq!(types, ["flannel", "portmap", "istio-cni"], "{}", n.name());
        chained.push(conflist);
    }

    let tx_before: Vec<u64> = c.nodes().into_iter().map(vxlan_tx_packets).collect();
    cross_node_traffic(&c, "mesh").await;
    for (n, before) in c.nodes().into_iter().zip(tx_before) {
        let after = vxlan_tx_packets(n);
        assert!(
            after > before,
            "{}: flannel.1 sent {before} packets before the traffic, {after} after",
            n.name()
        );
    }

    c.namespace("plain", false).await;
    let node2 = c.node(2);
    let gateway2 = node2.pod_cidr().replace(".0/24", ".1");
    create(
        &c,
        "plain",
        on_node(sidecar_pod("sidecar", &gateway2), &node2.name()),
    )
    .await;
    wait_running(&c, "plain", "sidecar").await;
    assert_eq!(
        witness(&c, "plain", "sidecar"),
        "REDIRECTED",
        "the plugin's sidecar rules on flannel's node 2"
    );

    flannel_rewrites_while_pods_start(&c, "mesh", &chained[1]).await;

    c.kubectl(&["-n", "istio-system", "delete", "ds", "ztunnel"]);
    c.helm(&["uninstall", "istio-cni", "-n", "istio-system", "--wait"]);
    for (n, flannel) in c.nodes().into_iter().zip(&flannel) {
        c.eventually(
            &format!("{}: flannel's conflist as flannel wrote it", n.name()),
            Duration::from_secs(60),
            || async {
                (n.read(FLANNEL_CONFLIST).as_deref() == Some(flannel.as_str())).then_some(())
            },
        )
        .await;
    }
}
