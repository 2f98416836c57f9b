//! A ztunnel-like in-pod proxy for tests. Its sockets are made inside the pod namespace exactly
//! as ztunnel makes them (listeners on 15001/15006/15008 and DNS on 15053, all with `SO_MARK`
//! 0x539 and `SO_REUSEPORT`), so the redirection rules see the same traffic they would see in
//! production. Each captured TCP connection is forwarded, in plain text, to its original
//! destination over a socket that also carries the mark; DNS is answered by the proxy itself.
//! Every accepted connection is recorded with the listener port and its original destination.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream,
    UdpSocket,
};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use cni_core::redirect::ambient::consts::{
    DNS_PROXY_PORT, INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, ZTUNNEL_MARK,
};
use dataplane::netns::Netns;
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, SockaddrIn, SockaddrIn6, SockaddrStorage, bind,
    connect, getsockopt, listen, setsockopt, socket, sockopt,
};

use crate::relay::relay;

/// What the DNS listeners answer: the query with this prefix.
pub const DNS_REPLY_PREFIX: &[u8] = b"proxy-dns:";
/// What the HBONE listener answers (it never forwards: nothing redirects to it).
pub const HBONE_REPLY: &[u8] = b"proxy-hbone\n";

/// One connection (or DNS datagram) a listener received.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Accepted {
    pub port: u16,
    pub peer: SocketAddr,
    /// `SO_ORIGINAL_DST` / `IP6T_SO_ORIGINAL_DST`, when the kernel has one.
    pub original_dst: Option<SocketAddr>,
}

#[derive(Default)]
struct Shared {
    log: Mutex<Vec<Accepted>>,
    stop: AtomicBool,
}

/// A running proxy; stops (and closes every listener) on [`PodProxy::stop`] or drop.
pub struct PodProxy {
    shared: Arc<Shared>,
    fds: Vec<OwnedFd>,
    threads: Vec<JoinHandle<()>>,
    netns: Arc<Netns>,
}

impl PodProxy {
    /// Binds every listener inside `netns` and starts serving them.
    pub fn start(netns: &Netns) -> io::Result<PodProxy> {
        let netns = Arc::new(netns.try_clone()?);
        let made = netns.run(make_listeners).map_err(io::Error::other)??;
        let shared = Arc::new(Shared::default());
        let mut fds = Vec::new();
        let mut threads = Vec::new();
        for l in made {
            match l {
                Listener::Tcp(port, listener) => {
                    fds.push(listener.as_fd().try_clone_to_owned()?);
                    let (shared, netns) = (shared.clone(), netns.clone());
                    threads.push(std::thread::spawn(move || {
                        serve_tcp(port, listener, shared, netns)
                    }));
                }
                Listener::Udp(port, sock) => {
                    fds.push(sock.as_fd().try_clone_to_owned()?);
                    let shared = shared.clone();
                    threads.push(std::thread::spawn(move || serve_udp(port, sock, shared)));
                }
            }
        }
        Ok(PodProxy {
            shared,
            fds,
            threads,
            netns,
        })
    }

    /// Connections (and DNS datagrams) per listener port.
    pub fn counts(&self) -> BTreeMap<u16, usize> {
        let mut out = BTreeMap::new();
        for a in self.accepted() {
            *out.entry(a.port).or_default() += 1;
        }
        out
    }

    /// How many connections `port` received.
    pub fn count(&self, port: u16) -> usize {
        self.counts().get(&port).copied().unwrap_or(0)
    }

    pub fn accepted(&self) -> Vec<Accepted> {
        self.shared.log.lock().expect("log poisoned").clone()
    }

