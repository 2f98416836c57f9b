//! Real traffic through the in-pod redirection: two pod namespaces on a bridge in a "node"
//! namespace, each with a ztunnel-like proxy ([`PodProxy`]) and an app on :8080. Every scenario
//! of issue 3 is checked by what actually arrives where, for each backend and address family.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::consts::{
    INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT,
};
use dataplane::inpod::{InpodRules, RuleState};
use dataplane::netns::Netns;
use dataplane::test_support::TestNetns;
use dataplane::{BackendOptions, RuleBackend, pod};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, socket};
use std::os::fd::AsRawFd;
use testbed::pod_proxy::{
    DNS_REPLY_PREFIX, HBONE_REPLY, PodProxy, connect_marked, connect_marked_from,
};

const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Copy)]
struct Family {
    v6: bool,
}

impl Family {
    fn pod_ip(self, n: u8) -> IpAddr {
        if self.v6 {
            format!("fd77::{n}").parse().unwrap()
        } else {
            format!("10.77.0.{n}").parse().unwrap()
        }
    }
    fn node_ip(self) -> IpAddr {
        self.pod_ip(1)
    }
    fn probe_ip(self) -> IpAddr {
        let cfg = InpodConfig::default();
        if self.v6 {
            cfg.probe_snat_v6.into()
        } else {
            cfg.probe_snat_v4.into()
        }
    }
}

/// The node namespace with a bridge, and pods `a` (.2) and `b` (.3) wired to it.
struct Topology {
    node: TestNetns,
    a: TestNetns,
    b: TestNetns,
}

fn ip(args: &[&str]) {
    dataplane::test_support::run("ip", args);
}

fn topology() -> Topology {
    let t = Topology {
        node: TestNetns::new("tn"),
        a: TestNetns::new("ta"),
        b: TestNetns::new("tb"),
    };
    let node = t.node.name.as_str();
    ip(&["-n", node, "link", "add", "br0", "type", "bridge"]);
    ip(&["-n", node, "link", "set", "br0", "up"]);
    ip(&["-n", node, "addr", "add", "10.77.0.1/24", "dev", "br0"]);
    ip(&[
        "-n",
        node,
        "addr",
        "add",
        "fd77::1/64",
        "dev",
        "br0",
        "nodad",
    ]);
    // Kubelet's probes leave the node from the probe SNAT address.
    ip(&["-n", node, "addr", "add", "169.254.7.127/32", "dev", "br0"]);
    let v6probe = format!("{}/128", InpodConfig::default().probe_snat_v6);
    ip(&["-n", node, "addr", "add", &v6probe, "dev", "br0", "nodad"]);
    for (pod, n, veth) in [(&t.a, 2, "va"), (&t.b, 3, "vb")] {
        let p = pod.name.as_str();
        ip(&[
            "-n", node, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", p,
        ]);
        ip(&["-n", node, "link", "set", veth, "master", "br0", "up"]);
        ip(&[
            "-n",
            p,
            "addr",
            "add",
            &format!("10.77.0.{n}/24"),
            "dev",
            "eth0",
        ]);
        ip(&[
            "-n",
            p,
            "addr",
            "add",
            &format!("fd77::{n}/64"),
            "dev",
            "eth0",
            "nodad",
        ]);
        ip(&["-n", p, "link", "set", "eth0", "up"]);
        ip(&["-n", p, "route", "add", "default", "via", "10.77.0.1"]);
        ip(&["-n", p, "-6", "route", "add", "default", "via", "fd77::1"]);
    }
    t
}

/// A TCP server on `[::]:port` inside `ns` answering `<name> saw <peer>`.
fn serve(ns: &Netns, port: u16, name: &'static str) {
    let listener = ns
        .run(move || TcpListener::bind(("::", port)))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let peer = s
                .peer_addr()
                .map(|p| p.ip().to_canonical().to_string())
                .unwrap_or_default();
            let _ = write!(s, "{name} saw {peer}");
        }
    });
}

/// A DNS stand-in on the node (UDP and TCP port 53) answering `node-dns:<query>`.
fn serve_node_dns(ns: &Netns) {
    let (tcp, udp) = ns
        .run(|| {
            (
                TcpListener::bind("[::]:53").unwrap(),
                UdpSocket::bind("[::]:53").unwrap(),
            )
        })
        .unwrap();
    std::thread::spawn(move || {
        for mut s in tcp.incoming().flatten() {
            let mut buf = [0u8; 256];
            let n = s.read(&mut buf).unwrap_or(0);
            let _ = s.write_all(&[b"node-dns:".as_slice(), &buf[..n]].concat());
        }
    });
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok((n, peer)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(&[b"node-dns:".as_slice(), &buf[..n]].concat(), peer);
        }
    });
}

fn read_all(mut s: TcpStream) -> String {
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read reply");
    out
}

