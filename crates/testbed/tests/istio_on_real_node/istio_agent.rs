//! Istio's own CNI agent on the real node, and the live switch to ours and back (issue #22).
//!
//! Istio's `istio-cni` chart is read from the pinned module (`tools/istio/moddir.sh`), its
//! `install-cni` and `istio-cni` built from it into `localhost/istio/install-cni:dev-distroless`
//! (`scripts/node-images`), with Debian's iptables in the image as Istio's base has them. The
//! same values file drives both charts (`deploy/node/values-real-node.yaml`, the `ambient`
//! profile, the iptables backend); the ZDS peer (`deploy/node/ztunnel-peer.yaml`) is ztunnel.
//! The switch follows docs/migrate-from-istio.md: `helm upgrade` of the same release to the other
//! chart, so the DaemonSet stays and the old agent takes its upgrade path.
//!
//! Needs root, the node binaries (`tools/k8s-node/build.sh`) and the images (`scripts/node-images`,
//! or `REAL_NODE_IMAGES`).

use std::time::Duration;

use testbed::migrate::{
    ISTIO_IMAGE, agent_image, agent_log, agent_readyz, helm_cni, helm_cni_with, install_peer,
    istio_plugin_binary, loud_lines, node_rules, peer_workloads, pod_rules, redirected_now,
    wait_peer_has,
};
use testbed::real_node::{
    CONFLIST, GATEWAY, REDIRECTION, RealNode, annotation, create, get, sidecar_pod,
    wait_redirection, wait_running, witness, witness_pod,
};

/// The iptables variants: kubelet's (and the node's `iptables`) is nft.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Nft,
    Legacy,
}

/// Pod `uid`'s normalized rules in `variant`, after checking the other variant has none.
fn rules_in(node: &RealNode, uid: &str, variant: Variant) -> String {
    let rules = pod_rules(node, uid);
    let (want, other) = match variant {
        Variant::Nft => (rules.nft, rules.legacy),
        Variant::Legacy => (rules.legacy, rules.nft),
    };
    assert!(
        !other.contains("ISTIO"),
        "rules outside {variant:?} too:\n{other}"
    );
    want
}

/// Creates ambient pod `mesh/name` and checks the current agent enrolled it: annotated,
/// redirected from its first connection, known to the peer, iptables redirect rules in
/// `variant` in its netns. Returns its UID and its normalized rules.
async fn enrolled_pod(
    node: &RealNode,
    name: &str,
    agent: &str,
    variant: Variant,
) -> (String, String) {
    let uid = create(node, "mesh", witness_pod(name, "sleep 3600")).await;
    wait_running(node, "mesh", name).await;
    wait_redirection(node, "mesh", name, Some("enabled")).await;
    assert_eq!(
        witness(node, "mesh", name),
        "REDIRECTED",
        "{name} started unredirected under {agent}'s agent\n{}",
        agent_log(node)
    );
    wait_peer_has(node, &uid, true).await;
    let rules = rules_in(node, &uid, variant);
    for want in [
        "-A PREROUTING -j ISTIO_PRERT",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "--to-ports 15001",
        "--to-ports 15006",
    ] {
        assert!(
            rules.contains(want),
            "{name} ({agent}): no {want:?} in its {variant:?} rules\n{rules}\n{}",
            agent_log(node)
        );
    }
    (uid, rules)
}

/// A pod enrolled earlier is, under the current agent, still annotated, known to the peer,
/// redirected now, and its nft rules are the ones it had. With `legacy_copy`, the same rules are
/// also in legacy (Istio's agent after its variant flipped, see below); else legacy has none.
async fn still_enrolled(
    node: &RealNode,
    name: &str,
    uid: &str,
    rules: &str,
    agent: &str,
    legacy_copy: bool,
) {
    let p = get(node, "mesh", name).await.unwrap();
    assert_eq!(
        annotation(&p, REDIRECTION).as_deref(),
        Some("enabled"),
        "{name} under {agent}'s agent"
    );
    assert!(
        peer_workloads(node).contains_key(uid),
        "the peer lost {name} when {agent}'s agent took over"
    );
    assert!(
        redirected_now(node, "mesh", name),
        "{name} unredirected under {agent}'s agent"
    );
    let now = pod_rules(node, uid);
    assert_eq!(
        now.nft, rules,
        "{name}'s rules changed when {agent}'s agent took over"
    );
    if legacy_copy {
        assert_eq!(
            by_table(&now.legacy),
            by_table(rules),
            "{name}'s legacy copy under {agent}'s agent"
        );
    } else {
        assert!(!now.legacy.contains("ISTIO"), "{name}: {}", now.legacy);
    }
}

