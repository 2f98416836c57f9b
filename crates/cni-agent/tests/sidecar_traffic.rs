//! Sidecar redirection with real traffic, for both backends. A pod netns and a peer netns are
//! joined by a veth pair; the sidecar rules come from an injected Pod object through the same
//! detection and backend code the plugin runs. A test proxy runs as UID/GID 1337 in the pod (a
//! separate process: this test binary re-executed through `setpriv`, since a thread cannot
//! change its own UID) and listens on 15001 and 15006.
//!
//! Proven per backend: the app's outbound TCP reaches the proxy on 15001 with its original
//! destination, and the proxy's own upstream connection (UID 1337) bypasses capture and reaches
//! the peer; inbound TCP from the peer reaches the proxy on 15006; excluded outbound ports and
//! ranges, the excluded inbound port 15020 and the app's loopback traffic bypass the proxy.
//!
//! A pod with `hostUsers: false` (its netns owned by a user namespace mapping UIDs 0-65535 to
//! host 100000-165535) gets the same rules: the proxy there runs as the mapped 1337 (host
//! 101337) and must be the one excluded from capture, while the app is redirected.
//!
//! `harness = false`: `main` is either the test driver or, with `SIDECAR_TRAFFIC_PROXY` set, the
//! proxy process itself.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cni_core::redirect::sidecar::{self, Detection, SidecarConfig};
use dataplane::sidecar::SidecarBackend;
use dataplane::test_support::{TestNetns, run};
use nix::sys::socket::{getsockopt, sockopt};
use serde_json::json;

const PROXY_ENV: &str = "SIDECAR_TRAFFIC_PROXY";
const POD_IP: &str = "10.77.0.2";
const PEER_IP: &str = "10.77.0.1";
/// On the peer, in a range the pod excludes from capture.
const EXCLUDED_IP: &str = "10.88.0.1";
const APP_PORT: u16 = 9080;
const PEER_PORT: u16 = 8080;
const EXCLUDED_PORT: u16 = 5555;
const TIMEOUT: Duration = Duration::from_secs(5);

fn main() {
    if std::env::var_os(PROXY_ENV).is_some() {
        proxy_main();
        return;
    }
    dataplane::require_root!();
    // The proxy runs as an unprivileged UID, which may not reach this binary where cargo put it
    // (a CARGO_TARGET_DIR under /root): it runs a copy in a directory everyone can read.
    let exe_dir = tempfile::Builder::new()
        .prefix("sidecar-traffic")
        .permissions(std::fs::Permissions::from_mode(0o755))
        .tempdir()
        .expect("temp dir for the proxy's binary");
    let exe = exe_dir.path().join("proxy");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).expect("copying the test binary");
    PROXY_EXE.set(exe).unwrap();
    for backend in ["iptables", "nftables"] {
        eprintln!("sidecar_traffic: {backend}");
        scenario(backend);
    }
    for (backend, variant) in [
        ("iptables", Some("nft")),
        ("iptables", Some("legacy")),
        ("nftables", None),
    ] {
        eprintln!("sidecar_traffic: {backend} {variant:?}, pod with hostUsers: false");
        userns_scenario(backend, variant);
    }
    eprintln!("sidecar_traffic: ok");
    drop(exe_dir);
}

/// This binary, where the proxy's UID can run it (set by `main`).
static PROXY_EXE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

fn proxy_exe() -> &'static std::path::Path {
    PROXY_EXE.get().expect("main copies the binary first")
}

// ---- the proxy process (UID 1337, inside the pod netns) ---------------------------------------

fn original_dst(stream: &TcpStream) -> SocketAddr {
    let sin = getsockopt(stream, sockopt::OriginalDst).expect("SO_ORIGINAL_DST");
    SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
        u16::from_be(sin.sin_port),
    ))
}

/// 15001: connect to the original destination (as UID 1337, so it must bypass capture), relay
/// its greeting. 15006: name the original destination.
fn proxy_main() {
    assert_eq!(
        nix::unistd::getuid().as_raw(),
        1337,
        "proxy must run as 1337"
    );
    let outbound = TcpListener::bind("0.0.0.0:15001").expect("bind 15001");
    let inbound = TcpListener::bind("0.0.0.0:15006").expect("bind 15006");
    std::thread::spawn(move || {
        for conn in inbound.incoming().flatten() {
            let dst = original_dst(&conn);
            let mut conn = conn;
            let _ = writeln!(
                conn,
                "proxy-inbound uid={} dst={dst}",
                nix::unistd::getuid()
            );
        }
    });
    println!("ready");
    std::io::stdout().flush().unwrap();
    for conn in outbound.incoming().flatten() {
        std::thread::spawn(move || {
            let dst = original_dst(&conn);
            let upstream = TcpStream::connect_timeout(&dst, TIMEOUT)
                .and_then(|s| {
                    s.set_read_timeout(Some(TIMEOUT))?;
                    Ok(s)
                })
                .map(read_line)
                .unwrap_or_else(|e| format!("upstream error: {e}"));
            let mut conn = conn;
            let _ = writeln!(conn, "proxy-outbound dst={dst} upstream=[{upstream}]");
        });
    }
}

