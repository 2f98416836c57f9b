//! A ztunnel-like ZDS client for tests and the demo (ztunnel.md §5): it connects with ztunnel's
//! backoff, says hello, and treats every message the way ztunnel's state manager does, including
//! the violations that make ztunnel drop the connection (bad packet, Add without fd) or exit
//! (Add without workload_info, Keep after SnapshotSent, a second SnapshotSent).
//!
//! Running workloads survive reconnects, as ztunnel's proxies do; on each new connection the
//! snapshot set and the pending workloads are forgotten, and SnapshotSent drains every workload
//! the new snapshot did not name. In-pod listeners are started through a [`ProxyFactory`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cni_core::zds::{
    WorkloadResponse, ZdsHello, decode_request, encode_hello, encode_response,
    workload_request::Payload,
};
use dataplane::netns::{Netns, NetnsId};
use serde::Serialize;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_seqpacket::UnixSeqpacket;

use crate::pod_proxy::{Accepted, PodProxy};
use cni_agent::zds::packet;

/// Starts the in-pod listeners for a workload (the pod proxy, when it is wired in).
pub trait ProxyFactory: Send + Sync {
    fn start(&self, uid: &str, netns: &Netns) -> Result<Box<dyn RunningProxy>, String>;
}

/// A started set of listeners; dropped when the workload is drained.
pub trait RunningProxy: Send {
    /// Connections accepted so far, for per-pod assertions.
    fn connections(&self) -> u64 {
        0
    }

    /// Each connection (or DNS datagram) accepted so far: listener port, peer, original
    /// destination.
    fn accepted(&self) -> Vec<Accepted> {
        Vec::new()
    }
}

/// Starts [`PodProxy`] (ztunnel's in-pod listeners) for every Add, like a real ztunnel.
pub struct PodProxies;

impl ProxyFactory for PodProxies {
    fn start(&self, _uid: &str, netns: &Netns) -> Result<Box<dyn RunningProxy>, String> {
        let proxy = PodProxy::start(netns).map_err(|e| e.to_string())?;
        Ok(Box::new(proxy))
    }
}

impl RunningProxy for PodProxy {
    fn connections(&self) -> u64 {
        self.counts().values().sum::<usize>() as u64
    }

    fn accepted(&self) -> Vec<Accepted> {
        PodProxy::accepted(self)
    }
}

/// How the peer answers an Add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddReply {
    Ack,
    /// Nack as ztunnel does when a proxy fails to start; the workload stays Pending.
    Nack(String),
    /// Ack only after this long (to exceed the agent's ack deadline).
    Delay(Duration),
    /// Close the connection without answering, as a crashing ztunnel would.
    Crash,
    /// Answer only once the test releases the gate, as it says then.
    Hold(Gate),
}

/// A reply a test holds back: the peer waits on it until [`Gate::release`].
#[derive(Clone, Default)]
pub struct Gate(Arc<tokio::sync::watch::Sender<Option<AddReply>>>);

impl Gate {
    pub fn new() -> Gate {
        Gate::default()
    }

    /// Lets every Add waiting on this gate (and later ones) be answered with `reply`.
    pub fn release(&self, reply: AddReply) {
        self.0.send_replace(Some(reply));
    }

    async fn wait(&self) -> AddReply {
        let mut rx = self.0.subscribe();
        let released = rx.wait_for(Option::is_some).await.expect("gate alive");
        released.clone().expect("released")
    }
}

impl PartialEq for Gate {
    fn eq(&self, other: &Gate) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Gate {}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gate")
    }
}

#[derive(Clone)]
pub struct PeerConfig {
    pub socket: PathBuf,
    /// Written (atomically) with the JSON status after every message, when set.
    pub status_file: Option<PathBuf>,
    pub max_backoff: Duration,
    pub proxies: Option<Arc<dyn ProxyFactory>>,
    /// How often Pending workloads are retried, as ztunnel does (every 5 s): one whose Add
    /// would now be acked comes up without the agent sending it again.
    pub pending_retry: Duration,
}

