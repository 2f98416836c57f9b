//! The migration of docs/migrate-from-istio.md on the real node, under a 100 ms prober (issue
//! #22): Istio's own chart and agent first (`localhost/istio/install-cni:dev-distroless`, built
//! from the pin), with ambient and sidecar pods running and enrolled; then `helm upgrade` of the
//! same release to our chart, with either of our backends, while pods are being created; then
//! back to Istio's chart the same way; then a final uninstall.
//!
//! Our nftables backend runs on two nodes, node by node (docs/migrate-from-istio.md, "A
//! half-migrated cluster"): both charts with `updateStrategy: OnDelete`, each `helm upgrade`
//! replacing no agent, then node 1's agent pod deleted while pods are created on node 1, the
//! cluster mixed, then node 2's the same way. Our iptables backend runs on one node with the
//! DaemonSet's rolling update (both backends on two nodes would double the file's time).
//!
//! Throughout, every ambient pod probes a witness on its node every 100 ms from inside its
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
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use testbed::migrate::{
    ISTIO_IMAGE, ON_DELETE, agent_pod, agent_pod_image, agent_pods, get_agent_pods, helm_cni_run,
    helm_cni_with, host_state, install_peer, netns_exec, node_rules, peer_workloads, pod_rules,
    redirected_now, replace_agent_pod, wait_peer_has,
};
use testbed::real_node::{
    CONFLIST, GATEWAY, Node, REDIRECTION, RealNode, annotation, create, get, label_namespace,
    on_node, sidecar_pod, wait_redirection, wait_running, witness, witness_pod,
};
use testbed::switch::{
    Created, Incarnation, NoSandbox, Probed, Prober, SocketWatch, Witness, agent_state,
    create_during, incarnation,
};

/// One cluster at a time: a node is several hundred MB of processes and most of a core to start.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const OURS_IMAGE: &str = "localhost/istio-cni-rs/install-cni:dev";
/// The witness's port on each node's gateway (the pods' own witness uses the closed port 9).
const WITNESS_PORT: u16 = 19;
/// How often a pod is created while a switch runs.
const CREATE_EVERY: Duration = Duration::from_secs(1);

const ISTIO_AGENT: &str = "Istio's agent";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Nftables,
    Iptables,
}

/// How a switch reaches the nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum How {
    /// The DaemonSet's rolling update, every node at once (one node here).
    Rolling,
    /// `updateStrategy: OnDelete` ([`ON_DELETE`] on every helm call): the `helm upgrade`
    /// replaces no agent; then each node's agent pod is deleted in turn, and the cluster runs
    /// both agents in between (docs/migrate-from-istio.md, "A half-migrated cluster").
    NodeByNode,
}

/// One node of the cluster, with what the test keeps about it.
struct NodeUnderTest<'a> {
    node: Node<'a>,
    /// The node's bridge address, which its pods' witnesses and the prober's witness use.
    gateway: String,
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
    /// Whether this node's agent was replaced in this step (the other nodes' keep serving).
    replaced: bool,
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

/// Node `node`'s bridge address: 10.244.(K-1).1, the first address of its pod CIDR.
fn gateway_of(node: Node<'_>) -> String {
    format!("10.244.{}.1", node.index() - 1)
}

