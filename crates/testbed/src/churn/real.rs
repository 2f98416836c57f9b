//! The churn harness's real node: `scripts/real-node` (kubelet, containerd, runc, the control
//! plane) with our chart and the ztunnel-like peer DaemonSet installed. Pods are API objects in an
//! ambient namespace; kubelet starts each sandbox through containerd → libcni → bridge →
//! `istio-cni` → agent → ZDS, and retries a failed one itself, so an "ADD" here is what kubelet
//! reports: the pod Running, or a `FailedCreatePodSandBox` event.
//!
//! Everything is read from the machine's side: the node's files through its init's
//! `/proc/<pid>/root`, pods' network namespaces through their processes (found by the node's pod
//! cgroups), the agent's fds and RSS from its `/proc`, each witness's output from kubelet's
//! container logs. Faults are the node's own: processes killed, components restarted, pods
//! deleted, files written; the peer's nack / late ack / crash / disconnect through fake-ztunnel's
//! control file. API faults (429/5xx bursts, slow answers, every connection reset) come from the
//! fault proxy ([`RealNode::api_proxy`]) that the agent and its plugin reach the API server
//! through; kubelet and the control plane reach it directly, as they would in a cluster whose
//! API server misbehaves for one client's connections (a load balancer, priority and fairness).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use super::conflist::{ConflistReader, ISTIO_CNI, Rewriter, damage, without_ours};
use super::{
    AddOutcome, AgentSample, ChurnNode, FaultKind, Rng, netns_ino, process_fds, process_memory_kib,
};
use crate::api_proxy::ApiProxy;
use crate::node::binary_dir;
use crate::real_node::{CONFLIST, REDIRECTION, RealNode, annotation, running, witness_pod};

const NAMESPACE: &str = "churn";
/// The `name` of the node's bridge conflist (`scripts/real-node`).
const CONFLIST_NAME: &str = "real-node";
/// The agent's run dir on the node (the chart's hostPath `/var/run/istio-cni`, without the
/// symlink): a 1 MiB tmpfs of its own here, so it can be filled without filling the node's /run.
const RUN_DIR: &str = "/run/istio-cni";
const RUN_DIR_BYTES: u64 = 1 << 20;
/// The node's pod network namespaces (containerd's, `cni-<id>`).
const NODE_NETNS_DIR: &str = "/run/netns";
const AGENT_COMM: &str = "install-cni";
const PEER_COMM: &str = "fake-ztunnel";
/// fake-ztunnel's control file on the node (`deploy/node/ztunnel-peer.yaml`).
const PEER_CONTROL: &str = "/run/ztunnel-peer/control";
/// fake-ztunnel reads its control file every 200 ms.
const PEER_CONTROL_PERIOD: Duration = Duration::from_millis(500);
/// The agent's ZDS ack deadline is 5 s; a "timeout" ack comes later than that.
const LATE_ACK_MS: u64 = 6000;
/// How long kubelet may take to run a pod or report its failed sandbox (its retries back off).
const ADD_WAIT: Duration = Duration::from_secs(45);
/// How long the node may take to converge after faults heal (watch backoffs, reconnects,
/// kubelet's pod cleanup).
const CONVERGE: Duration = Duration::from_secs(60);
/// kubelet's crash-loop backoff cap for the churn node: with kubelet's default (10 s doubling to
/// 5 min) a few agent kills would keep the agent down for minutes, and every pod's ADD with it.
pub const MAX_RESTART_BACKOFF: &str = "2s";

struct ChurnPod {
    uid: String,
    /// `FailedCreatePodSandBox` events already reported as failed ADDs.
    failed_sandboxes: u64,
    /// Running (the harness counts it as added).
    added: bool,
    /// Its sandbox may have been set up while the other writer replaced the conflist: its chain
    /// may have had no `istio-cni`, so it may have started unredirected (Istio's gap too).
    in_writer_window: bool,
}

/// The agent process as the samples saw it.
#[derive(Default)]
struct AgentTrack {
    pid: Option<u32>,
    incarnation: u64,
    /// Restarts the harness caused and has not seen yet.
    expected: u64,
    exits: u64,
}

