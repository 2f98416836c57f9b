//! Ports for the servers a test starts in the machine's network namespace (API server, etcd, the
//! agent's health and metrics).
//!
//! Ports are picked below the kernel's ephemeral range, which no outbound connection is ever
//! given, but any process on the machine may bind one of them at any moment: a port found free is
//! not promised to stay free (issue #35). So no launcher relies on that:
//! - [`held`]: the port stays bound by this process, which sets `SO_REUSEPORT` only after its
//!   bind succeeded, so that a child told to share the port (kube-apiserver's
//!   `--permit-port-sharing`, etcd's `--socket-reuse-port`) can bind it too, and nothing else can
//!   while the [`Held`] lives. The hold never listens: every connection goes to the child.
//! - [`unused`]: a port free now, for a child that cannot share one (our agent); its launcher
//!   starts the child again on fresh ports when one was taken first, up to [`START_ATTEMPTS`]
//!   times.
//!
//! A server the test bed runs in-process binds port 0 and keeps its listener instead.

use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::TcpListener;
use std::ops::Range;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;

use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, SockaddrIn, bind, setsockopt, socket, sockopt,
};

/// The lowest port handed out, clear of the well-known and registered ports most daemons use.
const FLOOR: u16 = 10_000;

/// How many times a launcher starts a child on [`unused`] ports before a collision fails the
/// test: five collisions in a row would mean the machine's ports are being taken on purpose.
pub const START_ATTEMPTS: usize = 5;

/// A port that no socket held a moment ago (another process may take it since), outside the
/// ephemeral range, never returned before by this process.
pub fn unused() -> u16 {
    take(|port| TcpListener::bind(("0.0.0.0", port)).ok()).0
}

/// A port bound by this process until dropped, which only a child binding it with
/// `SO_REUSEPORT` can bind as well (see the module doc).
pub struct Held {
    port: u16,
    _socket: OwnedFd,
}

impl Held {
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// A port outside the ephemeral range, never returned before by this process, held (see
/// [`Held`]).
pub fn held() -> Held {
    let (port, socket) = take(|port| hold(port).ok());
    Held {
        port,
        _socket: socket,
    }
}

/// Binds `0.0.0.0:port` without sharing, so the bind fails if anyone holds the port (or holds it
/// shared), and only then lets children share it.
fn hold(port: u16) -> nix::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(fd.as_raw_fd(), &SockaddrIn::new(0, 0, 0, 0, port))?;
    setsockopt(&fd, sockopt::ReusePort, &true)?;
    Ok(fd)
}

/// The first port of [`range`], from a random start, that `try_take` takes and this process has
/// not handed out before.
fn take<T>(try_take: impl FnMut(u16) -> Option<T>) -> (u16, T) {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let range = range();
    let start = RandomState::new().hash_one(std::process::id()) as u16;
    first_taken(
        range.clone(),
        start,
        given.get_or_insert_with(HashSet::new),
        try_take,
    )
    .unwrap_or_else(|| panic!("no port in {range:?} is free"))
}

/// Ports below the ephemeral range (`ip_local_port_range`) and above [`FLOOR`].
fn range() -> Range<u16> {
    let ceiling = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    // An unusual ephemeral range leaves no room below it: every port above the floor is as good.
    if ceiling > FLOOR + 1_000 {
        FLOOR..ceiling
    } else {
        FLOOR..u16::MAX
    }
}

/// Walks `range` once from `start` (wrapping), skipping `given`, and returns the first port
/// `try_take` takes, adding it to `given`.
fn first_taken<T>(
    range: Range<u16>,
    start: u16,
    given: &mut HashSet<u16>,
    mut try_take: impl FnMut(u16) -> Option<T>,
) -> Option<(u16, T)> {
    let len = range.end - range.start;
    (0..len)
        .map(|i| range.start + ((u32::from(start) + u32::from(i)) % u32::from(len)) as u16)
        .filter(|port| !given.contains(port))
        .find_map(|port| Some((port, try_take(port)?)))
        .inspect(|(port, _)| {
            given.insert(*port);
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    #[test]
    fn only_ports_taken_are_handed_out_each_once_then_none() {
        let mut given = HashSet::new();
        let odd = |port: u16| (port % 2 == 1).then_some(());
        let mut out = Vec::new();
        while let Some((port, ())) = first_taken(100..110, 7, &mut given, odd) {
            out.push(port);
        }
        assert_eq!(out, [107, 109, 101, 103, 105]);
    }

    #[test]
    fn ports_lie_between_the_floor_and_the_ephemeral_range_and_are_never_repeated() {
        let range = range();
        let ports: Vec<u16> = (0..20)
            .map(|_| unused())
            .chain((0..20).map(|_| held().port()))
            .collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        assert!(
            ports.iter().all(|p| range.contains(p)),
            "{ports:?} {range:?}"
        );
    }

    #[test]
    fn a_held_port_is_refused_to_other_binders_and_shared_with_a_child_that_asks() {
        let held = held();
        let port = held.port();
        for addr in ["0.0.0.0", "127.0.0.1"] {
            let err = TcpListener::bind((addr, port)).expect_err("a held port is refused");
            assert_eq!(err.kind(), ErrorKind::AddrInUse, "{addr}:{port}");
        }
        // What kube-apiserver's `--permit-port-sharing` does to its listener.
        let child = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        setsockopt(&child, sockopt::ReuseAddr, &true).unwrap();
        setsockopt(&child, sockopt::ReusePort, &true).unwrap();
        bind(child.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, port)).expect("sharing bind");
        nix::sys::socket::listen(&child, nix::sys::socket::Backlog::new(1).unwrap()).unwrap();
        let child = TcpListener::from(child);
        // The hold never listens, so the connection can only have reached the child.
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (accepted, from) = child.accept().unwrap();
        assert_eq!(from, client.local_addr().unwrap());
        drop((accepted, child));
        let err = TcpListener::bind(("127.0.0.1", port)).expect_err("still held");
        assert_eq!(err.kind(), ErrorKind::AddrInUse);
    }
}
