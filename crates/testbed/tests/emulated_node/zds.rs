//! The ZDS server against the ztunnel-like peer (and raw sockets where the peer would be too
//! polite): real SEQPACKET sockets, real fd passing, real namespaces where root is available.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cni_agent::netns_cache::NetnsCache;
use cni_agent::zds::{self, packet};
use cni_agent::zds::{ZdsConfig, ZdsError, ZdsHandle, ZdsServer};
use cni_core::zds::{
    WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello, decode_ack, decode_hello,
    decode_request, encode_hello, encode_request, encode_response,
};
use dataplane::netns::Netns;
use dataplane::test_support::TestNetns;
use testbed::zds_peer::{AddReply, PeerConfig, PeerStatus, PodProxies, WorkloadState, ZdsPeer};
use tokio::sync::oneshot;
use tokio_seqpacket::{UnixSeqpacket, UnixSeqpacketListener};

const WAIT: Duration = Duration::from_secs(5);

fn info(name: &str) -> WorkloadInfo {
    WorkloadInfo::new(name, "default", format!("sa-{name}"))
}

struct Agent {
    _dir: tempfile::TempDir,
    path: PathBuf,
    cache: Arc<NetnsCache>,
    zds: ZdsHandle,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl Agent {
    fn start_with(tweak: impl FnOnce(&mut ZdsConfig)) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ztunnel/ztunnel.sock");
        let mut cfg = ZdsConfig {
            socket_path: path.clone(),
            accept_interval: Duration::ZERO,
            ..Default::default()
        };
        tweak(&mut cfg);
        let cache = Arc::new(NetnsCache::new("/"));
        let (server, zds) = ZdsServer::bind(cfg, cache.clone()).unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(server.serve(async {
            let _ = stopped.await;
        }));
        Agent {
            _dir: dir,
            path,
            cache,
            zds,
            stop: Some(stop),
            server,
        }
    }

    fn start() -> Agent {
        Self::start_with(|_| {})
    }

    fn peer(&self) -> ZdsPeer {
        ZdsPeer::start(PeerConfig::new(&self.path))
    }

    async fn wait_synced(&self, n: usize) {
        wait_until("server-side synced connections", || self.zds.synced() == n).await;
    }

    async fn add(&self, uid: &str, netns: &Netns) -> Result<(), ZdsError> {
        self.cache
            .upsert(uid, info(uid), netns.try_clone().unwrap());
        self.zds.pod_added(uid, info(uid), netns).await
    }

    async fn shutdown(mut self) {
        self.stop.take().unwrap().send(()).unwrap();
        tokio::time::timeout(WAIT, &mut self.server)
            .await
            .expect("server stops")
            .unwrap();
    }
}

async fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn logged(st: &PeerStatus, entry: &str) -> usize {
    st.log.iter().filter(|l| *l == entry).count()
}

#[test]
fn codec_round_trips_every_message() {
    dataplane::enter_test_group!();
    for req in [
        WorkloadRequest::add("uid-1", info("a")),
        WorkloadRequest::keep("uid-2"),
        WorkloadRequest::del("uid-3"),
        WorkloadRequest::snapshot_sent(),
    ] {
        assert_eq!(decode_request(&encode_request(&req).unwrap()).unwrap(), req);
    }
    assert_eq!(
        decode_ack(&encode_response(&WorkloadResponse::ack()).unwrap()).unwrap(),
        Ok(())
    );
    assert_eq!(
        decode_ack(&encode_response(&WorkloadResponse::nack("no")).unwrap()).unwrap(),
        Err("no".to_string())
    );
    assert_eq!(
        decode_hello(&encode_hello(&ZdsHello::v1()).unwrap()).unwrap(),
        ZdsHello::v1()
    );
    let huge = WorkloadRequest::add("u", WorkloadInfo::new("x".repeat(2000), "ns", "sa"));
    assert!(encode_request(&huge).is_err());
    assert!(decode_request(&[0x0a; 1025]).is_err());
}