impl PeerConfig {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        PeerConfig {
            socket: socket.into(),
            status_file: None,
            max_backoff: Duration::from_secs(15),
            proxies: None,
            pending_retry: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub enum WorkloadState {
    Up,
    Pending,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadStatus {
    pub state: WorkloadState,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub netns_dev: u64,
    pub netns_ino: u64,
    pub connections: u64,
    /// What the in-pod listeners accepted, in order: a test on another node (or process) sees
    /// through the status file which listener took a connection, from where, and where it was
    /// going (the proof that it was redirected, on the client's side and on the server's).
    pub accepted: Vec<Accepted>,
}

impl WorkloadStatus {
    pub fn netns(&self) -> NetnsId {
        NetnsId {
            dev: self.netns_dev,
            ino: self.netns_ino,
        }
    }
}

/// Everything the peer saw, as JSON for the demo and as a struct for tests.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PeerStatus {
    pub connected: bool,
    /// Successful connects so far.
    pub connects: u64,
    pub snapshot_received: bool,
    /// ztunnel's readiness: snapshot received and nothing pending.
    pub ready: bool,
    pub workloads: BTreeMap<String, WorkloadStatus>,
    /// Every event in order: "connect", "add <uid>", "keep <uid>", "del <uid>", "snapshot_sent",
    /// "nack <text>", "eof", "closed <why>".
    pub log: Vec<String>,
    /// The protocol error that made the peer exit, like ztunnel's exit(1).
    pub fatal: Option<String>,
}

struct Workload {
    status: WorkloadStatus,
    netns: Netns,
    proxy: Option<Box<dyn RunningProxy>>,
}

#[derive(Default)]
struct State {
    status: PeerStatus,
    workloads: HashMap<String, Workload>,
    snapshot_set: HashSet<String>,
    replies: HashMap<String, AddReply>,
    default_reply: Option<AddReply>,
}

impl State {
    fn refresh(&mut self) {
        self.status.workloads = self
            .workloads
            .iter()
            .map(|(uid, w)| {
                let mut s = w.status.clone();
                s.connections = w.proxy.as_ref().map_or(0, |p| p.connections());
                s.accepted = w.proxy.as_ref().map_or_else(Vec::new, |p| p.accepted());
                (uid.clone(), s)
            })
            .collect();
        self.status.ready = self.status.snapshot_received
            && self
                .workloads
                .values()
                .all(|w| w.status.state == WorkloadState::Up);
    }
}

struct Inner {
    cfg: PeerConfig,
    state: Mutex<State>,
    disconnect: Notify,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn log(&self, entry: String) {
        self.state().status.log.push(entry);
    }

    /// Writes the status file, if any. In-process users read [`ZdsPeer::status`] instead, so
    /// without a file nothing is serialised per message.
    fn publish(&self) {
        let Some(path) = &self.cfg.status_file else {
            return;
        };
        let json = {
            let mut st = self.state();
            st.refresh();
            serde_json::to_vec_pretty(&st.status)
        };
        if let Ok(json) = json {
            let _ = write_atomically(path, &json);
        }
    }
}

fn write_atomically(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data)?;
    std::fs::rename(tmp, path)
}

/// Control of a running peer. Dropping it stops the peer (its socket closes).
pub struct ZdsPeer {
    inner: Arc<Inner>,
    task: JoinHandle<Result<(), String>>,
    retry: JoinHandle<()>,
}

impl Drop for ZdsPeer {
    fn drop(&mut self) {
        self.task.abort();
        self.retry.abort();
    }
}

/// ztunnel's retry of failed proxies: every `pending_retry`, each Pending workload whose Add
/// would be acked now (no nack configured for it) has its proxy started and goes Up.
async fn retry_pending(inner: Arc<Inner>) {
    loop {
        tokio::time::sleep(inner.cfg.pending_retry).await;
        let mut changed = false;
        {
            let mut st = inner.state();
            let State {
                workloads,
                replies,
                default_reply,
                ..
            } = &mut *st;
            for (uid, w) in workloads.iter_mut() {
                if w.status.state != WorkloadState::Pending {
                    continue;
                }
                let reply = replies.get(uid).or(default_reply.as_ref());
                if matches!(reply, Some(AddReply::Nack(_))) {
                    continue;
                }
                let started = match &inner.cfg.proxies {
                    Some(factory) => factory.start(uid, &w.netns).map(Some),
                    None => Ok(None),
                };
                if let Ok(proxy) = started {
                    w.proxy = proxy;
                    w.status.state = WorkloadState::Up;
                    changed = true;
                }
            }
            if changed {
                st.status.log.push("pending retried".into());
            }
        }
        if changed {
            inner.publish();
        }
    }
}

/// Why a connection ended.
enum ConnEnd {
    /// Reconnect, like ztunnel after EOF or a read failure.
    Reconnect,
    /// ztunnel would exit(1).
    Fatal(String),
}

impl ZdsPeer {
    /// Starts connecting in the background (inside a tokio runtime).
    pub fn start(cfg: PeerConfig) -> ZdsPeer {
        let inner = Arc::new(Inner {
            cfg,
            state: Mutex::new(State::default()),
            disconnect: Notify::new(),
        });
        let task = tokio::spawn(run(inner.clone()));
        let retry = tokio::spawn(retry_pending(inner.clone()));
        ZdsPeer { inner, task, retry }
    }

