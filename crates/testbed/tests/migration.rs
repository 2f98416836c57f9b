//! The migration of docs/migrate-from-istio.md on the real node, under a 100 ms prober (issue
//! #22): Istio's own chart and agent first (`localhost/istio/install-cni:dev-distroless`, built
//! from the pin), with ambient and sidecar pods running and enrolled; then `helm upgrade` of the
//! same release to our chart, with either of our backends, while pods are being created; then
//! back to Istio's chart the same way; then a final uninstall.
//!
//! Throughout, every ambient pod probes a witness on the node every 100 ms from inside its
//! network namespace ([`testbed::switch::Prober`]): no connection may escape redirection. After
//! each switch: the peer (ztunnel) still has every ambient pod, the pods created during the switch
//! started redirected and enrolled, every annotation is `enabled`, and no pod was restarted (same
//! containers, same restart counts, same sandbox). Each switch prints its row of the migration
//! benchmark (BENCHMARKS.md): how long no agent served ADDs on each node, how many pods were
//! created meanwhile and how long their sandboxes waited, probes and escapes.
//!
//! What Istio's agent does differently, and how the procedure handles it (docs/migrate-from-istio.md):
//! - it does not know our nftables backend's rules, so the way back from our nftables backend
//!   goes through our iptables backend first (`global.nativeNftables=false`; a ConfigMap change,
//!   so the DaemonSet needs `kubectl rollout restart`);
//! - from its second start on a node it picks iptables-legacy (its first start leaves an empty
//!   legacy table), so the rollback pins `env.FORCE_IPTABLES_BINARY=nft`, the node's variant;
//! - its uninstall writes the CNI config back with its keys sorted: after the final uninstall the
//!   config equals the original as JSON, and byte for byte Istio's own config before and after
//!   the round trip.
//!
//! Needs root, the node binaries (`tools/k8s-node/build.sh`) and the images (`scripts/node-images`,
//! or `REAL_NODE_IMAGES`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use testbed::migrate::{
    ISTIO_IMAGE, helm_cni, helm_cni_run, install_peer, netns_exec, node_rules, peer_workloads,
    pod_rules, redirected_now, wait_peer_has,
};
use testbed::real_node::{
    CONFLIST, GATEWAY, REDIRECTION, RealNode, annotation, create, get, label_namespace,
    sidecar_pod, wait_redirection, wait_running, witness, witness_pod,
};
use testbed::switch::{
    Created, Incarnation, Probed, Prober, SocketWatch, Witness, agent_state, create_during,
    incarnation,
};

/// One node at a time: a node is several hundred MB of processes and most of a core to start.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const OURS_IMAGE: &str = "localhost/istio-cni-rs/install-cni:dev";
/// The witness's port on each node's gateway (the pods' own witness uses the closed port 9).
const WITNESS_PORT: u16 = 19;
/// How often a pod is created while a switch runs.
const CREATE_EVERY: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Nftables,
    Iptables,
}

/// One node of the cluster, with what the test keeps about it.
struct NodeUnderTest<'a> {
    node: &'a RealNode,
    gateway: &'static str,
    /// Kept alive for the probers.
    _witness: Witness,
    prober: Prober,
    /// Ambient pods: name → UID.
    ambient: BTreeMap<String, String>,
    sidecars: Vec<String>,
    incarnations: BTreeMap<(String, String), Incarnation>,
}

/// One switch on one node, as BENCHMARKS.md's migration table shows it.
struct Row {
    switch: String,
    node: usize,
    gap: Duration,
    created: usize,
    waited_min: Duration,
    waited_max: Duration,
    probes: u64,
    escaped: u64,
    failed: u64,
}

fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

impl<'a> NodeUnderTest<'a> {
    async fn new(node: &'a RealNode, gateway: &'static str) -> Self {
        let witness = Witness::start(node, gateway.parse().unwrap(), WITNESS_PORT);
        let prober = Prober::new(&witness);
        NodeUnderTest {
            node,
            gateway,
            _witness: witness,
            prober,
            ambient: BTreeMap::new(),
            sidecars: Vec::new(),
            incarnations: BTreeMap::new(),
        }
    }