#[tokio::test]
async fn snapshot_passes_the_netns_fd_then_keeps_and_steady_adds() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    agent
        .cache
        .upsert("with-netns", info("a"), me.try_clone().unwrap());
    agent.cache.ensure("no-netns");
    let peer = agent.peer();
    agent.wait_synced(1).await;
    let st = peer.wait_for("snapshot", WAIT, |s| s.ready).await.unwrap();
    assert_eq!(
        st.workloads["with-netns"].netns(),
        me.id(),
        "the fd received is the same netns"
    );
    assert_eq!(st.workloads["with-netns"].name, "a");
    assert_eq!(st.workloads["with-netns"].service_account, "sa-a");
    assert!(
        !st.workloads.contains_key("no-netns"),
        "Keep does not start anything"
    );
    let pos = |e: &str| {
        st.log
            .iter()
            .position(|l| l == e)
            .unwrap_or_else(|| panic!("{e} missing: {:?}", st.log))
    };
    assert!(pos("add with-netns") < pos("snapshot_sent"));
    assert!(pos("keep no-netns") < pos("snapshot_sent"));
    assert_eq!(logged(&st, "snapshot_sent"), 1);

    agent.add("later", &me).await.unwrap();
    let st = peer.status();
    assert_eq!(st.workloads["later"].state, WorkloadState::Up);
    assert!(
        st.log.iter().position(|l| l == "add later")
            > st.log.iter().position(|l| l == "snapshot_sent")
    );
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register(
        "ack",
        "ack latency",
        agent.zds.metrics().ack_latency.clone(),
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("ack_count 4\n"),
        "snapshot add and keep, SnapshotSent and add acks observed: {text}"
    );
    assert_eq!(agent.zds.metrics().ztunnel_connected.get(), 1);
    agent.shutdown().await;
}

#[tokio::test]
async fn real_netns_fd_is_the_pod_netns() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let pod = TestNetns::new("zds-pod");
    let agent = Agent::start();
    let peer = agent.peer();
    agent.wait_synced(1).await;
    let ns = pod.open();
    agent.add("pod-uid", &ns).await.unwrap();
    let st = peer.status();
    assert_eq!(st.workloads["pod-uid"].netns(), ns.id());
    assert_ne!(ns.id(), Netns::current().unwrap().id());
    // Same namespace again is idempotent on the peer; a recreated sandbox replaces it.
    agent.add("pod-uid", &ns).await.unwrap();
    let other = TestNetns::new("zds-pod2");
    agent.add("pod-uid", &other.open()).await.unwrap();
    assert_eq!(
        peer.status().workloads["pod-uid"].netns(),
        other.open().id()
    );
    assert_eq!(
        agent.cache.get("pod-uid").unwrap().netns.unwrap().id(),
        other.open().id()
    );
    agent.shutdown().await;
}

#[tokio::test]
async fn peer_starts_in_pod_listeners_and_drains_them_on_del() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let pod = TestNetns::new("zds-proxy");
    let agent = Agent::start();
    let mut cfg = PeerConfig::new(&agent.path);
    cfg.proxies = Some(Arc::new(PodProxies));
    let peer = ZdsPeer::start(cfg);
    agent.wait_synced(1).await;
    let ns = pod.open();
    agent.add("proxied", &ns).await.unwrap();
    let listening = pod.exec("ss", &["-ltn"]);
    for port in [":15001", ":15006", ":15008", ":15053"] {
        assert!(
            listening.contains(port),
            "{port} listening after the ack: {listening}"
        );
    }
    ns.run(|| std::net::TcpStream::connect("127.0.0.1:15008").map(drop))
        .unwrap()
        .unwrap();
    peer.wait_for("connection counted", WAIT, |s| {
        s.workloads["proxied"].connections >= 1
    })
    .await
    .unwrap();
    agent.cache.take("proxied");
    agent.zds.pod_deleted("proxied").await.unwrap();
    let listening = pod.exec("ss", &["-ltn"]);
    assert!(
        !listening.contains(":15001"),
        "listeners closed after del: {listening}"
    );
    agent.shutdown().await;
}