    pub fn status(&self) -> PeerStatus {
        let mut st = self.inner.state();
        st.refresh();
        st.status.clone()
    }

    /// Also writes the status file every `period`, not only after each ZDS message: connection
    /// counts change between messages.
    pub fn publish_every(&self, period: Duration) -> tokio::task::JoinHandle<()> {
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                inner.publish();
            }
        })
    }

    /// Polls the status until `pred` holds; the error names `what` and shows the last status.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&PeerStatus) -> bool,
    ) -> Result<PeerStatus, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Judged on the live status under the lock: a copy per poll (the log grows with every
            // message) cost the bench more CPU than the agent restart it was timing, and held
            // the lock the peer needs for each message meanwhile.
            {
                let mut st = self.inner.state();
                st.refresh();
                if pred(&st.status) {
                    return Ok(st.status.clone());
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "timed out waiting for {what}; peer status: {:#?}",
                    self.status()
                ));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Sets the answer to Adds for `uid` (or for every UID without its own answer, with `None`).
    pub fn set_add_reply(&self, uid: Option<&str>, reply: AddReply) {
        self.control().set_add_reply(uid, reply)
    }

    /// Closes the current connection; the peer reconnects (a ztunnel stream reset).
    pub fn disconnect(&self) {
        self.control().disconnect()
    }

    /// A handle steering this peer from elsewhere while [`ZdsPeer::join`] waits on it.
    pub fn control(&self) -> PeerControl {
        PeerControl {
            inner: self.inner.clone(),
        }
    }

    /// Waits for the peer to exit; `Err` carries the protocol error (ztunnel's exit 1). Pending
    /// workloads are retried meanwhile, as ztunnel does.
    pub async fn join(mut self) -> Result<(), String> {
        let task = std::mem::replace(&mut self.task, tokio::spawn(async { Ok(()) }));
        let result = task.await.map_err(|e| format!("peer task: {e}"));
        self.retry.abort();
        result?
    }
}

/// Steers a running peer: its answers to Adds and its connection.
#[derive(Clone)]
pub struct PeerControl {
    inner: Arc<Inner>,
}

impl PeerControl {
    /// See [`ZdsPeer::set_add_reply`].
    pub fn set_add_reply(&self, uid: Option<&str>, reply: AddReply) {
        let mut st = self.inner.state();
        match uid {
            Some(uid) => {
                st.replies.insert(uid.to_string(), reply);
            }
            None => st.default_reply = Some(reply),
        }
    }

    /// See [`ZdsPeer::disconnect`].
    pub fn disconnect(&self) {
        self.inner.disconnect.notify_one();
    }

    /// See [`ZdsPeer::status`].
    pub fn status(&self) -> PeerStatus {
        let mut st = self.inner.state();
        st.refresh();
        st.status.clone()
    }
}