    /// An ambient pod (its witness printed `REDIRECTED`, annotated, known to the peer), probed
    /// from now on.
    async fn adopt_ambient(&mut self, name: &str, uid: &str, agent: &str) {
        let node = self.node;
        wait_running(node, "mesh", name).await;
        wait_redirection(node, "mesh", name, Some("enabled")).await;
        assert_eq!(
            witness(node, "mesh", name),
            "REDIRECTED",
            "{name} started unredirected under {agent}"
        );
        wait_peer_has(node, uid, true).await;
        self.prober.add(node, name, uid);
        self.ambient.insert(name.to_string(), uid.to_string());
        let inc = incarnation(node, "mesh", name).await;
        self.incarnations
            .insert(("mesh".into(), name.to_string()), inc);
    }

    async fn adopt_sidecar(&mut self, name: &str) {
        let node = self.node;
        wait_running(node, "side", name).await;
        assert_eq!(witness(node, "side", name), "REDIRECTED", "sidecar {name}");
        self.sidecars.push(name.to_string());
        let inc = incarnation(node, "side", name).await;
        self.incarnations
            .insert(("side".into(), name.to_string()), inc);
    }

    /// Every pod enrolled before is still enrolled, redirected and known to the peer, and was
    /// not restarted; no probe escaped so far.
    async fn check_pods(&self, after: &str) {
        let node = self.node;
        let peer = peer_workloads(node);
        for (name, uid) in &self.ambient {
            let p = get(node, "mesh", name).await.unwrap();
            assert_eq!(
                annotation(&p, REDIRECTION).as_deref(),
                Some("enabled"),
                "{name} after {after}"
            );
            assert!(peer.contains_key(uid), "the peer lost {name} after {after}");
        }
        for name in &self.sidecars {
            assert!(
                redirected_now(node, "side", name),
                "sidecar {name} unredirected after {after}"
            );
        }
        for ((ns, name), was) in &self.incarnations {
            assert_eq!(
                &incarnation(node, ns, name).await,
                was,
                "{ns}/{name} was restarted during {after}"
            );
        }
        let total = self.prober.total();
        assert_eq!(
            total.escaped,
            0,
            "connections escaped redirection by {after}: {:#?}",
            self.prober.results()
        );
        assert_eq!(
            total.failed,
            0,
            "probes failed by {after}: {:#?}",
            self.prober.results()
        );
    }
}