/// Normalized iptables-save output per table (the variants list the tables in different orders).
fn by_table(rules: &str) -> std::collections::BTreeMap<String, String> {
    let mut tables = std::collections::BTreeMap::new();
    for block in rules.split("\n*").filter(|b| !b.is_empty()) {
        let block = block.trim_start_matches('*');
        let (name, body) = block.split_once('\n').unwrap_or((block, ""));
        tables.insert(name.to_string(), body.to_string());
    }
    tables
}

/// One node at a time: a node is several hundred MB of processes and most of a core to start.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn plugin_on_node(node: &RealNode) -> Vec<u8> {
    std::fs::read(node.node_path("/opt/cni/bin/istio-cni")).expect("the plugin on the node")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istios_agent_enrolls_kubelets_pods_then_helm_upgrade_to_ours_and_back_keeps_them() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    let istio_plugin = istio_plugin_binary();

    // Istio's agent, from Istio's chart, on the node.
    helm_cni(&node, "install", true).await;
    install_peer(&node).await;
    assert_eq!(agent_image(&node), ISTIO_IMAGE);
    let conflist = node.read(CONFLIST).unwrap();
    assert!(conflist.contains("\"type\": \"istio-cni\""), "{conflist}");
    assert!(
        plugin_on_node(&node) == istio_plugin,
        "the node's /opt/cni/bin/istio-cni is not Istio's"
    );
    let host = node_rules(&node);
    assert!(
        host.nft.contains("-A POSTROUTING -j ISTIO_POSTRT"),
        "Istio's host rules:\n{}",
        host.nft
    );
    node.namespace("mesh", true).await;
    node.namespace("plain", false).await;
    let (istio_uid, istio_rules) = enrolled_pod(&node, "by-istio", "Istio", Variant::Nft).await;
    create(&node, "plain", witness_pod("plain", "sleep 3600")).await;
    wait_running(&node, "plain", "plain").await;
    assert_eq!(witness(&node, "plain", "plain"), "DIRECT");

    // Ours, as docs/migrate-from-istio.md says: the same release upgraded to our chart.
    helm_cni(&node, "upgrade", false).await;
    assert_eq!(agent_image(&node), "localhost/istio-cni-rs/install-cni:dev");
    node.eventually(
        "our plugin replaced Istio's on the node",
        Duration::from_secs(30),
        || async { (plugin_on_node(&node) != istio_plugin).then_some(()) },
    )
    .await;
    still_enrolled(&node, "by-istio", &istio_uid, &istio_rules, "our", false).await;
    let (ours_uid, ours_rules) = enrolled_pod(&node, "by-ours", "our", Variant::Nft).await;
    assert_eq!(
        ours_rules, istio_rules,
        "our agent's in-pod rules differ from Istio's"
    );
    assert_eq!(witness(&node, "plain", "plain"), "DIRECT");

    // And back to Istio's, the same way.
    helm_cni(&node, "upgrade", true).await;
    assert_eq!(agent_image(&node), ISTIO_IMAGE);
    node.eventually(
        "Istio's plugin back on the node",
        Duration::from_secs(30),
        || async { (plugin_on_node(&node) == istio_plugin).then_some(()) },
    )
    .await;
    // Istio's agent, started a second time on this node, programs legacy iptables although
    // kubelet uses nft: its first start left an empty legacy `nat` table in the node's netns,
    // and its detection takes any `iptables-legacy-save` output of 3 lines or more for rules
    // (docs/migrate-from-istio.md). Its startup reconcile (the chart's default
    // `ambient.reconcileIptablesOnStartup`) then writes every running pod's rules again, in
    // legacy, next to their nft ones; both redirect the same way.
    let legacy = node_rules(&node).legacy;
    assert!(legacy.contains("*nat"), "{legacy}");
    still_enrolled(&node, "by-istio", &istio_uid, &istio_rules, "Istio", true).await;
    still_enrolled(&node, "by-ours", &ours_uid, &ours_rules, "Istio", true).await;
    let (again_uid, _) = enrolled_pod(&node, "by-istio-again", "Istio", Variant::Legacy).await;
    let conflist = node.read(CONFLIST).unwrap();
    assert_eq!(
        conflist.matches("\"type\": \"istio-cni\"").count(),
        1,
        "{conflist}"
    );

    // Ours once more, onto the node Istio's flip left in both variants: our agent keeps the
    // variant kubelet uses and removes the legacy copies, so every pod ends with the nft rules
    // alone, still redirected and known to the peer, and the host chains in nft only.
    helm_cni(&node, "upgrade", false).await;
    assert_eq!(agent_image(&node), "localhost/istio-cni-rs/install-cni:dev");
    for (name, uid) in [
        ("by-istio", &istio_uid),
        ("by-ours", &ours_uid),
        ("by-istio-again", &again_uid),
    ] {
        node.eventually(
            &format!("{name}'s legacy rules removed by our agent"),
            Duration::from_secs(60),
            || async { (!pod_rules(&node, uid).legacy.contains("ISTIO")).then_some(()) },
        )
        .await;
        still_enrolled(&node, name, uid, &istio_rules, "our", false).await;
    }
    let host = node_rules(&node);
    assert!(
        host.nft.contains("-A POSTROUTING -j ISTIO_POSTRT"),
        "{}",
        host.nft
    );
    assert!(!host.legacy.contains("ISTIO"), "{}", host.legacy);
}