    /// The namespace the proxy serves.
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for fd in &self.fds {
            // Wakes the blocked accept/recv so the serving thread sees the stop flag.
            let _ = nix::sys::socket::shutdown(fd.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for PodProxy {
    fn drop(&mut self) {
        self.shutdown();
    }
}

enum Listener {
    Tcp(u16, TcpListener),
    Udp(u16, UdpSocket),
}

fn marked_socket(family: AddressFamily, kind: SockType) -> io::Result<OwnedFd> {
    let fd = socket(family, kind, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::Mark, &ZTUNNEL_MARK)?;
    setsockopt(&fd, sockopt::ReusePort, &true)?;
    Ok(fd)
}

fn bind_to(fd: &OwnedFd, addr: SocketAddr) -> io::Result<()> {
    match addr {
        SocketAddr::V4(a) => bind(fd.as_raw_fd(), &SockaddrIn::from(a))?,
        SocketAddr::V6(a) => bind(fd.as_raw_fd(), &SockaddrIn6::from(a))?,
    }
    Ok(())
}

/// Runs inside the pod namespace: ztunnel's listener set.
fn make_listeners() -> io::Result<Vec<Listener>> {
    let ipv6 = std::fs::read_to_string("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
        .is_ok_and(|s| s.trim() == "0");
    let mut out = Vec::new();
    for port in [OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, INBOUND_HBONE_PORT] {
        let fd = if ipv6 {
            let fd = marked_socket(AddressFamily::Inet6, SockType::Stream)?;
            setsockopt(&fd, sockopt::Ipv6V6Only, &false)?;
            let _ = setsockopt(&fd, sockopt::IpTransparent, &true);
            bind_to(
                &fd,
                SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
            )?;
            fd
        } else {
            let fd = marked_socket(AddressFamily::Inet, SockType::Stream)?;
            let _ = setsockopt(&fd, sockopt::IpTransparent, &true);
            bind_to(
                &fd,
                SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            )?;
            fd
        };
        listen(&fd, Backlog::new(128)?)?;
        out.push(Listener::Tcp(port, TcpListener::from(fd)));
    }
    let mut dns: Vec<IpAddr> = vec![Ipv4Addr::LOCALHOST.into()];
    if ipv6 {
        dns.push(Ipv6Addr::LOCALHOST.into());
    }
    for ip in dns {
        let family = if ip.is_ipv4() {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        };
        let tcp = marked_socket(family, SockType::Stream)?;
        bind_to(&tcp, SocketAddr::new(ip, DNS_PROXY_PORT))?;
        listen(&tcp, Backlog::new(128)?)?;
        out.push(Listener::Tcp(DNS_PROXY_PORT, TcpListener::from(tcp)));
        let udp = marked_socket(family, SockType::Datagram)?;
        bind_to(&udp, SocketAddr::new(ip, DNS_PROXY_PORT))?;
        out.push(Listener::Udp(DNS_PROXY_PORT, UdpSocket::from(udp)));
    }
    Ok(out)
}

/// The pre-NAT destination of a redirected connection. A dual-stack listener sees IPv4 clients
/// as mapped addresses; their conntrack entry is IPv4, so the IPv4 option answers.
fn original_dst(stream: &TcpStream) -> Option<SocketAddr> {
    let local = stream.local_addr().ok()?;
    let is_v4 = match local.ip() {
        IpAddr::V4(_) => true,
        IpAddr::V6(v6) => v6.to_ipv4_mapped().is_some(),
    };
    if is_v4 {
        let sin = getsockopt(stream, sockopt::OriginalDst).ok()?;
        let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
        Some(SocketAddr::V4(SocketAddrV4::new(
            ip,
            u16::from_be(sin.sin_port),
        )))
    } else {
        let sin6 = getsockopt(stream, sockopt::Ip6tOriginalDst).ok()?;
        let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
        Some(SocketAddr::V6(SocketAddrV6::new(
            ip,
            u16::from_be(sin6.sin6_port),
            0,
            0,
        )))
    }
}

fn unmap(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), a.port()),
            None => addr,
        },
        v4 => v4,
    }
}

fn serve_tcp(port: u16, listener: TcpListener, shared: Arc<Shared>, netns: Arc<Netns>) {
    loop {
        let Ok((stream, peer)) = listener.accept() else {
            if shared.stop.load(Ordering::SeqCst) {
                return;
            }
            continue;
        };
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let original_dst = original_dst(&stream).map(unmap);
        shared.log.lock().expect("log poisoned").push(Accepted {
            port,
            peer: unmap(peer),
            original_dst,
        });
        let netns = netns.clone();
        std::thread::spawn(move || handle(port, stream, original_dst, &netns));
    }
}

fn handle(port: u16, mut stream: TcpStream, original_dst: Option<SocketAddr>, netns: &Netns) {
    match port {
        DNS_PROXY_PORT => {
            let mut buf = [0u8; 512];
            if let Ok(n) = stream.read(&mut buf) {
                let _ = stream.write_all(&[DNS_REPLY_PREFIX, &buf[..n]].concat());
            }
        }
        INBOUND_HBONE_PORT => {
            let _ = stream.write_all(HBONE_REPLY);
        }
        _ => {
            let Some(dst) = original_dst else { return };
            let Ok(Ok(upstream)) = netns.run(|| connect_marked(dst)) else {
                return;
            };
            if let Ok(done) = relay(stream, upstream) {
                let _ = done.join();
            }
        }
    }
}

/// A connection from inside the pod carrying ztunnel's mark, so the pod's rules let it through.
pub fn connect_marked(dst: SocketAddr) -> io::Result<TcpStream> {
    connect_marked_from(None, dst)
}

/// [`connect_marked`] from `src`, an address the pod does not own (`IP_TRANSPARENT`), as ztunnel
/// connects to the app with the original client's address: the app's replies to it can only
/// come back to this socket through the pod's connmark rules. Gives up after 5 s.
pub fn connect_marked_from(src: Option<IpAddr>, dst: SocketAddr) -> io::Result<TcpStream> {
    let family = if dst.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::Mark, &ZTUNNEL_MARK)?;
    if let Some(src) = src {
        setsockopt(&fd, sockopt::IpTransparent, &true)?;
        let from: SockaddrStorage = SocketAddr::new(src, 0).into();
        bind(fd.as_raw_fd(), &from)?;
    }
    // A blocking connect gives up after the send timeout.
    let limit = nix::sys::time::TimeVal::new(5, 0);
    setsockopt(&fd, sockopt::SendTimeout, &limit)?;
    let addr: SockaddrStorage = dst.into();
    connect(fd.as_raw_fd(), &addr)?;
    let stream = TcpStream::from(fd);
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(stream)
}

fn serve_udp(port: u16, sock: UdpSocket, shared: Arc<Shared>) {
    let mut buf = [0u8; 512];
    loop {
        let Ok((n, peer)) = sock.recv_from(&mut buf) else {
            if shared.stop.load(Ordering::SeqCst) {
                return;
            }
            continue;
        };
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        shared.log.lock().expect("log poisoned").push(Accepted {
            port,
            peer,
            original_dst: None,
        });
        let _ = sock.send_to(&[DNS_REPLY_PREFIX, &buf[..n]].concat(), peer);
    }
}