/// `helm upgrade` of the release to `istio`'s chart or ours with `extra`, on every node, while
/// pods are created in the ambient namespace; `restart` adds `kubectl rollout restart` (a
/// change the DaemonSet's template does not show). Checks every node afterwards and returns a row
/// per node.
async fn switch(
    nodes: &mut [NodeUnderTest<'_>],
    label: &str,
    istio: bool,
    extra: &[&str],
    restart: bool,
) -> Vec<Row> {
    let node = nodes[0].node;
    let before: Vec<Probed> = nodes.iter().map(|n| n.prober.total()).collect();
    let watches: Vec<SocketWatch> = nodes.iter().map(|n| SocketWatch::start(n.node)).collect();
    let done = Arc::new(AtomicBool::new(false));
    let prefix = label.to_string();
    let gateway = nodes[0].gateway;
    let creator = tokio::spawn(create_during(
        node.client(),
        "mesh".into(),
        CREATE_EVERY,
        done.clone(),
        move |i| witness_pod_to(&format!("{prefix}-{i}"), gateway),
    ));
    let started = Instant::now();
    helm_cni_run(node, "upgrade", istio, extra);
    if restart {
        node.kubectl(&[
            "-n",
            "istio-system",
            "rollout",
            "restart",
            "ds/istio-cni-node",
        ]);
    }
    node.rollout("istio-cni-node").await;
    let want = if istio { ISTIO_IMAGE } else { OURS_IMAGE };
    for n in nodes.iter() {
        let state = agent_state(n.node);
        assert_eq!(state.image, want, "{label}: {state:?}");
    }
    // A little after the rollout: pods created right after the new agent came up, too.
    tokio::time::sleep(Duration::from_secs(2)).await;
    done.store(true, Ordering::Relaxed);
    let created: Vec<Created> = creator.await.unwrap();
    let took = started.elapsed();
    let served: Vec<_> = watches.into_iter().map(SocketWatch::stop).collect();

    let agent = if istio { "Istio's agent" } else { "our agent" };
    let mut rows = Vec::new();
    for (i, n) in nodes.iter_mut().enumerate() {
        // The pods are created on the first node (one node so far; a second node's pods would
        // be created through its own creator).
        if i == 0 {
            for c in &created {
                n.adopt_ambient(&c.name, &c.uid, agent).await;
            }
        }
        n.check_pods(label).await;
        let now = n.prober.total();
        let waits: Vec<Duration> = created.iter().map(|c| c.waited).collect();
        rows.push(Row {
            switch: label.to_string(),
            node: i,
            gap: served[i].longest_gap,
            created: created.len(),
            waited_min: waits.iter().copied().min().unwrap_or_default(),
            waited_max: waits.iter().copied().max().unwrap_or_default(),
            probes: now.probes - before[i].probes,
            escaped: now.escaped - before[i].escaped,
            failed: now.failed - before[i].failed,
        });
        eprintln!(
            "{label} on node {i}: {took:?}; no agent served ADDs for {:?} (total {:?}, {} agents seen, {} samples); created {} pods, sandboxes waited {:?}",
            served[i].longest_gap,
            served[i].total_gap,
            served[i].agents,
            served[i].samples,
            created.len(),
            waits
        );
    }
    rows
}

/// [`witness_pod`] whose witness targets `gateway`.
fn witness_pod_to(name: &str, gateway: &str) -> serde_json::Value {
    if gateway == GATEWAY {
        return witness_pod(name, "sleep 3600");
    }
    let script = format!(
        "{}; sleep 3600",
        testbed::real_node::witness_script(gateway)
    );
    testbed::real_node::busybox_pod(name, &["sh", "-c", &script])
}

/// The node's netns, as the machine sees it.
fn node_netns(node: &RealNode) -> std::path::PathBuf {
    format!("/proc/{}/ns/net", node.holder_pid()).into()
}

/// What of either agent is on the node besides the pods: host chains (both iptables variants),
/// nftables tables, ipsets, policy routing rules, and files.
fn host_state(node: &RealNode) -> BTreeMap<&'static str, String> {
    let ns = node_netns(node);
    let rules = node_rules(node);
    let istio_lines = |s: &str| {
        s.lines()
            .filter(|l| l.contains("ISTIO") || l.contains("istio"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut out = BTreeMap::new();
    out.insert("iptables-nft", istio_lines(&rules.nft));
    out.insert("iptables-legacy", istio_lines(&rules.legacy));
    out.insert(
        "nft tables",
        istio_lines(&netns_exec(&ns, "nft", &["list", "tables"])),
    );
    out.insert(
        "ipsets",
        istio_lines(&netns_exec(&ns, "ipset", &["list", "-n"])),
    );
    out.insert("ip rules", netns_exec(&ns, "ip", &["rule", "list"]));
    out.insert(
        "ip rules v6",
        netns_exec(&ns, "ip", &["-6", "rule", "list"]),
    );
    out.insert(
        "route table 100",
        netns_exec(&ns, "ip", &["route", "show", "table", "all"])
            .lines()
            .filter(|l| l.contains("table 100"))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    out.insert("/etc/cni/net.d", ls(node, "/etc/cni/net.d"));
    out.insert("/opt/cni/bin/istio-cni", ls(node, "/opt/cni/bin/istio-cni"));
    // Istio's plugin writes every record into istio-cni.log there and Istio's uninstall leaves
    // it; it is Istio's file (ours writes it only with records the agent could not take, and
    // never without Istio having written it first here), so it is not counted.
    out.insert(
        "/run/istio-cni",
        ls(node, "/run/istio-cni")
            .lines()
            .filter(|l| *l != "istio-cni.log")
            .collect::<Vec<_>>()
            .join("\n"),
    );
    out
}

fn ls(node: &RealNode, path: &str) -> String {
    let out = node.try_script(&["exec", "ls", "-A", path]);
    if out.status.success() {
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    } else {
        String::new()
    }
}

/// What is in a pod's network namespace of either agent: iptables `ISTIO_*` chains and rules in
/// either variant, our nftables tables, policy rules and routes beyond the main table.
fn pod_state(node: &RealNode, uid: &str) -> String {
    let netns = node.pod_netns(uid).expect("the pod's netns");
    let rules = pod_rules(node, uid);
    let mut s = String::new();
    for l in rules.nft.lines().chain(rules.legacy.lines()) {
        if l.contains("ISTIO") {
            s += l;
            s.push('\n');
        }
    }
    // iptables-nft's own tables (`ip nat`, ...) stay once created, empty: only ours count.
    for l in netns_exec(&netns, "nft", &["list", "tables"]).lines() {
        if l.contains("istio") {
            s += l;
            s.push('\n');
        }
    }
    for l in netns_exec(&netns, "ip", &["rule", "list"]).lines() {
        if ![
            "from all lookup local",
            "from all lookup main",
            "from all lookup default",
        ]
        .iter()
        .any(|d| l.ends_with(d))
        {
            s += l;
            s.push('\n');
        }
    }
    s += &netns_exec(&netns, "ip", &["route", "show", "table", "100"]);
    s
}

/// Whether pod `uid` holds iptables redirect rules (either variant), and our nftables tables.
fn backends_in_pod(node: &RealNode, uid: &str) -> (bool, bool) {
    let rules = pod_rules(node, uid);
    let tables = netns_exec(&node.pod_netns(uid).unwrap(), "nft", &["list", "tables"]);
    (
        rules.nft.contains("ISTIO_OUTPUT") || rules.legacy.contains("ISTIO_OUTPUT"),
        tables.contains("istio-ambient"),
    )
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

async fn migration(ours: Backend) -> Vec<Row> {
    let node = RealNode::up().await;
    let nodes_list = [&node];
    let start_conflist = node.read(CONFLIST).expect("the node's conflist");
    let start_host: Vec<_> = nodes_list.iter().map(|n| host_state(n)).collect();

    // Istio's agent, from Istio's chart, with ambient and sidecar pods it enrolled.
    helm_cni(&node, "install", true).await;
    install_peer(&node).await;
    assert_eq!(agent_state(&node).image, ISTIO_IMAGE);
    let istio_conflist = node.read(CONFLIST).unwrap();
    node.namespace("mesh", true).await;
    node.namespace("side", false).await;
    let mut nodes = Vec::new();
    for node in nodes_list {
        let gateway = GATEWAY;
        let mut uids = Vec::new();
        for i in 0..3 {
            let name = format!("istio-{i}");
            uids.push((
                name.clone(),
                create(node, "mesh", witness_pod_to(&name, gateway)).await,
            ));
        }
        create(node, "side", sidecar_pod("sidecar-0", gateway)).await;
        // The bridge, and with it the gateway address the witness listens on, comes with the
        // node's first pod.
        wait_running(node, "mesh", "istio-0").await;
        let mut n = NodeUnderTest::new(node, gateway).await;
        for (name, uid) in uids {
            n.adopt_ambient(&name, &uid, "Istio's agent").await;
        }
        n.adopt_sidecar("sidecar-0").await;
        nodes.push(n);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for n in &nodes {
        let t = n.prober.total();
        assert!(t.redirected > 0, "the prober does not run: {t:?}");
        n.check_pods("Istio's install").await;
    }

    // To ours, as docs/migrate-from-istio.md says: the same release, our chart.
    let mut rows = Vec::new();
    let backend_set = match ours {
        Backend::Nftables => "global.nativeNftables=true",
        Backend::Iptables => "global.nativeNftables=false",
    };
    let to_ours = format!("istio-to-ours-{}", format!("{ours:?}").to_lowercase());
    rows.extend(switch(&mut nodes, &to_ours, false, &["--set", backend_set], false).await);
    for n in &nodes {
        let out = n.node.kubectl(&[
            "-n",
            "istio-system",
            "exec",
            "ds/istio-cni-node",
            "--",
            "install-cni",
            "explain",
            "mesh/istio-0",
        ]);
        assert!(out.contains("meshed:      yes"), "{out}");
        // Our agent moved every pod Istio's agent enrolled to the backend it uses.
        for (name, uid) in &n.ambient {
            n.node
                .eventually(
                    &format!("{name} redirected by our {ours:?} backend alone"),
                    Duration::from_secs(60),
                    || async {
                        let (ipt, nft) = backends_in_pod(n.node, uid);
                        ((ipt, nft) == (ours == Backend::Iptables, ours == Backend::Nftables))
                            .then_some(())
                    },
                )
                .await;
        }
    }

    // And back. Istio's agent knows only iptables: from our nftables backend, to our iptables
    // backend first (a ConfigMap value: the DaemonSet needs a restart to see it).
    if ours == Backend::Nftables {
        rows.extend(
            switch(
                &mut nodes,
                "ours-nftables-to-iptables",
                false,
                &["--set", "global.nativeNftables=false"],
                true,
            )
            .await,
        );
    }
    // Istio's agent on its second start here would pick iptables-legacy: pinned to the node's.
    rows.extend(
        switch(
            &mut nodes,
            "ours-iptables-to-istio",
            true,
            &["--set", "env.FORCE_IPTABLES_BINARY=nft"],
            false,
        )
        .await,
    );
    for n in &nodes {
        assert_eq!(
            n.node.read(CONFLIST).unwrap(),
            istio_conflist,
            "Istio's CNI config after the round trip"
        );
        // Istio's agent adopted every pod: each has Istio's rules, in the node's variant only,
        // and nothing of our nftables backend.
        for (name, uid) in &n.ambient {
            assert_eq!(backends_in_pod(n.node, uid), (true, false), "{name}");
            let rules = pod_rules(n.node, uid);
            assert!(rules.nft.contains("ISTIO_OUTPUT"), "{name}: {}", rules.nft);
            assert!(!rules.legacy.contains("ISTIO"), "{name}: {}", rules.legacy);
        }
        let host = node_rules(n.node);
        assert!(!host.legacy.contains("ISTIO"), "{}", host.legacy);
    }
    let results: Vec<BTreeMap<String, Probed>> =
        nodes.into_iter().map(|n| n.prober.stop()).collect();
    eprintln!("probes per pod: {results:#?}");

    // Out of the mesh: Istio's agent takes its rules out of every pod, ours included.
    label_namespace(&node, "mesh", false).await;
    let pods = results[0].keys().cloned().collect::<Vec<_>>();
    for name in &pods {
        wait_redirection(&node, "mesh", name, None).await;
    }
    for name in &pods {
        let uid = get(&node, "mesh", name)
            .await
            .unwrap()
            .metadata
            .uid
            .unwrap();
        wait_peer_has(&node, &uid, false).await;
        let left = pod_state(&node, &uid);
        assert!(
            left.trim().is_empty(),
            "{name} out of the mesh still has:\n{left}"
        );
    }
    // The final uninstall.
    for ns in ["mesh", "side"] {
        node.kubectl(&["-n", ns, "delete", "pods", "--all", "--wait=true"]);
    }
    node.helm(&["uninstall", "istio-cni", "-n", "istio-system", "--wait"]);
    node.eventually("the agent's pod gone", Duration::from_secs(60), || async {
        let pods = node.kubectl(&[
            "-n",
            "istio-system",
            "get",
            "pods",
            "-l",
            "k8s-app=istio-cni-node",
            "-o",
            "name",
        ]);
        pods.trim().is_empty().then_some(())
    })
    .await;
    let end_conflist = node.read(CONFLIST).unwrap();
    assert_eq!(
        json(&end_conflist),
        json(&start_conflist),
        "the CNI config after the final uninstall"
    );
    for (n, before) in nodes_list.iter().zip(&start_host) {
        assert_eq!(
            &host_state(n),
            before,
            "left on the node after the final uninstall"
        );
    }
    rows
}

fn print_rows(backend: Backend, rows: &[Row]) {
    eprintln!("\nmigration, our {backend:?} backend:");
    eprintln!(
        "| switch | node | gap (s) | pods created | sandbox wait (s) | probes | escaped | failed |"
    );
    eprintln!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        eprintln!(
            "| {} | {} | {} | {} | {}–{} | {} | {} | {} |",
            r.switch,
            r.node,
            secs(r.gap),
            r.created,
            secs(r.waited_min),
            secs(r.waited_max),
            r.probes,
            r.escaped,
            r.failed
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_to_ours_with_nftables_and_back_under_a_100ms_prober() {
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let t0 = Instant::now();
    let rows = migration(Backend::Nftables).await;
    print_rows(Backend::Nftables, &rows);
    eprintln!("took {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_to_ours_with_iptables_and_back_under_a_100ms_prober() {
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let t0 = Instant::now();
    let rows = migration(Backend::Iptables).await;
    print_rows(Backend::Iptables, &rows);
    eprintln!("took {:?}", t0.elapsed());
}
