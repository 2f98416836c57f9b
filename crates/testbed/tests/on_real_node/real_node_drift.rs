//! Host drift and replaced sandboxes on the real node (issue #39): kubelet's HTTP probes to ambient
//! pods while the node's nat rules and probe sets are wiped (`nft flush ruleset`; a firewalld-style
//! reload that flushes everything and re-adds only the node's own rules), and pods whose sandbox
//! is replaced under them (the pause process killed: kubelet makes a new netns, host-local a new
//! IP), once through our CNI ADD and once with our plugin out of the chain, so that only the
//! agent's drift check can find the new netns. One node: the nftables backend first, then switched
//! live to the iptables backend, under which `iptables -t nat -F` + `ipset flush` are repaired the
//! same way.
//!
//! What tells a probe that was SNATed from one that was not: kubelet probes from the bridge
//! gateway. SNATed to 169.254.7.127 by the host's probe rule, it bypasses the pod's redirection;
//! unSNATed, it is redirected to the peer's inbound listener (15006), which records it (and
//! forwards it, so the test peer keeps the probe green where ztunnel with STRICT mTLS would fail
//! it). "Probes recovered" is: the peer's count of such connections stops growing.
//!
//! Needs root, the node binaries (`tools/k8s-node/build.sh`) and the images (`scripts/node-images`,
//! or `REAL_NODE_IMAGES`).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, WatchEvent, WatchParams};
use nix::sys::signal::Signal;
use serde_json::Value;
use testbed::migrate::{
    agent_log, agent_pods, netns_exec, peer_accepted, redirected_now, repo_path,
};
use testbed::real_node::{
    CHART, GATEWAY, RealNode, VALUES, create, get, running, wait_redirection, wait_running,
    witness_pod,
};

/// One node at a time: a node is several hundred MB of processes and most of a core to start.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The agent's drift check interval here (`DRIFT_CHECK_INTERVAL_SECONDS`), short so that a test
/// waits seconds, not the default 30.
const DRIFT_SECONDS: u64 = 2;
/// How long a repair may take to show: two checks (rules at one, entries at the next) and the
/// kubelet probe that then bypasses the proxy, with room for a loaded machine.
const REPAIRED_WITHIN: Duration = Duration::from_secs(30);
const NS: &str = "probed";
/// The in-pod inbound plaintext listener of the peer (ztunnel's 15006).
const INBOUND: u16 = 15006;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Nftables,
    Iptables,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Nftables => "nftables",
            Backend::Iptables => "iptables",
        }
    }
}

/// A witness pod serving HTTP on 8080, with kubelet's readiness and liveness probes on it.
fn probed_pod(name: &str) -> Value {
    let mut p = witness_pod(
        name,
        "mkdir /www; echo ok > /www/index.html; exec httpd -f -p 8080 -h /www",
    );
    let probe = |failures: u32| {
        serde_json::json!({
            "httpGet": {"path": "/", "port": 8080},
            "periodSeconds": 1,
            "failureThreshold": failures,
        })
    };
    p["spec"]["containers"][0]["readinessProbe"] = probe(1);
    p["spec"]["containers"][0]["livenessProbe"] = probe(5);
    p
}

fn node_netns(node: &RealNode) -> PathBuf {
    PathBuf::from(format!("/proc/{}/ns/net", node.holder_pid()))
}

/// `script` by `sh` inside the node's network namespace (the machine's tools); panics on failure.
fn node_sh(node: &RealNode, script: &str) -> String {
    netns_exec(&node_netns(node), "sh", &["-c", script])
}

/// The host side of the probe SNAT as the backend keeps it: the nftables ruleset, or the nat
/// table of the node's iptables (nft variant, kubelet's) and the ipsets.
fn host_state(node: &RealNode, backend: Backend) -> String {
    match backend {
        Backend::Nftables => node_sh(node, "nft list ruleset"),
        Backend::Iptables => node_sh(node, "iptables-nft-save -t nat; ipset list"),
    }
}