async fn connect(inner: &Inner) -> UnixSeqpacket {
    let mut backoff = Duration::from_millis(10);
    loop {
        match UnixSeqpacket::connect(&inner.cfg.socket).await {
            Ok(sock) => return sock,
            Err(e) => {
                tracing::debug!(error = %e, ?backoff, "ZDS peer: connect failed, retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(inner.cfg.max_backoff);
            }
        }
    }
}

async fn run(inner: Arc<Inner>) -> Result<(), String> {
    inner.publish();
    loop {
        let sock = connect(&inner).await;
        {
            let mut st = inner.state();
            st.status.connected = true;
            st.status.connects += 1;
            st.status.snapshot_received = false;
            st.status.log.push("connect".into());
            st.snapshot_set.clear();
            // A new stream forgets failed Adds: the agent must name them again.
            st.workloads
                .retain(|_, w| w.status.state == WorkloadState::Up);
        }
        inner.publish();
        let end = match encode_hello(&ZdsHello::v1()) {
            Ok(hello) => match packet::send(&sock, &hello, None).await {
                Ok(()) => serve(&inner, &sock).await,
                Err(e) => {
                    inner.log(format!("closed hello failed: {e}"));
                    ConnEnd::Reconnect
                }
            },
            Err(e) => ConnEnd::Fatal(e.to_string()),
        };
        drop(sock);
        {
            let mut st = inner.state();
            st.status.connected = false;
            st.status.snapshot_received = false;
        }
        if let ConnEnd::Fatal(why) = end {
            inner.state().status.fatal = Some(why.clone());
            inner.publish();
            return Err(why);
        }
        inner.publish();
    }
}

async fn reply(sock: &UnixSeqpacket, resp: WorkloadResponse) -> bool {
    match encode_response(&resp) {
        Ok(bytes) => packet::send(sock, &bytes, None).await.is_ok(),
        Err(_) => false,
    }
}

async fn serve(inner: &Inner, sock: &UnixSeqpacket) -> ConnEnd {
    loop {
        let got = tokio::select! {
            got = packet::recv(sock) => got,
            () = inner.disconnect.notified() => {
                inner.log("closed by test".into());
                return ConnEnd::Reconnect;
            }
        };
        let datagram = match got {
            Ok(Some(d)) => d,
            Ok(None) => {
                inner.log("eof".into());
                return ConnEnd::Reconnect;
            }
            Err(e) => return read_failure(inner, sock, e.to_string()).await,
        };
        let req = match decode_request(&datagram.bytes) {
            Ok(r) => r,
            Err(e) => return read_failure(inner, sock, e.to_string()).await,
        };
        let mut fds = datagram.fds;
        let payload = req.payload.expect("decode_request guarantees a payload");
        let is_add = matches!(payload, Payload::Add(_));
        match (is_add, fds.len()) {
            (true, 0) => return read_failure(inner, sock, "No control message".into()).await,
            (true, 1) | (false, 0) => {}
            (true, _) => return read_failure(inner, sock, "Too many fds".into()).await,
            (false, _) => {
                return read_failure(inner, sock, "Unexpected control message".into()).await;
            }
        }
        let outcome = match payload {
            Payload::Add(add) => handle_add(inner, add, fds.pop().expect("one fd")).await,
            Payload::Keep(keep) => {
                inner.log(format!("keep {}", keep.uid));
                let mut st = inner.state();
                if st.status.snapshot_received {
                    Err("pod keep received after snapshot".to_string())
                } else {
                    st.snapshot_set.insert(keep.uid);
                    Ok(Some(WorkloadResponse::ack()))
                }
            }
            Payload::Del(del) => {
                inner.log(format!("del {}", del.uid));
                let mut st = inner.state();
                if !st.status.snapshot_received {
                    st.snapshot_set.remove(&del.uid);
                    if st
                        .workloads
                        .get(&del.uid)
                        .is_some_and(|w| w.status.state == WorkloadState::Pending)
                    {
                        st.workloads.remove(&del.uid);
                    }
                } else {
                    st.workloads.remove(&del.uid);
                }
                Ok(Some(WorkloadResponse::ack()))
            }
            Payload::SnapshotSent(_) => {
                inner.log("snapshot_sent".into());
                let mut st = inner.state();
                if st.status.snapshot_received {
                    Err("pod snapshot received already".to_string())
                } else {
                    let keep = std::mem::take(&mut st.snapshot_set);
                    st.workloads.retain(|uid, _| keep.contains(uid));
                    st.status.snapshot_received = true;
                    Ok(Some(WorkloadResponse::ack()))
                }
            }
        };
        match outcome {
            Ok(Some(resp)) => {
                let nack = resp_error(&resp);
                if let Some(text) = nack {
                    inner.log(format!("nack {text}"));
                }
                inner.publish();
                if !reply(sock, resp).await {
                    inner.log("closed reply failed".into());
                    return ConnEnd::Reconnect;
                }
            }
            Ok(None) => {
                inner.log("closed crash".into());
                inner.publish();
                return ConnEnd::Reconnect;
            }
            Err(protocol) => {
                let text = format!("failure to process message : ProtocolError(\"{protocol}\")");
                inner.log(format!("nack {text}"));
                let _ = reply(sock, WorkloadResponse::nack(text)).await;
                return ConnEnd::Fatal(protocol);
            }
        }
    }
}

fn resp_error(resp: &WorkloadResponse) -> Option<String> {
    match &resp.payload {
        Some(cni_core::zds::workload_response::Payload::Ack(ack)) if !ack.error.is_empty() => {
            Some(ack.error.clone())
        }
        _ => None,
    }
}

/// ztunnel answers an unreadable message with a nack and then drops the stream.
async fn read_failure(inner: &Inner, sock: &UnixSeqpacket, why: String) -> ConnEnd {
    let text = format!("failure to read message : {why}");
    inner.log(format!("nack {text}"));
    let _ = reply(sock, WorkloadResponse::nack(text)).await;
    inner.log(format!("closed {why}"));
    ConnEnd::Reconnect
}

/// `Ok(None)` means "crash without answering"; `Err` is a fatal protocol error.
async fn handle_add(
    inner: &Inner,
    add: cni_core::zds::AddWorkload,
    fd: OwnedFd,
) -> Result<Option<WorkloadResponse>, String> {
    let uid = add.uid;
    inner.log(format!("add {uid}"));
    let Some(info) = add.workload_info else {
        return Err("workload_info is required but not present".into());
    };
    // Reopening through /proc validates the fd is a network namespace and yields its identity.
    let netns = match Netns::open(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        Ok(ns) => ns,
        Err(e) => {
            return Ok(Some(WorkloadResponse::nack(format!(
                "failure to read message : {e}"
            ))));
        }
    };
    drop(fd);
    let reply = {
        let mut st = inner.state();
        if !st.status.snapshot_received {
            st.snapshot_set.insert(uid.clone());
        }
        st.replies
            .get(&uid)
            .or(st.default_reply.as_ref())
            .cloned()
            .unwrap_or(AddReply::Ack)
    };
    let reply = match reply {
        AddReply::Hold(gate) => gate.wait().await,
        other => other,
    };
    let fail = match reply {
        AddReply::Hold(_) => Some("a gate released with a gate".to_string()),
        AddReply::Crash => return Ok(None),
        AddReply::Delay(d) => {
            tokio::time::sleep(d).await;
            None
        }
        AddReply::Nack(text) => Some(text),
        AddReply::Ack => None,
    };
    let mut st = inner.state();
    if fail.is_none()
        && st
            .workloads
            .get(&uid)
            .is_some_and(|w| w.status.state == WorkloadState::Up && w.status.netns() == netns.id())
    {
        return Ok(Some(WorkloadResponse::ack()));
    }
    // A different netns means the sandbox was recreated: the old proxy goes first.
    st.workloads.remove(&uid);
    let started = match fail {
        Some(text) => Err(text),
        None => match &inner.cfg.proxies {
            Some(factory) => factory.start(&uid, &netns).map(Some),
            None => Ok(None),
        },
    };
    let (state, proxy, resp) = match started {
        Ok(proxy) => (WorkloadState::Up, proxy, WorkloadResponse::ack()),
        Err(text) => (
            WorkloadState::Pending,
            None,
            WorkloadResponse::nack(format!("failure to start proxy : {text}")),
        ),
    };
    let id = netns.id();
    st.workloads.insert(
        uid,
        Workload {
            status: WorkloadStatus {
                state,
                name: info.name,
                namespace: info.namespace,
                service_account: info.service_account,
                netns_dev: id.dev,
                netns_ino: id.ino,
                connections: 0,
                accepted: Vec::new(),
            },
            netns,
            proxy,
        },
    );
    Ok(Some(resp))
}