/// A CNI ADD with nobody connected waits for a ztunnel (one restarting, or reconnecting to a
/// restarted agent) as long as it is told to, then sends its Add to it.
#[tokio::test]
async fn an_add_can_wait_for_a_ztunnel_to_connect() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let zds = agent.zds.clone();
    let waiting = tokio::spawn(async move { zds.wait_connected(WAIT * 2).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "returned with no ztunnel connected");
    let peer = agent.peer();
    waiting.await.unwrap().expect("a ztunnel connected");
    agent
        .add("early", &Netns::current().unwrap())
        .await
        .unwrap();
    let st = peer.status();
    assert_eq!(st.workloads["early"].state, WorkloadState::Up);
    agent.shutdown().await;
}

#[tokio::test]
async fn no_connection_is_an_error() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let err = agent
        .add("u", &Netns::current().unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, ZdsError::NoConnection), "{err}");
    assert_eq!(err.to_string(), "no ztunnel connection");
    let waited = agent
        .zds
        .wait_connected(Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(matches!(waited, ZdsError::NoConnection), "{waited}");
    agent
        .zds
        .pod_deleted("u")
        .await
        .expect("del with nobody connected is a no-op");
    agent.shutdown().await;
}

#[tokio::test]
async fn snapshot_is_replayed_on_reconnect_and_drains_the_rest() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    let peer = agent.peer();
    agent.wait_synced(1).await;
    agent.add("stays", &me).await.unwrap();
    agent.add("goes", &me).await.unwrap();
    // Forgotten by the agent while the peer is connected: only the next snapshot can drop it.
    agent.cache.take("goes");
    peer.disconnect();
    let st = peer
        .wait_for("second snapshot", WAIT, |s| s.connects == 2 && s.ready)
        .await
        .unwrap();
    assert_eq!(
        logged(&st, "add stays"),
        2,
        "re-sent in the new snapshot: {:?}",
        st.log
    );
    assert_eq!(logged(&st, "snapshot_sent"), 2);
    assert!(st.workloads.contains_key("stays"));
    assert!(
        !st.workloads.contains_key("goes"),
        "not in the snapshot → drained"
    );
    agent.wait_synced(1).await;
    assert_eq!(agent.zds.connected(), 1);
    agent.shutdown().await;
}

#[tokio::test]
async fn nack_returns_ztunnel_text_and_keeps_the_connection() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    let peer = agent.peer();
    agent.wait_synced(1).await;
    peer.set_add_reply(
        Some("bad"),
        AddReply::Nack("Bind([::]:15008, AddrInUse)".into()),
    );
    let err = agent.add("bad", &me).await.unwrap_err();
    match &err {
        ZdsError::Nack(text) => {
            assert_eq!(text, "failure to start proxy : Bind([::]:15008, AddrInUse)")
        }
        other => panic!("expected a nack, got {other}"),
    }
    assert_eq!(peer.status().workloads["bad"].state, WorkloadState::Pending);
    agent.add("good", &me).await.unwrap();
    assert_eq!(
        peer.status().connects,
        1,
        "a nack does not cost the connection"
    );
    agent.shutdown().await;
}

#[tokio::test]
async fn peer_retries_pending_workloads_like_ztunnel() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    let mut cfg = PeerConfig::new(&agent.path);
    cfg.pending_retry = Duration::from_millis(50);
    let peer = ZdsPeer::start(cfg);
    agent.wait_synced(1).await;
    peer.set_add_reply(None, AddReply::Nack("proxy failed".into()));
    agent.add("late", &me).await.unwrap_err();
    // Still refused: the retries keep it Pending.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        peer.status().workloads["late"].state,
        WorkloadState::Pending
    );
    // Once the proxy could start, the retry brings it up with no Add from the agent.
    peer.set_add_reply(None, AddReply::Ack);
    wait_until("pending workload up", || {
        peer.status().workloads["late"].state == WorkloadState::Up
    })
    .await;
    assert_eq!(logged(&peer.status(), "add late"), 1);
    agent.shutdown().await;
}