/// Connects from inside `ns` (optionally from `src`) and returns what the server said.
fn get(ns: &Netns, dst: SocketAddr, src: Option<IpAddr>) -> String {
    let stream = ns
        .run(move || -> std::io::Result<TcpStream> {
            let Some(src) = src else {
                return TcpStream::connect_timeout(&dst, TIMEOUT);
            };
            let family = if dst.is_ipv4() {
                AddressFamily::Inet
            } else {
                AddressFamily::Inet6
            };
            let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
            bind(
                fd.as_raw_fd(),
                &SockaddrStorage::from(SocketAddr::new(src, 0)),
            )?;
            connect(fd.as_raw_fd(), &SockaddrStorage::from(dst))?;
            Ok(TcpStream::from(fd))
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("connect {dst}: {e}"));
    read_all(stream)
}

fn dns_udp(ns: &Netns, server: IpAddr) -> String {
    ns.run(move || {
        let sock = UdpSocket::bind(if server.is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        })
        .unwrap();
        sock.set_read_timeout(Some(TIMEOUT)).unwrap();
        sock.send_to(b"q", (server, 53)).unwrap();
        let mut buf = [0u8; 256];
        let (n, from) = sock.recv_from(&mut buf).expect("dns reply");
        // The reply must look like it came from the server the app asked.
        assert_eq!(from, SocketAddr::new(server, 53));
        String::from_utf8_lossy(&buf[..n]).into_owned()
    })
    .unwrap()
}

fn dns_tcp(ns: &Netns, server: IpAddr) -> String {
    let mut s = ns
        .run(move || TcpStream::connect_timeout(&SocketAddr::new(server, 53), TIMEOUT))
        .unwrap()
        .unwrap();
    s.write_all(b"q").unwrap();
    read_all(s)
}

fn proxy_prefix() -> String {
    String::from_utf8_lossy(DNS_REPLY_PREFIX).into_owned()
}

fn no_residue(ns: &TestNetns) {
    for save in [
        "iptables-nft-save",
        "ip6tables-nft-save",
        "iptables-legacy-save",
        "ip6tables-legacy-save",
    ] {
        let out = ns.exec(save, &[]);
        assert!(!out.contains("ISTIO"), "{save} in {}: {out}", ns.name);
    }
    let nft = ns.exec("nft", &["list", "ruleset"]);
    assert!(!nft.contains("istio"), "nft ruleset left: {nft}");
    for fam in ["-4", "-6"] {
        let routes = ns.exec("ip", &[fam, "route", "show", "table", "all"]);
        assert!(
            !routes.contains("table 100"),
            "table 100 left ({fam}): {routes}"
        );
        assert!(
            !ns.exec("ip", &[fam, "rule"]).contains("0x111"),
            "fwmark rule left ({fam})"
        );
    }
}

