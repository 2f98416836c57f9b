//! A whole node, end to end: real kube-apiserver, the real `install-cni` agent process (installer +
//! ambient agent), Debian's bridge/host-local/portmap chained with our `istio-cni` by the installer,
//! pods as network namespaces created through that chain, and a ztunnel-like ZDS peer.
//! Root only (real namespaces); run by `scripts/test`.

use std::time::Duration;

use testbed::node::{Backend, TestNode, TestPod};
use testbed::zds_peer::{AddReply, PeerConfig, ZdsPeer};

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");
const BYPASS_INBOUND: &str = "ambient.istio.io/bypass-inbound-capture";

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
        Backend::Iptables => {
            // The node namespace holds no rules at startup: nft, and the log says why.
            let log = node.agent_log();
            let chosen = log
                .lines()
                .find(|l| l.contains("iptables variant chosen"))
                .unwrap_or_else(|| panic!("no variant in the startup log:\n{log}"));
            assert!(
                chosen.contains("iptables-nft (nft ") && chosen.contains("no rules in either"),
                "{chosen}"
            );
            let legacy = pod.netns.exec("iptables-legacy-save", &[]);
            assert!(!legacy.contains("ISTIO"), "rules in legacy:\n{legacy}");
            iptables_rules(&pod.netns)
        }
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
    dataplane::enter_test_group!();
    dataplane::require_root!();
    enrolls_on_cni_add(Backend::Iptables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambient_pod_enrolled_on_cni_add_nftables() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    enrolls_on_cni_add(Backend::Nftables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_label_enrolls_and_unenrolls_running_pods() {
    dataplane::enter_test_group!();
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
    dataplane::enter_test_group!();
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
    // The runtime tears the failed sandbox down and retries with a new one: the agent keeps no
    // handle on the old namespace (it would keep the dead sandbox alive).
    use std::os::unix::fs::MetadataExt;
    let ns = std::fs::metadata(pod.netns.path()).unwrap();
    let pid = node.agent_pid().unwrap();
    let held = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::metadata(e.ok()?.path()).ok())
        .any(|m| m.dev() == ns.dev() && m.ino() == ns.ino());
    assert!(
        !held,
        "the agent still holds the failed sandbox's namespace"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_down_fails_closed_for_ambient_pods_only() {
    dataplane::enter_test_group!();
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

/// An ambient pod whose ADD comes while the agent restarts (a crash, an upgrade) waits for the next
/// agent instead of failing: the runtime would retry the sandbox only seconds later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambient_add_waits_for_a_restarting_agent() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Nftables).await;
    let _peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let mut pod = node.create_pod_object("mesh", "patient", &[]).await;
    let prev = node.sandbox_add_primary(&pod).await.unwrap();
    node.kill_agent();

    let add = add_ours_in_background(&node, &pod, prev);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!add.is_finished(), "the ADD did not wait for the agent");
    node.start_agent();
    node.wait_ready().await;
    let result = finished(add, &node);
    node.report_running(&mut pod, &result).await;
    node.wait_redirection(&pod, Some("enabled")).await;
    assert_pod_redirected_by(&pod, Backend::Nftables);
}

/// The agent's health and metrics ports are only found free before it binds them (it cannot share
/// a port the test bed holds), so another process may take one first: the node then starts the
/// agent again on fresh ports instead of failing the test (issue #35). Here both ports of a
/// restart are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_ports_were_taken_comes_up_on_fresh_ones() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Iptables).await;
    node.kill_agent();
    let taken = [testbed::ports::held(), testbed::ports::held()];
    (node.health_port, node.metrics_port) = (taken[0].port(), taken[1].port());
    node.start_agent();
    node.wait_ready().await;
    let now = [node.health_port, node.metrics_port];
    assert!(
        taken.iter().all(|t| !now.contains(&t.port())),
        "the agent kept a taken port: {now:?}"
    );
    let log = std::fs::read_to_string(node.path("agent.log")).unwrap();
    assert!(log.contains("port in use"), "no collision seen:\n{log}");
    let metrics = node.metrics();
    assert!(
        metrics.lines().any(|l| l.starts_with("ztunnel_connected ")),
        "no metrics on the fresh port {}: {metrics}",
        node.metrics_port
    );
}

/// An ambient pod whose ADD comes while no ztunnel is connected (ztunnel restarting, or not yet
/// reconnected to a restarted agent) waits for one instead of failing, and is not annotated
/// `enabled` while it waits. With no ztunnel at all the ADD fails closed, leaving `pending`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambient_add_waits_for_ztunnel_and_fails_closed_without_it() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let node = TestNode::start(Backend::Nftables).await;
    node.create_namespace("mesh", &[AMBIENT]).await;
    let mut pod = node.create_pod_object("mesh", "patient", &[]).await;
    let prev = node.sandbox_add_primary(&pod).await.unwrap();
    let add = add_ours_in_background(&node, &pod, prev);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(!add.is_finished(), "the ADD did not wait for ztunnel");
    assert_ne!(node.redirection(&pod).await.as_deref(), Some("enabled"));
    let peer = fast_peer(&node);
    let result = finished(add, &node);
    node.report_running(&mut pod, &result).await;
    node.wait_redirection(&pod, Some("enabled")).await;
    assert_pod_redirected_by(&pod, Backend::Nftables);

    drop(peer);
    let disconnected = |m: &str| m.lines().any(|l| l == "ztunnel_connected 0");
    let metrics = metrics_once(&node, disconnected).await;
    assert!(disconnected(&metrics), "{metrics}");
    let (alone, result) = node.create_pod("mesh", "alone", &[]).await;
    let err = result
        .expect_err("an ambient pod must not start without ztunnel")
        .to_string();
    assert!(err.contains("no ztunnel connection"), "{err}");
    assert_eq!(node.redirection(&alone).await.as_deref(), Some("pending"));
}