/// Whether `text` names `ip` as a whole address (10.244.0.5 is not in 10.244.0.50).
fn mentions(text: &str, ip: &str) -> bool {
    text.match_indices(ip).any(|(i, _)| {
        let after = text[i + ip.len()..].chars().next();
        let before = text[..i].chars().next_back();
        !after.is_some_and(|c| c.is_ascii_digit() || c == '.')
            && !before.is_some_and(|c| c.is_ascii_digit() || c == '.')
    })
}

/// The probe SNAT rule is in place and the probe set holds every one of `ips`.
fn probes_programmed(state: &str, ips: &[String]) -> bool {
    state.contains("169.254.7.127") && ips.iter().all(|ip| mentions(state, ip))
}

/// Connections from the node's bridge gateway (kubelet's probes) that the peer's inbound listener
/// took for each pod: probes that were not SNATed.
fn proxied_probes(node: &RealNode, uids: &[String]) -> BTreeMap<String, usize> {
    uids.iter()
        .map(|uid| {
            let n = peer_accepted(node, uid)
                .iter()
                .filter(|a| a.port == INBOUND && peer_host(&a.peer) == GATEWAY)
                .count();
            (uid.clone(), n)
        })
        .collect()
}

/// The address of a `host:port` (`[::ffff:a.b.c.d]:port` too).
fn peer_host(peer: &str) -> &str {
    let host = peer.rsplit_once(':').map_or(peer, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.trim_start_matches("::ffff:")
}

/// Waits until kubelet's probes to `uids` bypass the proxy: the peer's count of unSNATed probes
/// holds still for three probe periods (six probes of two pods). Returns the counts.
async fn wait_probes_bypass(
    node: &RealNode,
    uids: &[String],
    what: &str,
) -> BTreeMap<String, usize> {
    node.eventually(what, REPAIRED_WITHIN, || async {
        let before = proxied_probes(node, uids);
        tokio::time::sleep(Duration::from_secs(3)).await;
        (proxied_probes(node, uids) == before).then_some(before)
    })
    .await
}

/// Waits until the host's probe rule and entries for `ips` are in place; on failure the message
/// has the host's state and the agent's log (what it did or refused).
async fn wait_host_programmed(node: &RealNode, backend: Backend, ips: &[String], what: &str) {
    let deadline = Instant::now() + REPAIRED_WITHIN;
    loop {
        let state = host_state(node, backend);
        if probes_programmed(&state, ips) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} ({}): not after {REPAIRED_WITHIN:?}\n{state}\n--- agent log\n{}",
            backend.name(),
            agent_log(node)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Injects `fault` until a kubelet probe of one of `uids` is seen unSNATed (the fault took the
/// SNAT away before the next drift check put it back), then waits until the host's probe rules
/// and entries for `ips` are back and probes bypass the proxy again. Returns how many probes went
/// through the proxy in between.
async fn fault_then_repair(
    node: &RealNode,
    backend: Backend,
    uids: &[String],
    ips: &[String],
    what: &str,
    fault: impl Fn(),
) -> usize {
    let total = |m: &BTreeMap<String, usize>| m.values().sum::<usize>();
    let before = total(&proxied_probes(node, uids));
    let began = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        fault();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        if total(&proxied_probes(node, uids)) > before {
            break;
        }
        assert!(
            tries < 10,
            "{what}: after {tries} faults no kubelet probe went through the proxy: the fault does \
             not take the probe SNAT away\n{}",
            host_state(node, backend)
        );
    }
    wait_host_programmed(
        node,
        backend,
        ips,
        &format!("{what}: host probe rules back"),
    )
    .await;
    let after = wait_probes_bypass(node, uids, &format!("{what}: probes SNATed again")).await;
    let gap = total(&after) - before;
    eprintln!(
        "{what} ({}): {tries} fault(s), {gap} probe(s) through the proxy, repaired in {:?}",
        backend.name(),
        began.elapsed()
    );
    gap
}

/// Ready, with every container's restart count as `restarts` says.
fn assert_ready_with_restarts(p: &Pod, restarts: i32) {
    let name = p.metadata.name.as_deref().unwrap_or_default();
    assert!(running(p), "{name} not Ready: {:?}", p.status);
    let st = p.status.as_ref().unwrap();
    let ready = st
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.as_str());
    assert_eq!(ready, Some("True"), "{name}: {:?}", st.conditions);
    for c in st.container_statuses.iter().flatten() {
        assert_eq!(
            c.restart_count, restarts,
            "{name}/{}: kubelet restarted it: {:?}",
            c.name, c.last_state
        );
    }
}

/// Whether no agent container was ever restarted by kubelet (none for anything in this suite).
fn agent_never_restarted(node: &RealNode) -> bool {
    let counts = agent_pods(
        node,
        None,
        "jsonpath={.items[*].status.containerStatuses[*].restartCount}",
    );
    !counts.trim().is_empty() && counts.split_whitespace().all(|n| n == "0")
}

/// `curl` on the node's loopback (the agent's host-network ports).
fn agent_http(node: &RealNode, path: &str) -> (String, String) {
    let out = node_sh(
        node,
        &format!("curl -s -w '\\n%{{http_code}}' http://127.0.0.1:{path}"),
    );
    let (body, code) = out.rsplit_once('\n').unwrap_or((&out, ""));
    (code.to_string(), body.to_string())
}

/// The agent's count of drift repairs for `backend` of `scope` (`host` or `pod`).
fn drift_repairs(node: &RealNode, backend: Backend, scope: &str) -> u64 {
    let (_, metrics) = agent_http(node, "15014/metrics");
    let series = format!(
        "istio_cni_drift_repairs_total{{backend=\"{}\",scope=\"{scope}\"}} ",
        backend.name()
    );
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
        .unwrap_or(0)
}

fn signal(pid: u32, sig: Signal) -> nix::Result<()> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig)
}

