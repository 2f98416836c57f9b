//! Hostile local callers of the agent's unix sockets: an unprivileged process (a thread running
//! as `nobody`, see `dataplane::test_support::as_user`) on the HTTP sockets (`pluginevent.sock`,
//! `log.sock` and `debug.sock` all sit behind `uds::PeerCheckedListener`) and on the ZDS socket,
//! and a ZDS impostor with an allowed UID that speaks garbage. Each is refused or dropped, no
//! handler runs, the refusal is logged naming the peer, and a real ztunnel keeps working.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use cni_agent::netns_cache::NetnsCache;
use cni_agent::uds::PeerCheckedListener;
use cni_agent::zds::{ZdsConfig, ZdsHandle, ZdsServer, packet};
use cni_core::zds::{WorkloadInfo, ZdsHello, encode_hello};
use dataplane::netns::Netns;
use dataplane::require_root;
use dataplane::test_support::as_user;
use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr};
use testbed::zds_peer::{PeerConfig, WorkloadState, ZdsPeer};
use tokio_seqpacket::UnixSeqpacket;

const NOBODY: u32 = 65534;
const WAIT: Duration = Duration::from_secs(5);

/// Everything the agent logs in this test binary, to check refusals name their peer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logs() -> &'static Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| {
        let captured = Captured::default();
        let writer = captured.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        captured
    })
}