/// containerd runs the `loopback` plugin beside the chain, not before it, so our ambient ADD can
/// find the pod's `lo` still down, where the kernel refuses the IPv6 local route ("Network is
/// down"). The ADD must not depend on that order: it enrolls the pod, with both families' routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambient_add_before_the_loopback_plugin_enrolls_the_pod() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Nftables).await;
    node.extra_env.push(("AMBIENT_IPV6".into(), "true".into()));
    node.stop_agent();
    node.start_agent();
    let peer = fast_peer(&node);
    node.wait_ready().await;
    node.create_namespace("mesh", &[AMBIENT]).await;
    let mut pod = node.create_pod_object("mesh", "early", &[]).await;
    pod.netns.exec("ip", &["link", "set", "lo", "down"]);
    node.sandbox_add(&mut pod)
        .await
        .unwrap_or_else(|e| panic!("ambient ADD with lo down failed: {e}\n{}", node.agent_log()));
    wait_peer_has(&peer, &pod.uid, true).await;
    node.wait_redirection(&pod, Some("enabled")).await;
    assert_pod_redirected_by(&pod, Backend::Nftables);
    let lo = pod.netns.exec("ip", &["link", "show", "lo"]);
    assert!(lo.contains(",UP"), "lo left down: {lo}");
    let v6 = pod
        .netns
        .exec("ip", &["-6", "route", "show", "table", "100"]);
    assert!(
        v6.contains("local default dev lo"),
        "no IPv6 local route: {v6}"
    );
}