// ---- the driver -------------------------------------------------------------------------------

fn read_line(mut s: TcpStream) -> String {
    let mut out = String::new();
    let _ = s.set_read_timeout(Some(TIMEOUT));
    let _ = s.read_to_string(&mut out);
    out.trim().to_string()
}

/// Serves `greeting` on `addr` inside `ns` (the listening socket belongs to that namespace for
/// good; the serving thread does not need to be in it).
fn serve(ns: &TestNetns, addr: &str, greeting: &'static str) {
    let addr: SocketAddr = addr.parse().unwrap();
    let listener = ns
        .open()
        .run(|| TcpListener::bind(addr))
        .unwrap()
        .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let _ = writeln!(conn, "{greeting}");
        }
    });
}

/// Connects from inside `ns` as root and returns the first line the server sends.
fn fetch(ns: &TestNetns, ip: &str, port: u16) -> String {
    let addr = SocketAddr::new(ip.parse::<IpAddr>().unwrap(), port);
    ns.open()
        .run(move || TcpStream::connect_timeout(&addr, TIMEOUT).map(read_line))
        .unwrap()
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"))
}

fn pod_object() -> serde_json::Value {
    json!({
        "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "default", "annotations": {
            "sidecar.istio.io/status": "{}",
            "traffic.sidecar.istio.io/excludeOutboundPorts": EXCLUDED_PORT.to_string(),
            "traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.88.0.0/16",
        }},
        "spec": {"containers": [{"name": "app"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}]}
    })
}

fn config() -> SidecarConfig {
    match sidecar::detect(&pod_object(), false).unwrap() {
        Detection::Sidecar(cfg) => *cfg,
        Detection::Skip(why) => panic!("not a sidecar pod: {why}"),
    }
}

struct Proxy(Child);

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_proxy(pod: &TestNetns) -> Proxy {
    let exe = proxy_exe();
    let mut child = Command::new("ip")
        .args(["netns", "exec", &pod.name, "setpriv"])
        .args(["--reuid=1337", "--regid=1337", "--clear-groups", "--"])
        .arg(exe)
        .env(PROXY_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn proxy");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready", "proxy did not start");
    Proxy(child)
}

