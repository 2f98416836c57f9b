//! The real-node suite: our chart installed with helm onto a real Kubernetes node
//! (`scripts/real-node`: kubelet, containerd, runc, controller-manager, scheduler), the agent and
//! a ztunnel-like peer running as DaemonSet pods, and every pod started by kubelet through
//! containerd → libcni → bridge → `istio-cni` → agent → ZDS.
//!
//! Each pod's first act is the witness: its container connects to a closed port on the node
//! (the bridge gateway). Redirected, the connection lands on a proxy listener in the pod and
//! succeeds (`REDIRECTED`); unredirected it is refused (`DIRECT`). A pod that ever printed
//! `DIRECT` in the mesh started unredirected.
//!
//! Needs root, the node binaries (`tools/k8s-node/build.sh`) and the images
//! (`scripts/node-images`, or `REAL_NODE_IMAGES`). The tests run one node at a time.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};
use testbed::churn::conflist::Rewriter;
use testbed::real_node::{
    CHART, GATEWAY, NODE_NAME, NodeEnv, REDIRECTION, RealNode, VALUES, ZTUNNEL, annotation,
    busybox_pod, create, get, label_namespace, processes_under, running, sidecar_pod,
    wait_redirection, wait_running, witness, witness_pod as pod,
};

/// One node at a time: a node is several hundred MB of processes and most of a core to start.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn repo_path(p: &str) -> String {
    format!("{}/../../{p}", env!("CARGO_MANIFEST_DIR"))
}

async fn namespace(node: &RealNode, name: &str, ambient: bool) {
    node.namespace(name, ambient).await
}