/// A firewall reload or a tuning daemon flushing the host's nat rules and probe sets (each
/// backend's way): within a drift interval the probe SNAT rule and every enrolled pod's probe
/// entry are back, counted as a host repair, and the agent stays ready.
async fn host_flush_is_repaired(backend: Backend) {
    let node = TestNode::start(backend).await;
    let _peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (pod, result) = node.create_pod("mesh", "probed", &[]).await;
    result.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    node.wait_redirection(&pod, Some("enabled")).await;
    let ip = pod.ip.expect("pod IP").to_string();
    let host = &node.node_netns;
    let state = || match backend {
        Backend::Iptables => format!(
            "{}{}",
            iptables_rules(host),
            host.exec("ipset", &["list", "istio-inpod-probes-v4"])
        ),
        Backend::Nftables => host.exec("nft", &["list", "ruleset"]),
    };
    let repaired = |s: &str| s.contains("169.254.7.127") && s.contains(&ip);
    assert!(
        repaired(&state()),
        "not in place before the flush:\n{}",
        state()
    );

    match backend {
        Backend::Iptables => {
            for tool in ["iptables-nft", "iptables-legacy"] {
                host.exec(tool, &["-t", "nat", "-F"]);
            }
            host.exec("ipset", &["flush"]);
        }
        Backend::Nftables => {
            host.exec("nft", &["flush", "ruleset"]);
        }
    }

    // The flush may take two checks to repair (rules at one, entries at the next).
    let name = match backend {
        Backend::Iptables => "iptables",
        Backend::Nftables => "nftables",
    };
    let series = format!("istio_cni_drift_repairs_total{{backend=\"{name}\",scope=\"host\"}} ");
    let counted = |m: &str| {
        m.lines()
            .filter_map(|l| l.strip_prefix(&series)?.parse::<u64>().ok())
            .any(|n| n >= 1)
    };
    let metrics = metrics_once(&node, |m| counted(m) && repaired(&state())).await;
    assert!(counted(&metrics), "no host repair counted:\n{metrics}");
    assert!(repaired(&state()), "not repaired:\n{}", state());
    assert_eq!(node.readyz().map(|(code, _)| code), Some(200));
    let log = node.agent_log();
    assert!(
        log.contains("host probe rules drifted; re-applied"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_flush_is_repaired_iptables() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    host_flush_is_repaired(Backend::Iptables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_flush_is_repaired_nftables() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    host_flush_is_repaired(Backend::Nftables).await;
}

/// An enrolled pod whose IP changes from one address to another with no empty step between:
/// the host probe set follows it (the new address in, the old one out), so kubelet's probes keep
/// being SNATed and no later owner of the old address inherits the SNAT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_ip_changes_moves_its_probe_entry() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let node = TestNode::start(Backend::Nftables).await;
    let _peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (mut pod, result) = node.create_pod("mesh", "moved", &[]).await;
    result.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    node.wait_redirection(&pod, Some("enabled")).await;
    let set = || probe_set_v4(&node);
    let old = format!("{} ", pod.ip.expect("pod IP"));
    assert!(set().contains(&old), "{}", set());

    let new = "10.250.0.7 ";
    let result = serde_json::json!({"ips": [{"address": "10.250.0.7/32"}]});
    node.report_running(&mut pod, &result).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let moved = || {
        let now = set();
        now.contains(new) && !now.contains(&old)
    };
    while !moved() {
        assert!(
            std::time::Instant::now() < deadline,
            "the probe set did not follow the IP change:\n{}\n{}",
            set(),
            node.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The probe set entries of pods the agent did not see leave (churn, pass 6 of a loaded CI run):
/// a pod deleted while no agent ran loses its entry at the restore even though another enrolled
/// pod has no IP in the API yet (an ADD cut short by the agent's kill leaves it so), and that pod,
/// retried by the runtime in a new sandbox with a new address, loses the entry of its first
/// sandbox too when it is deleted. Both stayed for good before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_entries_of_pods_deleted_or_resandboxed_while_no_agent_ran_go() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Nftables).await;
    let _peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (gone, result) = node.create_pod("mesh", "gone", &[]).await;
    result.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    // Enrolled, but the kubelet has not posted its IP.
    let mut cut = node.create_pod_object("mesh", "cut", &[]).await;
    let prev = node.sandbox_add_primary(&cut).await.unwrap();
    node.sandbox_add_ours(&cut, prev)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    let before = probe_set_v4(&node);
    assert!(
        before.contains(&gone.uid) && before.contains(&cut.uid),
        "{before}"
    );

    node.kill_agent();
    node.delete_pod(&gone).await;
    node.start_agent();
    node.wait_ready().await;
    let after = probe_set_v4(&node);
    assert!(
        !after.contains(&gone.uid) && after.contains(&cut.uid),
        "the restore kept the entry of a deleted pod, or dropped one of a pod without its IP \
         yet:\n{after}\n{}",
        node.agent_log()
    );

    // The runtime retries the pod in a new sandbox: a new address, the first one's entry left.
    let _ = node.sandbox_del(&cut, None).await;
    cut.netns = dataplane::test_support::TestNetns::new("pod");
    cut.container_id = format!("{}r", cut.container_id);
    let prev = node.sandbox_add_primary(&cut).await.unwrap();
    let result = node
        .sandbox_add_ours(&cut, prev)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    node.report_running(&mut cut, &result).await;
    node.wait_redirection(&cut, Some("enabled")).await;
    node.delete_pod(&cut).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while probe_set_v4(&node).contains(&cut.uid) {
        assert!(
            std::time::Instant::now() < deadline,
            "the deleted pod's entries are not all gone:\n{}\n{}",
            probe_set_v4(&node),
            node.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

type PluginAdd = std::thread::JoinHandle<Result<Option<serde_json::Value>, String>>;

/// Our plugin's part of the chain for `pod` (after the primary plugins' `prev`), on a thread as
/// the runtime runs it, so the test can act while the ADD waits.
fn add_ours_in_background(node: &TestNode, pod: &TestPod, prev: serde_json::Value) -> PluginAdd {
    let (runtime, sandbox) = (node.runtime(), pod.sandbox());
    std::thread::spawn(move || {
        let ours = runtime
            .position("istio-cni")
            .expect("our plugin is chained");
        runtime
            .add_plugins(
                &sandbox,
                ours..runtime.plugin_count(),
                Some(prev),
                &mut |_| {},
            )
            .map_err(|e| e.to_string())
    })
}

/// The result of a successful [`add_ours_in_background`].
fn finished(add: PluginAdd, node: &TestNode) -> serde_json::Value {
    add.join()
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()))
        .expect("prev is passed through")
}

/// The agent's metrics once `ready` holds for them, or as they are after 10 s: a metric is
/// updated just after what it counts, so the test may see the effect first.
async fn metrics_once(node: &TestNode, ready: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = node.metrics();
        if ready(&metrics) || std::time::Instant::now() > deadline {
            return metrics;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn fast_peer(node: &TestNode) -> ZdsPeer {
    ZdsPeer::start(fast_peer_config(node))
}

fn fast_peer_config(node: &TestNode) -> PeerConfig {
    let mut cfg = PeerConfig::new(node.path("zt/ztunnel.sock"));
    cfg.max_backoff = Duration::from_millis(200);
    cfg
}

/// A [`fast_peer`] that also opens the in-pod listeners, so traffic can go through it.
fn proxying_peer(node: &TestNode) -> ZdsPeer {
    let mut cfg = fast_peer_config(node);
    cfg.proxies = Some(std::sync::Arc::new(testbed::zds_peer::PodProxies));
    ZdsPeer::start(cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_crash_and_restart_keeps_pods_redirected() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Iptables).await;
    let peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (pod, result) = node.create_pod("mesh", "survivor", &[]).await;
    result.unwrap();
    node.wait_redirection(&pod, Some("enabled")).await;
    let connects = peer.status().connects;

    node.kill_agent();
    // Rules stay in the pod while the agent is gone: traffic keeps flowing through ztunnel.
    assert!(iptables_rules(&pod.netns).contains("ISTIO_OUTPUT"));
    node.start_agent();
    node.wait_ready().await;

    // The restarted agent found the pod's namespace again and handed it over in the snapshot
    // (an Add with the same namespace, not a Keep).
    let st = peer
        .wait_for("reconnect with snapshot", Duration::from_secs(15), |s| {
            s.connects > connects && s.snapshot_received && s.workloads.contains_key(&pod.uid)
        })
        .await
        .unwrap();
    assert_eq!(st.workloads[&pod.uid].netns(), pod.netns.open().id());
    assert!(
        st.log
            .iter()
            .rev()
            .any(|e| e == &format!("add {}", pod.uid)),
        "{:?}",
        st.log
    );
    assert_eq!(node.redirection(&pod).await.as_deref(), Some("enabled"));
    let (ok, text) = node.explain(&pod);
    assert!(ok && text.contains("meshed:      yes"), "{text}");
}

/// Rules that drifted while no agent ran are repaired by the next one before it is ready, each pod
/// against its own settings: the restart checks the hinted namespaces against the node's settings
/// while the API server's lists are on their way, and a pod with settings of its own must be
/// checked against those, not "repaired" to the node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_repairs_rules_that_drifted_while_no_agent_ran() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Iptables).await;
    let _peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (drifted, result) = node.create_pod("mesh", "drifted", &[]).await;
    result.unwrap();
    let mut own = node
        .create_annotated_pod_object("mesh", "own-settings", &[], &[(BYPASS_INBOUND, "true")])
        .await;
    node.sandbox_add(&mut own)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    // Without comments: iptables-save stamps them with the time.
    let rules = |pod: &TestPod| {
        iptables_rules(&pod.netns)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let own_rules = rules(&own);
    assert!(
        rules(&drifted).contains("--to-ports 15006") && !own_rules.contains("--to-ports 15006"),
        "the two pods' settings differ:\n{own_rules}"
    );

    node.kill_agent();
    for variant in ["iptables-legacy", "iptables-nft"] {
        // Only the variant the agent uses has the chain.
        let _ = std::process::Command::new("ip")
            .args(["netns", "exec", &drifted.netns.name, variant])
            .args(["-t", "nat", "-F", "ISTIO_OUTPUT"])
            .output();
    }
    assert!(!rules(&drifted).contains("--to-ports 15001"));
    node.start_agent();
    node.wait_ready().await;

    let log = node.agent_log();
    assert!(
        rules(&drifted).contains("--to-ports 15001"),
        "not repaired before ready:\n{log}"
    );
    assert_eq!(rules(&own), own_rules, "{log}");
    assert!(
        node.metrics()
            .contains("istio_cni_drift_repairs_total{backend=\"iptables\",scope=\"pod\"} 1"),
        "{}",
        node.metrics()
    );
    assert!(
        log.contains("hinted namespaces checked\tnamespaces=2"),
        "{log}"
    );
}

/// A handover's last pod: the previous agent (nftables) answered its ADD, but the kubelet had not
/// posted its IP yet when the next agent (iptables) restored, so the restore could not look for
/// its namespace and only kept it for ztunnel. Once its IP shows, the agent adopts it: the pod is
/// redirected by iptables alone and ztunnel gets it with its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_restored_without_its_ip_is_adopted_once_the_ip_shows() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Nftables).await;
    let peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let mut pod = node.create_pod_object("mesh", "last", &[]).await;
    let prev = node.sandbox_add_primary(&pod).await.unwrap();
    let result = node
        .sandbox_add_ours(&pod, prev)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    assert_pod_redirected_by(&pod, Backend::Nftables);
    let connects = peer.status().connects;

    node.switch_backend(Backend::Iptables).await;
    let st = peer
        .wait_for(
            "the restarted agent's snapshot",
            Duration::from_secs(15),
            |s| s.connects > connects && s.snapshot_received,
        )
        .await
        .unwrap();
    let log_len = st.log.len();
    assert!(
        st.log
            .iter()
            .rev()
            .any(|e| e == &format!("keep {}", pod.uid)),
        "kept without a namespace at the restore: {:?}",
        st.log
    );
    assert_pod_redirected_by(&pod, Backend::Nftables);

    node.report_running(&mut pod, &result).await;
    peer.wait_for(
        "the pod handed over with its namespace",
        Duration::from_secs(15),
        |s| {
            s.log[log_len.min(s.log.len())..]
                .iter()
                .any(|e| e == &format!("add {}", pod.uid))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:?}\n{}", node.agent_log()));
    assert_eq!(
        peer.status().workloads[&pod.uid].netns(),
        pod.netns.open().id()
    );
    eventually_redirected_by(&pod, Backend::Iptables).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_ztunnel_gets_the_snapshot() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let node = TestNode::start(Backend::Nftables).await;
    let first = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (pod, result) = node.create_pod("mesh", "app", &[]).await;
    result.unwrap();
    wait_peer_has(&first, &pod.uid, true).await;
    drop(first);

    let second = fast_peer(&node);
    let st = second
        .wait_for("snapshot", Duration::from_secs(10), |s| s.snapshot_received)
        .await
        .unwrap();
    assert_eq!(
        st.workloads[&pod.uid].netns(),
        pod.netns.open().id(),
        "{st:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drifted_rules_are_repaired_and_explained() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let node = TestNode::start(Backend::Iptables).await;
    let _peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    node.create_namespace("plain", &[]).await;
    let (pod, result) = node.create_pod("mesh", "tampered", &[]).await;
    result.unwrap();
    let before = iptables_rules(&pod.netns);

    // Someone flushes the pod's nat table: outbound traffic would now bypass ztunnel.
    for variant in ["iptables-legacy", "iptables-nft"] {
        // Only the variant the agent uses has the chain; the other one fails, which is fine.
        let _ = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &pod.netns.name,
                variant,
                "-t",
                "nat",
                "-F",
                "ISTIO_OUTPUT",
            ])
            .output();
    }
    assert!(!iptables_rules(&pod.netns).contains("--to-ports 15001"));
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !iptables_rules(&pod.netns).contains("--to-ports 15001") {
        assert!(
            std::time::Instant::now() < deadline,
            "drift not repaired:\n{}",
            node.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        iptables_rules(&pod.netns).matches("ISTIO_OUTPUT").count(),
        before.matches("ISTIO_OUTPUT").count()
    );
    // The repair is counted just after its rules are written: on a loaded machine the rules can
    // be seen first.
    let counted = "istio_cni_drift_repairs_total{backend=\"iptables\",scope=\"pod\"}";
    let metrics = metrics_once(&node, |m| m.contains(counted)).await;
    assert!(metrics.contains(&format!("{counted} 1\n")), "{metrics}");

    let (plain, result) = node.create_pod("plain", "web", &[]).await;
    result.unwrap();
    let (ok, text) = node.explain(&plain);
    assert!(ok, "{text}");
    assert!(
        text.contains("meshed:      NO") && text.contains("no ambient enablement selector matches"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_keeps_plugin_in_place_and_uninstall_removes_it() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    // nftables: the backend that keeps a generations journal beside the hints.
    let mut node = TestNode::start(Backend::Nftables).await;
    let _peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    node.create_namespace("plain", &[]).await;
    node.create_agent_daemonset().await;
    let dss = kube::Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(
        node.kube.client(),
        "istio-system",
    );

    let (pod, r) = node.create_pod("mesh", "before-upgrade", &[]).await;
    r.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    assert!(
        node.path("run/netns").join(&pod.uid).exists(),
        "no netns hint"
    );
    let journal = node.path("run/nft-generations");
    assert!(journal.exists(), "no nftables generations journal");

    // Upgrade: the DaemonSet still exists, so the plugin and its config entry stay; the netns
    // hints and the generations journal go (the next agent may be Istio's, which would leave
    // them behind forever).
    assert!(node.stop_agent().success(), "{}", node.agent_log());
    assert!(
        !node.path("run/netns").exists(),
        "netns hints left after a requested stop"
    );
    assert!(
        !journal.exists(),
        "generations journal left after a requested stop"
    );
    assert!(
        node.conflist().contains("istio-cni"),
        "plugin entry removed on upgrade"
    );
    assert!(node.path("bin/istio-cni").exists());
    let (_, ambient) = node.create_pod("mesh", "during-upgrade", &[]).await;
    assert!(ambient.is_err(), "ambient pods must wait for the new agent");
    let (_, plain) = node.create_pod("plain", "during-upgrade", &[]).await;
    plain.expect("non-mesh pods keep starting during an upgrade");

    node.start_agent();
    node.wait_ready().await;
    let (pod, ambient) = node.create_pod("mesh", "after-upgrade", &[]).await;
    ambient.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    node.wait_redirection(&pod, Some("enabled")).await;

    // Uninstall: the DaemonSet is gone, so everything is removed.
    dss.delete("istio-cni-node", &Default::default())
        .await
        .unwrap();
    assert!(node.stop_agent().success());
    assert!(
        !node.conflist().contains("istio-cni"),
        "plugin entry left after uninstall"
    );
    assert!(
        !node.path("run/netns").exists(),
        "netns hints left after uninstall"
    );
    assert!(
        !journal.exists(),
        "generations journal left after uninstall"
    );
    assert!(!node.path("bin/istio-cni").exists());
}

/// The installer's writes fail while no DaemonSet exists (an agent that exited would find no
/// upgrade to keep the plugin for): first the plugin's kubeconfig, its run dir made immutable
/// (`chattr +i`, which stops root too), then the plugin's copy, its bin dir replaced by a file.
/// Each time the agent stays up, not ready naming the file, enrolls ambient pods meanwhile and
/// keeps the plugin chained, and is ready again once the file can be written: one process
/// throughout, never restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_write_failure_is_retried_in_place() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Nftables).await;
    let peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let agent = node.agent_pid();

    // The same token written again: the installer rewrites the kubeconfig, which is refused.
    let immutable = Immutable::set(node.path("run"));
    let token = std::fs::read(node.path("sa/token")).unwrap();
    std::fs::write(node.path("sa/token"), token).unwrap();
    let kubeconfig = node.path("run/istio-cni-kubeconfig");
    let reason = installer_failing(&mut node, &kubeconfig.display().to_string()).await;
    assert!(reason.contains("Operation not permitted"), "{reason}");
    let (pod, r) = node.create_pod("mesh", "while-failing", &[]).await;
    r.unwrap_or_else(|e| {
        panic!(
            "ambient ADD while the installer fails: {e}\n{}",
            node.agent_log()
        )
    });
    wait_peer_has(&peer, &pod.uid, true).await;
    let metrics = metrics_once(&node, |m| m.contains("CREATE_KUBECONFIG_FAILURE")).await;
    assert!(
        metrics.contains("istio_cni_installs_total{result=\"CREATE_KUBECONFIG_FAILURE\"}")
            && metrics.contains("istio_cni_install_ready 0"),
        "{metrics}"
    );
    drop(immutable);
    node.wait_ready().await;
    assert_eq!(node.agent_pid(), agent, "the agent was restarted");

    // The plugin's copy fails: its bin dir is now a file.
    std::fs::rename(node.path("bin"), node.path("bin.moved")).unwrap();
    std::fs::write(node.path("bin"), "not a directory").unwrap();
    let bin = node.path("bin").display().to_string();
    installer_failing(&mut node, &bin).await;
    assert!(
        node.conflist().contains("istio-cni"),
        "a failing installer unchained the plugin:\n{}",
        node.agent_log()
    );
    std::fs::remove_file(node.path("bin")).unwrap();
    std::fs::rename(node.path("bin.moved"), node.path("bin")).unwrap();
    node.wait_ready().await;
    assert_eq!(node.agent_pid(), agent, "the agent was restarted");
    assert!(node.agent_exited().is_none());
}

/// A directory with the immutable attribute, in which nobody (root included) creates a file,
/// until dropped.
struct Immutable(std::path::PathBuf);

impl Immutable {
    fn set(dir: std::path::PathBuf) -> Immutable {
        chattr(&dir, "+i");
        Immutable(dir)
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        chattr(&self.0, "-i");
    }
}

fn chattr(path: &std::path::Path, flag: &str) {
    let status = std::process::Command::new("chattr")
        .arg(flag)
        .arg(path)
        .status()
        .expect("chattr (e2fsprogs)");
    assert!(status.success(), "chattr {flag} {}", path.display());
}

/// Waits until `/readyz` says the installer is failing on `file` (its error names it); returns
/// the body. The agent must stay up meanwhile.
async fn installer_failing(node: &mut TestNode, file: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((503, body)) = node.readyz()
            && body.contains("installer (")
            && body.contains(file)
        {
            return body;
        }
        if let Some(status) = node.agent_exited() {
            panic!("the agent exited with {status}:\n{}", node.agent_log());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/readyz never named {file}: {:?}\n{}",
            node.readyz(),
            node.agent_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_traffic_goes_through_the_ztunnel_listeners() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    use testbed::node::{app_request, serve_hello};
    let node = TestNode::start(Backend::Nftables).await;
    let mut cfg = PeerConfig::new(node.path("zt/ztunnel.sock"));
    cfg.proxies = Some(std::sync::Arc::new(testbed::zds_peer::PodProxies));
    let peer = ZdsPeer::start(cfg);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (client, r) = node.create_pod("mesh", "client", &[]).await;
    r.unwrap();
    let (server, r) = node.create_pod("mesh", "server", &[]).await;
    r.unwrap();
    serve_hello(&server, 8080);

    let answer =
        app_request(&client, &server, 8080).unwrap_or_else(|e| panic!("request failed: {e}"));
    assert_eq!(answer, "hello from server\n");
    let st = peer.status();
    assert_eq!(
        st.workloads[&client.uid].connections, 1,
        "client's outbound did not pass its 15001: {st:#?}"
    );
    assert_eq!(
        st.workloads[&server.uid].connections, 1,
        "server's inbound did not pass its 15006: {st:#?}"
    );

    // Out of the mesh: the same request now goes direct.
    node.label_namespace("mesh", AMBIENT.0, None).await;
    node.wait_redirection(&client, None).await;
    node.wait_redirection(&server, None).await;
    assert_eq!(
        app_request(&client, &server, 8080).unwrap(),
        "hello from server\n"
    );
    assert!(peer.status().workloads.is_empty(), "{:#?}", peer.status());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_reboot_reenrolls_pods_through_their_new_sandboxes() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Iptables).await;
    let peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (mut pod, result) = node.create_pod("mesh", "rebooted", &[]).await;
    result.unwrap();
    node.wait_redirection(&pod, Some("enabled")).await;

    // Reboot: the agent stops without cleanup, every sandbox namespace is gone, and the agent's
    // run dir (a tmpfs on the host) is empty; the Pod object keeps its `enabled` annotation.
    node.kill_agent();
    pod.netns = dataplane::test_support::TestNetns::new("pod");
    pod.container_id = format!("{}-after-reboot", pod.container_id);
    std::fs::remove_dir_all(node.path("run")).unwrap();
    std::fs::create_dir(node.path("run")).unwrap();
    let connects = peer.status().connects;
    node.start_agent();
    node.wait_ready().await;

    // The old namespace cannot be found: ztunnel is told to keep the pod (not drop it) until the
    // runtime recreates the sandbox.
    let st = peer
        .wait_for("snapshot after restart", Duration::from_secs(15), |s| {
            s.connects > connects && s.snapshot_received
        })
        .await
        .unwrap();
    assert!(
        st.log
            .iter()
            .rev()
            .any(|e| e == &format!("keep {}", pod.uid)),
        "{:?}",
        st.log
    );

    node.sandbox_add(&mut pod)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    let st = peer.status();
    assert_eq!(
        st.workloads[&pod.uid].netns(),
        pod.netns.open().id(),
        "ztunnel must get the new sandbox"
    );
    assert!(iptables_rules(&pod.netns).contains("ISTIO_OUTPUT"));
    assert_eq!(node.redirection(&pod).await.as_deref(), Some("enabled"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_rows_terminated_deleted_excluded_host_network() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    use kube::api::{Patch, PatchParams, PostParams};
    let node = TestNode::start(Backend::Nftables).await;
    let peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    // kube-system exists already (the API server creates it): label it ambient.
    node.label_namespace("kube-system", AMBIENT.0, Some(AMBIENT.1))
        .await;

    // A job's pod finishes: terminal phase, IPs gone from the status → removed from the mesh.
    let (job, r) = node.create_pod("mesh", "job", &[]).await;
    r.unwrap();
    wait_peer_has(&peer, &job.uid, true).await;
    let done = serde_json::json!({"status": {"phase": "Succeeded", "podIP": null, "podIPs": null}});
    node.pods("mesh")
        .patch_status("job", &PatchParams::default(), &Patch::Merge(&done))
        .await
        .unwrap();
    wait_peer_has(&peer, &job.uid, false).await;
    node.wait_redirection(&job, None).await;

    // A deleted pod: ztunnel is told to drop it.
    let (gone, r) = node.create_pod("mesh", "gone", &[]).await;
    r.unwrap();
    wait_peer_has(&peer, &gone.uid, true).await;
    node.delete_pod(&gone).await;
    wait_peer_has(&peer, &gone.uid, false).await;

    // EXCLUDE_NAMESPACES wins over a namespace's ambient label.
    let (excluded, r) = node.create_pod("kube-system", "dns", &[]).await;
    r.unwrap();
    assert_eq!(node.redirection(&excluded).await, None);
    assert!(!peer.status().workloads.contains_key(&excluded.uid));

    // A host-network pod in an ambient namespace is never enrolled (no sandbox of its own).
    let host: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "hostnet"},
        "spec": {"nodeName": node.node_name, "hostNetwork": true, "containers": [{"name": "c", "image": "c"}]}
    }))
    .unwrap();
    node.pods("mesh")
        .create(&PostParams::default(), &host)
        .await
        .unwrap();
    let running = serde_json::json!({"status": {"phase": "Running", "podIP": "10.99.0.1", "podIPs": [{"ip": "10.99.0.1"}]}});
    node.pods("mesh")
        .patch_status("hostnet", &PatchParams::default(), &Patch::Merge(&running))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let host = node.pods("mesh").get("hostnet").await.unwrap();
    let annotations = host.metadata.annotations.unwrap_or_default();
    assert!(
        !annotations.contains_key("ambient.istio.io/redirection"),
        "{annotations:?}"
    );
    assert_eq!(peer.status().workloads.len(), 0, "{:#?}", peer.status());
}

/// Everything either backend could have programmed in a namespace.
fn rules_of_both_backends(netns: &dataplane::test_support::TestNetns) -> String {
    format!(
        "{}{}",
        iptables_rules(netns),
        netns.exec("nft", &["list", "ruleset"])
    )
}

fn assert_pod_clean(pod: &testbed::node::TestPod) {
    let rules = rules_of_both_backends(&pod.netns);
    assert!(
        !rules.contains("ISTIO") && !rules.contains("istio"),
        "{} left the mesh with rules of a backend:\n{rules}",
        pod.name
    );
}

/// Whether iptables and our nftables table redirect the pod, with both listings.
fn pod_backends(pod: &testbed::node::TestPod) -> ((bool, bool), String) {
    let (ipt, nft) = (
        iptables_rules(&pod.netns),
        pod.netns.exec("nft", &["list", "ruleset"]),
    );
    let found = (
        ipt.contains("ISTIO_OUTPUT"),
        nft.contains("istio-ambient-nat"),
    );
    (found, format!("{ipt}\n{nft}"))
}

fn only(backend: Backend) -> (bool, bool) {
    (backend == Backend::Iptables, backend == Backend::Nftables)
}

/// Only nftables (`nft`) or only iptables (`ipt`) redirects the pod.
fn assert_pod_redirected_by(pod: &testbed::node::TestPod, backend: Backend) {
    let (found, listings) = pod_backends(pod);
    assert_eq!(
        found,
        only(backend),
        "{} should be redirected by {backend:?} only:\n{listings}",
        pod.name
    );
}

/// [`assert_pod_redirected_by`] once the agent got there (within 10 s).
async fn eventually_redirected_by(pod: &testbed::node::TestPod, backend: Backend) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while pod_backends(pod).0 != only(backend) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_pod_redirected_by(pod, backend);
}

fn assert_host_is(node: &TestNode, backend: Backend) {
    let host = &node.node_netns;
    let (ipt, sets, nft) = (
        iptables_rules(host),
        host.exec("ipset", &["list", "-n"]),
        host.exec("nft", &["list", "ruleset"]),
    );
    assert_eq!(
        (
            ipt.contains("ISTIO_POSTRT"),
            sets.contains("istio-inpod-probes-v4"),
            nft.contains("istio-ambient-nat")
        ),
        (
            backend == Backend::Iptables,
            backend == Backend::Iptables,
            backend == Backend::Nftables
        ),
        "host should hold {backend:?} state only:\n{ipt}\nipsets: {sets}\n{nft}"
    );
}

/// A request through the peer's proxies: the client's outbound and the server's inbound
/// listeners each count one more connection.
async fn request_through_peer(
    peer: &ZdsPeer,
    client: &testbed::node::TestPod,
    server: &testbed::node::TestPod,
) {
    let before = peer.status();
    let (c0, s0) = (
        before.workloads[&client.uid].connections,
        before.workloads[&server.uid].connections,
    );
    let answer = tokio::task::block_in_place(|| testbed::node::app_request(client, server, 8080))
        .unwrap_or_else(|e| panic!("{} → {}: {e}", client.name, server.name));
    assert_eq!(answer, format!("hello from {}\n", server.name));
    let after = peer.status();
    assert_eq!(
        (
            after.workloads[&client.uid].connections,
            after.workloads[&server.uid].connections
        ),
        (c0 + 1, s0 + 1),
        "{} → {} bypassed the peer: {after:#?}",
        client.name,
        server.name
    );
}

/// A DaemonSet rollout that changes the backend (iptables → nftables, then back) on a node with
/// pods enrolled under each: nothing of the previous backend is left on the host or in any pod,
/// pods enrolled before a switch are redirected by the new backend (without startup
/// reconciliation), and pods leaving the mesh afterwards are clean of both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_switch_on_a_live_node_strands_nothing() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    use testbed::node::serve_hello;
    let mut node = TestNode::start(Backend::Iptables).await;
    node.extra_env.push((
        "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP".into(),
        "false".into(),
    ));
    let peer = proxying_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let mut pods = Vec::new();
    for name in ["old-a", "old-b"] {
        let (pod, r) = node.create_pod("mesh", name, &[]).await;
        r.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
        serve_hello(&pod, 8080);
        pods.push(pod);
    }
    let [old_a, old_b] = <[_; 2]>::try_from(pods).ok().unwrap();
    assert_host_is(&node, Backend::Iptables);
    assert_pod_redirected_by(&old_a, Backend::Iptables);

    node.switch_backend(Backend::Nftables).await;
    assert_host_is(&node, Backend::Nftables);
    for pod in [&old_a, &old_b] {
        assert_pod_redirected_by(pod, Backend::Nftables);
    }
    let (new_c, r) = node.create_pod("mesh", "new-c", &[]).await;
    r.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    serve_hello(&new_c, 8080);
    assert_pod_redirected_by(&new_c, Backend::Nftables);
    request_through_peer(&peer, &old_b, &old_a).await;
    request_through_peer(&peer, &new_c, &old_a).await;

    // One pod from each side of the switch leaves the mesh.
    for pod in [&old_b, &new_c] {
        node.label_pod(pod, AMBIENT.0, Some("none")).await;
        node.wait_redirection(pod, None).await;
        wait_peer_has(&peer, &pod.uid, false).await;
        assert_pod_clean(pod);
    }

    // And back: the nftables state goes, the pods left are redirected by iptables.
    node.switch_backend(Backend::Iptables).await;
    assert_host_is(&node, Backend::Iptables);
    assert_pod_redirected_by(&old_a, Backend::Iptables);
    let (new_d, r) = node.create_pod("mesh", "new-d", &[]).await;
    r.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    wait_peer_has(&peer, &new_d.uid, true).await;
    request_through_peer(&peer, &new_d, &old_a).await;
    for pod in [&old_a, &new_d] {
        node.label_pod(pod, AMBIENT.0, Some("none")).await;
        node.wait_redirection(pod, None).await;
        assert_pod_clean(pod);
    }
}

/// A CNI ADD does not look for the previous backend's rules (`Mesh::add` says why: the runtime
/// made the namespace for the sandbox), but one way brings them there: an agent of the other
/// backend programmed the namespace while serving the same ADD and died, and our plugin posts
/// the ADD again to the next agent. That pod still ends redirected by the new backend alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_posted_again_after_a_backend_switch_ends_with_the_new_rules_alone() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    use cni_core::redirect::ambient::InpodConfig;
    use dataplane::backend::{BackendOptions, RuleBackend};
    let node = TestNode::start(Backend::Nftables).await;
    let _peer = fast_peer(&node);
    node.create_namespace("mesh", &[AMBIENT]).await;
    let pod = node.create_pod_object("mesh", "again", &[]).await;
    let prev = node.sandbox_add_primary(&pod).await.unwrap();
    // What the iptables agent that died in the middle of this ADD left in the pod.
    let ns = pod.netns.open();
    let iptables = ns
        .run(|| RuleBackend::new("iptables", &BackendOptions::default()))
        .unwrap()
        .unwrap();
    dataplane::pod::enroll(&ns, &InpodConfig::default(), &iptables).unwrap();
    assert_pod_redirected_by(&pod, Backend::Iptables);

    node.sandbox_add_ours(&pod, prev)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    eventually_redirected_by(&pod, Backend::Nftables).await;
}

/// The node's iptables variant changes under a live agent (an OS upgrade from iptables-legacy to
/// iptables-nft; forced here): pods enrolled before are redirected by the new variant only, the
/// host's chains move with it while the probe sets stay, and a pod leaving the mesh is clean of
/// both variants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iptables_variant_switch_on_a_live_node_strands_nothing() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    use testbed::node::serve_hello;
    let in_variant = |ns: &dataplane::test_support::TestNetns, variant: &str| {
        format!(
            "{}{}",
            ns.exec(&format!("iptables-{variant}-save"), &[]),
            ns.exec(&format!("ip6tables-{variant}-save"), &[])
        )
    };
    let force = |node: &mut TestNode, variant: &str| {
        node.extra_env.retain(|(k, _)| k != "FORCE_IPTABLES_BINARY");
        node.extra_env
            .push(("FORCE_IPTABLES_BINARY".into(), variant.into()));
    };
    let mut node = TestNode::start(Backend::Iptables).await;
    node.extra_env.push((
        "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP".into(),
        "false".into(),
    ));
    let peer = proxying_peer(&node);
    force(&mut node, "legacy");
    node.switch_backend(Backend::Iptables).await;
    node.create_namespace("mesh", &[AMBIENT]).await;
    let (old, r) = node.create_pod("mesh", "old", &[]).await;
    r.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    serve_hello(&old, 8080);
    let host = &node.node_netns;
    assert!(in_variant(&old.netns, "legacy").contains("ISTIO_OUTPUT"));
    assert!(!in_variant(&old.netns, "nft").contains("ISTIO"));
    assert!(in_variant(host, "legacy").contains("ISTIO_POSTRT"));
    assert!(!in_variant(host, "nft").contains("ISTIO"));

    force(&mut node, "nft");
    node.switch_backend(Backend::Iptables).await;
    let host = &node.node_netns;
    let (legacy, nft) = (in_variant(host, "legacy"), in_variant(host, "nft"));
    assert!(
        !legacy.contains("ISTIO") && nft.contains("ISTIO_POSTRT"),
        "host chains should have moved to nft:\n{legacy}\n{nft}\n{}",
        node.agent_log()
    );
    let sets = host.exec("ipset", &["list", "-n"]);
    assert!(sets.contains("istio-inpod-probes-v4"), "{sets}");
    let (legacy, nft) = (
        in_variant(&old.netns, "legacy"),
        in_variant(&old.netns, "nft"),
    );
    assert!(
        !legacy.contains("ISTIO") && nft.contains("ISTIO_OUTPUT"),
        "the old pod should be redirected by nft only:\n{legacy}\n{nft}"
    );
    let (new, r) = node.create_pod("mesh", "new", &[]).await;
    r.unwrap_or_else(|e| panic!("{e}\n{}", node.agent_log()));
    assert!(!in_variant(&new.netns, "legacy").contains("ISTIO"));
    request_through_peer(&peer, &new, &old).await;

    node.label_pod(&old, AMBIENT.0, Some("none")).await;
    node.wait_redirection(&old, None).await;
    wait_peer_has(&peer, &old.uid, false).await;
    assert_pod_clean(&old);
}

/// AWS Security Groups for Pods: a pod whose host route lives in an `iif` table (aws-vpc-cni's
/// branch-ENI setup, here faked on the test bridge) gets Istio's two probe rules while enrolled,
/// on nodes with `tcp_early_demux=0` only, and loses them on removal and on uninstall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_branch_eni_pods_get_probe_rules_while_enrolled() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start(Backend::Iptables).await;
    let _peer = fast_peer(&node);
    node.create_namespace("sgp", &[]).await;
    let (pod, r) = node.create_pod("sgp", "branch", &[]).await;
    r.unwrap();
    let ip = pod.ip.unwrap().to_string();
    let host = node.node_netns.name.clone();
    let in_host = |args: &[&str]| {
        dataplane::test_support::run("ip", &[&["-n", host.as_str()], args].concat())
    };
    let rules = || in_host(&["rule", "show"]);
    in_host(&[
        "rule", "add", "iif", "cni0", "lookup", "105", "priority", "10",
    ]);
    in_host(&[
        "route",
        "add",
        &format!("{ip}/32"),
        "dev",
        "cni0",
        "table",
        "105",
    ]);
    let forward = format!("512:\tfrom all to {ip} lookup 105");
    let back = "9:\tfrom all iif cni0 lookup local";

    // tcp_early_demux is 1 (the kernel default): not a Security Groups for Pods node.
    node.label_namespace("sgp", AMBIENT.0, Some(AMBIENT.1))
        .await;
    node.wait_redirection(&pod, Some("enabled")).await;
    assert!(!rules().contains(&forward), "{}", rules());

    // An SGP node: a restarted agent adds the rules while restoring the enrolled pod.
    node.kill_agent();
    node.node_netns
        .exec("sysctl", &["-qw", "net.ipv4.tcp_early_demux=0"]);
    node.start_agent();
    node.wait_ready().await;
    let shown = rules();
    assert!(shown.contains(&forward) && shown.contains(back), "{shown}");
    // A pod on plain routing gets none.
    let (plain, r) = node.create_pod("sgp", "plain", &[]).await;
    r.unwrap();
    let plain_ip = plain.ip.unwrap().to_string();
    assert!(!rules().contains(&format!("to {plain_ip} ")), "{}", rules());

    node.label_pod(&pod, AMBIENT.0, Some("none")).await;
    node.wait_redirection(&pod, None).await;
    let shown = rules();
    assert!(
        !shown.contains(&forward) && !shown.contains(back),
        "{shown}"
    );
    assert!(
        shown.contains("10:\tfrom all iif cni0 lookup 105"),
        "{shown}"
    );

    // Back in the mesh, then uninstall: the rules go with the host rules.
    node.label_pod(&pod, AMBIENT.0, None).await;
    node.wait_redirection(&pod, Some("enabled")).await;
    assert!(rules().contains(&forward), "{}", rules());
    assert!(node.stop_agent().success(), "{}", node.agent_log());
    let shown = rules();
    assert!(
        !shown.contains(&forward) && !shown.contains(back),
        "{shown}"
    );
}

/// The node's IPv4 probe set as nftables lists it (elements with their pods' UIDs).
fn probe_set_v4(node: &TestNode) -> String {
    node.node_netns.exec(
        "nft",
        &[
            "list",
            "set",
            "inet",
            "istio-ambient-nat",
            "istio-inpod-probes-v4",
        ],
    )
}