fn scenario(backend_name: &str, fam: Family) {
    let t = topology();
    let (node, a, b) = (t.node.open(), t.a.open(), t.b.open());
    let rules: Arc<dyn InpodRules> = Arc::new(
        RuleBackend::new(
            backend_name,
            &BackendOptions {
                ipv6: fam.v6,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let cfg = InpodConfig {
        ipv6: fam.v6,
        ..Default::default()
    };
    let (a_ip, b_ip) = (fam.pod_ip(2), fam.pod_ip(3));
    let b_app = SocketAddr::new(b_ip, 8080);

    serve(&a, 8080, "app-a");
    serve(&b, 8080, "app-b");
    serve_node_dns(&node);
    // Without rules, traffic is direct.
    assert_eq!(get(&a, b_app, None), format!("app-b saw {a_ip}"));

    pod::enroll(&a, &cfg, rules.as_ref()).unwrap();
    pod::enroll(&b, &cfg, rules.as_ref()).unwrap();
    assert_eq!(
        pod::verify(&a, &cfg, rules.as_ref()).unwrap(),
        RuleState::InSync
    );
    let pa = PodProxy::start(&a).unwrap();
    let pb = PodProxy::start(&b).unwrap();

    // App in A → B:8080: A's outbound listener, original destination intact; B's inbound
    // listener then delivers it to B's app.
    assert_eq!(get(&a, b_app, None), format!("app-b saw {b_ip}"));
    let out = pa.accepted();
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(
        (out[0].port, out[0].original_dst),
        (OUTBOUND_PORT, Some(b_app))
    );
    let inb = pb.accepted();
    assert_eq!(inb.len(), 1, "{inb:?}");
    assert_eq!(
        (inb[0].port, inb[0].original_dst),
        (INBOUND_PLAINTEXT_PORT, Some(b_app))
    );
    // The proxy's own (marked) upstream connection was not captured again in A.
    assert_eq!(pa.count(OUTBOUND_PORT), 1);

    // An uncaptured peer (the node) → B:8080 is captured inbound.
    assert_eq!(
        get(&node, b_app, Some(fam.node_ip())),
        format!("app-b saw {b_ip}")
    );
    assert_eq!(pb.count(INBOUND_PLAINTEXT_PORT), 2);

    // HBONE port is never redirected: B's real 15008 listener answers.
    let hbone = String::from_utf8_lossy(HBONE_REPLY).into_owned();
    assert_eq!(
        get(&node, SocketAddr::new(b_ip, INBOUND_HBONE_PORT), None),
        hbone
    );
    let marked = a
        .run(move || connect_marked(SocketAddr::new(b_ip, INBOUND_HBONE_PORT)))
        .unwrap()
        .unwrap();
    assert_eq!(read_all(marked), hbone);
    assert_eq!(pb.count(INBOUND_HBONE_PORT), 2);
    assert_eq!(pb.count(INBOUND_PLAINTEXT_PORT), 2);
    assert_eq!(
        pa.count(OUTBOUND_PORT),
        1,
        "a marked socket in A must bypass capture"
    );

    // Kubelet probe from the SNAT address: straight to the app.
    assert_eq!(
        get(&node, b_app, Some(fam.probe_ip())),
        format!("app-b saw {}", fam.probe_ip())
    );
    assert_eq!(pb.count(INBOUND_PLAINTEXT_PORT), 2);

    // App → its own pod IP over lo: not looped through the proxy.
    assert_eq!(
        get(&a, SocketAddr::new(a_ip, 8080), None),
        format!("app-a saw {a_ip}")
    );
    assert_eq!(
        (pa.count(OUTBOUND_PORT), pa.count(INBOUND_PLAINTEXT_PORT)),
        (1, 0)
    );

    // DNS, UDP and TCP, is answered by the proxy while capture is on...
    assert_eq!(dns_udp(&a, fam.node_ip()), format!("{}q", proxy_prefix()));
    assert_eq!(dns_tcp(&a, fam.node_ip()), format!("{}q", proxy_prefix()));
    assert_eq!(pa.count(15053), 2);
    assert_eq!(
        pa.count(OUTBOUND_PORT),
        1,
        "TCP DNS goes to the DNS proxy, not the outbound listener"
    );
    // ...and reaches the real server when it is off.
    let no_dns = InpodConfig {
        redirect_dns: false,
        ..cfg.clone()
    };
    pod::enroll(&a, &no_dns, rules.as_ref()).unwrap();
    assert_eq!(
        pod::verify(&a, &no_dns, rules.as_ref()).unwrap(),
        RuleState::InSync
    );
    assert_eq!(dns_udp(&a, fam.node_ip()), "node-dns:q");
    assert_eq!(pa.count(15053), 2);
    // TCP/53 is then ordinary outbound traffic: captured by 15001 and forwarded to the server.
    assert_eq!(dns_tcp(&a, fam.node_ip()), "node-dns:q");
    assert_eq!(pa.count(OUTBOUND_PORT), 2);

    // bypass-inbound on B: inbound reaches the app directly, A's outbound is still captured.
    let ingress = InpodConfig {
        ingress_mode: true,
        ..cfg.clone()
    };
    pod::enroll(&b, &ingress, rules.as_ref()).unwrap();
    assert_eq!(
        get(&node, b_app, Some(fam.node_ip())),
        format!("app-b saw {}", fam.node_ip())
    );
    assert_eq!(get(&a, b_app, None), format!("app-b saw {a_ip}"));
    assert_eq!(pb.count(INBOUND_PLAINTEXT_PORT), 2);
    assert_eq!(pa.count(OUTBOUND_PORT), 3);
    // Inbound HBONE to an ingress-mode pod: ztunnel connects to the app from the client's
    // address. The app's replies reach ztunnel only through the connmark rule (Istio's 1.29
    // fix, issue 58546); without it they leave the pod and the connection never completes.
    let client = fam.pod_ip(9);
    let from_ztunnel = b
        .run(move || connect_marked_from(Some(client), b_app))
        .unwrap()
        .unwrap_or_else(|e| panic!("ztunnel -> app of an ingress-mode pod: {e}"));
    assert_eq!(read_all(from_ztunnel), format!("app-b saw {client}"));

    // Removal: traffic is direct again and nothing of ours is left.
    pod::unenroll(&a, &no_dns, rules.as_ref()).unwrap();
    pod::unenroll(&b, &ingress, rules.as_ref()).unwrap();
    assert_eq!(get(&a, b_app, None), format!("app-b saw {a_ip}"));
    assert_eq!(dns_udp(&a, fam.node_ip()), "node-dns:q");
    assert_eq!(
        (pa.count(OUTBOUND_PORT), pb.count(INBOUND_PLAINTEXT_PORT)),
        (3, 2)
    );
    no_residue(&t.a);
    no_residue(&t.b);
    pa.stop();
    pb.stop();
}

#[test]
fn iptables_ipv4() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    scenario("iptables", Family { v6: false });
}

#[test]
fn iptables_ipv6() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    scenario("iptables", Family { v6: true });
}

#[test]
fn nftables_ipv4() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    scenario("nftables", Family { v6: false });
}

#[test]
fn nftables_ipv6() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    scenario("nftables", Family { v6: true });
}
