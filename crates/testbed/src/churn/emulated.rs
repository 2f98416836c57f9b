//! The churn harness's emulated node: the node test kit ([`TestNode`]: a real kube-apiserver, the
//! real agent process, the CNI chain run by the runtime emulator, pods as network namespaces) with
//! the ZDS peer, the fault-injecting API proxy in front of the API server, another writer of the
//! primary CNI config, and a tmpfs run dir that can be filled.
//!
//! The run dir tmpfs needs a private mount namespace: the process must `unshare(CLONE_NEWNS)`
//! before it starts threads (the `churn` binary and test do).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::conflist::{ConflistReader, ISTIO_CNI, Rewriter, damage, without_ours};
use super::{AddOutcome, AgentSample, ChurnNode, FaultKind, Rng, netns_ino, process_fds};
use crate::api_proxy::ApiProxy;
use crate::kube::KubeTestEnv;
use crate::node::{Backend, NodeOptions, TestNode, TestPod, binary_dir};
use crate::zds_peer::{AddReply, PeerConfig, ZdsPeer};

const NAMESPACE: &str = "churn";
const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");
/// Small enough to fill at once, large enough for the agent's sockets and hints.
const RUN_DIR_BYTES: u64 = 1 << 20;
/// The agent's ZDS ack deadline is 5 s; a "timeout" ack comes later than that.
const LATE_ACK: Duration = Duration::from_secs(6);
/// How long the node may take to converge after faults heal (watch backoffs, reconnects).
const CONVERGE: Duration = Duration::from_secs(40);

struct Pod {
    pod: TestPod,
    /// The ADD result the runtime caches for DEL.
    result: Option<Value>,
    /// The sandbox's chain had our plugin and succeeded: it must be redirected.
    meshed: bool,
    /// The agent incarnation its ADD went to.
    added_by: u64,
}

pub struct EmulatedNode {
    node: TestNode,
    proxy: ApiProxy,
    peer: Option<ZdsPeer>,
    pods: BTreeMap<String, Pod>,
    /// Every pod the harness deleted: UID → how (for violation messages).
    deleted: BTreeMap<String, String>,
    /// Faults injected and not healed yet.
    active: BTreeSet<FaultKind>,
    /// Every sandbox namespace made: inode → pod and attempt (an inode held open cannot be
    /// reused, so a leaked fd's inode names its sandbox).
    sandboxes: HashMap<u64, String>,
    incarnation: u64,
    /// The primary config as its own writer writes it (no `istio-cni`).
    primary: Vec<u8>,
    rewriter: Option<Rewriter>,
    reader: ConflistReader,
    /// Whether the agent is waiting to be checked for readiness (killed while the API failed).
    agent_unready: bool,
    exits: u64,
}

fn peer_config(node: &TestNode) -> PeerConfig {
    let mut cfg = PeerConfig::new(node.path("zt/ztunnel.sock"));
    cfg.max_backoff = Duration::from_millis(100);
    cfg
}

impl EmulatedNode {
    pub async fn start(backend: Backend) -> EmulatedNode {
        let kube = KubeTestEnv::start().await;
        let proxy = ApiProxy::start(&kube).await;
        let options = NodeOptions {
            api_port: Some(proxy.port()),
            run_dir_tmpfs: Some(RUN_DIR_BYTES),
            ..NodeOptions::default()
        };
        let node = TestNode::start_on(kube, backend, options).await;
        let peer = ZdsPeer::start(peer_config(&node));
        peer.wait_for("snapshot", Duration::from_secs(20), |s| s.snapshot_received)
            .await
            .unwrap();
        node.create_namespace(NAMESPACE, &[AMBIENT]).await;
        // An agent that exits must take the upgrade path, not uninstall.
        node.create_agent_daemonset().await;
        let primary = without_ours(&node.conflist());
        let reader = ConflistReader::start(node.path("net.d/10-e2e.conflist"), "e2e");
        EmulatedNode {
            node,
            proxy,
            peer: Some(peer),
            pods: BTreeMap::new(),
            deleted: BTreeMap::new(),
            active: BTreeSet::new(),
            sandboxes: HashMap::new(),
            incarnation: 0,
            primary,
            rewriter: None,
            reader,
            agent_unready: false,
            exits: 0,
        }
    }