pub struct RealChurnNode {
    node: RealNode,
    /// In front of the API server for the agent and the plugin.
    proxy: ApiProxy,
    pods: BTreeMap<String, ChurnPod>,
    /// Every pod the harness deleted: UID → how (for violation messages).
    deleted: BTreeMap<String, String>,
    active: BTreeSet<FaultKind>,
    primary: Vec<u8>,
    rewriter: Option<Rewriter>,
    reader: ConflistReader,
    agent: Mutex<AgentTrack>,
    /// Mid-enrollment kills that met the pod's CNI ADD running, and those that did not.
    mid_add: (u64, u64),
    /// Pods that printed DIRECT after starting in the other writer's window.
    window_direct: u64,
    /// The other writer's window outlasts the writer: until the installer chained the file
    /// again and containerd reloaded it.
    window_until: Option<Instant>,
    /// The peer's answer to Adds (first line of its control file) and its disconnect count.
    peer_reply: String,
    peer_disconnects: u64,
}

/// `FailedCreatePodSandBox` events of a pod: how many (kubelet aggregates repeats into a count),
/// and the last message.
fn sandbox_failures(events: &[Event]) -> (u64, String) {
    let mut n = 0;
    let mut last = String::new();
    for e in events {
        let count = e
            .series
            .as_ref()
            .and_then(|s| s.count)
            .or(e.count)
            .unwrap_or(1);
        n += count.max(1) as u64;
        last = e.message.clone().unwrap_or_default();
    }
    (n, last)
}

/// The witness lines of a container's output: REDIRECTED or DIRECT, one per run.
fn witnesses(output: &[String]) -> Vec<&str> {
    output
        .iter()
        .map(|l| l.trim())
        .filter(|l| *l == "REDIRECTED" || *l == "DIRECT")
        .collect()
}

/// The (dev, ino) of a namespace file.
fn ns_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Whether a process is the CNI ADD of pod `name` (libcni passes the pod in `CNI_ARGS`).
fn is_add_of(pid: u32, name: &str) -> bool {
    let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
    let pod = format!("K8S_POD_NAME={name}");
    vars.contains(&&b"CNI_COMMAND=ADD"[..])
        && vars.iter().any(|v| {
            v.starts_with(b"CNI_ARGS=")
                && String::from_utf8_lossy(v)
                    .split(';')
                    .any(|kv| kv == pod || kv.ends_with(&format!("={pod}")))
        })
}

/// Writes fake-ztunnel's control file (atomically: the peer may read it at any moment).
fn write_control(node: &RealNode, reply: &str, disconnects: u64) {
    let path = node.node_path(PEER_CONTROL);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{reply}\ndisconnect {disconnects}\n")).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
}

/// How long containerd may keep using a config version after the file changed (it reloads on
/// inotify events).
const CONFIG_RELOAD: Duration = Duration::from_secs(2);

impl RealChurnNode {
    /// Whether a sandbox set up now may read a config without our entry.
    fn in_window(&self) -> bool {
        self.rewriter.is_some() || self.window_until.is_some_and(|t| Instant::now() < t)
    }

    /// Sets the peer's answer to Adds and waits until it read it.
    async fn steer_peer(&mut self, reply: String) {
        self.peer_reply = reply;
        write_control(&self.node, &self.peer_reply, self.peer_disconnects);
        tokio::time::sleep(PEER_CONTROL_PERIOD).await;
    }

    /// Sets up a running node for the churn: the agent's run dir on a small tmpfs, our chart
    /// and the peer installed, the ambient namespace, the continuous conflist reader.
    pub async fn start(node: RealNode) -> Self {
        node.script(&[
            "exec",
            "sh",
            "-c",
            &format!(
                "mkdir -p {RUN_DIR} && mount -t tmpfs -o size={RUN_DIR_BYTES},mode=0755 tmpfs {RUN_DIR}"
            ),
        ]);
        // Before the peer starts: its first read of the file sets the disconnect baseline.
        write_control(&node, "ack", 0);
        let proxy = node.api_proxy();
        let env = node.api_proxy_env(&proxy);
        node.install_chart(&env.iter().map(String::as_str).collect::<Vec<_>>())
            .await;
        node.namespace(NAMESPACE, true).await;
        let chained = std::fs::read_to_string(node.node_path(CONFLIST)).expect("the conflist");
        assert!(chained.contains(ISTIO_CNI), "not chained: {chained}");
        let reader = ConflistReader::start(node.node_path(CONFLIST), CONFLIST_NAME);
        let mut churn = RealChurnNode {
            primary: without_ours(&chained),
            node,
            proxy,
            pods: BTreeMap::new(),
            deleted: BTreeMap::new(),
            active: BTreeSet::new(),
            rewriter: None,
            reader,
            agent: Mutex::new(AgentTrack::default()),
            mid_add: (0, 0),
            window_direct: 0,
            window_until: None,
            peer_reply: "ack".into(),
            peer_disconnects: 0,
        };
        churn.wait_healthy().await;
        churn
    }