/// Kills pod `uid`'s pause process (catatonit): kubelet sees its sandbox die, tears it down and
/// makes a new one.
fn kill_pause(node: &RealNode, uid: &str) {
    let pause = node.pod_processes(&format!("pod{uid}/"), Some("catatonit"));
    assert_eq!(pause.len(), 1, "{uid}: one pause process: {pause:?}");
    signal(pause[0], Signal::SIGKILL).unwrap();
}

/// The agent's process stopped (SIGSTOP) until dropped: its installer cannot chain our plugin
/// back meanwhile, nor can its drift check or its watches run. The chart has no liveness probe
/// (Istio's has none), so kubelet only marks it unready and does not restart it.
struct HeldAgent(Vec<u32>);

impl HeldAgent {
    fn stop(node: &RealNode) -> HeldAgent {
        let uid = agent_pods(node, None, "jsonpath={.items[*].metadata.uid}");
        let pids = node.pod_processes(&format!("pod{}/", uid.trim()), Some("install-cni"));
        assert!(!pids.is_empty(), "no agent process in pod {uid}");
        for pid in &pids {
            signal(*pid, Signal::SIGSTOP).unwrap();
        }
        HeldAgent(pids)
    }
}

impl Drop for HeldAgent {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = signal(*pid, Signal::SIGCONT);
        }
    }
}

/// Prints the agent's log when the test fails while it lives (the node's own failure messages
/// carry kubelet's and containerd's, not the agent's).
struct AgentLogOnPanic<'a>(&'a RealNode);

impl Drop for AgentLogOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- agent log\n{}", agent_log(self.0));
            eprintln!("--- peer status\n{:?}", self.0.peer_status());
        }
    }
}

/// The primary conflist as another writer leaves it: our `istio-cni` entry dropped from its
/// plugins, every other byte of meaning kept. Panics when the entry is not there to drop.
fn without_our_entry(conflist: &str) -> String {
    let mut v: Value = serde_json::from_str(conflist).expect("the primary conflist is JSON");
    let plugins = v["plugins"].as_array_mut().expect("a conflist's plugins");
    let before = plugins.len();
    plugins.retain(|p| p["type"] != "istio-cni");
    assert_eq!(
        plugins.len(),
        before - 1,
        "no istio-cni entry in\n{conflist}"
    );
    serde_json::to_string_pretty(&v).unwrap()
}