    pub fn agent_log(&self) -> String {
        self.node.agent_log()
    }

    fn peer(&self) -> &ZdsPeer {
        self.peer.as_ref().expect("peer running")
    }

    /// The kubelet's part: an agent that exited is started again.
    fn revive(&mut self) {
        if let Some(status) = self.node.agent_exited() {
            self.exits += 1;
            tracing::warn!(%status, log = %self.node.agent_log(), "churn: the agent exited; restarting it");
            self.restart_agent();
        }
    }

    fn restart_agent(&mut self) {
        self.node.kill_agent();
        self.node.start_agent();
        self.incarnation += 1;
        self.agent_unready = true;
    }

    /// Runs the chain for the pod's current sandbox with one read of the config.
    async fn add(&mut self, name: &str, kill_after: Option<Duration>) -> AddOutcome {
        if let Some(ino) = netns_ino(&self.pods[name].pod.netns.path()) {
            let faults = &self.active;
            self.sandboxes.insert(
                ino,
                format!(
                    "sandbox {} of {name}, faults active {faults:?}",
                    self.pods[name].pod.container_id
                ),
            );
        }
        let runtime = self.node.runtime();
        let chained = runtime.position(ISTIO_CNI).is_some();
        let incarnation = self.incarnation;
        let mut entry = self.pods.remove(name).expect("pod known");
        let outcome = {
            let add = self.node.sandbox_add_on(&mut entry.pod, runtime);
            match kill_after {
                None => add.await,
                Some(delay) => {
                    let pid = self.node.agent_pid();
                    let kill = async {
                        tokio::time::sleep(delay).await;
                        if let Some(pid) = pid {
                            let _ = nix::sys::signal::kill(
                                nix::unistd::Pid::from_raw(pid as i32),
                                nix::sys::signal::Signal::SIGKILL,
                            );
                        }
                    };
                    let (result, ()) = tokio::join!(add, kill);
                    result
                }
            }
        };
        if kill_after.is_some() {
            self.restart_agent();
        }
        let outcome = match outcome {
            Ok(result) => {
                entry.result = Some(result);
                entry.meshed = chained;
                entry.added_by = incarnation;
                if chained {
                    AddOutcome::Added
                } else {
                    AddOutcome::AddedWithoutPlugin
                }
            }
            Err(e) => AddOutcome::Failed(e.to_string()),
        };
        self.pods.insert(name.to_string(), entry);
        outcome
    }