/// The ordering docs/migrate-from-istio.md warns against: `helm uninstall` of Istio's chart before
/// installing ours. Istio's agent takes its uninstall path (plugin and config entry removed), so
/// an ambient pod created in the gap starts unredirected; running pods keep their rules. Our
/// agent, once installed, enrolls the gap's pod as a running pod (redirected from then on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_uninstall_of_istios_chart_first_leaves_a_gap_that_our_install_closes() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    helm_cni(&node, "install", true).await;
    install_peer(&node).await;
    node.namespace("mesh", true).await;
    let (before_uid, before_rules) = enrolled_pod(&node, "before", "Istio", Variant::Nft).await;

    node.helm(&["uninstall", "istio-cni", "-n", "istio-system", "--wait"]);
    node.eventually(
        "Istio's agent removed its plugin from the conflist",
        Duration::from_secs(60),
        || async { (!node.read(CONFLIST)?.contains("istio-cni")).then_some(()) },
    )
    .await;
    let gap = create(&node, "mesh", witness_pod("gap", "sleep 3600")).await;
    wait_running(&node, "mesh", "gap").await;
    assert_eq!(witness(&node, "mesh", "gap"), "DIRECT", "the gap's pod");
    assert_eq!(
        annotation(&get(&node, "mesh", "gap").await.unwrap(), REDIRECTION),
        None
    );
    assert!(
        redirected_now(&node, "mesh", "before"),
        "running pods keep their rules"
    );

    helm_cni(&node, "install", false).await;
    wait_redirection(&node, "mesh", "gap", Some("enabled")).await;
    wait_peer_has(&node, &gap, true).await;
    assert!(redirected_now(&node, "mesh", "gap"));
    assert_eq!(
        witness(&node, "mesh", "gap"),
        "DIRECT",
        "its first connection stays unredirected"
    );
    still_enrolled(&node, "before", &before_uid, &before_rules, "our", false).await;
}