    pub fn node(&self) -> &RealNode {
        &self.node
    }

    /// Requests of the agent and the plugin the API proxy answered with an error status: none
    /// after a burst would mean they bypass the proxy.
    pub fn api_rejected(&self) -> u64 {
        self.proxy.rejected()
    }

    fn pods_api(&self) -> Api<Pod> {
        Api::namespaced(self.node.client(), NAMESPACE)
    }

    /// The agent's process: the DaemonSet container's `install-cni` in this node's pods.
    fn agent_pid(&self) -> Option<u32> {
        self.node
            .pod_processes("/", Some(AGENT_COMM))
            .into_iter()
            .min()
    }

    fn kill(pid: u32) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }

    /// SIGKILLs the agent (kubelet restarts its container); false if none runs.
    fn kill_agent(&self) -> bool {
        let Some(pid) = self.agent_pid() else {
            tracing::warn!("churn: no agent process to kill");
            return false;
        };
        self.agent.lock().unwrap().expected += 1;
        Self::kill(pid);
        true
    }

    /// The last lines of the agent's container logs (every run), for violation reports.
    pub fn agent_log(&self) -> String {
        let dir = self.node.node(1).pod_logs_dir();
        let mut text = String::new();
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(rest) = name.strip_prefix("istio-system_istio-cni-node-") {
                let uid = rest.rsplit('_').next().unwrap_or_default().to_string();
                let pod = name
                    .strip_prefix("istio-system_")
                    .unwrap()
                    .trim_end_matches(&format!("_{uid}"))
                    .to_string();
                let lines = self
                    .node
                    .container_output("istio-system", &pod, &uid, "install-cni");
                text += &format!("--- agent pod {pod}\n");
                for l in &lines[lines.len().saturating_sub(80)..] {
                    text += l;
                    text.push('\n');
                }
            }
        }
        text
    }

    async fn create_object(&self, name: &str) -> String {
        let pod: Pod = serde_json::from_value(witness_pod(name, "sleep 3600")).unwrap();
        let deadline = Instant::now() + CONVERGE;
        loop {
            match self.pods_api().create(&PostParams::default(), &pod).await {
                Ok(p) => return p.metadata.uid.unwrap(),
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(pod = name, error = %e, "churn: pod create failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("cannot create pod {name}: {e}"),
            }
        }
    }

    async fn events(&self, name: &str) -> Option<Vec<Event>> {
        let lp = ListParams::default().fields(&format!(
            "involvedObject.name={name},reason=FailedCreatePodSandBox"
        ));
        Api::<Event>::namespaced(self.node.client(), NAMESPACE)
            .list(&lp)
            .await
            .ok()
            .map(|l| l.items)
    }

    /// What kubelet made of the pod's sandbox: Running (with the witness read), or a new
    /// `FailedCreatePodSandBox` beyond the `seen` already reported, or neither in time.
    async fn await_add(&self, name: &str, uid: &str, seen: u64) -> (AddOutcome, u64) {
        let deadline = Instant::now() + ADD_WAIT;
        loop {
            if let Ok(Some(p)) = self.pods_api().get_opt(name).await
                && running(&p)
            {
                return (self.witnessed(name, uid).await, seen);
            }
            if let Some(events) = self.events(name).await {
                let (failures, why) = sandbox_failures(&events);
                if failures > seen {
                    return (AddOutcome::Failed(why), failures);
                }
            }
            if Instant::now() > deadline {
                return (
                    AddOutcome::Failed(format!("not Running after {ADD_WAIT:?}")),
                    seen,
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A running pod's outcome by its witness: a DIRECT in the other writer's window is an ADD
    /// without our plugin; any other DIRECT is left to [`ChurnNode::check_added`] to report.
    async fn witnessed(&self, name: &str, uid: &str) -> AddOutcome {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = self.node.container_output(NAMESPACE, name, uid, "app");
            let w = witnesses(&out);
            if let Some(first) = w.first() {
                let window =
                    self.pods.get(name).is_some_and(|p| p.in_writer_window) || self.in_window();
                return if *first == "DIRECT" && window {
                    AddOutcome::AddedWithoutPlugin
                } else {
                    AddOutcome::Added
                };
            }
            if Instant::now() > deadline {
                // Reported by check_added as a missing witness.
                return AddOutcome::Added;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn record(&mut self, name: &str, outcome: &AddOutcome, failures: u64) {
        let writer = self.in_window();
        let p = self.pods.get_mut(name).expect("pod known");
        p.failed_sandboxes = failures;
        p.in_writer_window |= writer;
        match outcome {
            AddOutcome::Added => p.added = true,
            AddOutcome::AddedWithoutPlugin => {
                p.added = true;
                self.window_direct += 1;
            }
            AddOutcome::Failed(_) => {}
        }
    }

    /// Waits until pod `name`'s CNI ADD runs (its plugin process exists), then SIGKILLs the
    /// agent `delay` after; returns whether it met the ADD running (else it killed anyway).
    async fn kill_during_add(&self, name: &str, delay: Duration) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        let hit = loop {
            if self
                .node
                .node_processes("istio-cni")
                .into_iter()
                .any(|pid| is_add_of(pid, name))
            {
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        };
        tokio::time::sleep(delay).await;
        self.kill_agent();
        hit
    }

    /// Rules read back from the pod's namespace (`install-cni dataplane inpod verify`), for the
    /// real node's values: nftables, the chart's default IPv6 and DNS capture.
    fn verify_rules(netns: &Path) -> Result<(), String> {
        let out = std::process::Command::new(binary_dir().join("install-cni"))
            .args(["dataplane", "inpod", "verify", "--netns"])
            .arg(netns)
            .args(["--backend", "nftables", "--ipv6=true", "--dns-capture=true"])
            .output()
            .map_err(|e| format!("cannot run install-cni verify: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "rules not in sync: {}{}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// The peer holds `uid` Up with the namespace at `netns`.
    fn peer_holds(status: &serde_json::Value, uid: &str, netns: &Path) -> Result<(), String> {
        let w = &status["workloads"][uid];
        if w.is_null() {
            return Err("unknown to the peer".into());
        }
        if w["state"] != "Up" {
            return Err(format!("peer holds it {}", w["state"]));
        }
        let held = (w["netns_dev"].as_u64(), w["netns_ino"].as_u64());
        match ns_id(netns) {
            Some((dev, ino)) if held == (Some(dev), Some(ino)) => Ok(()),
            _ => Err("the peer holds another namespace for it".into()),
        }
    }

    /// The invariants of one running pod (`pod` as the API has it).
    fn pod_violations(
        &self,
        name: &str,
        p: &ChurnPod,
        pod: Option<&Pod>,
        peer: &serde_json::Value,
    ) -> Vec<String> {
        let mut bad = Vec::new();
        let Some(pod) = pod else {
            return vec!["its API object is gone".into()];
        };
        if !running(pod) {
            bad.push(format!(
                "not Running ({:?})",
                pod.status.as_ref().and_then(|s| s.phase.clone())
            ));
        }
        let out = self.node.container_output(NAMESPACE, name, &p.uid, "app");
        let w = witnesses(&out);
        if w.is_empty() {
            bad.push("printed no witness".into());
        } else if w.contains(&"DIRECT") && !p.in_writer_window {
            bad.push(format!("started unredirected (witnesses {w:?})"));
        }
        match self.node.pod_netns(&p.uid) {
            None => bad.push("no process of its sandbox found".into()),
            Some(netns) => {
                if let Err(e) = Self::verify_rules(&netns) {
                    bad.push(e);
                }
                if let Err(e) = Self::peer_holds(peer, &p.uid, &netns) {
                    bad.push(e);
                }
            }
        }
        match annotation(pod, REDIRECTION) {
            Some(v) if v == "enabled" => {}
            other => bad.push(format!("redirection annotation {other:?}")),
        }
        bad
    }

    /// The host probe set (nftables set elements, each commented with its pod's UID).
    fn probe_set(&self) -> String {
        std::process::Command::new("nsenter")
            .args([
                "-t",
                &self.node.holder_pid().to_string(),
                "-n",
                "nft",
                "list",
                "ruleset",
            ])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// One pass over every invariant of the node; empty when it is converged.
    async fn violations(&self) -> Vec<String> {
        let mut found = Vec::new();
        let api_pods: BTreeMap<String, Pod> =
            match self.pods_api().list(&ListParams::default()).await {
                Ok(l) => l
                    .items
                    .into_iter()
                    .map(|p| (p.metadata.name.clone().unwrap_or_default(), p))
                    .collect(),
                Err(e) => return vec![format!("cannot list pods: {e}")],
            };
        let peer = self.node.peer_status().unwrap_or_default();
        let probes = self.probe_set();
        let live_uids: BTreeSet<&str> = self.pods.values().map(|p| p.uid.as_str()).collect();
        let mut live_netns = BTreeSet::new();
        let mut without_netns = 0;
        for (name, p) in &self.pods {
            match self.node.pod_netns(&p.uid).and_then(|n| netns_ino(&n)) {
                Some(ino) => {
                    live_netns.insert(ino);
                }
                None => without_netns += 1,
            }
            if !p.added {
                continue;
            }
            let mut bad = self.pod_violations(name, p, api_pods.get(name), &peer);
            if !probes.contains(&p.uid) {
                bad.push("not in the host probe set".into());
            }
            if !bad.is_empty() {
                found.push(format!("running pod {name}: {}", bad.join("; ")));
            }
        }
        let gone = |uid: &str| {
            self.deleted
                .get(uid)
                .cloned()
                .unwrap_or_else(|| format!("unknown pod {uid}"))
        };
        if let Some(w) = peer["workloads"].as_object() {
            for uid in w.keys() {
                if !live_uids.contains(uid.as_str()) {
                    found.push(format!("peer still holds {}", gone(uid)));
                }
            }
        }
        for uid in self.deleted.keys() {
            if probes.contains(uid.as_str()) {
                found.push(format!("probe set still holds {}", gone(uid)));
            }
        }
        let hints = self.node.node_path(&format!("{RUN_DIR}/netns"));
        for e in std::fs::read_dir(hints).into_iter().flatten().flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            if !live_uids.contains(f.as_str()) {
                found.push(format!("netns hint {f} left behind: {}", gone(&f)));
            }
        }
        // Sandboxes of deleted pods: a namespace of the node's that no live pod's process is in.
        // A live pod between sandboxes (failed, retried) may own one no process is in yet.
        let stray: Vec<String> = std::fs::read_dir(self.node.node_path(NODE_NETNS_DIR))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("cni-"))
            .filter(|e| netns_ino(&e.path()).is_none_or(|i| !live_netns.contains(&i)))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        if stray.len() > without_netns {
            found.push(format!(
                "pod network namespaces of no live pod left behind: {stray:?} ({without_netns} live pods have no sandbox process)"
            ));
        }
        if let Some(pid) = self.agent_pid() {
            let mut allowed = live_netns.clone();
            allowed.extend(netns_ino(&PathBuf::from(format!(
                "/proc/{}/ns/net",
                self.node.holder_pid()
            ))));
            allowed.extend(netns_ino(&PathBuf::from(format!("/proc/{pid}/ns/net"))));
            if let Some((netns, _)) = process_fds(pid) {
                for ino in netns.into_iter().filter(|i| !allowed.contains(i)) {
                    found.push(format!(
                        "agent holds an fd to network namespace {ino} of no live pod"
                    ));
                }
            }
        }
        match std::fs::read_to_string(self.node.node_path(CONFLIST)) {
            Ok(conflist) => {
                if let Some(why) = damage(&conflist, CONFLIST_NAME) {
                    found.push(format!("CNI config damaged: {why}"));
                } else if !conflist.contains(ISTIO_CNI) {
                    found.push("CNI config not chained (no istio-cni entry)".into());
                }
            }
            Err(e) => found.push(format!("cannot read the CNI config: {e}")),
        }
        found
    }

    /// The peer's status is its live process's: written within the last 3 s (it publishes
    /// every second; a killed peer's file stays behind).
    fn peer_live(&self) -> Option<serde_json::Value> {
        let path = self.node.node_path(crate::real_node::PEER_STATUS);
        let age = SystemTime::now()
            .duration_since(std::fs::metadata(&path).ok()?.modified().ok()?)
            .unwrap_or_default();
        (age < Duration::from_secs(3))
            .then(|| self.node.peer_status())
            .flatten()
    }

    async fn delete_object(&self, name: &str, forced: bool) {
        let dp = if forced {
            DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            }
        } else {
            DeleteParams::default()
        };
        let deadline = Instant::now() + CONVERGE;
        loop {
            match self.pods_api().delete(name, &dp).await {
                Ok(_) => return,
                Err(kube::Error::Api(e)) if e.code == 404 => return,
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(pod = name, error = %e, "churn: pod delete failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("cannot delete pod {name}: {e}"),
            }
        }
    }
}

impl ChurnNode for RealChurnNode {
    fn supports(&self, kind: FaultKind) -> bool {
        matches!(
            kind,
            FaultKind::AgentKill
                | FaultKind::AgentKillMidAdd
                | FaultKind::AgentPodDelete
                | FaultKind::PeerRestart
                | FaultKind::PeerNack
                | FaultKind::PeerSlowAck
                | FaultKind::PeerAckTimeout
                | FaultKind::PeerCrashOnAdd
                | FaultKind::PeerDisconnect
                | FaultKind::ApiRestart
                | FaultKind::ApiErrorBurst
                | FaultKind::ApiSlowAnswers
                | FaultKind::ApiConnectionReset
                | FaultKind::ConflistRewriter
                | FaultKind::DiskFull
                | FaultKind::KubeletRestart
                | FaultKind::ContainerdRestart
        )
    }

    async fn create_pod(&mut self, name: &str, kill_agent_after: Option<Duration>) -> AddOutcome {
        let uid = self.create_object(name).await;
        self.pods.insert(
            name.to_string(),
            ChurnPod {
                uid: uid.clone(),
                failed_sandboxes: 0,
                added: false,
                in_writer_window: self.in_window(),
            },
        );
        // kubelet starts the sandbox only after the scheduler bound the pod: the watcher for its
        // ADD starts in time.
        let added = self.await_add(name, &uid, 0);
        let (outcome, failures) = match kill_agent_after {
            None => added.await,
            Some(delay) => {
                let (added, hit) = tokio::join!(added, self.kill_during_add(name, delay));
                if hit {
                    self.mid_add.0 += 1;
                } else {
                    self.mid_add.1 += 1;
                }
                added
            }
        };
        self.record(name, &outcome, failures);
        outcome
    }

    async fn retry_pod(&mut self, name: &str) -> AddOutcome {
        let (uid, seen) = {
            let p = &self.pods[name];
            (p.uid.clone(), p.failed_sandboxes)
        };
        let (outcome, failures) = self.await_add(name, &uid, seen).await;
        self.record(name, &outcome, failures);
        outcome
    }

    /// `sandbox_first`: a graceful delete (kubelet stops the pod, then the object goes); else
    /// forced (the object goes at once, kubelet cleans up after).
    async fn delete_pod(&mut self, name: &str, sandbox_first: bool) {
        let p = self.pods.remove(name).expect("pod known");
        self.delete_object(name, !sandbox_first).await;
        let how = format!(
            "deleted pod {name} (uid {}; {}, {}, {} failed sandboxes, faults active {:?})",
            p.uid,
            if sandbox_first { "graceful" } else { "forced" },
            if p.added {
                "was Running"
            } else {
                "never Running"
            },
            p.failed_sandboxes,
            self.active
        );
        self.deleted.insert(p.uid, how);
    }

    async fn check_added(&self, name: &str) -> Vec<String> {
        let p = &self.pods[name];
        // The peer's file and the annotation trail the ADD by a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pod = self.pods_api().get_opt(name).await.ok().flatten();
            let peer = self.node.peer_status().unwrap_or_default();
            let bad = self.pod_violations(name, p, pod.as_ref(), &peer);
            if bad.is_empty() || Instant::now() > deadline {
                return bad;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn check_converged(&self) -> Vec<String> {
        let deadline = Instant::now() + CONVERGE;
        loop {
            let found = self.violations().await;
            if found.is_empty() || Instant::now() >= deadline {
                if !found.is_empty() {
                    tracing::error!(?found, agent_log = %self.agent_log(), "not converged");
                }
                return found;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn conflist_reads(&self) -> (u64, Vec<String>) {
        self.reader.seen()
    }

    fn sample(&self) -> Option<AgentSample> {
        let pid = self.agent_pid()?;
        let mut t = self.agent.lock().unwrap();
        if t.pid.is_some_and(|old| old != pid) {
            t.incarnation += 1;
            if t.expected > 0 {
                t.expected -= 1;
            } else {
                t.exits += 1;
            }
        }
        t.pid = Some(pid);
        let (netns, other) = process_fds(pid)?;
        Some(AgentSample {
            incarnation: t.incarnation,
            other_fds: other,
            netns_fds: netns.len() as u64,
            rss_kib: process_memory_kib(pid, "VmRSS")?,
        })
    }

    fn agent_exits(&self) -> u64 {
        self.agent.lock().unwrap().exits
    }

    fn notes(&self) -> Vec<String> {
        vec![
            format!(
                "mid-enrollment kills that met the pod's CNI ADD running: {} of {}",
                self.mid_add.0,
                self.mid_add.0 + self.mid_add.1
            ),
            format!(
                "pods that started unredirected in the other writer's window (enrolled late): {}",
                self.window_direct
            ),
        ]
    }

    async fn inject(&mut self, kind: FaultKind, rng: &mut Rng) {
        tracing::info!(?kind, "churn: injecting fault");
        if kind.lasts() {
            self.active.insert(kind);
        }
        match kind {
            FaultKind::AgentKill => {
                self.kill_agent();
            }
            // Done by the driver through create_pod's kill_agent_after.
            FaultKind::AgentKillMidAdd => {}
            FaultKind::AgentPodDelete => {
                let forced = rng.chance(50);
                let mut args = vec![
                    "-n",
                    "istio-system",
                    "delete",
                    "pod",
                    "-l",
                    "k8s-app=istio-cni-node",
                    "--wait=false",
                ];
                if forced {
                    args.extend(["--grace-period=0", "--force"]);
                }
                self.agent.lock().unwrap().expected += 1;
                self.node.kubectl(&args);
            }
            FaultKind::PeerRestart => {
                if rng.chance(50) {
                    for pid in self.node.pod_processes("/", Some(PEER_COMM)) {
                        Self::kill(pid);
                    }
                } else {
                    self.node.kubectl(&[
                        "-n",
                        "istio-system",
                        "delete",
                        "pod",
                        "-l",
                        "app=ztunnel",
                        "--wait=false",
                    ]);
                }
            }
            FaultKind::ApiRestart => self.node.restart("kube-apiserver").await,
            FaultKind::KubeletRestart => self.node.restart("kubelet").await,
            FaultKind::ContainerdRestart => self.node.restart("containerd").await,
            FaultKind::ConflistRewriter => {
                let period = rng.millis(30, 300);
                self.rewriter = Some(Rewriter::start(
                    self.node.node_path(CONFLIST),
                    self.primary.clone(),
                    period,
                ));
            }
            FaultKind::DiskFull => {
                super::fill(&self.node.node_path(&format!("{RUN_DIR}/filler")));
            }
            FaultKind::PeerNack => {
                self.steer_peer("nack injected: proxy failed to start".into())
                    .await
            }
            FaultKind::PeerSlowAck => {
                let ms = rng.millis(100, 1500).as_millis();
                self.steer_peer(format!("delay {ms}")).await
            }
            FaultKind::PeerAckTimeout => self.steer_peer(format!("delay {LATE_ACK_MS}")).await,
            FaultKind::PeerCrashOnAdd => self.steer_peer("crash".into()).await,
            FaultKind::PeerDisconnect => {
                self.peer_disconnects += 1;
                let reply = self.peer_reply.clone();
                self.steer_peer(reply).await;
            }
            FaultKind::ApiErrorBurst => {
                let status = [429, 500, 503][rng.below(3) as usize];
                self.proxy.set_failing(Some(status));
            }
            FaultKind::ApiSlowAnswers => self.proxy.set_delay(Some(rng.millis(1000, 4000))),
            FaultKind::ApiConnectionReset => self.proxy.reset_connections(),
        }
    }

    async fn heal(&mut self, kind: FaultKind) {
        tracing::info!(?kind, "churn: healing fault");
        self.active.remove(&kind);
        match kind {
            FaultKind::ConflistRewriter => {
                if let Some(r) = self.rewriter.take() {
                    let writes = r.stop();
                    tracing::info!(writes, "churn: other writer stopped");
                }
                // The writer's last version has no entry until the installer chains it again.
                // (Not chained in time is the quiet point's violation to report, not a panic.)
                let path = self.node.node_path(CONFLIST);
                let deadline = Instant::now() + CONVERGE;
                while Instant::now() < deadline
                    && !std::fs::read_to_string(&path).is_ok_and(|t| t.contains(ISTIO_CNI))
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                self.window_until = Some(Instant::now() + CONFIG_RELOAD);
            }
            FaultKind::DiskFull => {
                let _ = std::fs::remove_file(self.node.node_path(&format!("{RUN_DIR}/filler")));
            }
            FaultKind::PeerNack
            | FaultKind::PeerSlowAck
            | FaultKind::PeerAckTimeout
            | FaultKind::PeerCrashOnAdd => self.steer_peer("ack".into()).await,
            FaultKind::ApiErrorBurst => self.proxy.set_failing(None),
            FaultKind::ApiSlowAnswers => self.proxy.set_delay(None),
            _ => {}
        }
    }

    async fn wait_healthy(&mut self) {
        self.node.rollout("istio-cni-node").await;
        self.node.rollout("ztunnel").await;
        let node = &self.node;
        node.eventually("the peer connected with a snapshot", CONVERGE, || async {
            let st = self.peer_live()?;
            (st["connected"] == true && st["snapshot_received"] == true).then_some(())
        })
        .await;
    }
}

/// The whole churn on a fresh real node (kubelet's crash-loop backoff capped at
/// [`MAX_RESTART_BACKOFF`]).
pub fn run_real(cfg: &super::ChurnConfig) -> super::ChurnReport {
    let start = async {
        let node =
            RealNode::up_with(&[("REAL_NODE_MAX_RESTART_BACKOFF", MAX_RESTART_BACKOFF)]).await;
        RealChurnNode::start(node).await
    };
    super::run_on(cfg, start, RealChurnNode::agent_log)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_failures_add_up_aggregated_events() {
        let ev = |count: Option<i32>, msg: &str| Event {
            count,
            message: Some(msg.into()),
            ..Event::default()
        };
        assert_eq!(sandbox_failures(&[]), (0, String::new()));
        let (n, last) = sandbox_failures(&[ev(Some(3), "a"), ev(None, "b")]);
        assert_eq!((n, last.as_str()), (4, "b"));
    }

    #[test]
    fn witness_lines_are_picked_out_of_the_output() {
        let out: Vec<String> = ["starting", "REDIRECTED", "x", "DIRECT "]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(witnesses(&out), ["REDIRECTED", "DIRECT"]);
    }

    #[test]
    fn only_the_add_of_the_named_pod_counts_as_in_flight() {
        let spawn = |command: &str| {
            std::process::Command::new("sleep")
                .arg("5")
                .env("CNI_COMMAND", command)
                .env(
                    "CNI_ARGS",
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE=churn;K8S_POD_NAME=churn-1;K8S_POD_UID=u",
                )
                .spawn()
                .unwrap()
        };
        let mut add = spawn("ADD");
        let mut del = spawn("DEL");
        let found = (add.id(), del.id());
        // spawn returns once exec has begun, but the kernel publishes the new environment a
        // little later: until then /proc/<pid>/environ reads empty.
        for pid in [found.0, found.1] {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|e| e.is_empty())
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        let seen = (
            is_add_of(found.0, "churn-1"),
            is_add_of(found.0, "churn-10"),
            is_add_of(found.1, "churn-1"),
            is_add_of(std::process::id(), "churn-1"),
        );
        let _ = (add.kill(), del.kill(), add.wait(), del.wait());
        assert_eq!(seen, (true, false, false, false));
    }
}