impl<'a> NodeUnderTest<'a> {
    async fn new(node: Node<'a>) -> Self {
        let gateway = gateway_of(node);
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

    /// An ambient pod (its witness printed `REDIRECTED`, annotated, known to the node's peer),
    /// probed from now on.
    async fn adopt_ambient(&mut self, name: &str, uid: &str, agent: &str) {
        let (node, c) = (self.node, self.node.cluster());
        let pod = wait_running(c, "mesh", name).await;
        assert_eq!(
            pod.spec.as_ref().unwrap().node_name,
            Some(node.name()),
            "{name} not on its node"
        );
        wait_redirection(c, "mesh", name, Some("enabled")).await;
        assert_eq!(
            witness(c, "mesh", name),
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

    /// Every ambient pod is redirected by our `backend` alone (within 60 s of the switch
    /// `after`); otherwise the agent's log tells what it did.
    async fn redirected_by_one_backend(&self, backend: Backend, after: &str) {
        let want = (backend == Backend::Iptables, backend == Backend::Nftables);
        let deadline = Instant::now() + Duration::from_secs(60);
        for (name, uid) in &self.ambient {
            loop {
                let found = backends_in_pod(self.node, uid);
                if found == want {
                    break;
                }
                if Instant::now() > deadline {
                    let log = self.node.cluster().try_script(&[
                        "kubectl",
                        "-n",
                        "istio-system",
                        "logs",
                        &agent_pod(self.node),
                    ]);
                    panic!(
                        "{after}: {name} on {} has (iptables, nftables) = {found:?}, not only our {backend:?} backend; its agent's log:\n{}",
                        self.node.name(),
                        String::from_utf8_lossy(&log.stdout)
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }

    async fn adopt_sidecar(&mut self, name: &str) {
        let (node, c) = (self.node, self.node.cluster());
        wait_running(c, "side", name).await;
        assert_eq!(witness(c, "side", name), "REDIRECTED", "sidecar {name}");
        self.sidecars.push(name.to_string());
        let inc = incarnation(node, "side", name).await;
        self.incarnations
            .insert(("side".into(), name.to_string()), inc);
    }

    /// Every pod enrolled before is still enrolled, redirected and known to the node's peer,
    /// and was not restarted; no probe escaped so far.
    async fn check_pods(&self, after: &str) {
        let (node, c) = (self.node, self.node.cluster());
        let peer = peer_workloads(node);
        for (name, uid) in &self.ambient {
            let p = get(c, "mesh", name).await.unwrap();
            assert_eq!(
                annotation(&p, REDIRECTION).as_deref(),
                Some("enabled"),
                "{name} after {after}"
            );
            assert!(
                peer.contains_key(uid),
                "the peer on {} lost {name} after {after}",
                node.name()
            );
        }
        for name in &self.sidecars {
            assert!(
                redirected_now(c, "side", name),
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
            "connections escaped redirection on {} by {after}: {:#?}",
            node.name(),
            self.prober.results()
        );
        assert_eq!(
            total.failed,
            0,
            "probes failed on {} by {after}: {:#?}",
            node.name(),
            self.prober.results()
        );
    }
}

/// `helm upgrade` of the release to `istio`'s chart or ours with `extra`, then the agents
/// replaced `how`, while pods are created on the node being switched; `restart` adds `kubectl
/// rollout restart` to a rolling switch (a change the DaemonSet's template does not show; node by
/// node, deleting the pod is the restart). Checks every node after each step and returns a row
/// per node and step.
async fn switch(
    nodes: &mut [NodeUnderTest<'_>],
    label: &str,
    istio: bool,
    extra: &[&str],
    restart: bool,
    how: How,
) -> Vec<Row> {
    let c = nodes[0].node.cluster();
    let want = if istio { ISTIO_IMAGE } else { OURS_IMAGE };
    let agent = if istio { ISTIO_AGENT } else { "our agent" };
    match how {
        How::Rolling => {
            let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
            let rows = step(nodes, label, 0, agent, async move {
                let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
                helm_cni_run(c, "upgrade", istio, &extra);
                if restart {
                    c.kubectl(&[
                        "-n",
                        "istio-system",
                        "rollout",
                        "restart",
                        "ds/istio-cni-node",
                    ]);
                }
                c.rollout("istio-cni-node").await;
            })
            .await;
            let state = agent_state(c);
            assert_eq!(state.image, want, "{label}: {state:?}");
            rows
        }
        How::NodeByNode => {
            let mut extra = extra.to_vec();
            extra.extend_from_slice(ON_DELETE);
            let agents: Vec<String> = nodes.iter().map(|n| agent_pod(n.node)).collect();
            helm_cni_run(c, "upgrade", istio, &extra);
            assert_eq!(agent_state(c).image, want, "{label}");
            let mut rows = Vec::new();
            for i in 0..nodes.len() {
                let node = nodes[i].node;
                let step_label = format!("{label}-n{}", node.index());
                rows.extend(
                    step(nodes, &step_label, i, agent, async move {
                        replace_agent_pod(node).await
                    })
                    .await,
                );
                assert_eq!(agent_pod_image(node), want, "{step_label}");
                // A mixed cluster: the nodes after this one still run the agent they had.
                for (n, was) in nodes.iter().zip(&agents).skip(i + 1) {
                    assert_eq!(
                        &agent_pod(n.node),
                        was,
                        "{step_label}: {}'s agent was replaced too",
                        n.node.name()
                    );
                }
            }
            rows
        }
    }
}

/// One step of a switch: `switching` runs while a pod is created on node `on` every
/// [`CREATE_EVERY`] (until 2 s after it is done) and every node's plugin socket is watched; then
/// node `on` adopts the pods created, and every node's pods are checked.
async fn step(
    nodes: &mut [NodeUnderTest<'_>],
    label: &str,
    on: usize,
    agent: &str,
    switching: impl Future<Output = ()>,
) -> Vec<Row> {
    let node = nodes[on].node;
    let before: Vec<Probed> = nodes.iter().map(|n| n.prober.total()).collect();
    let watches: Vec<SocketWatch> = nodes.iter().map(|n| SocketWatch::start(n.node)).collect();
    let done = Arc::new(AtomicBool::new(false));
    let (prefix, gateway, name) = (label.to_string(), nodes[on].gateway.clone(), node.name());
    // Istio's agent takes over slowly on these 2 cores: at its start it re-applies every enrolled
    // pod's iptables rules (iptables-restore execs) while the pods created meanwhile retry their
    // sandboxes, 10-15 s apart, and its plugin gives up on an ADD after 5 s. Seen on a busy
    // machine: 20 pods still without a sandbox after 120 s.
    let sandbox_wait = Duration::from_secs(if agent == ISTIO_AGENT { 300 } else { 120 });
    let creator = tokio::spawn(create_during(
        node.cluster().client(),
        "mesh".into(),
        CREATE_EVERY,
        sandbox_wait,
        done.clone(),
        move |i| on_node(witness_pod_to(&format!("{prefix}-{i}"), &gateway), &name),
    ));
    let started = Instant::now();
    switching.await;
    // A little after the switch: pods created right after the new agent came up, too.
    tokio::time::sleep(Duration::from_secs(2)).await;
    done.store(true, Ordering::Relaxed);
    let (created, missing): (Vec<_>, Vec<_>) =
        creator.await.unwrap().into_iter().partition(Result::is_ok);
    let created: Vec<Created> = created.into_iter().map(Result::unwrap).collect();
    if !missing.is_empty() {
        let missing: Vec<NoSandbox> = missing.into_iter().map(|m| m.unwrap_err()).collect();
        // Which agent turned the ADDs away, and why.
        let log =
            node.cluster()
                .try_script(&["kubectl", "-n", "istio-system", "logs", &agent_pod(node)]);
        let log = String::from_utf8_lossy(&log.stdout);
        if agent == ISTIO_AGENT && missing.iter().all(|m| refused_for_lo_down(&log, &m.name)) {
            // Istio's agent adds the pod's IPv6 local route before containerd's loopback plugin,
            // run in parallel with the chain, has set lo up: the kernel refuses it and the ADD
            // fails (ours sets lo up first: ARCHITECTURE.md). On a busy node every retry of the
            // sandbox can lose that race; such a pod is Istio's bug, not a failed handover.
            for m in &missing {
                eprintln!(
                    "{label}: {} refused by Istio's agent at every attempt for {:?} (lo still down); left out",
                    m.name, sandbox_wait
                );
                node.cluster()
                    .kubectl(&["-n", "mesh", "delete", "pod", &m.name, "--wait=false"]);
            }
        } else {
            let tail: Vec<&str> = log.lines().rev().take(200).collect();
            panic!(
                "{label}: pods on {} without a sandbox after {:?}: {missing:?}; its agent's log:\n{}\n{}",
                node.name(),
                sandbox_wait,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
                node.log_tails(&["kubelet", "containerd"])
            );
        }
    }
    let took = started.elapsed();
    let served: Vec<_> = watches.into_iter().map(SocketWatch::stop).collect();
    // A new agent that crashed before it served shows here (pods then wait for its backoff).
    let restarts = get_agent_pods(
        node.cluster(),
        Some(&node.name()),
        "jsonpath={range .items[*]}{.metadata.name}: {.status.containerStatuses[0].restartCount} restarts; {end}",
    );
    eprintln!(
        "{label}: agent pods on {}: {}",
        node.name(),
        String::from_utf8_lossy(&restarts.stdout)
    );

    for c in &created {
        nodes[on].adopt_ambient(&c.name, &c.uid, agent).await;
    }
    let mut rows = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        n.check_pods(label).await;
        let now = n.prober.total();
        let waits: Vec<Duration> = if i == on {
            created.iter().map(|c| c.waited).collect()
        } else {
            Vec::new()
        };
        rows.push(Row {
            switch: label.to_string(),
            node: n.node.index(),
            replaced: i == on || nodes.len() == 1,
            gap: served[i].longest_gap,
            created: waits.len(),
            waited_min: waits.iter().copied().min().unwrap_or_default(),
            waited_max: waits.iter().copied().max().unwrap_or_default(),
            probes: now.probes - before[i].probes,
            escaped: now.escaped - before[i].escaped,
            failed: now.failed - before[i].failed,
        });
        eprintln!(
            "{label} on {}: {took:?}; no agent served ADDs for {:?} (total {:?}, {} agents seen, {} samples); created {} pods, sandboxes waited {:?}",
            n.node.name(),
            served[i].longest_gap,
            served[i].total_gap,
            served[i].agents,
            served[i].samples,
            waits.len(),
            waits
        );
    }
    rows
}

/// Whether Istio's agent `log` shows it refused pod `name`'s ADD because the pod's `lo` was
/// still down (its IPv6 local route: "network is down").
fn refused_for_lo_down(log: &str, name: &str) -> bool {
    let field = format!("name={name}");
    log.lines().any(|l| {
        l.contains("failed to add route")
            && l.contains("network is down")
            && l.split_whitespace().any(|w| w == field)
    })
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

/// What is in a pod's network namespace of either agent: iptables `ISTIO_*` chains and rules in
/// either variant, our nftables tables, policy rules and routes beyond the main table.
fn pod_state(node: Node<'_>, uid: &str) -> String {
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
fn backends_in_pod(node: Node<'_>, uid: &str) -> (bool, bool) {
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

/// The migration on a cluster of `nodes` nodes, switched `how`.
async fn migration(ours: Backend, nodes: usize, how: How) -> Vec<Row> {
    let c = RealNode::up_nodes(nodes).await;
    let nodes_list = c.nodes();
    let start_conflist: Vec<String> = nodes_list
        .iter()
        .map(|n| n.read(CONFLIST).expect("the node's conflist"))
        .collect();
    let start_host: Vec<_> = nodes_list.iter().map(|n| host_state(*n)).collect();
    let on_delete: &[&str] = match how {
        How::Rolling => &[],
        How::NodeByNode => ON_DELETE,
    };

    // Istio's agent, from Istio's chart, with ambient and sidecar pods it enrolled on each node.
    helm_cni_with(&c, "install", true, on_delete).await;
    install_peer(&c).await;
    for n in &nodes_list {
        assert_eq!(agent_pod_image(*n), ISTIO_IMAGE, "{}", n.name());
    }
    let istio_conflist: Vec<String> = nodes_list
        .iter()
        .map(|n| n.read(CONFLIST).unwrap())
        .collect();
    c.namespace("mesh", true).await;
    c.namespace("side", false).await;
    let mut nodes = Vec::new();
    for node in nodes_list.iter().copied() {
        let (k, gateway) = (node.index(), gateway_of(node));
        let mut uids = Vec::new();
        for i in 0..3 {
            let name = format!("istio-{k}-{i}");
            let pod = on_node(witness_pod_to(&name, &gateway), &node.name());
            uids.push((name, create(&c, "mesh", pod).await));
        }
        let sidecar = format!("sidecar-{k}");
        let pod = on_node(sidecar_pod(&sidecar, &gateway), &node.name());
        create(&c, "side", pod).await;
        // The bridge, and with it the gateway address the witness listens on, comes with the
        // node's first pod.
        wait_running(&c, "mesh", &uids[0].0).await;
        let mut n = NodeUnderTest::new(node).await;
        for (name, uid) in uids {
            n.adopt_ambient(&name, &uid, ISTIO_AGENT).await;
        }
        n.adopt_sidecar(&sidecar).await;
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
    rows.extend(
        switch(
            &mut nodes,
            &to_ours,
            false,
            &["--set", backend_set],
            false,
            how,
        )
        .await,
    );
    for n in &nodes {
        let first = n.ambient.keys().next().unwrap();
        let out = c.kubectl(&[
            "-n",
            "istio-system",
            "exec",
            &agent_pod(n.node),
            "--",
            "install-cni",
            "explain",
            &format!("mesh/{first}"),
        ]);
        assert!(out.contains("meshed:      yes"), "{out}");
        // Our agent moved every pod Istio's agent enrolled to the backend it uses.
        n.redirected_by_one_backend(ours, &to_ours).await;
    }

    // And back. Istio's agent knows only iptables: from our nftables backend, to our iptables
    // backend first (a ConfigMap value: a rolling DaemonSet needs a restart to see it).
    if ours == Backend::Nftables {
        rows.extend(
            switch(
                &mut nodes,
                "ours-nftables-to-iptables",
                false,
                &["--set", "global.nativeNftables=false"],
                true,
                how,
            )
            .await,
        );
        // Pods the nftables agent enrolled in its last moments too: the iptables agent that
        // replaced it waits for its exit to check them again.
        for n in &nodes {
            n.redirected_by_one_backend(Backend::Iptables, "ours-nftables-to-iptables")
                .await;
        }
    }
    // Istio's agent on its second start here would pick iptables-legacy: pinned to the node's.
    rows.extend(
        switch(
            &mut nodes,
            "ours-iptables-to-istio",
            true,
            &["--set", "env.FORCE_IPTABLES_BINARY=nft"],
            false,
            how,
        )
        .await,
    );
    for (n, istio_conflist) in nodes.iter().zip(&istio_conflist) {
        assert_eq!(
            &n.node.read(CONFLIST).unwrap(),
            istio_conflist,
            "Istio's CNI config on {} after the round trip",
            n.node.name()
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
    let mut results: Vec<(Node<'_>, BTreeMap<String, Probed>)> = Vec::new();
    for n in nodes {
        let (node, ambient) = (n.node, n.ambient.clone());
        let probed = n.prober.stop();
        assert_eq!(probed.len(), ambient.len());
        results.push((node, probed));
    }
    eprintln!(
        "probes per pod: {results:#?}",
        results = results
            .iter()
            .map(|(n, r)| (n.name(), r))
            .collect::<Vec<_>>()
    );

    // Out of the mesh: Istio's agent takes its rules out of every pod, ours included.
    label_namespace(&c, "mesh", false).await;
    for (_, probed) in &results {
        for name in probed.keys() {
            wait_redirection(&c, "mesh", name, None).await;
        }
    }
    for (node, probed) in &results {
        for name in probed.keys() {
            let uid = get(&c, "mesh", name).await.unwrap().metadata.uid.unwrap();
            wait_peer_has(*node, &uid, false).await;
            // Istio's agent may take the annotation and ztunnel's entry out before the rules
            // (seen once: the rules were still there right after both had gone).
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            let left = loop {
                let left = pod_state(*node, &uid);
                if left.trim().is_empty() || std::time::Instant::now() > deadline {
                    break left;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            assert!(
                left.trim().is_empty(),
                "{name} out of the mesh still has, 30 s after its annotation went:\n{left}"
            );
        }
    }
    // The final uninstall.
    for ns in ["mesh", "side"] {
        c.kubectl(&["-n", ns, "delete", "pods", "--all", "--wait=true"]);
    }
    c.helm(&["uninstall", "istio-cni", "-n", "istio-system", "--wait"]);
    c.eventually("the agents' pods gone", Duration::from_secs(60), || async {
        let pods = agent_pods(&c, None, "name");
        pods.trim().is_empty().then_some(())
    })
    .await;
    for ((n, start), before) in nodes_list.iter().zip(&start_conflist).zip(&start_host) {
        let end_conflist = n.read(CONFLIST).unwrap();
        assert_eq!(
            json(&end_conflist),
            json(start),
            "the CNI config on {} after the final uninstall",
            n.name()
        );
        // The iptables variant our agent recorded for Istio's (detected-iptables-backend-v4/-v6,
        // the files Istio's agent keeps from 1.31.1 on) is handed over with the node: after the
        // switch back they are Istio's files, like its istio-cni.log, and Istio's uninstall keeps
        // them. Our own uninstall removes them (the istio_installers suites check it).
        let mut end = host_state(*n);
        if let Some(run) = end.get_mut("/run/istio-cni") {
            *run = run
                .lines()
                .filter(|l| !l.starts_with("detected-iptables-backend-"))
                .collect::<Vec<_>>()
                .join("\n");
        }
        assert_eq!(
            &end,
            before,
            "left on {} after the final uninstall",
            n.name()
        );
    }
    rows
}

fn print_rows(backend: Backend, how: How, rows: &[Row]) {
    eprintln!("\nmigration, our {backend:?} backend, {how:?}:");
    eprintln!(
        "| switch | node | agent replaced | gap (s) | pods created | sandbox wait (s) | probes | escaped | failed |"
    );
    eprintln!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        eprintln!(
            "| {} | {} | {} | {} | {} | {}–{} | {} | {} | {} |",
            r.switch,
            r.node,
            if r.replaced { "yes" } else { "no" },
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

async fn run(backend: Backend, nodes: usize, how: How) {
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let t0 = Instant::now();
    let rows = migration(backend, nodes, how).await;
    print_rows(backend, how, &rows);
    eprintln!("took {:?}", t0.elapsed());
}

/// Two nodes, node by node: the cluster runs Istio's agent on one node and ours on the other
/// between the steps, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_to_ours_with_nftables_and_back_node_by_node_under_a_100ms_prober() {
    dataplane::enter_test_group!();
    run(Backend::Nftables, 2, How::NodeByNode).await;
}

/// One node, the DaemonSet's rolling update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_to_ours_with_iptables_and_back_under_a_100ms_prober() {
    dataplane::enter_test_group!();
    run(Backend::Iptables, 1, How::Rolling).await;
}