/// The pod IPs each update of pod `name` shows, as a watch (the agent's kind) sees them from the
/// moment it starts: whether kubelet reports a replaced sandbox's IP change with an empty step
/// between the two addresses.
struct IpSteps {
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl IpSteps {
    async fn watch(node: &RealNode, name: &str) -> IpSteps {
        let api = Api::<Pod>::namespaced(node.client(), NS);
        let rv = api.get(name).await.unwrap().metadata.resource_version;
        let wp = WatchParams::default().fields(&format!("metadata.name={name}"));
        let mut events = api.watch(&wp, &rv.unwrap()).await.unwrap().boxed();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let seen = seen.clone();
            async move {
                while let Some(event) = events.next().await {
                    let Ok(WatchEvent::Modified(p)) = event else {
                        continue;
                    };
                    let ips: Vec<String> = p
                        .status
                        .and_then(|s| s.pod_ips)
                        .into_iter()
                        .flatten()
                        .map(|ip| ip.ip)
                        .collect();
                    seen.lock().unwrap().push(ips.join(","));
                }
            }
        });
        IpSteps { seen, task }
    }

    /// The IPs of each update that changed them ("" for none), in order.
    fn steps(&self) -> Vec<String> {
        let mut steps = self.seen.lock().unwrap().clone();
        steps.dedup();
        steps
    }
}