#[tokio::test]
async fn peer_crash_mid_request_fails_the_request_and_the_peer_resyncs() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    let peer = agent.peer();
    agent.wait_synced(1).await;
    peer.set_add_reply(Some("boom"), AddReply::Crash);
    let err = agent.add("boom", &me).await.unwrap_err();
    assert!(
        matches!(err, ZdsError::ConnectionClosed { kind: "add" }),
        "{err}"
    );
    peer.set_add_reply(Some("boom"), AddReply::Ack);
    // The pod is in the cache, so the reconnecting peer gets it from the snapshot.
    let st = peer
        .wait_for("resync", WAIT, |s| s.connects == 2 && s.ready)
        .await
        .unwrap();
    assert_eq!(st.workloads["boom"].state, WorkloadState::Up);
    agent.wait_synced(1).await;
    agent.shutdown().await;
}

#[tokio::test]
async fn timed_out_request_closes_the_connection() {
    dataplane::enter_test_group!();
    let agent = Agent::start_with(|c| c.ack_timeout = Duration::from_millis(200));
    let me = Netns::current().unwrap();
    let peer = agent.peer();
    agent.wait_synced(1).await;
    peer.set_add_reply(Some("slow"), AddReply::Delay(Duration::from_millis(600)));
    let err = agent.add("slow", &me).await.unwrap_err();
    assert!(
        matches!(err, ZdsError::AckTimeout { kind: "add", .. }),
        "{err}"
    );
    // Istio would keep the connection and read the late ack as the answer to the next request.
    wait_until("connection dropped", || {
        agent.zds.connected() == 0 || peer.status().connects == 2
    })
    .await;
    peer.set_add_reply(Some("slow"), AddReply::Ack);
    let st = peer
        .wait_for("reconnect", WAIT, |s| s.connects == 2 && s.ready)
        .await
        .unwrap();
    assert!(
        st.log
            .iter()
            .any(|l| l == "closed reply failed" || l == "eof"),
        "{:?}",
        st.log
    );
    agent.wait_synced(1).await;
    agent.add("next", &me).await.unwrap();
    assert_eq!(peer.status().workloads["next"].state, WorkloadState::Up);
    agent.shutdown().await;
}

#[tokio::test]
async fn adds_go_to_the_newest_dels_to_all_and_fall_back() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    let old = agent.peer();
    agent.wait_synced(1).await;
    let new = agent.peer();
    agent.wait_synced(2).await;
    agent.add("p1", &me).await.unwrap();
    assert!(new.status().workloads.contains_key("p1"));
    assert!(
        !old.status().workloads.contains_key("p1"),
        "adds only reach the newest ztunnel"
    );

    agent.cache.take("p1");
    agent.zds.pod_deleted("p1").await.unwrap();
    assert_eq!(logged(&old.status(), "del p1"), 1);
    assert_eq!(logged(&new.status(), "del p1"), 1);
    assert!(!new.status().workloads.contains_key("p1"));

    drop(new);
    wait_until("newest gone", || agent.zds.connected() == 1).await;
    agent.add("p2", &me).await.unwrap();
    assert!(
        old.status().workloads.contains_key("p2"),
        "falls back to the previous connection"
    );
    agent.shutdown().await;
}

#[tokio::test]
async fn idle_connection_notices_a_dead_peer() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let peer = agent.peer();
    agent.wait_synced(1).await;
    drop(peer);
    wait_until("dead peer dropped", || agent.zds.connected() == 0).await;
    assert_eq!(agent.zds.metrics().ztunnel_connected.get(), 0);
    agent.shutdown().await;
}

/// The next request the agent writes to a raw peer, within [`WAIT`].
async fn next_request(sock: &UnixSeqpacket) -> WorkloadRequest {
    let d = tokio::time::timeout(WAIT, packet::recv(sock))
        .await
        .expect("a request within the wait")
        .unwrap()
        .expect("connection open");
    decode_request(&d.bytes).unwrap()
}

/// A raw peer sends `resp` (the agent takes it as the answer to its oldest unanswered request).
async fn respond(sock: &UnixSeqpacket, resp: &WorkloadResponse) {
    packet::send(sock, &encode_response(resp).unwrap(), None)
        .await
        .unwrap();
}

