//! The test kit's TCP relay: copies bytes both ways between two connected streams until each side
//! has sent its end of stream. Used by the pod proxy (captured connection → original destination)
//! and by the loopback forwarders ([`forward_loopback`]: a test node's namespace → the test API
//! server, the real node's → a test registry).
//!
//! Both legs get `TCP_NODELAY`: the relay writes each read at once, so with Nagle a small reply
//! that follows an unacknowledged small write waits for the peer's delayed ACK (≈ 40 ms on Linux),
//! and every request/response exchange through the relay stalled that long.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::thread::JoinHandle;

use dataplane::netns::Netns;

/// Starts relaying between `a` and `b`. `TCP_NODELAY` is set on both before any byte moves; the
/// returned thread ends once both directions are closed.
pub fn relay(a: TcpStream, b: TcpStream) -> io::Result<JoinHandle<()>> {
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    let (mut a_read, mut b_write) = (a.try_clone()?, b.try_clone()?);
    let (mut b_read, mut a_write) = (b, a);
    Ok(std::thread::spawn(move || {
        let up = std::thread::spawn(move || {
            let _ = io::copy(&mut a_read, &mut b_write);
            let _ = b_write.shutdown(Shutdown::Write);
        });
        let _ = io::copy(&mut b_read, &mut a_write);
        let _ = a_write.shutdown(Shutdown::Write);
        let _ = up.join();
    }))
}

/// `127.0.0.1:port` inside network namespace `ns`, relayed to the same address in the caller's
/// namespace: the listener is made in `ns`, each outbound connection in the caller's (a socket
/// keeps the namespace it was made in). Stops accepting once dropped.
pub struct LoopbackForward {
    listener: TcpListener,
}

/// Starts forwarding `127.0.0.1:port` of `ns` to the caller's `127.0.0.1:port`.
pub fn forward_loopback(ns: &Netns, port: u16) -> LoopbackForward {
    let listener = ns
        .run(|| TcpListener::bind(("127.0.0.1", port)))
        .expect("enter the namespace")
        .unwrap_or_else(|e| panic!("listen on 127.0.0.1:{port} in the namespace: {e}"));
    let accept = listener.try_clone().unwrap();
    std::thread::spawn(move || {
        for conn in accept.incoming() {
            let Ok(down) = conn else { return };
            let Ok(up) = TcpStream::connect(("127.0.0.1", port)) else {
                continue;
            };
            let _ = relay(down, up);
        }
    });
    LoopbackForward { listener }
}

impl Drop for LoopbackForward {
    fn drop(&mut self) {
        // Wakes the accept loop (its clone of the socket) so its thread ends.
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    use super::*;

    /// A connected pair over loopback: (client end, accepted end).
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    #[test]
    fn both_legs_have_nodelay_and_bytes_flow_both_ways() {
        let (mut client, relay_down) = pair();
        let (relay_up, mut server) = pair();
        // Clones share the socket, so they see the option the relay set on its own handles.
        let (down_probe, up_probe) = (
            relay_down.try_clone().unwrap(),
            relay_up.try_clone().unwrap(),
        );
        assert!(!down_probe.nodelay().unwrap() && !up_probe.nodelay().unwrap());

        let done = relay(relay_down, relay_up).unwrap();
        assert!(down_probe.nodelay().unwrap(), "leg towards the client");
        assert!(up_probe.nodelay().unwrap(), "leg towards the server");
        drop((down_probe, up_probe));

        for round in 0..3u8 {
            client.write_all(&[b'q', round]).unwrap();
            let mut req = [0u8; 2];
            server.read_exact(&mut req).unwrap();
            assert_eq!(req, [b'q', round]);
            server.write_all(&[b'r', round]).unwrap();
            let mut resp = [0u8; 2];
            client.read_exact(&mut resp).unwrap();
            assert_eq!(resp, [b'r', round]);
        }
        client.shutdown(Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "end of stream reaches the server");
        drop(server);
        client.read_to_end(&mut rest).unwrap();
        done.join().unwrap();
    }
}