impl Drop for IpSteps {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Each run's witness of container `app` of pod `name`, in order.
fn witnesses(node: &RealNode, name: &str, uid: &str) -> Vec<String> {
    node.container_output(NS, name, uid, "app")
        .iter()
        .map(|l| l.trim().to_string())
        .filter(|l| l == "REDIRECTED" || l == "DIRECT")
        .collect()
}

/// The inode of the pod's current network namespace (through one of its processes).
fn pod_netns_ino(node: &RealNode, uid: &str) -> u64 {
    let path = node.pod_netns(uid).expect("a process of the pod");
    std::fs::metadata(path).unwrap().ino()
}

/// Waits until the peer runs pod `uid`'s proxies in the namespace `ino`.
async fn wait_peer_netns(node: &RealNode, uid: &str, ino: u64, what: &str) {
    node.eventually(what, REPAIRED_WITHIN, || async {
        let st = node.peer_status()?;
        let w = &st["workloads"][uid];
        (w["netns_ino"].as_u64() == Some(ino) && w["state"] == "Up").then_some(())
    })
    .await
}

/// Waits until pod `name` (UID `uid`) has run `runs` times and runs again, in a sandbox with an
/// address other than `old_ip`.
async fn wait_new_sandbox(node: &RealNode, name: &str, runs: i32, old_ip: &str) -> Pod {
    node.eventually(
        &format!("{name}: sandbox {runs} Running with a new IP"),
        Duration::from_secs(120),
        || async {
            let p = get(node, NS, name).await?;
            let st = p.status.as_ref()?;
            let restarted = st.container_statuses.as_ref()?.first()?.restart_count >= runs;
            let moved = st.pod_ip.as_deref().is_some_and(|ip| ip != old_ip);
            (running(&p) && restarted && moved).then_some(p)
        },
    )
    .await
}

/// The pod's sandbox as it was before a replacement: what the new one must differ from.
struct Before {
    uid: String,
    ip: String,
    netns: u64,
    adds: usize,
    steps: IpSteps,
}

impl Before {
    async fn take(node: &RealNode, name: &str) -> Before {
        let p = get(node, NS, name).await.unwrap();
        let uid = p.metadata.uid.clone().unwrap();
        Before {
            ip: p.status.as_ref().unwrap().pod_ip.clone().unwrap(),
            netns: pod_netns_ino(node, &uid),
            adds: zds_adds(node, &uid),
            steps: IpSteps::watch(node, name).await,
            uid,
        }
    }
}

/// The ZDS Adds of pod `uid` the peer has logged.
fn zds_adds(node: &RealNode, uid: &str) -> usize {
    node.peer_status().map_or(0, |s| {
        s["log"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e.as_str() == Some(&format!("add {uid}")))
            .count()
    })
}

/// Waits until pod `name`, whose sandbox `was` replaced and now runs as `p`, is enrolled in its
/// new netns: rules of the agent's backend there, the peer handed the new netns for the same UID
/// by a new ZDS Add (ztunnel drains the old proxy and starts one there; ZDS carries no address,
/// so the IP change itself is nothing ztunnel is told), the probe entry moved to the new IP with
/// the old one out, and a connection from the pod redirected now. Returns the new IP.
async fn wait_enrolled_again(
    node: &RealNode,
    backend: Backend,
    name: &str,
    was: &Before,
    p: &Pod,
) -> String {
    let uid = &was.uid;
    let (old_ip, new_ip) = (&was.ip, p.status.as_ref().unwrap().pod_ip.clone().unwrap());
    let new_ns_path = node.pod_netns(uid).unwrap();
    let new_ns = pod_netns_ino(node, uid);
    assert_ne!(new_ns, was.netns, "{name}: the sandbox kept its netns");
    // ztunnel's way: an Add of the same UID with the new netns (the old proxy drained).
    wait_peer_netns(
        node,
        uid,
        new_ns,
        &format!("{name}: the peer runs it in the new netns"),
    )
    .await;
    assert!(zds_adds(node, uid) > was.adds, "{name}: no new ZDS Add");
    // Rules in the new netns, of the agent's backend (in place before the Add).
    let rules = match backend {
        Backend::Nftables => netns_exec(&new_ns_path, "nft", &["list", "ruleset"]),
        Backend::Iptables => netns_exec(&new_ns_path, "iptables-nft-save", &[]),
    };
    assert!(rules.contains("15006"), "{name}: no redirect in\n{rules}");
    // The host probe entry followed the IP.
    node.eventually(
        &format!("{name}: probe entry moved {old_ip} -> {new_ip}"),
        REPAIRED_WITHIN,
        || async {
            let state = host_state(node, backend);
            (mentions(&state, &new_ip) && !mentions(&state, old_ip)).then_some(())
        },
    )
    .await;
    assert!(redirected_now(node, NS, name), "{name}: not redirected now");
    eprintln!(
        "{name}: pod IPs as a watch saw them: {} -> {:?}",
        was.ip,
        was.steps.steps()
    );
    new_ip
}

/// The pod's sandbox replaced: its pause process (catatonit) killed, so kubelet tears the sandbox
/// down and makes a new one (a new netns; host-local hands out the next address) and restarts the
/// containers in it, through the whole CNI chain: our ADD enrolls the new netns before its
/// containers start (the new container's witness REDIRECTED), and the pod ends enrolled there
/// ([`wait_enrolled_again`]).
async fn replace_sandbox(node: &RealNode, backend: Backend, name: &str) -> Pod {
    let began = Instant::now();
    let was = Before::take(node, name).await;
    kill_pause(node, &was.uid);
    let p = wait_new_sandbox(node, name, 1, &was.ip).await;
    // The new container's witness (its first act in the new netns).
    assert_eq!(
        witnesses(node, name, &was.uid),
        ["REDIRECTED", "REDIRECTED"],
        "{name}: each run's witness"
    );
    let new_ip = wait_enrolled_again(node, backend, name, &was, &p).await;
    eprintln!(
        "{name} ({}): sandbox replaced ({} -> {new_ip}), re-enrolled in {:?}",
        backend.name(),
        was.ip,
        began.elapsed()
    );
    p
}

/// The pod's sandbox replaced with no CNI ADD of ours: in production, the primary CNI rewrote its
/// conflist without our entry and the runtime set a sandbox up before our installer chained it
/// back. Made deterministic here by holding the agent ([`HeldAgent`]) while the conflist loses our
/// entry, the pause process is killed and kubelet makes the new sandbox from that conflist; then
/// the agent goes on. Its installer chains our entry back, and its drift check finds the cached
/// netns (kept alive by the agent's fd) holding none of the pod's addresses, looks the new one up
/// under /proc, enrolls it and sends an Add of the same UID: the pod ends enrolled in the new netns
/// ([`wait_enrolled_again`]), counted as a pod drift repair, the agent never restarted.
///
/// What fail closed means here: nothing can refuse this sandbox (no ADD asked us), so its
/// containers start unredirected (the new run's witness is DIRECT) and stay so until the first
/// drift check after the agent's watch shows the new IP: at most one drift period
/// (`DRIFT_CHECK_INTERVAL_SECONDS`: 30 s by default, [`DRIFT_SECONDS`] here) with the agent
/// running; here the time the agent was held comes on top.
async fn replace_sandbox_unchained(node: &RealNode, backend: Backend, name: &str) -> Pod {
    let began = Instant::now();
    let _log = AgentLogOnPanic(node);
    let was = Before::take(node, name).await;
    let pod_repairs = drift_repairs(node, backend, "pod");
    let conflist = node.node_path(&node.conflist());
    let chained = std::fs::read_to_string(&conflist).unwrap();
    let held = HeldAgent::stop(node);
    std::fs::write(&conflist, without_our_entry(&chained)).unwrap();
    kill_pause(node, &was.uid);
    let p = wait_new_sandbox(node, name, 1, &was.ip).await;
    // The new run started in a netns nothing redirected (no ADD of ours, the agent held).
    let runs = node
        .eventually(
            &format!("{name}: the new run's witness"),
            REPAIRED_WITHIN,
            || async { Some(witnesses(node, name, &was.uid)).filter(|w| w.len() == 2) },
        )
        .await;
    assert_eq!(runs, ["REDIRECTED", "DIRECT"], "{name}: each run's witness");
    let released = Instant::now();
    drop(held);
    let new_ip = wait_enrolled_again(node, backend, name, &was, &p).await;
    let window = released.elapsed();
    assert!(
        drift_repairs(node, backend, "pod") > pod_repairs,
        "{name}: no pod drift repair counted"
    );
    let log = agent_log(node);
    assert!(
        log.contains("replaced without a CNI ADD"),
        "{name}: the drift check did not enroll the new netns:\n{log}"
    );
    node.eventually(
        "the installer chained our entry back and the agent is ready",
        REPAIRED_WITHIN,
        || async {
            let now = std::fs::read_to_string(&conflist).ok()?;
            let ready = agent_http(node, "8000/readyz").0 == "200";
            (now.contains("\"istio-cni\"") && ready).then_some(())
        },
    )
    .await;
    assert!(agent_never_restarted(node), "the agent restarted");
    eprintln!(
        "{name} ({}): sandbox replaced without our ADD ({} -> {new_ip}), enrolled by the drift \
         check {window:?} after the agent went on, {:?} in all",
        backend.name(),
        was.ip,
        began.elapsed()
    );
    p
}

/// kubelet's probes to ambient pods through every kind of host flush, on both backends (the
/// second reached by a live switch), and two pods whose sandbox is replaced: the probe SNAT and
/// entries are back within a drift period or two, the pods stay Ready and are never restarted by
/// kubelet (but for the replacement's one), the agent never restarts and stays ready; a pod
/// created while the host is being flushed is still redirected; a replaced sandbox is enrolled
/// again in its new netns with its new IP, by our ADD or, when none reached us, by the drift check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_flushes_and_replaced_sandboxes_keep_probes_and_redirection() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let began = Instant::now();
    let node = RealNode::up().await;
    let drift = format!("env.DRIFT_CHECK_INTERVAL_SECONDS={DRIFT_SECONDS}");
    node.install_chart(&["--set-string", &drift]).await;
    node.namespace(NS, true).await;
    let mut uids = Vec::new();
    for name in ["web-0", "web-1"] {
        uids.push(create(&node, NS, probed_pod(name)).await);
    }
    let mut ips = Vec::new();
    for name in ["web-0", "web-1"] {
        let p = wait_running(&node, NS, name).await;
        wait_redirection(&node, NS, name, Some("enabled")).await;
        ips.push(p.status.unwrap().pod_ip.unwrap());
    }
    assert!(probes_programmed(
        &host_state(&node, Backend::Nftables),
        &ips
    ));
    // Before any fault, kubelet's probes bypass the proxy: the SNAT works.
    let quiet = wait_probes_bypass(&node, &uids, "probes bypass the proxy").await;
    assert!(
        quiet.values().all(|n| *n == 0),
        "probes went through the proxy before any fault: {quiet:?}"
    );
    eprintln!(
        "node up, chart installed, pods Ready: {:?}",
        began.elapsed()
    );