/// A raw client that completes the handshake by hand (acking everything).
async fn raw_client(path: &Path) -> UnixSeqpacket {
    let sock = UnixSeqpacket::connect(path).await.unwrap();
    packet::send(&sock, &encode_hello(&ZdsHello::v1()).unwrap(), None)
        .await
        .unwrap();
    loop {
        let d = packet::recv(&sock)
            .await
            .unwrap()
            .expect("snapshot message");
        respond(&sock, &WorkloadResponse::ack()).await;
        if decode_request(&d.bytes).unwrap() == WorkloadRequest::snapshot_sent() {
            return sock;
        }
    }
}

#[tokio::test]
async fn unsolicited_message_is_a_protocol_error() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let sock = raw_client(&agent.path).await;
    agent.wait_synced(1).await;
    respond(&sock, &WorkloadResponse::ack()).await;
    let closed = tokio::time::timeout(WAIT, packet::recv(&sock))
        .await
        .unwrap()
        .unwrap();
    assert!(closed.is_none(), "server closes the connection");
    wait_until("dropped", || agent.zds.connected() == 0).await;
    agent.shutdown().await;
}

#[tokio::test]
async fn missing_hello_times_out() {
    dataplane::enter_test_group!();
    let agent = Agent::start_with(|c| c.hello_timeout = Duration::from_millis(100));
    let sock = UnixSeqpacket::connect(&agent.path).await.unwrap();
    wait_until("registered", || agent.zds.connected() == 1).await;
    let closed = tokio::time::timeout(WAIT, packet::recv(&sock))
        .await
        .unwrap()
        .unwrap();
    assert!(closed.is_none());
    wait_until("dropped", || agent.zds.connected() == 0).await;
    agent.shutdown().await;
}

#[tokio::test]
async fn disconnect_racing_deletes_does_not_deadlock() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    for round in 0..10 {
        let peer = agent.peer();
        agent.wait_synced(1).await;
        let uid = format!("r{round}");
        agent.add(&uid, &me).await.unwrap();
        agent.cache.take(&uid);
        let zds = agent.zds.clone();
        let dels = tokio::spawn(async move {
            for _ in 0..20 {
                zds.pod_deleted(&uid).await.unwrap();
            }
        });
        tokio::task::yield_now().await;
        drop(peer);
        tokio::time::timeout(WAIT, dels)
            .await
            .expect("deletes finish")
            .unwrap();
        wait_until("peer gone", || agent.zds.connected() == 0).await;
    }
    let peer = agent.peer();
    agent.wait_synced(1).await;
    peer.wait_for("ready", WAIT, |s| s.ready).await.unwrap();
    agent.shutdown().await;
}

#[tokio::test]
async fn peer_uid_not_allowed_is_refused() {
    dataplane::enter_test_group!();
    // Tests run as one user, so refuse that user instead of connecting as another one.
    let me = nix::unistd::geteuid().as_raw();
    let agent = Agent::start_with(|c| c.allowed_uids = vec![me.wrapping_add(4242)]);
    let sock = UnixSeqpacket::connect(&agent.path).await.unwrap();
    let _ = packet::send(&sock, &encode_hello(&ZdsHello::v1()).unwrap(), None).await;
    let got = tokio::time::timeout(WAIT, packet::recv(&sock))
        .await
        .unwrap();
    assert!(
        matches!(got, Ok(None) | Err(_)),
        "refused peer gets no snapshot"
    );
    assert_eq!(agent.zds.connected(), 0);
    agent.shutdown().await;
}

#[tokio::test]
async fn socket_setup_replaces_stale_socket_and_guards_the_dir() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let sock_dir = dir.path().join("run");
    std::fs::create_dir(&sock_dir).unwrap();
    std::fs::set_permissions(&sock_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let path = sock_dir.join("ztunnel.sock");
    drop(UnixSeqpacketListener::bind(&path).unwrap());
    assert!(path.exists(), "a stale socket file is left behind");
    let cfg = ZdsConfig {
        socket_path: path.clone(),
        ..Default::default()
    };
    let (server, zds) = ZdsServer::bind(cfg.clone(), Arc::new(NetnsCache::new("/"))).unwrap();
    let mode = std::fs::metadata(&sock_dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode & !0o750,
        0,
        "socket dir tightened to at most 0750, got {mode:o}"
    );
    assert!(!zds.serving());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(async {
        let _ = stopped.await;
    }));
    wait_until("serving", || zds.serving()).await;
    stop.send(()).unwrap();
    task.await.unwrap();
    assert!(!zds.serving());
    assert!(!path.exists(), "socket unlinked on shutdown");

    std::fs::write(&path, b"not a socket").unwrap();
    let err = ZdsServer::bind(cfg, Arc::new(NetnsCache::new("/")))
        .err()
        .expect("refuses a regular file");
    assert!(err.to_string().contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
}