    /// Rules of a pod read back from its namespace by `install-cni dataplane inpod verify`.
    fn verify_rules(&self, pod: &TestPod) -> Result<(), String> {
        let backend = match self.node.backend {
            Backend::Iptables => "iptables",
            Backend::Nftables => "nftables",
        };
        let out = std::process::Command::new(binary_dir().join("install-cni"))
            .args(["dataplane", "inpod", "verify", "--netns"])
            .arg(pod.netns.path())
            .args(["--backend", backend, "--dns-capture=true"])
            .output()
            .map_err(|e| format!("cannot run install-cni verify: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "rules not in sync: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    fn peer_holds(&self, pod: &TestPod) -> Result<(), String> {
        let st = self.peer().status();
        let Some(w) = st.workloads.get(&pod.uid) else {
            return Err("unknown to the peer".into());
        };
        if w.state != crate::zds_peer::WorkloadState::Up {
            return Err(format!("peer holds it {:?}", w.state));
        }
        if w.netns() != pod.netns.open().id() {
            return Err("the peer holds another namespace for it".into());
        }
        Ok(())
    }

    /// A pod the agent can find again only under /proc: the run dir was full at its ADD, so its
    /// netns hint waited in the memory of an agent that was restarted before it could write it.
    /// The emulated node's pods have no process, so every later agent keeps it for ztunnel
    /// without a namespace (a ZDS Keep, as Istio does for a pod it cannot find), and a ztunnel
    /// that restarts since never learns it. A real node's pods have processes: the restart finds
    /// them under /proc and hands them over with their namespaces.
    fn found_only_under_proc(&self, p: &Pod) -> bool {
        p.added_by != self.incarnation
            && !self.node.path(&format!("run/netns/{}", p.pod.uid)).exists()
    }

    /// Whether the agent named the pod a Keep in the peer's current stream.
    fn peer_kept(&self, uid: &str) -> bool {
        let st = self.peer().status();
        let since = st
            .log
            .iter()
            .rposition(|e| e == "connect")
            .map_or(0, |i| i + 1);
        st.log[since..].iter().any(|e| *e == format!("keep {uid}"))
    }

    /// The host probe set as text (nftables set elements or ipset entries, with their UIDs).
    fn probe_set(&self) -> String {
        let ns = &self.node.node_netns.name;
        let run = |args: &[&str]| {
            std::process::Command::new("ip")
                .args(["netns", "exec", ns])
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        match self.node.backend {
            Backend::Nftables => run(&["nft", "list", "ruleset"]),
            Backend::Iptables => run(&["ipset", "list"]),
        }
    }

    /// One pass over every invariant; empty when the node is converged.
    async fn violations(&self) -> Vec<String> {
        let mut found = Vec::new();
        let live_uids: BTreeSet<&str> = self.pods.values().map(|p| p.pod.uid.as_str()).collect();
        let probes = self.probe_set();
        let annotations: HashMap<String, Option<String>> =
            match self.node.pods(NAMESPACE).list(&Default::default()).await {
                Ok(list) => list
                    .items
                    .into_iter()
                    .map(|p| {
                        let a = p.metadata.annotations.and_then(|a| {
                            a.get(cni_core::reconcile::REDIRECTION_ANNOTATION).cloned()
                        });
                        (p.metadata.uid.unwrap_or_default(), a)
                    })
                    .collect(),
                Err(e) => return vec![format!("cannot list pods: {e}")],
            };
        for (name, p) in &self.pods {
            if !p.meshed {
                continue;
            }
            let mut bad = Vec::new();
            if let Err(e) = self.verify_rules(&p.pod) {
                bad.push(e);
            }
            if let Err(e) = self.peer_holds(&p.pod)
                && !(self.found_only_under_proc(p) && self.peer_kept(&p.pod.uid))
            {
                bad.push(e);
            }
            if !probes.contains(&p.pod.uid) {
                bad.push("not in the host probe set".into());
            }
            match annotations.get(&p.pod.uid) {
                Some(Some(v)) if v == "enabled" => {}
                other => bad.push(format!("redirection annotation {other:?}")),
            }
            if !bad.is_empty() {
                found.push(format!("running pod {name}: {}", bad.join("; ")));
            }
        }
        let st = self.peer().status();
        let gone = |uid: &str| {
            self.deleted
                .get(uid)
                .cloned()
                .unwrap_or_else(|| format!("unknown pod {uid}"))
        };
        for uid in st.workloads.keys() {
            if !live_uids.contains(uid.as_str()) {
                found.push(format!("peer still holds {}", gone(uid)));
            }
        }
        for uid in self.deleted.keys() {
            if probes.contains(uid.as_str()) {
                found.push(format!("probe set still holds {}", gone(uid)));
            }
        }
        if let Ok(dir) = std::fs::read_dir(self.node.path("run/netns")) {
            for e in dir.flatten() {
                let f = e.file_name().to_string_lossy().into_owned();
                if !live_uids.contains(f.as_str()) {
                    found.push(format!("netns hint {f} left behind: {}", gone(&f)));
                }
            }
        }
        if let Some(pid) = self.node.agent_pid() {
            let mut allowed: BTreeSet<u64> = self
                .pods
                .values()
                .filter_map(|p| netns_ino(&p.pod.netns.path()))
                .collect();
            allowed.extend(netns_ino(&self.node.node_netns.path()));
            allowed.extend(netns_ino(Path::new(&format!("/proc/{pid}/ns/net"))));
            if let Some((netns, _)) = process_fds(pid) {
                for ino in netns.into_iter().filter(|i| !allowed.contains(i)) {
                    let whose = self.sandboxes.get(&ino).map_or("unknown", String::as_str);
                    found.push(format!(
                        "agent holds an fd to network namespace {ino} of no live pod: {whose}"
                    ));
                }
            }
        }
        let conflist = self.node.conflist();
        if let Some(why) = damage(&conflist, "e2e") {
            found.push(format!("CNI config damaged: {why}"));
        } else if !conflist.contains(ISTIO_CNI) {
            found.push("CNI config not chained (no istio-cni entry)".into());
        }
        found
    }
}

impl ChurnNode for EmulatedNode {
    /// Every fault but the real node's own: no kubelet, containerd or agent pod here.
    fn supports(&self, kind: FaultKind) -> bool {
        // The API proxy's slow answers and resets are the real node's (issue #39); left out here
        // so the emulated node's seeds keep their schedules.
        !matches!(
            kind,
            FaultKind::AgentPodDelete
                | FaultKind::KubeletRestart
                | FaultKind::ContainerdRestart
                | FaultKind::ApiSlowAnswers
                | FaultKind::ApiConnectionReset
        )
    }

    async fn create_pod(&mut self, name: &str, kill_agent_after: Option<Duration>) -> AddOutcome {
        self.revive();
        let pod = self.node.create_pod_object(NAMESPACE, name, &[]).await;
        self.pods.insert(
            name.to_string(),
            Pod {
                pod,
                result: None,
                meshed: false,
                added_by: 0,
            },
        );
        self.add(name, kill_agent_after).await
    }

    async fn retry_pod(&mut self, name: &str) -> AddOutcome {
        self.revive();
        let entry = self.pods.get_mut(name).expect("pod known");
        let _ = self.node.sandbox_del(&entry.pod, None).await;
        entry.pod.netns = dataplane::test_support::TestNetns::new("pod");
        entry.pod.container_id = format!("{}r", entry.pod.container_id);
        self.add(name, None).await
    }

    async fn delete_pod(&mut self, name: &str, sandbox_first: bool) {
        let entry = self.pods.remove(name).expect("pod known");
        if !sandbox_first {
            self.node.delete_pod(&entry.pod).await;
        }
        let _ = self
            .node
            .sandbox_del(&entry.pod, entry.result.clone())
            .await;
        let uid = entry.pod.uid.clone();
        if sandbox_first {
            self.node.delete_pod(&entry.pod).await;
        }
        let how = format!(
            "deleted pod {name} (uid {uid}; {}, ADD {}, agent incarnation {}, faults active {:?})",
            if sandbox_first {
                "sandbox first"
            } else {
                "API object first"
            },
            if entry.result.is_some() {
                "succeeded"
            } else {
                "failed"
            },
            self.incarnation,
            self.active
        );
        drop(entry);
        self.deleted.insert(uid, how);
    }

    async fn check_added(&self, name: &str) -> Vec<String> {
        let p = &self.pods[name].pod;
        [self.verify_rules(p), self.peer_holds(p)]
            .into_iter()
            .filter_map(Result::err)
            .collect()
    }

    async fn check_converged(&self) -> Vec<String> {
        let deadline = Instant::now() + CONVERGE;
        loop {
            let found = self.violations().await;
            if found.is_empty() || Instant::now() >= deadline {
                if !found.is_empty() {
                    let keep = std::env::temp_dir().join(format!(
                        "churn-agent-{}-{}.log",
                        std::process::id(),
                        self.deleted.len()
                    ));
                    let _ = std::fs::copy(self.node.path("agent.log"), &keep);
                    tracing::error!(?found, agent_log = %keep.display(), "not converged");
                }
                return found;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn conflist_reads(&self) -> (u64, Vec<String>) {
        self.reader.seen()
    }

    fn agent_exits(&self) -> u64 {
        self.exits
    }

    fn sample(&self) -> Option<AgentSample> {
        let pid = self.node.agent_pid()?;
        let (netns, other) = process_fds(pid)?;
        Some(AgentSample {
            incarnation: self.incarnation,
            other_fds: other,
            netns_fds: netns.len() as u64,
            rss_kib: self.node.agent_memory_kib("VmRSS")?,
        })
    }

    async fn inject(&mut self, kind: FaultKind, rng: &mut Rng) {
        tracing::info!(?kind, "churn: injecting fault");
        if kind.lasts() {
            self.active.insert(kind);
        }
        match kind {
            FaultKind::AgentKill => self.restart_agent(),
            FaultKind::AgentPodDelete
            | FaultKind::KubeletRestart
            | FaultKind::ContainerdRestart
            | FaultKind::ApiSlowAnswers
            | FaultKind::ApiConnectionReset => {
                unreachable!("{kind:?} is not supported on the emulated node")
            }
            // Done by the driver through create_pod's kill_agent_after.
            FaultKind::AgentKillMidAdd => {}
            FaultKind::PeerRestart => {
                self.peer = None;
                self.peer = Some(ZdsPeer::start(peer_config(&self.node)));
            }
            FaultKind::PeerNack => self.peer().set_add_reply(
                None,
                AddReply::Nack("injected: proxy failed to start".into()),
            ),
            FaultKind::PeerSlowAck => self
                .peer()
                .set_add_reply(None, AddReply::Delay(rng.millis(100, 1500))),
            FaultKind::PeerAckTimeout => self.peer().set_add_reply(None, AddReply::Delay(LATE_ACK)),
            FaultKind::PeerCrashOnAdd => self.peer().set_add_reply(None, AddReply::Crash),
            FaultKind::PeerDisconnect => self.peer().disconnect(),
            FaultKind::ApiRestart => self.node.kube.restart_apiserver().await,
            FaultKind::ApiErrorBurst => {
                let status = [429, 500, 503][rng.below(3) as usize];
                self.proxy.set_failing(Some(status));
            }
            FaultKind::ConflistRewriter => {
                let period = rng.millis(30, 300);
                self.rewriter = Some(Rewriter::start(
                    self.node.path("net.d/10-e2e.conflist"),
                    self.primary.clone(),
                    period,
                ));
            }
            FaultKind::DiskFull => super::fill(&self.node.path("run/filler")),
        }
    }

    async fn heal(&mut self, kind: FaultKind) {
        tracing::info!(?kind, "churn: healing fault");
        self.active.remove(&kind);
        match kind {
            FaultKind::PeerNack
            | FaultKind::PeerSlowAck
            | FaultKind::PeerAckTimeout
            | FaultKind::PeerCrashOnAdd => self.peer().set_add_reply(None, AddReply::Ack),
            FaultKind::ApiErrorBurst => self.proxy.set_failing(None),
            FaultKind::ConflistRewriter => {
                if let Some(r) = self.rewriter.take() {
                    let writes = r.stop();
                    tracing::info!(writes, "churn: other writer stopped");
                }
            }
            FaultKind::DiskFull => {
                let _ = std::fs::remove_file(self.node.path("run/filler"));
            }
            FaultKind::AgentKill
            | FaultKind::AgentKillMidAdd
            | FaultKind::PeerRestart
            | FaultKind::PeerDisconnect
            | FaultKind::ApiRestart
            | FaultKind::AgentPodDelete
            | FaultKind::KubeletRestart
            | FaultKind::ContainerdRestart
            | FaultKind::ApiSlowAnswers
            | FaultKind::ApiConnectionReset => {}
        }
    }

    async fn wait_healthy(&mut self) {
        self.revive();
        if self.agent_unready {
            self.node.wait_ready().await;
            self.agent_unready = false;
        }
        // The agent may exit meanwhile (a full run dir it only notices now): start it again.
        let deadline = Instant::now() + CONVERGE;
        loop {
            let st = self.peer().status();
            if st.connected && st.snapshot_received {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "peer not connected with a snapshot after {CONVERGE:?}: {st:#?}\n{}",
                self.node.agent_log()
            );
            self.revive();
            if self.agent_unready {
                self.node.wait_ready().await;
                self.agent_unready = false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The whole churn on a fresh emulated node, in a private mount namespace (so this must run
/// before the process starts any thread).
pub fn run_emulated(cfg: &super::ChurnConfig, backend: Backend) -> super::ChurnReport {
    crate::node::private_mount_namespace()
        .expect("unshare(CLONE_NEWNS) needs root and a single thread");
    super::run_on(cfg, EmulatedNode::start(backend), EmulatedNode::agent_log)
}