async fn wait_for_log(needle: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let text = String::from_utf8_lossy(&logs().0.lock().unwrap()).into_owned();
        if text.contains(needle) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no log line with {needle:?} in:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A directory `nobody` can traverse, so the peer check (not the directory mode) is what is
/// tested; the production directories are 0750 and keep `nobody` out before that.
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Sends one HTTP request and returns whatever came back before the connection closed.
fn http_exchange(path: &Path) -> std::io::Result<Vec<u8>> {
    // The server closing on us (a refused peer) shows as a reset, or as a broken pipe when it
    // closed before our request was written: refused all the same, nothing came back.
    let closed = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        )
    };
    let mut s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(WAIT))?;
    let mut out = Vec::new();
    match s.write_all(
        b"POST /cmdadd HTTP/1.1\r\nHost: unix\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    ) {
        Err(e) if closed(&e) => return Ok(out),
        other => other?,
    }
    match s.read_to_end(&mut out) {
        Ok(_) => Ok(out),
        Err(e) if closed(&e) => Ok(out),
        Err(e) => Err(e),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprivileged_process_is_refused_on_the_http_sockets() {
    dataplane::enter_test_group!();
    require_root!();
    logs();
    let dir = open_dir();
    let path = dir.path().join(cni_core::cmdadd::EVENT_SOCKET);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let router = Router::new().route(
        "/cmdadd",
        post(move || async move {
            counted.fetch_add(1, Ordering::SeqCst);
            "ok"
        }),
    );
    let listener = PeerCheckedListener::bind(&path, vec![0]).unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let p = path.clone();
    let refused =
        tokio::task::spawn_blocking(move || as_user(NOBODY, NOBODY, move || http_exchange(&p)))
            .await
            .unwrap()
            .unwrap()
            .expect("the socket file itself is open to everyone");
    assert!(
        refused.is_empty(),
        "nobody got an answer: {:?}",
        String::from_utf8_lossy(&refused)
    );
    wait_for_log(&format!("refused plugin socket peer uid={NOBODY}")).await;
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no handler ran for nobody");

    // Root (the container runtime running the plugin) is served on the same socket.
    let p = path.clone();
    let served = tokio::task::spawn_blocking(move || http_exchange(&p))
        .await
        .unwrap()
        .unwrap();
    assert!(
        served.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&served)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nobody_cannot_even_reach_the_sockets_the_agent_creates() {
    dataplane::enter_test_group!();
    require_root!();
    let dir = tempfile::tempdir().unwrap();
    let http = dir.path().join("run/pluginevent.sock");
    let _listener = PeerCheckedListener::bind(&http, vec![0]).unwrap();
    let zds = dir.path().join("ztunnel/ztunnel.sock");
    let (_server, _zds) = ZdsServer::bind(
        ZdsConfig {
            socket_path: zds.clone(),
            ..Default::default()
        },
        Arc::new(NetnsCache::new("/")),
    )
    .unwrap();
    // Make the test's own tempdir traversable: what remains is what the agent set up (root-owned
    // 0750 directories; the socket files themselves are 0666).
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for path in [http, zds] {
        let p = path.clone();
        let err = tokio::task::spawn_blocking(move || {
            as_user(NOBODY, NOBODY, move || seqpacket_or_stream_connect(&p))
        })
        .await
        .unwrap()
        .unwrap()
        .expect_err("nobody cannot reach the socket");
        assert_eq!(err, nix::errno::Errno::EACCES, "{}", path.display());
    }
}

fn seqpacket_or_stream_connect(path: &Path) -> Result<(), nix::errno::Errno> {
    let kind = if path.ends_with("ztunnel.sock") {
        SockType::SeqPacket
    } else {
        SockType::Stream
    };
    let fd = nix::sys::socket::socket(AddressFamily::Unix, kind, SockFlag::SOCK_CLOEXEC, None)?;
    nix::sys::socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(path)?)
}

struct Zds {
    _dir: tempfile::TempDir,
    path: PathBuf,
    cache: Arc<NetnsCache>,
    zds: ZdsHandle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Zds {
    fn start() -> Zds {
        let dir = open_dir();
        let path = dir.path().join("ztunnel/ztunnel.sock");
        let cache = Arc::new(NetnsCache::new("/"));
        let (server, zds) = ZdsServer::bind(
            ZdsConfig {
                socket_path: path.clone(),
                accept_interval: Duration::ZERO,
                hello_timeout: Duration::from_millis(500),
                ack_timeout: Duration::from_millis(500),
                ..Default::default()
            },
            cache.clone(),
        )
        .unwrap();
        // The server made its root-owned directory 0750 (its socket file is 0666); open both so
        // the peer check is what refuses.
        let open = |p: &Path, mode| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        open(path.parent().unwrap(), 0o755);
        open(&path, 0o666);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(server.serve(async {
            let _ = stopped.await;
        }));
        Zds {
            _dir: dir,
            path,
            cache,
            zds,
            stop: Some(stop),
        }
    }

    async fn wait(&self, what: &str, cond: impl Fn(&ZdsHandle) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !cond(&self.zds) {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    async fn add(&self, uid: &str) {
        let me = Netns::current().unwrap();
        let info = WorkloadInfo::new(uid, "default", "sa");
        self.cache
            .upsert(uid, info.clone(), me.try_clone().unwrap());
        self.zds.pod_added(uid, info, &me).await.unwrap();
    }
}

impl Drop for Zds {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// What `nobody` gets from the ZDS socket after sending a valid hello: `Ok(0)` is end of stream.
fn zds_hello_as(path: &Path) -> Result<usize, nix::errno::Errno> {
    let fd = nix::sys::socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    nix::sys::socket::connect(raw, &UnixAddr::new(path)?)?;
    let hello = encode_hello(&ZdsHello::v1()).unwrap();
    // The server may already have closed: a failed send is a refusal too.
    if nix::sys::socket::send(raw, &hello, MsgFlags::empty()).is_err() {
        return Ok(0);
    }
    let tv = nix::sys::time::TimeVal::new(5, 0);
    nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::ReceiveTimeout, &tv)?;
    let mut buf = [0u8; 1024];
    match nix::sys::socket::recv(raw, &mut buf, MsgFlags::empty()) {
        Err(nix::errno::Errno::ECONNRESET) => Ok(0),
        other => other,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprivileged_process_is_refused_on_the_zds_socket() {
    dataplane::enter_test_group!();
    require_root!();
    logs();
    let zds = Zds::start();
    zds.add_cached_only("enrolled");
    let p = zds.path.clone();
    let got =
        tokio::task::spawn_blocking(move || as_user(NOBODY, NOBODY, move || zds_hello_as(&p)))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(got, Ok(0), "nobody gets no snapshot");
    wait_for_log(&format!("ZDS peer uid not allowed; closing uid={NOBODY}")).await;
    assert_eq!(zds.zds.connected(), 0);

    // A real ztunnel (root) still gets the snapshot with the enrolled pod.
    let peer = ZdsPeer::start(PeerConfig::new(&zds.path));
    let st = peer.wait_for("snapshot", WAIT, |s| s.ready).await.unwrap();
    assert_eq!(st.workloads["enrolled"].state, WorkloadState::Up);
}

impl Zds {
    /// A pod the server knows about (its snapshot will carry it) without any connection yet.
    fn add_cached_only(&self, uid: &str) {
        let me = Netns::current().unwrap();
        self.cache
            .upsert(uid, WorkloadInfo::new(uid, "default", "sa"), me);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zds_impostor_is_dropped_and_the_real_ztunnel_is_unaffected() {
    dataplane::enter_test_group!();
    require_root!();
    let zds = Zds::start();
    let peer = ZdsPeer::start(PeerConfig::new(&zds.path));
    peer.wait_for("snapshot", WAIT, |s| s.ready).await.unwrap();
    zds.wait("real peer synced", |z| z.synced() == 1).await;
    zds.add("before").await;

    let hello = encode_hello(&ZdsHello::v1()).unwrap();
    let garbage: &[u8] = b"\xff\xff\xff\xff not protobuf";
    let oversized = vec![0x0a; 64 << 10];
    // First datagram garbage; first datagram too large for the protocol; a valid hello and then
    // garbage where the snapshot's acks belong; a hello and then nothing at all.
    let scripts: [(&str, Vec<&[u8]>); 4] = [
        ("garbage hello", vec![garbage]),
        ("oversized hello", vec![&oversized]),
        ("garbage ack", vec![&hello, garbage]),
        ("silent after hello", vec![&hello]),
    ];
    for (what, datagrams) in scripts {
        let sock = UnixSeqpacket::connect(&zds.path).await.unwrap();
        for d in datagrams {
            // Sending may fail once the server has closed: that is the expected outcome.
            let _ = packet::send(&sock, d, None).await;
        }
        let closed = tokio::time::timeout(WAIT, async {
            loop {
                match packet::recv(&sock).await {
                    Ok(Some(_)) => continue, // snapshot messages the impostor never acks
                    Ok(None) | Err(_) => return,
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "{what}: the server closes the impostor");
        zds.wait(what, |z| z.connected() == 1).await;
        assert_eq!(zds.zds.synced(), 1, "{what}: the real ztunnel stays synced");
    }

    // The real ztunnel kept its workload and still gets new ones.
    zds.add("after").await;
    let st = peer.status();
    assert_eq!(st.workloads["before"].state, WorkloadState::Up);
    assert_eq!(st.workloads["after"].state, WorkloadState::Up);
}