/// A hand-driven agent side, to make the peer face what a buggy agent might send.
async fn raw_server(path: &Path) -> (UnixSeqpacketListener, UnixSeqpacket) {
    let mut listener = UnixSeqpacketListener::bind(path).unwrap();
    let sock = listener.accept().await.unwrap();
    let hello = packet::recv(&sock).await.unwrap().unwrap();
    assert_eq!(decode_hello(&hello.bytes).unwrap(), ZdsHello::v1());
    (listener, sock)
}

async fn ask(
    sock: &UnixSeqpacket,
    req: &WorkloadRequest,
    fd: Option<&Netns>,
) -> Option<Result<(), String>> {
    use std::os::fd::AsFd;
    packet::send(sock, &encode_request(req).unwrap(), fd.map(|n| n.as_fd()))
        .await
        .unwrap();
    packet::recv(sock)
        .await
        .unwrap()
        .map(|d| decode_ack(&d.bytes).unwrap())
}

#[tokio::test]
async fn peer_exits_on_protocol_errors_like_ztunnel() {
    dataplane::enter_test_group!();
    let me = Netns::current().unwrap();
    let no_info = WorkloadRequest {
        payload: Some(cni_core::zds::workload_request::Payload::Add(
            cni_core::zds::AddWorkload {
                uid: "u".into(),
                workload_info: None,
            },
        )),
    };
    let cases: Vec<(Vec<(WorkloadRequest, bool)>, &str)> = vec![
        (
            vec![(no_info, true)],
            "workload_info is required but not present",
        ),
        (
            vec![
                (WorkloadRequest::snapshot_sent(), false),
                (WorkloadRequest::keep("k"), false),
            ],
            "pod keep received after snapshot",
        ),
        (
            vec![
                (WorkloadRequest::snapshot_sent(), false),
                (WorkloadRequest::snapshot_sent(), false),
            ],
            "pod snapshot received already",
        ),
    ];
    for (steps, fatal) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.sock");
        let peer = ZdsPeer::start(PeerConfig::new(&path));
        let (_l, sock) = raw_server(&path).await;
        let last = steps.len() - 1;
        for (i, (req, fd)) in steps.into_iter().enumerate() {
            let verdict = ask(&sock, &req, fd.then_some(&me))
                .await
                .expect("peer answers");
            if i == last {
                assert_eq!(
                    verdict,
                    Err(format!(
                        "failure to process message : ProtocolError(\"{fatal}\")"
                    ))
                );
            } else {
                assert_eq!(verdict, Ok(()));
            }
        }
        let exit = tokio::time::timeout(WAIT, peer.join()).await.unwrap();
        assert_eq!(exit, Err(fatal.to_string()));
    }
}

#[tokio::test]
async fn peer_drops_the_stream_on_add_without_fd_and_reconnects() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z.sock");
    let peer = ZdsPeer::start(PeerConfig::new(&path));
    let (mut listener, sock) = raw_server(&path).await;
    let verdict = ask(&sock, &WorkloadRequest::add("u", info("a")), None).await;
    assert_eq!(
        verdict,
        Some(Err("failure to read message : No control message".into()))
    );
    assert!(
        packet::recv(&sock).await.unwrap().is_none(),
        "peer closes after the nack"
    );
    let again = tokio::time::timeout(WAIT, listener.accept())
        .await
        .unwrap()
        .unwrap();
    let hello = packet::recv(&again).await.unwrap().unwrap();
    assert_eq!(decode_hello(&hello.bytes).unwrap(), ZdsHello::v1());
    assert_eq!(peer.status().connects, 2);
    // An fd on anything but Add is refused the same way.
    let me = Netns::current().unwrap();
    let verdict = ask(&again, &WorkloadRequest::del("u"), Some(&me)).await;
    assert_eq!(
        verdict,
        Some(Err(
            "failure to read message : Unexpected control message".into()
        ))
    );
}