/// The peer's view: pod UID → (state, connections through its listeners).
fn peer_workloads(node: &RealNode) -> BTreeMap<String, (String, u64)> {
    let Some(st) = node.peer_status() else {
        return BTreeMap::new();
    };
    st["workloads"]
        .as_object()
        .map(|w| {
            w.iter()
                .map(|(uid, v)| {
                    (
                        uid.clone(),
                        (
                            v["state"].as_str().unwrap_or_default().to_string(),
                            v["connections"].as_u64().unwrap_or_default(),
                        ),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn wait_peer_has(node: &RealNode, uid: &str, present: bool) {
    node.eventually(
        &format!("peer has {uid}: {present}"),
        Duration::from_secs(60),
        || async { (peer_workloads(node).contains_key(uid) == present).then_some(()) },
    )
    .await
}

/// Pod network namespaces on the node, pinned under its own /run/netns (containerd's `cni-<id>`,
/// CRI-O's `<id>`). CRI-O pins the node's own namespace there too, for each host-network pod:
/// those are not counted.
fn netns_count(node: &RealNode) -> usize {
    let script = "host=$(stat -L -c %i /proc/1/ns/net); \
                  for f in /run/netns/*; do \
                    [ -e \"$f\" ] && [ \"$(stat -L -c %i \"$f\")\" != \"$host\" ] && echo \"$f\"; \
                  done; true";
    let out = node.script(&["exec", "sh", "-c", script]);
    out.lines().count()
}

/// A sidecar pod whose `istio-validation` init container checks its redirection as Istio's does
/// (its own listener on 15001, then a connection to a closed port on the gateway) and exits 126
/// when unredirected: created before the agent, it crash-loops until repair fixes it.
fn raced_sidecar_pod(name: &str) -> Value {
    let validation = format!(
        "nc -ll -p 15001 -e true & sleep 0.3; \
         if nc -w 2 {GATEWAY} 9 </dev/null; then echo REDIRECTED; else echo DIRECT; exit 126; fi"
    );
    let mut p = sidecar_pod(name, GATEWAY);
    p["spec"]["initContainers"] = json!([{
        "name": "istio-validation",
        "image": "localhost/istio-cni-rs/busybox:dev",
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", validation]
    }]);
    p
}

/// The node's container runtime (`REAL_NODE_RUNTIME` of `scripts/real-node env`).
fn runtime(node: &RealNode) -> String {
    let env = node.script(&["env"]);
    env.lines()
        .find_map(|l| l.strip_prefix("REAL_NODE_RUNTIME="))
        .unwrap_or_else(|| panic!("scripts/real-node env names no REAL_NODE_RUNTIME:\n{env}"))
        .to_string()
}

/// How many of the node's processes are in the pod namespace pinned under /run/netns that holds
/// `ip`; `None` unless exactly one pinned namespace holds it.
fn processes_in_pinned_netns(node: &RealNode, ip: &str) -> Option<usize> {
    let script = format!(
        "for f in /run/netns/*; do \
           nsenter --net=\"$f\" ip -o -4 addr show | grep -q ' {ip}/' || continue; \
           ino=$(stat -L -c %i \"$f\"); n=0; \
           for p in /proc/[0-9]*; do \
             [ \"$(stat -L -c %i $p/ns/net 2>/dev/null)\" = \"$ino\" ] && n=$((n + 1)); \
           done; echo $n; \
         done"
    );
    let out = node.script(&["exec", "sh", "-c", &script]);
    match out.lines().collect::<Vec<_>>()[..] {
        [n] => n.parse().ok(),
        _ => None,
    }
}

/// The pod's IP once its validation init container has failed with 126 at least once.
async fn wait_validation_failed(node: &RealNode, ns: &str, name: &str) -> String {
    node.eventually(
        &format!("{ns}/{name}'s istio-validation failed"),
        Duration::from_secs(120),
        || async {
            let p = get(node, ns, name).await?;
            let st = p.status?;
            let failed = st.init_container_statuses?.iter().any(|c| {
                c.last_state
                    .as_ref()
                    .and_then(|s| s.terminated.as_ref())
                    .is_some_and(|t| t.exit_code == 126)
            });
            if failed { st.pod_ip } else { None }
        },
    )
    .await
}

async fn delete(node: &RealNode, ns: &str, name: &str) {
    Api::<Pod>::namespaced(node.client(), ns)
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
    node.eventually(
        &format!("{ns}/{name} deleted"),
        Duration::from_secs(60),
        || async { get(node, ns, name).await.is_none().then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambient_and_sidecar_pods_through_kubelet_then_uninstall_restores_the_node() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    // The primary's own file: bridge's by default, another under scripts/matrix's knobs.
    let conflist = node.conflist();
    let before = node.read(&conflist).expect("the node's primary conflist");
    let netns_before = netns_count(&node);
    // A sidecar pod that starts before the agent (no chain entry yet, so unredirected): its
    // validation crash-loops until repair programs its redirection in place. With CRI-O's
    // drop_infra_ctr no pause process holds its namespace between restarts, only the runtime's
    // pin, so a repair that looks in /proc alone cannot find it (istio/istio#60478).
    namespace(&node, "race", false).await;
    let raced = create(&node, "race", raced_sidecar_pod("raced")).await;
    let raced_ip = wait_validation_failed(&node, "race", "raced").await;
    if runtime(&node) == "crio" {
        node.eventually(
            "race/raced's namespace held by its pin alone",
            Duration::from_secs(60),
            || async { (processes_in_pinned_netns(&node, &raced_ip) == Some(0)).then_some(()) },
        )
        .await;
    }
    node.install_chart(&[]).await;
    let chained = node.read(&conflist).unwrap();
    assert!(chained.contains("\"type\": \"istio-cni\""), "{chained}");

    namespace(&node, "mesh", true).await;
    namespace(&node, "plain", false).await;
    let server = create(
        &node,
        "mesh",
        pod(
            "server",
            "mkdir /www; echo hello > /www/index.html; httpd -f -p 8080 -h /www",
        ),
    )
    .await;
    let client = create(&node, "mesh", pod("client", "sleep 3600")).await;
    let plain = create(&node, "plain", pod("plain", "sleep 3600")).await;
    create(&node, "plain", sidecar_pod("sidecar", GATEWAY)).await;
    let server_pod = wait_running(&node, "mesh", "server").await;
    assert_eq!(
        server_pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some(NODE_NAME),
        "scheduled by kube-scheduler onto the node"
    );
    wait_running(&node, "mesh", "client").await;
    wait_running(&node, "plain", "plain").await;
    wait_running(&node, "plain", "sidecar").await;

    for name in ["server", "client"] {
        let p = get(&node, "mesh", name).await.unwrap();
        assert_eq!(annotation(&p, REDIRECTION).as_deref(), Some("enabled"));
        assert_eq!(witness(&node, "mesh", name), "REDIRECTED", "{name}");
    }
    assert_eq!(witness(&node, "plain", "plain"), "DIRECT");
    assert_eq!(
        witness(&node, "plain", "sidecar"),
        "REDIRECTED",
        "the plugin's sidecar rules send the app's outbound to 15001"
    );
    let w = peer_workloads(&node);
    assert!(w.contains_key(&server) && w.contains_key(&client), "{w:?}");
    assert!(!w.contains_key(&plain), "{w:?}");

    // The raced pod repaired in place: the same sandbox (UID and IP), its validation passed at
    // its next restart, its app's outbound sent to 15001. kubelet's crash-loop backoff (up to
    // 80 s by then) decides when that restart comes.
    let repaired = node
        .eventually(
            "race/raced Running after repair",
            Duration::from_secs(300),
            || async { get(&node, "race", "raced").await.filter(running) },
        )
        .await;
    assert_eq!(repaired.metadata.uid.as_deref(), Some(raced.as_str()));
    assert_eq!(
        repaired.status.and_then(|s| s.pod_ip).as_deref(),
        Some(raced_ip.as_str())
    );
    assert_eq!(witness(&node, "race", "raced"), "REDIRECTED");
    let agent = node.kubectl(&["-n", "istio-system", "logs", "ds/istio-cni-node"]);
    assert!(
        agent
            .lines()
            .any(|l| l.contains("broken pod repaired in place") && l.contains("race/raced")),
        "{agent}"
    );

    // An operator's one command from a workstation: the kubectl plugin finds the pod's node, the
    // agent there, and asks it (kubectl exec through the API server and kubelet).
    let plugin = repo_path("tools/kubectl-plugin/kubectl-istio_cni-explain");
    let text = node.node(1).exec(&[&plugin, "mesh/server"]);
    assert!(text.contains("meshed:      yes\n"), "{text}");
    let listed: Value = serde_json::from_str(
        &node
            .node(1)
            .exec(&[&plugin, "--node", NODE_NAME, "-o", "json"]),
    )
    .unwrap();
    let meshed: BTreeMap<&str, bool> = listed["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["pod"].as_str().unwrap(), p["meshed"].as_bool().unwrap()))
        .collect();
    assert_eq!(
        (
            meshed.get("mesh/server"),
            meshed.get("mesh/client"),
            meshed.get("plain/plain")
        ),
        (Some(&true), Some(&true), Some(&false)),
        "{listed}"
    );

    // App traffic through the peer: kubectl exec (API server → kubelet → containerd), then the
    // client's outbound through its 15001 and the server's inbound through its 15006.
    let ip = server_pod.status.unwrap().pod_ip.unwrap();
    // (nc, not wget: busybox-static's wget looks its service up through glibc's NSS and crashes.)
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
    assert!(
        response.starts_with("HTTP/1.") && response.ends_with("\r\n\r\nhello\n"),
        "{response:?}"
    );
    // Each pod's witness went out through its 15001; then the request out of the client's 15001
    // and into the server's 15006.
    node.eventually(
        "the request counted by the peer's in-pod listeners",
        Duration::from_secs(10),
        || async {
            let w = peer_workloads(&node);
            (w[&client].1 >= 2 && w[&server].1 >= 2).then_some(())
        },
    )
    .await;

    // Out of the mesh and back, by namespace label, for running pods.
    label_namespace(&node, "mesh", false).await;
    wait_redirection(&node, "mesh", "client", None).await;
    wait_peer_has(&node, &client, false).await;
    label_namespace(&node, "mesh", true).await;
    wait_redirection(&node, "mesh", "client", Some("enabled")).await;
    wait_peer_has(&node, &client, true).await;

    let rewritten = primary_rewrites_while_pods_start(&node, &conflist, &before, &chained).await;

    // Pod delete: kubelet's DEL through the chain; the peer is told, the netns goes.
    for (ns, name) in [
        ("mesh", "server"),
        ("mesh", "client"),
        ("plain", "plain"),
        ("plain", "sidecar"),
        ("race", "raced"),
    ]
    .into_iter()
    .chain(rewritten.iter().map(|n| ("mesh", n.as_str())))
    {
        delete(&node, ns, name).await;
    }
    wait_peer_has(&node, &server, false).await;
    wait_peer_has(&node, &client, false).await;
    node.eventually(
        "every pod netns removed",
        Duration::from_secs(30),
        || async { (netns_count(&node) == netns_before).then_some(()) },
    )
    .await;

    // helm uninstall: the node's CNI config byte for byte as it was, the plugin gone.
    node.kubectl(&["-n", "istio-system", "delete", "ds", "ztunnel"]);
    node.helm(&["uninstall", "istio-cni", "-n", "istio-system", "--wait"]);
    node.eventually("conflist restored", Duration::from_secs(60), || async {
        (node.read(&conflist).as_deref() == Some(before.as_str())).then_some(())
    })
    .await;
    assert!(node.read("/opt/cni/bin/istio-cni").is_none());
    // And the node still starts pods, unredirected.
    namespace(&node, "after", true).await;
    create(&node, "after", pod("late", "sleep 3600")).await;
    wait_running(&node, "after", "late").await;
    assert_eq!(witness(&node, "after", "late"), "DIRECT");
}

/// The primary rewrites its conflist without our entry (as kindnet or flannel does when its own
/// pod restarts) once a second while ambient pods `rewrite-0..3` start: the installer chains it
/// again, byte for byte as before, and every pod ends up Running, redirected and known to the
/// peer. A pod whose sandbox read a version without our entry starts unredirected until the
/// agent's pod watch enrolls it (Istio's gap too): allowed only for pods created while the writer
/// ran, and counted on the `rewrite:` line. A pod created after it must start redirected.
/// Returns the pods' names.
async fn primary_rewrites_while_pods_start(
    node: &RealNode,
    conflist: &str,
    primary: &str,
    chained: &str,
) -> Vec<String> {
    let writer = Rewriter::start(
        node.node_path(conflist),
        primary.as_bytes().to_vec(),
        Duration::from_secs(1),
    );
    let mut names: Vec<String> = (0..3).map(|i| format!("rewrite-{i}")).collect();
    for name in &names {
        create(node, "mesh", pod(name, "sleep 3600")).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let writes = writer.stop();
    assert!(writes >= 2, "the primary's writer wrote {writes} versions");
    node.eventually(
        "the installer chained the primary's last version again",
        Duration::from_secs(60),
        || async { (node.read(conflist).as_deref() == Some(chained)).then_some(()) },
    )
    .await;
    // containerd reloads the file on inotify: a pod created from now on reads our entry.
    tokio::time::sleep(Duration::from_secs(2)).await;
    create(node, "mesh", pod("rewrite-after", "sleep 3600")).await;
    names.push("rewrite-after".into());
    let mut direct = Vec::new();
    for name in &names {
        let p = wait_running(node, "mesh", name).await;
        wait_redirection(node, "mesh", name, Some("enabled")).await;
        wait_peer_has(node, p.metadata.uid.as_deref().unwrap(), true).await;
        if witness(node, "mesh", name) == "DIRECT" {
            direct.push(name.clone());
        }
    }
    assert!(
        !direct.contains(&"rewrite-after".to_string()),
        "a pod created after the installer chained the file again started unredirected"
    );
    eprintln!(
        "rewrite: the primary rewrote {conflist} {writes} times while 3 ambient pods started; \
         chained again; started before enrolment: {direct:?}"
    );
    names
}

/// Creates ambient pods `<prefix>-0..n` one after another while `during` runs, then checks that
/// every one is Running, redirected, known to the peer, and that none ever started unredirected.
async fn create_while<F: std::future::Future<Output = ()>>(
    node: &RealNode,
    ns: &str,
    prefix: &str,
    n: usize,
    during: F,
) {
    let creating = async {
        for i in 0..n {
            create(node, ns, pod(&format!("{prefix}-{i}"), "sleep 3600")).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    tokio::join!(creating, during);
    for i in 0..n {
        let name = format!("{prefix}-{i}");
        let p = wait_running(node, ns, &name).await;
        wait_redirection(node, ns, &name, Some("enabled")).await;
        assert_eq!(witness(node, ns, &name), "REDIRECTED", "{ns}/{name}");
        wait_peer_has(node, p.metadata.uid.as_deref().unwrap(), true).await;
    }
}

async fn agent_pod(node: &RealNode) -> String {
    testbed::migrate::agent_pods(node, None, "jsonpath={.items[0].metadata.name}")
}

/// Deletes the agent's pod (with `how`'s extra `kubectl delete` flags) while ambient pods
/// `<prefix>-0..3` are created; the DaemonSet replaces it and every pod ends up redirected.
async fn delete_agent_pod_while_creating(node: &RealNode, prefix: &str, how: &[&str]) {
    let agent = agent_pod(node).await;
    create_while(node, "mesh", prefix, 3, async {
        let mut args = vec![
            "-n",
            "istio-system",
            "delete",
            "pod",
            &agent,
            "--wait=false",
        ];
        args.extend_from_slice(how);
        node.kubectl(&args);
        node.rollout("istio-cni-node").await;
    })
    .await;
    assert_ne!(
        agent_pod(node).await,
        agent,
        "the DaemonSet replaced the agent pod ({prefix})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_restarts_and_reboot_never_start_an_ambient_pod_unredirected() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    node.install_chart(&[]).await;
    namespace(&node, "mesh", true).await;
    create(&node, "mesh", pod("steady", "sleep 3600")).await;
    wait_running(&node, "mesh", "steady").await;
    wait_redirection(&node, "mesh", "steady", Some("enabled")).await;

    // helm upgrade rolls the agent's DaemonSet (old pod gone before the new one is up) while
    // pods are being created: their ADDs fail closed until the new agent serves.
    let old_agent = agent_pod(&node).await;
    create_while(&node, "mesh", "upgrade", 6, async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        node.helm(&[
            "upgrade",
            "istio-cni",
            &repo_path(CHART),
            "-n",
            "istio-system",
            "-f",
            &repo_path(VALUES),
            "--set-string",
            "podAnnotations.rollout=2",
        ]);
        node.rollout("istio-cni-node").await;
    })
    .await;
    assert_ne!(
        agent_pod(&node).await,
        old_agent,
        "the upgrade replaced the agent pod"
    );
    assert_eq!(witness(&node, "mesh", "steady"), "REDIRECTED");

    // kubelet and runtime (containerd, or CRI-O in its cell) restarts: running pods stay as
    // they are, new pods still start through the chain.
    let runtime_component = if runtime(&node) == "crio" {
        "crio"
    } else {
        "containerd"
    };
    for component in ["kubelet", runtime_component] {
        node.restart(component).await;
        let name = format!("after-{component}");
        create(&node, "mesh", pod(&name, "sleep 3600")).await;
        wait_running(&node, "mesh", &name).await;
        wait_redirection(&node, "mesh", &name, Some("enabled")).await;
        assert_eq!(witness(&node, "mesh", &name), "REDIRECTED", "{name}");
        let steady = get(&node, "mesh", "steady").await.unwrap();
        assert!(
            running(&steady),
            "{component} restart disturbed a running pod"
        );
    }

    // The agent killed: its process (SIGKILL; kubelet restarts the container), then its pod
    // (deleted; the DaemonSet makes a new one), then its pod force-deleted (the object, and the
    // stopping agent's bound token with it, vanish at once: the DaemonSet watch must tell this
    // from an uninstall). Pods created meanwhile fail closed until it is back.
    create_while(&node, "mesh", "crashed", 3, async {
        node.script(&["exec", "pkill", "-KILL", "-x", "install-cni"]);
        node.rollout("istio-cni-node").await;
    })
    .await;
    delete_agent_pod_while_creating(&node, "killed", &[]).await;
    delete_agent_pod_while_creating(&node, "forced", &["--grace-period=0", "--force"]).await;

    // Reboot: every process and pod netns gone; kubelet recreates each sandbox through the
    // chain, ambient ones only once the agent (itself a pod again) is back.
    node.stop();
    node.start().await;
    node.rollout("istio-cni-node").await;
    node.rollout("ztunnel").await;
    for name in [
        "steady",
        "upgrade-0",
        "after-kubelet",
        "crashed-0",
        "killed-0",
    ] {
        node.eventually(
            &format!("mesh/{name} restarted after reboot"),
            Duration::from_secs(120),
            || async {
                let p = get(&node, "mesh", name).await?;
                let restarted = p.status.as_ref()?.container_statuses.as_ref()?[0].restart_count;
                (running(&p) && restarted >= 1).then_some(())
            },
        )
        .await;
        assert_eq!(
            witness(&node, "mesh", name),
            "REDIRECTED",
            "{name} after reboot"
        );
    }
    let uid = get(&node, "mesh", "steady")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    wait_peer_has(&node, &uid, true).await;
}

/// The real ztunnel's metrics (`:15020` on its pod IP, from the node).
fn ztunnel_metrics(node: &RealNode) -> String {
    let ip = node.kubectl(&[
        "-n",
        "istio-system",
        "get",
        "pods",
        "-l",
        "app=ztunnel",
        "-o",
        "jsonpath={.items[0].status.podIP}",
    ]);
    let out = node.try_script(&["exec", "curl", "-sf", &format!("http://{ip}:15020/metrics")]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of the first sample of `metric` whose line contains every one of `labels`.
fn sample(metrics: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(metric) && labels.iter().all(|want| l.contains(want)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

async fn wait_ztunnel_proxies(node: &RealNode, want: f64) {
    node.eventually(
        &format!("ztunnel runs {want} in-pod proxies"),
        Duration::from_secs(60),
        || async {
            (sample(
                &ztunnel_metrics(node),
                "workload_manager_active_proxy_count",
                &[],
            ) == Some(want))
            .then_some(())
        },
    )
    .await
}

/// With the real ztunnel (`ZTUNNEL_BIN`, built with its `testing` feature, in the node's images)
/// as the DaemonSet next to ours: its readiness needs our snapshot, kubelet's pods get in-pod
/// proxies through our ZDS server, a ztunnel restart gets every running pod again, and traffic
/// between two ambient pods goes over HBONE with mTLS between their proxies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ztunnel_daemonset_proxies_kubelets_pods_over_hbone() {
    dataplane::enter_test_group!();
    if std::env::var_os("ZTUNNEL_BIN").is_none() {
        eprintln!(
            "SKIPPED real_ztunnel_daemonset_proxies_kubelets_pods_over_hbone: set ZTUNNEL_BIN to a ztunnel built with --features testing"
        );
        return;
    }
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    assert!(
        node.has_real_ztunnel(),
        "ZTUNNEL_BIN is set but the node's images have no ztunnel.tar"
    );
    // Rolled out = Ready = ztunnel processed our (empty) snapshot.
    node.install_chart_with(&[], ZTUNNEL).await;

    namespace(&node, "zt", true).await;
    let server = busybox_pod(
        "server",
        &[
            "sh",
            "-c",
            "mkdir /www; echo hello > /www/index.html; exec httpd -f -p 8080 -h /www",
        ],
    );
    create(&node, "zt", server).await;
    create(&node, "zt", busybox_pod("client", &["sleep", "3600"])).await;
    let mut ips = BTreeMap::new();
    for name in ["server", "client"] {
        let p = wait_running(&node, "zt", name).await;
        wait_redirection(&node, "zt", name, Some("enabled")).await;
        ips.insert(name, p.status.unwrap().pod_ip.unwrap());
    }
    wait_ztunnel_proxies(&node, 2.0).await;

    // Tell ztunnel who the pods are (it reads the file once): restart it. The new ztunnel is
    // Ready only once our snapshot handed it both running pods again.
    let workloads: Vec<Value> = ips
        .iter()
        .map(|(name, ip)| {
            json!({
                "uid": format!("Kubernetes//Pod/zt/{name}"),
                "name": name,
                "namespace": "zt",
                "serviceAccount": "default",
                "trustDomain": "cluster.local",
                "workloadIps": [ip],
                "protocol": "HBONE",
                "node": NODE_NAME,
                "services": {},
            })
        })
        .collect();
    let xds = serde_yaml::to_string(&json!({ "workloads": workloads })).unwrap();
    let patch = json!({"data": {"local-xds.yaml": xds}});
    Api::<ConfigMap>::namespaced(node.client(), "istio-system")
        .patch(
            "ztunnel-local-xds",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
    node.kubectl(&[
        "-n",
        "istio-system",
        "delete",
        "pod",
        "-l",
        "app=ztunnel",
        "--wait=true",
    ]);
    node.rollout("ztunnel").await;
    wait_ztunnel_proxies(&node, 2.0).await;

    let response = node.kubectl(&[
        "-n",
        "zt",
        "exec",
        "client",
        "--",
        "sh",
        "-c",
        &format!(
            "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {} 8080",
            ips["server"]
        ),
    ]);
    assert!(
        response.starts_with("HTTP/1.") && response.ends_with("\r\n\r\nhello\n"),
        "{response:?}"
    );
    // The server's proxy took the request over HBONE from the client's, with both identities.
    let metrics = ztunnel_metrics(&node);
    let mtls = sample(
        &metrics,
        "istio_tcp_connections_opened_total",
        &[
            "reporter=\"destination\"",
            "connection_security_policy=\"mutual_tls\"",
            "source_principal=\"spiffe://cluster.local/ns/zt/sa/default\"",
        ],
    );
    assert!(
        mtls >= Some(1.0),
        "no mTLS connection in ztunnel's metrics:\n{metrics}"
    );

    // Pod delete: kubelet's DEL reaches ztunnel through the agent.
    delete(&node, "zt", "server").await;
    wait_ztunnel_proxies(&node, 1.0).await;
}

/// `scripts/real-node up` in a fresh directory with extra environment; returns (success, stderr).
fn up_with(dir: &std::path::Path, env: &[(&str, String)]) -> (bool, String) {
    let mut cmd = std::process::Command::new(repo_path("scripts/real-node"));
    cmd.arg("up")
        .env("REAL_NODE_DIR", dir)
        .stdin(std::process::Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn missing_tool_is_named_and_nothing_starts() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let empty = tempfile::tempdir().unwrap();
    let (ok, err) = up_with(
        dir.path(),
        &[(
            "REAL_NODE_CNI_PLUGINS",
            empty.path().to_str().unwrap().into(),
        )],
    );
    assert!(!ok);
    let bridge = format!("{}/bridge", empty.path().display());
    assert!(
        err.contains("missing tools") && err.contains(&bridge),
        "{err}"
    );
    let env = NodeEnv::read(dir.path(), 1);
    assert!(!env.path("REAL_NODE_HOLDER_PID_FILE").exists());
    assert!(processes_under(dir.path()).is_empty());
}

#[tokio::test]
async fn failed_component_start_names_it_and_tears_down_the_rest() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let dir = tempfile::tempdir().unwrap();
    // A containerd that fails the way a broken one does: a message, then exit 1.
    let fake = tempfile::tempdir().unwrap();
    let containerd = fake.path().join("containerd");
    std::fs::write(
        &containerd,
        "#!/bin/sh\necho 'containerd: failed to load plugin: broken on purpose' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &containerd,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        fake.path().display(),
        std::env::var("PATH").unwrap()
    );
    let (ok, err) = up_with(dir.path(), &[("PATH", path)]);
    assert!(!ok);
    assert!(
        err.contains("containerd exited during start") && err.contains("broken on purpose"),
        "{err}"
    );
    // etcd and the API server had started: they are gone again, with the node's cgroups.
    assert!(
        processes_under(dir.path()).is_empty(),
        "{:?}",
        processes_under(dir.path())
    );
    let env = NodeEnv::read(dir.path(), 1);
    assert!(!env.path("REAL_NODE_RUN").exists());
    let logs =
        std::fs::read_to_string(env.path("REAL_NODE_LOGS").join("kube-apiserver.log")).unwrap();
    assert!(!logs.is_empty(), "the API server ran before containerd");
}

/// `stop` of a node that died leaves alone the processes its stale files name: pids wrap within
/// minutes on a busy machine, and the kernel hands a dead mount namespace's number to the next
/// one made, so a dead node's `holder.pid`, component pid files and `mntns` may all name another
/// node's processes by then (a CI run lost its node so). Here they name a foreign process in a
/// mount namespace of its own, the worst case: the number recorded is that namespace's.
#[tokio::test]
async fn stop_of_a_dead_node_spares_the_processes_its_stale_files_name() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let dir = tempfile::tempdir().unwrap();
    let env = NodeEnv::read(dir.path(), 1);
    let run = env.path("REAL_NODE_RUN");
    std::fs::create_dir_all(&run).unwrap();
    let mut foreign = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sleep", "600"])
        .spawn()
        .unwrap();
    let pid = foreign.id();
    // unshare execs sleep in place: the same pid, once in its own namespace.
    let mntns = loop {
        let ns = std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
        if ns != std::fs::read_link("/proc/self/ns/mnt").unwrap() {
            break ns;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    std::fs::write(run.join("mntns"), format!("{}\n", mntns.display())).unwrap();
    std::fs::write(env.path("REAL_NODE_HOLDER_PID_FILE"), format!("{pid}\n")).unwrap();
    for c in ["kubelet", "kube-apiserver", "etcd", "containerd"] {
        std::fs::write(run.join(format!("{c}.pid")), format!("{pid}\n")).unwrap();
    }
    let out = std::process::Command::new(repo_path("scripts/real-node"))
        .arg("stop")
        .env("REAL_NODE_DIR", dir.path())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    // A SIGKILL the script sent is delivered by now; the exit shows within a moment.
    let alive = (0..20).all(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        foreign.try_wait().unwrap().is_none()
    });
    let _ = foreign.kill();
    let _ = foreign.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(alive, "stop killed a process that was not its node's");
    assert!(!run.exists(), "the dead node's run dir is cleaned up");
}

/// The seed of a churn run (`CHURN_SEED` replays a schedule, else `default`) and a real node
/// ready for it, its components restarted quickly after the faults that stop them.
async fn churn_node(default: u64) -> (u64, testbed::churn::real::RealChurnNode) {
    let seed = std::env::var("CHURN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    let node = RealNode::up_with(&[(
        "REAL_NODE_MAX_RESTART_BACKOFF",
        testbed::churn::real::MAX_RESTART_BACKOFF,
    )])
    .await;
    (seed, testbed::churn::real::RealChurnNode::start(node).await)
}

/// The churn harness (`scripts/churn --real-node`, RELIABILITY.md) cut short: ambient pods
/// created and deleted through kubelet while the agent is SIGKILLed (also mid-ADD) or its pod
/// deleted, the peer restarts, the API server, kubelet and containerd restart, another writer
/// rewrites the conflist and the agent's run dir is full; zero invariant violations.
/// `CHURN_SEED` replays a schedule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_short_on_the_real_node() {
    dataplane::enter_test_group!();
    use testbed::churn::{self, ChurnConfig, FaultKind};
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let (seed, mut node) = churn_node(14).await;
    // Kept short (each failed ADD costs a kubelet retry, seconds): scripts/churn --real-node is
    // the long run.
    let mut cfg = ChurnConfig::new(12, seed);
    // A short run meets several kinds of fault only when faults are frequent.
    cfg.fault_percent = 50;
    cfg.quiet_every = 6;
    cfg.population = 5;
    // The API proxy's faults have their own run (api_faults_on_the_real_node); this seed keeps
    // the schedule it had before them.
    cfg.kinds = Some(
        FaultKind::ALL
            .into_iter()
            .filter(|k| !API_PROXY_FAULTS.contains(k))
            .collect(),
    );
    let report = churn::run(&mut node, &cfg).await;
    println!("seed {seed}\n{}", report.markdown());
    assert!(
        report.violations.is_empty(),
        "churn violations (seed {seed}): {:#?}\n{}",
        report.violations,
        node.agent_log()
    );
    assert_eq!(report.pods_created, 12);
    assert!(
        report.faults.values().sum::<u64>() >= 4,
        "too few faults: {:?}",
        report.faults
    );
}

/// What the fault proxy in front of the API server does to the agent's and the plugin's requests.
const API_PROXY_FAULTS: [testbed::churn::FaultKind; 3] = [
    testbed::churn::FaultKind::ApiErrorBurst,
    testbed::churn::FaultKind::ApiSlowAnswers,
    testbed::churn::FaultKind::ApiConnectionReset,
];

/// API server faults on the real node (issue #39): the agent and its plugin reach the API server
/// through the fault proxy (429/500/503 bursts, answers seconds late, every connection reset:
/// watch streams cut mid-stream) and the API server itself restarts, while ambient pods are
/// created and deleted through kubelet. No pod ever starts unredirected, the peer's state stays
/// complete at every quiet point, and kubelet never restarts the agent (no liveness failure, no
/// exit) for any of it. `CHURN_SEED` replays a schedule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_faults_on_the_real_node() {
    dataplane::enter_test_group!();
    use testbed::churn::{self, ChurnConfig, FaultKind};
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let (seed, mut node) = churn_node(39).await;
    let mut cfg = ChurnConfig::new(10, seed);
    cfg.fault_percent = 70;
    cfg.quiet_every = 5;
    cfg.population = 4;
    let mut kinds = API_PROXY_FAULTS.to_vec();
    kinds.push(FaultKind::ApiRestart);
    cfg.kinds = Some(kinds);
    let report = churn::run(&mut node, &cfg).await;
    println!("seed {seed}\n{}", report.markdown());
    assert!(
        report.violations.is_empty(),
        "churn violations (seed {seed}): {:#?}\n{}",
        report.violations,
        node.agent_log()
    );
    assert_eq!(
        report.agent_exits,
        0,
        "the agent restarted under API faults\n{}",
        node.agent_log()
    );
    if report.faults.contains_key(&FaultKind::ApiErrorBurst) {
        assert!(
            node.api_rejected() > 0,
            "no request of the agent or the plugin met the error bursts: they bypass the proxy"
        );
    }
    let drawn = report
        .faults
        .keys()
        .filter(|k| API_PROXY_FAULTS.contains(k))
        .count();
    assert!(
        drawn >= 2 && report.faults.values().sum::<u64>() >= 4,
        "too few API faults: {:?}",
        report.faults
    );
    assert_eq!(report.pods_created, 10);
}

/// The commands of the README's first `bash` block under `heading`, continuation lines joined and
/// trailing comments dropped.
fn readme_commands(heading: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(repo_path("README.md")).unwrap();
    let section = &readme[readme
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("README has no {heading:?} section"))..];
    let block = section
        .split("```bash\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .unwrap_or_else(|| panic!("README's {heading:?} has no bash block"));
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in block.lines() {
        // A comment starts after two or more spaces (`#` inside a command is not one).
        let line = line.split("  #").next().unwrap().trim_end();
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                let cmd = current.split_whitespace().collect::<Vec<_>>().join(" ");
                commands.push(cmd);
                current.clear();
            }
        }
    }
    commands.retain(|c| !c.is_empty());
    commands
}

/// The README's "Real node" block as a user types it, from the repository's root, command by
/// command, on this suite's node: each succeeds and shows what its comment promises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_real_node_block_works_as_written() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let node = RealNode::up().await;
    let run = |cmd: &str, stdin: &str| {
        use std::io::Write;
        let mut child = std::process::Command::new("bash")
            .args(["-c", cmd])
            .current_dir(repo_path(""))
            .env("REAL_NODE_DIR", node.dir())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "README command `{cmd}` failed ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let commands = readme_commands("## Real node");
    let mut ran = 0;
    for cmd in &commands {
        // The kit brought this node up with exactly these two commands (its own image dir).
        if cmd.starts_with("scripts/node-images build") || cmd.starts_with("scripts/real-node up") {
            continue;
        }
        if let Some(alternatives) = cmd.strip_prefix("scripts/real-node restart ") {
            for component in alternatives.split('|') {
                run(&format!("scripts/real-node restart {component}"), "");
            }
            ran += 1;
            continue;
        }
        let stdin = if cmd == "scripts/real-node shell" {
            "kubectl get node real-node -o name\n"
        } else {
            ""
        };
        let out = run(cmd, stdin);
        ran += 1;
        if cmd.contains("get pod app -o jsonpath='{.metadata.annotations}'") {
            assert!(
                out.contains(r#""ambient.istio.io/redirection":"enabled""#),
                "{out}"
            );
        } else if cmd.ends_with("cat /etc/cni/net.d/10-bridge.conflist") {
            assert!(out.contains(r#""type": "istio-cni""#), "{out}");
        } else if cmd.ends_with("cat /var/run/ztunnel-peer/status.json") {
            let uid = get(&node, "mesh", "app")
                .await
                .unwrap()
                .metadata
                .uid
                .unwrap();
            let status: Value = serde_json::from_str(&out).unwrap();
            assert!(status["workloads"].get(&uid).is_some(), "{out}");
        } else if cmd == "scripts/real-node shell" {
            assert!(out.contains("node/real-node"), "{out}");
        } else if cmd == "scripts/real-node stop" {
            let inside = node.try_script(&["exec", "true"]);
            assert!(!inside.status.success(), "the node still runs after stop");
        } else if cmd == "scripts/real-node down" {
            assert!(!node.dir().exists(), "down keeps {}", node.dir().display());
        }
    }
    assert!(
        ran >= 12,
        "the README block shrank to {ran} commands: {commands:#?}"
    );
}