fn scenario(backend: &str) {
    let pod = TestNetns::new("sct-pod");
    let peer = TestNetns::new("sct-peer");
    // Interface names are global until moved: unique per process and backend, <= 15 bytes.
    let tag = format!("sct{}{}", std::process::id() % 100_000, &backend[..1]);
    let (a, b) = (format!("{tag}a"), format!("{tag}b"));
    run(
        "ip",
        &["link", "add", &a, "type", "veth", "peer", "name", &b],
    );
    run("ip", &["link", "set", &a, "netns", &pod.name]);
    run("ip", &["link", "set", &b, "netns", &peer.name]);
    pod.exec("ip", &["addr", "add", &format!("{POD_IP}/24"), "dev", &a]);
    pod.exec("ip", &["link", "set", &a, "up"]);
    pod.exec("ip", &["route", "add", "default", "via", PEER_IP]);
    peer.exec("ip", &["addr", "add", &format!("{PEER_IP}/24"), "dev", &b]);
    peer.exec(
        "ip",
        &["addr", "add", &format!("{EXCLUDED_IP}/32"), "dev", &b],
    );
    peer.exec("ip", &["link", "set", &b, "up"]);

    serve(&peer, &format!("{PEER_IP}:{PEER_PORT}"), "peer");
    serve(
        &peer,
        &format!("{PEER_IP}:{EXCLUDED_PORT}"),
        "peer-excluded-port",
    );
    serve(
        &peer,
        &format!("{EXCLUDED_IP}:{PEER_PORT}"),
        "peer-excluded-range",
    );
    serve(&pod, &format!("0.0.0.0:{APP_PORT}"), "app");
    serve(&pod, "0.0.0.0:15020", "app-15020");

    let cfg = config();
    let rules = SidecarBackend::new(backend, None, false).unwrap();
    rules.apply(&pod.open(), &cfg).unwrap();
    let _proxy = start_proxy(&pod);

    // Outbound from the app (root) is captured; the proxy's own upstream leg (UID 1337) is not,
    // or it would loop back into 15001 instead of greeting from the peer.
    assert_eq!(
        fetch(&pod, PEER_IP, PEER_PORT),
        format!("proxy-outbound dst={PEER_IP}:{PEER_PORT} upstream=[peer]"),
        "{backend}: outbound"
    );
    assert_eq!(
        fetch(&pod, PEER_IP, EXCLUDED_PORT),
        "peer-excluded-port",
        "{backend}: excluded outbound port"
    );
    assert_eq!(
        fetch(&pod, EXCLUDED_IP, PEER_PORT),
        "peer-excluded-range",
        "{backend}: excluded outbound range"
    );
    assert_eq!(
        fetch(&pod, "127.0.0.1", APP_PORT),
        "app",
        "{backend}: loopback"
    );
    // Inbound from the peer to the app's port goes to the proxy; 15020 is always excluded.
    assert_eq!(
        fetch(&peer, POD_IP, APP_PORT),
        format!("proxy-inbound uid=1337 dst={POD_IP}:{APP_PORT}"),
        "{backend}: inbound"
    );
    assert_eq!(
        fetch(&peer, POD_IP, 15020),
        "app-15020",
        "{backend}: excluded inbound port"
    );

    // Removed: traffic flows directly again.
    rules.remove(&pod.open(), &cfg).unwrap();
    assert_eq!(
        fetch(&pod, PEER_IP, PEER_PORT),
        "peer",
        "{backend}: removed"
    );
    assert_eq!(fetch(&peer, POD_IP, APP_PORT), "app", "{backend}: removed");

    // ISTIO_OUTBOUND_OWNER_GROUPS=4242: only that group's traffic is captured, so the app (root,
    // gid 0) reaches the peer directly; a /8 loopback CIDR reads back in sync (masked in nft).
    let mut only = config();
    only.owner_groups = sidecar::OwnerGroups::Only(vec![4242]);
    only.loopback_v4 = sidecar::loopback_cidr("127.0.0.1/8").unwrap();
    rules.apply(&pod.open(), &only).unwrap();
    assert!(
        matches!(
            rules.verify(&pod.open(), &only).unwrap(),
            dataplane::inpod::RuleState::InSync
        ),
        "{backend}: owner-group rules read back"
    );
    assert_eq!(
        fetch(&pod, PEER_IP, PEER_PORT),
        "peer",
        "{backend}: group outside ISTIO_OUTBOUND_OWNER_GROUPS"
    );
    // _EXCLUDE of the app's group: the same, through the all-groups-except form.
    let mut except = config();
    except.owner_groups = sidecar::OwnerGroups::AllExcept(vec![0]);
    rules.apply(&pod.open(), &except).unwrap();
    assert_eq!(
        fetch(&pod, PEER_IP, PEER_PORT),
        "peer",
        "{backend}: group in ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE"
    );
    rules.apply(&pod.open(), &config()).unwrap();
    assert_eq!(
        fetch(&pod, PEER_IP, PEER_PORT),
        format!("proxy-outbound dst={PEER_IP}:{PEER_PORT} upstream=[peer]"),
        "{backend}: captured again with the default groups"
    );
    rules.remove(&pod.open(), &config()).unwrap();
}

// ---- a pod with hostUsers: false --------------------------------------------------------------

/// Host UID (and GID) the pod's user namespace maps its UID 0 to, as the kubelet would.
const USERNS_BASE: u32 = 100_000;

/// The sandbox of a user-namespaced pod, made in the runtime's order: a user namespace whose
/// UIDs and GIDs 0-65535 map to the host's from [`USERNS_BASE`], then, from inside it, the pod's
/// network namespace (so that namespace's root is the mapped one). Each is held by a process.
struct UsernsPod {
    user: Child,
    net: Child,
}