#[tokio::test]
async fn status_file_is_json() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let dir = tempfile::tempdir().unwrap();
    let status = dir.path().join("status.json");
    let mut cfg = PeerConfig::new(&agent.path);
    cfg.status_file = Some(status.clone());
    let peer = ZdsPeer::start(cfg);
    agent.wait_synced(1).await;
    agent
        .add("json-pod", &Netns::current().unwrap())
        .await
        .unwrap();
    peer.wait_for("add", WAIT, |s| s.workloads.contains_key("json-pod"))
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&status).unwrap()).unwrap();
    assert_eq!(v["connected"], true);
    assert_eq!(v["workloads"]["json-pod"]["state"], "Up");
    assert_eq!(v["workloads"]["json-pod"]["namespace"], "default");
    agent.shutdown().await;
}

/// Runs a real ztunnel (ztunnel.md §4) against our server when `ZTUNNEL_BIN` points to one.
#[tokio::test]
async fn real_ztunnel_handshake_add_and_del() {
    dataplane::enter_test_group!();
    let Some(bin) = std::env::var_os("ZTUNNEL_BIN") else {
        eprintln!(
            "SKIPPED real_ztunnel_handshake_add_and_del: set ZTUNNEL_BIN to a ztunnel built with --features testing"
        );
        return;
    };
    dataplane::require_root!();
    let node = TestNetns::new("zt-node");
    let pod_a = TestNetns::new("zt-pod-a");
    let pod_b = TestNetns::new("zt-pod-b");
    let agent = Agent::start();
    agent.cache.upsert("uid-a", info("pod-a"), pod_a.open());
    let work = tempfile::tempdir().unwrap();
    let xds = work.path().join("local-xds.yaml");
    std::fs::write(&xds, "workloads: []\n").unwrap();
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("proxy")
        .current_dir(work.path())
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("FAKE_CA", "true")
        .env("XDS_ADDRESS", "")
        .env("LOCAL_XDS_PATH", &xds)
        .env("INPOD_UDS", &agent.path)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(work.path().join("ztunnel.log")).unwrap());
    let mut child = node.open().spawn(&mut cmd).expect("start ztunnel");
    let result = async {
        agent.wait_synced(1).await;
        agent.add("uid-b", &pod_b.open()).await?;
        let listening = pod_b.exec("ss", &["-ltn"]);
        assert!(
            listening.contains(":15008"),
            "ztunnel listens in pod b after its ack: {listening}"
        );
        agent.cache.take("uid-b");
        agent.zds.pod_deleted("uid-b").await?;
        Ok::<_, ZdsError>(())
    }
    .await;
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(work.path().join("ztunnel.log")).unwrap_or_default();
    result.unwrap_or_else(|e| panic!("real ztunnel: {e}\n{log}"));
    agent.shutdown().await;
}