/// Our agent's image, as `scripts/node-images` tags it.
const OUR_IMAGE: &str = "localhost/istio-cni-rs/install-cni:dev";

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// Issue #36: "keep your installer, point the image at ours". Istio's own chart (the `ambient`
/// profile, its defaults but for the node's paths and host network) with `image=` ours: under
/// Istio's RBAC (a `get` of its DaemonSet, no list or watch), ours enrolls ambient pods exactly
/// as Istio's does, redirects a sidecar pod through our plugin, logs nothing at warn or above
/// and names at start (log and `/readyz`) an Istio setting it cannot honour. `helm upgrade`
/// from Istio's image to ours, back, and to ours again keeps every pod redirected; `helm
/// uninstall` then leaves the node's CNI config and host rules as before the install.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_image_in_istios_chart_works_quietly_across_image_switches_and_uninstall() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    let bare = node.read(CONFLIST).unwrap();
    let ours = format!("image={OUR_IMAGE}");
    let ours = ["--set", ours.as_str()];

    helm_cni(&node, "install", true).await;
    install_peer(&node).await;
    assert_eq!(agent_image(&node), ISTIO_IMAGE);
    node.namespace("mesh", true).await;
    node.namespace("plain", false).await;
    let (istio_uid, istio_rules) = enrolled_pod(&node, "by-istio", "Istio", Variant::Nft).await;

    // Istio's chart, our image.
    helm_cni_with(&node, "upgrade", true, &ours).await;
    assert_eq!(agent_image(&node), OUR_IMAGE);
    still_enrolled(&node, "by-istio", &istio_uid, &istio_rules, "our", false).await;
    let (ours_uid, ours_rules) = enrolled_pod(&node, "by-ours", "our", Variant::Nft).await;
    assert_eq!(
        ours_rules, istio_rules,
        "our agent's in-pod rules differ from Istio's"
    );
    create(&node, "plain", sidecar_pod("sidecar", GATEWAY)).await;
    wait_running(&node, "plain", "sidecar").await;
    // Its app retries for a few seconds (its proxy container starts after it), then prints.
    let printed = node
        .eventually(
            "the sidecar pod's witness",
            Duration::from_secs(30),
            || async {
                let logs = node.kubectl(&["-n", "plain", "logs", "sidecar", "-c", "app"]);
                logs.lines()
                    .rfind(|l| *l == "REDIRECTED" || *l == "DIRECT")
                    .map(str::to_string)
            },
        )
        .await;
    assert_eq!(
        printed, "REDIRECTED",
        "our plugin did not redirect the sidecar pod"
    );
    assert_eq!(agent_readyz(&node), "ok\n");
    let log = agent_log(&node);
    assert!(
        loud_lines(&log).is_empty(),
        "our agent under Istio's chart logged warnings a correct install has not:\n{log}"
    );

    // Back to Istio's image: its second start on this node flips it to legacy iptables (see
    // the first test), and every pod stays enrolled.
    helm_cni(&node, "upgrade", true).await;
    assert_eq!(agent_image(&node), ISTIO_IMAGE);
    still_enrolled(&node, "by-istio", &istio_uid, &istio_rules, "Istio", true).await;
    still_enrolled(&node, "by-ours", &ours_uid, &ours_rules, "Istio", true).await;

    // Ours again, now with a setting it cannot honour (Istio's dry run): named at start, in the
    // log (its one loud line) and in `/readyz`, and the pods still enrolled.
    let dry_run = [
        ours[0],
        ours[1],
        "--set",
        "env.DRY_RUN_FILE_PATH=/tmp/dry-run",
    ];
    helm_cni_with(&node, "upgrade", true, &dry_run).await;
    assert_eq!(agent_image(&node), OUR_IMAGE);
    for (name, uid) in [("by-istio", &istio_uid), ("by-ours", &ours_uid)] {
        node.eventually(
            &format!("{name}'s legacy rules removed by our agent"),
            Duration::from_secs(60),
            || async { (!pod_rules(&node, uid).legacy.contains("ISTIO")).then_some(()) },
        )
        .await;
        still_enrolled(&node, name, uid, &istio_rules, "our", false).await;
    }
    // The legacy copies Istio's flip left are drift to our agent, repaired at warn: expected on
    // this node, not from a correct install.
    let log = agent_log(&node);
    let loud: Vec<&str> = loud_lines(&log)
        .into_iter()
        .filter(|l| !l.contains("(rules of the previous backend, nftables, iptables-legacy)"))
        .collect();
    assert!(
        loud.len() == 1 && loud[0].contains("not honoured: DRY_RUN_FILE_PATH=/tmp/dry-run"),
        "the dry run named once at start, nothing else loud:\n{log}"
    );
    let body = agent_readyz(&node);
    assert!(
        body.starts_with("ok\n") && body.contains("not honoured: DRY_RUN_FILE_PATH=/tmp/dry-run"),
        "{body}"
    );

    // Uninstall: the agent reads its DaemonSet gone and removes its config entry, plugin and
    // host rules; running pods keep their own rules.
    node.helm(&["uninstall", "istio-cni", "-n", "istio-system", "--wait"]);
    node.eventually(
        "our agent restored the node's CNI config",
        Duration::from_secs(60),
        || async { (json(&node.read(CONFLIST)?) == json(&bare)).then_some(()) },
    )
    .await;
    node.eventually(
        "our agent removed its host rules",
        Duration::from_secs(30),
        || async {
            let host = node_rules(&node);
            (!host.nft.contains("ISTIO") && !host.legacy.contains("ISTIO")).then_some(())
        },
    )
    .await;
    assert!(
        !node.node_path("/opt/cni/bin/istio-cni").exists(),
        "the plugin binary left on the node"
    );
    assert!(
        redirected_now(&node, "mesh", "by-ours"),
        "running pods keep their rules"
    );
}