    // The node's own rules (kubelet's and kube-proxy's iptables-nft), as a firewall would keep
    // them to load again at its reload: before any fault took them.
    let own = node_sh(&node, "iptables-nft-save");
    assert!(!own.contains("ISTIO"), "iptables rules of ours: {own}");
    let saved = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(saved.path(), &own).unwrap();
    let nft = Backend::Nftables;
    fault_then_repair(&node, nft, &uids, &ips, "nft flush ruleset", || {
        node_sh(&node, "nft flush ruleset");
    })
    .await;
    // firewalld's reload with its nftables backend: everything flushed, then its own rules (here
    // the node's: kubelet's and kube-proxy's iptables-nft) loaded again, never ours.
    let reload = format!(
        "nft flush ruleset && iptables-nft-restore < {}",
        saved.path().display()
    );
    fault_then_repair(&node, nft, &uids, &ips, "firewalld-style reload", || {
        node_sh(&node, &reload);
    })
    .await;
    assert!(
        own.contains(":KUBE-IPTABLES-HINT")
            && node_sh(&node, "iptables-nft-save").contains(":KUBE-IPTABLES-HINT"),
        "the reload put the node's own rules back"
    );

    // An ambient pod created while the host is flushed over and over (every 100 ms for 5 s): its
    // ADD may fail (the probe set gone under it; kubelet retries the sandbox) but never succeeds
    // unredirected, and its probe entry is there once the flushing stops.
    let flusher = {
        let ns = node_netns(&node);
        std::thread::spawn(move || {
            for _ in 0..50 {
                netns_exec(&ns, "nft", &["flush", "ruleset"]);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let late = create(&node, NS, probed_pod("late")).await;
    tokio::task::spawn_blocking(move || flusher.join().unwrap())
        .await
        .unwrap();
    let late_pod = wait_running(&node, NS, "late").await;
    assert_eq!(
        witnesses(&node, "late", &late),
        ["REDIRECTED"],
        "an ADD during host flushes"
    );
    uids.push(late);
    ips.push(late_pod.status.unwrap().pod_ip.unwrap());
    node.eventually(
        "probe entries after the flushing stopped",
        REPAIRED_WITHIN,
        || async { probes_programmed(&host_state(&node, nft), &ips).then_some(()) },
    )
    .await;
    wait_probes_bypass(&node, &uids, "probes SNATed after the flushing").await;

    // Replaced netns and changed IP without our ADD, right after the burst: only the agent's pod
    // watch tells it the new IP, and the burst took kube-proxy's NAT from under the watch's
    // connection to the API server's Service address (issue #39): the node's kernel reset the
    // server's end, and the agent's end stayed ESTABLISHED and deaf until kube's 295 s watch
    // idle timeout, so this failed before the kube client's TCP keepalive (1dab3b8). Enrolled
    // within REPAIRED_WITHIN: the watch heard the update within one default drift period.
    let p = replace_sandbox_unchained(&node, nft, "web-1").await;
    ips[1] = p.status.unwrap().pod_ip.unwrap();
    wait_host_programmed(&node, nft, &ips, "probe entry of the new sandbox").await;
    wait_probes_bypass(&node, &uids, "probes SNATed in the new sandbox").await;

    assert_ready_with_restarts(&get(&node, NS, "web-1").await.unwrap(), 1);
    for name in ["web-0", "late"] {
        assert_ready_with_restarts(&get(&node, NS, name).await.unwrap(), 0);
    }
    assert!(
        drift_repairs(&node, nft, "host") >= 2,
        "host repairs not counted"
    );
    assert_eq!(agent_http(&node, "8000/readyz").0, "200");
    assert!(agent_never_restarted(&node), "the agent restarted");
    eprintln!("nftables flushes done: {:?}", began.elapsed());

    // Replaced netns and changed IP, nftables, through our ADD.
    let p = replace_sandbox(&node, nft, "web-0").await;
    ips[0] = p.status.unwrap().pod_ip.unwrap();
    node.eventually(
        "probe entries of the new sandboxes",
        REPAIRED_WITHIN,
        || async { probes_programmed(&host_state(&node, nft), &ips).then_some(()) },
    )
    .await;
    wait_probes_bypass(&node, &uids, "probes SNATed in the new sandboxes").await;

    // A sandbox replacement restarts the containers once, and nothing else restarted any.
    for name in ["web-0", "web-1"] {
        assert_ready_with_restarts(&get(&node, NS, name).await.unwrap(), 1);
    }
    assert_ready_with_restarts(&get(&node, NS, "late").await.unwrap(), 0);
    assert_eq!(agent_http(&node, "8000/readyz").0, "200");
    assert!(agent_never_restarted(&node), "the agent restarted");
    eprintln!("nftables sandbox replaced: {:?}", began.elapsed());

    // The iptables backend, switched to live: the new agent moves the pods and the host to
    // iptables rules and an ipset, then repairs `iptables -t nat -F` + `ipset flush`. The
    // backend is read from the ConfigMap, which the DaemonSet's template does not reflect (as in
    // Istio's chart): the upgrade alone leaves the nftables agent running, so restart the rollout
    // as docs/migrate-from-istio.md tells users to.
    let ipt = Backend::Iptables;
    node.helm(&[
        "upgrade",
        "istio-cni",
        &repo_path(CHART),
        "-n",
        "istio-system",
        "-f",
        &repo_path(VALUES),
        "--set-string",
        &drift,
        "--set",
        "global.nativeNftables=false",
    ]);
    node.kubectl(&[
        "-n",
        "istio-system",
        "rollout",
        "restart",
        "ds/istio-cni-node",
    ]);
    node.rollout("istio-cni-node").await;
    wait_host_programmed(&node, ipt, &ips, "iptables probe rules in place").await;
    wait_probes_bypass(&node, &uids, "probes SNATed by iptables").await;
    let flush = "iptables-nft -t nat -F && ipset flush";
    fault_then_repair(&node, ipt, &uids, &ips, flush, || {
        node_sh(&node, flush);
    })
    .await;
    for name in ["web-0", "web-1", "late"] {
        assert!(redirected_now(&node, NS, name), "{name}: not redirected");
    }
    for name in ["web-0", "web-1"] {
        assert_ready_with_restarts(&get(&node, NS, name).await.unwrap(), 1);
    }
    assert_ready_with_restarts(&get(&node, NS, "late").await.unwrap(), 0);
    assert!(
        drift_repairs(&node, ipt, "host") >= 1,
        "iptables host repairs not counted"
    );
    assert_eq!(agent_http(&node, "8000/readyz").0, "200");
    assert!(agent_never_restarted(&node), "the agent restarted");
    eprintln!("done: {:?}", began.elapsed());
}

#[test]
fn addresses_are_matched_whole() {
    dataplane::enter_test_group!();
    assert!(mentions("elements = { 10.244.0.5 }", "10.244.0.5"));
    assert!(!mentions("elements = { 10.244.0.50 }", "10.244.0.5"));
    assert!(!mentions("110.244.0.5", "10.244.0.5"));
    assert!(mentions("10.244.0.5,", "10.244.0.5"));
    assert_eq!(peer_host("10.244.0.1:43210"), "10.244.0.1");
    assert_eq!(peer_host("[::ffff:10.244.0.1]:43210"), "10.244.0.1");
}