/// A non-root ztunnel is trusted through the socket directory the operator gave its UID: it
/// connects and gets its snapshot; another unprivileged peer that can reach the socket (here
/// through the directory's group) is refused by the peer check.
#[tokio::test]
async fn socket_dir_owner_is_the_trusted_ztunnel_and_others_are_refused() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    const ZTUNNEL_UID: u32 = 4242;
    const OTHER_UID: u32 = 4343;
    let agent = Agent::start_with(|c| {
        let dir = c.socket_path.parent().unwrap();
        // The temp dir above is 0700; open it so the unprivileged peers reach the socket dir.
        std::fs::set_permissions(
            dir.parent().unwrap(),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::fs::create_dir(dir).unwrap();
        std::os::unix::fs::chown(dir, Some(ZTUNNEL_UID), Some(ZTUNNEL_UID)).unwrap();
        assert_eq!(c.allowed_uids, vec![0], "root only by default");
    });
    // The unprivileged peers may not reach the binary where cargo put it (a CARGO_TARGET_DIR
    // under /root): they run a copy in the opened temp dir.
    let peer_bin = agent
        .path
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("fake-ztunnel");
    std::fs::copy(env!("CARGO_BIN_EXE_fake-ztunnel"), &peer_bin).unwrap();
    let peer_as = |uid: u32| {
        tokio::process::Command::new("setpriv")
            .args([
                format!("--reuid={uid}"),
                format!("--regid={ZTUNNEL_UID}"),
                "--clear-groups".into(),
                "--".into(),
            ])
            .arg(&peer_bin)
            .arg("--socket")
            .arg(&agent.path)
            .arg("--no-proxies")
            .kill_on_drop(true)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let _ztunnel = peer_as(ZTUNNEL_UID);
    agent.wait_synced(1).await;
    assert_eq!(agent.zds.connected(), 1);

    let _other = peer_as(OTHER_UID);
    // The other peer keeps reconnecting; none of its connections may be counted.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(agent.zds.connected(), 1, "uid {OTHER_UID} must be refused");
    agent.shutdown().await;
}

#[tokio::test]
async fn a_snapshot_runs_ahead_of_its_acks_by_the_window_and_no_further() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    let pods = zds::WRITE_AHEAD + 4;
    for i in 0..pods {
        let uid = format!("pod-{i}");
        agent
            .cache
            .upsert(&uid, info(&uid), me.try_clone().unwrap());
    }
    let sock = UnixSeqpacket::connect(&agent.path).await.unwrap();
    packet::send(&sock, &encode_hello(&ZdsHello::v1()).unwrap(), None)
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..zds::WRITE_AHEAD {
        seen.push(next_request(&sock).await);
    }
    let more = tokio::time::timeout(Duration::from_millis(200), packet::recv(&sock)).await;
    assert!(more.is_err(), "nothing beyond the window before an ack");
    // Each ack lets exactly one more request out, until SnapshotSent.
    while seen.last() != Some(&WorkloadRequest::snapshot_sent()) {
        respond(&sock, &WorkloadResponse::ack()).await;
        seen.push(next_request(&sock).await);
    }
    for _ in 0..zds::WRITE_AHEAD {
        respond(&sock, &WorkloadResponse::ack()).await;
    }
    agent.wait_synced(1).await;
    let mut uids: Vec<&str> = seen.iter().filter_map(|r| r.uid()).collect();
    assert_eq!(uids.len(), pods, "{seen:?}");
    uids.sort();
    uids.dedup();
    assert_eq!(uids.len(), pods, "every pod once: {seen:?}");
    assert!(seen[..pods].iter().all(|r| r.kind() == "add"), "{seen:?}");
    agent.shutdown().await;
}

#[tokio::test]
async fn requests_written_ahead_get_their_own_acks() {
    dataplane::enter_test_group!();
    let agent = Agent::start();
    let me = Netns::current().unwrap();
    let sock = raw_client(&agent.path).await;
    agent.wait_synced(1).await;
    let adds = async {
        tokio::join!(
            agent.add("first", &me),
            agent.add("refused", &me),
            agent.add("last", &me)
        )
    };
    let peer = async {
        // All three arrive before any is acked, then are answered in the order they came.
        let mut uids = Vec::new();
        for _ in 0..3 {
            uids.push(next_request(&sock).await.uid().unwrap().to_string());
        }
        for uid in &uids {
            let resp = if uid == "refused" {
                WorkloadResponse::nack("port busy")
            } else {
                WorkloadResponse::ack()
            };
            respond(&sock, &resp).await;
        }
        uids
    };
    let ((first, refused, last), uids) = tokio::join!(adds, peer);
    assert_eq!(uids.len(), 3);
    first.unwrap();
    match refused {
        Err(ZdsError::Nack(text)) => assert_eq!(text, "port busy"),
        other => panic!("the nack belongs to the refused pod, got {other:?}"),
    }
    last.unwrap();
    agent.shutdown().await;
}