/// Waits until `child` runs `sleep` (so its namespaces exist).
fn wait_for_sleep(child: &Child) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    while std::fs::read_to_string(format!("/proc/{}/comm", child.id()))
        .is_ok_and(|c| c.trim() != "sleep")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "namespace holder not ready"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl UsernsPod {
    fn new() -> Self {
        let user = Command::new("unshare")
            .args(["--user", "--", "sleep", "infinity"])
            .spawn()
            .expect("unshare --user");
        wait_for_sleep(&user);
        for map in ["uid_map", "gid_map"] {
            std::fs::write(
                format!("/proc/{}/{map}", user.id()),
                format!("0 {USERNS_BASE} 65536\n"),
            )
            .unwrap_or_else(|e| panic!("{map}: {e}"));
        }
        let net = Command::new("nsenter")
            .arg(format!("--user=/proc/{}/ns/user", user.id()))
            .args(["--", "unshare", "--net", "--", "sleep", "infinity"])
            .spawn()
            .expect("unshare --net in the user namespace");
        wait_for_sleep(&net);
        UsernsPod { user, net }
    }

    fn ns(&self, kind: &str) -> String {
        format!("/proc/{}/ns/{kind}", self.net.id())
    }

    fn netns(&self) -> dataplane::netns::Netns {
        dataplane::netns::Netns::open(self.ns("net")).unwrap()
    }

    /// Runs a host tool in the pod's network namespace (as host root).
    fn exec(&self, program: &str, args: &[&str]) -> String {
        let net = format!("--net={}", self.ns("net"));
        run("nsenter", &[&[net.as_str(), "--", program], args].concat())
    }

    /// The test proxy as the pod's own UID 1337.
    fn start_proxy(&self) -> Proxy {
        let exe = proxy_exe();
        let mut child = Command::new("nsenter")
            .arg(format!("--user={}", self.ns("user")))
            .arg(format!("--net={}", self.ns("net")))
            .args([
                "--",
                "setpriv",
                "--reuid=1337",
                "--regid=1337",
                "--clear-groups",
                "--",
            ])
            .arg(exe)
            .env(PROXY_ENV, "1")
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn proxy");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "proxy did not start");
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
        let host_uid = USERNS_BASE + 1337;
        assert!(
            status
                .lines()
                .any(|l| l.starts_with("Uid:") && l.contains(&host_uid.to_string())),
            "proxy is not host UID {host_uid}: {status}"
        );
        Proxy(child)
    }
}

impl Drop for UsernsPod {
    fn drop(&mut self) {
        for holder in [&mut self.net, &mut self.user] {
            let _ = holder.kill();
            let _ = holder.wait();
        }
    }
}

fn fetch_from(ns: &dataplane::netns::Netns, ip: &str, port: u16) -> String {
    let addr = SocketAddr::new(ip.parse::<IpAddr>().unwrap(), port);
    ns.run(move || TcpStream::connect_timeout(&addr, TIMEOUT).map(read_line))
        .unwrap()
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"))
}

/// `variant`: the iptables one (`FORCE_IPTABLES_BINARY`).
fn userns_scenario(backend: &str, variant: Option<&str>) {
    let pod = UsernsPod::new();
    let peer = TestNetns::new("sct-upeer");
    let tag = format!(
        "scu{}{}",
        std::process::id() % 100_000,
        match variant {
            Some("legacy") => "l",
            Some(_) => "f",
            None => "n",
        }
    );
    let (a, b) = (format!("{tag}a"), format!("{tag}b"));
    run(
        "ip",
        &["link", "add", &a, "type", "veth", "peer", "name", &b],
    );
    run(
        "ip",
        &["link", "set", &a, "netns", &pod.net.id().to_string()],
    );
    run("ip", &["link", "set", &b, "netns", &peer.name]);
    pod.exec("ip", &["link", "set", "lo", "up"]);
    pod.exec("ip", &["addr", "add", &format!("{POD_IP}/24"), "dev", &a]);
    pod.exec("ip", &["link", "set", &a, "up"]);
    pod.exec("ip", &["route", "add", "default", "via", PEER_IP]);
    peer.exec("ip", &["addr", "add", &format!("{PEER_IP}/24"), "dev", &b]);
    peer.exec("ip", &["link", "set", &b, "up"]);
    serve(&peer, &format!("{PEER_IP}:{PEER_PORT}"), "peer");

    let cfg = config();
    let rules = SidecarBackend::new(backend, variant, false).unwrap();
    rules
        .apply(&pod.netns(), &cfg)
        .unwrap_or_else(|e| panic!("{backend}: rules in a user-namespaced pod: {e}"));
    assert!(
        matches!(
            rules.verify(&pod.netns(), &cfg).unwrap(),
            dataplane::inpod::RuleState::InSync
        ),
        "{backend}: rules read back differently"
    );
    let _proxy = pod.start_proxy();

    // Host root (unmapped in the pod) is redirected; the pod's 1337 is not, or its upstream
    // connection would loop back into 15001 instead of greeting from the peer.
    assert_eq!(
        fetch_from(&pod.netns(), PEER_IP, PEER_PORT),
        format!("proxy-outbound dst={PEER_IP}:{PEER_PORT} upstream=[peer]"),
        "{backend}: outbound of a user-namespaced pod"
    );
    assert_eq!(
        fetch(&peer, POD_IP, APP_PORT),
        format!("proxy-inbound uid=1337 dst={POD_IP}:{APP_PORT}"),
        "{backend}: inbound of a user-namespaced pod"
    );
    rules.remove(&pod.netns(), &cfg).unwrap();
    assert_eq!(
        fetch_from(&pod.netns(), PEER_IP, PEER_PORT),
        "peer",
        "{backend}: removed from a user-namespaced pod"
    );
}
