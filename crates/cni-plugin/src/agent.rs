//! Talking to the node agent over `<run dir>/pluginevent.sock` (protocol: `cni_core::cmdadd`).

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::http::{self, Deadline, HttpError, Request, Response};

/// Istio's plugin gives the agent 5 s; enrollment (rules + ztunnel ack) fits well inside.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Large enough for the Pod object in a `sidecar` decision.
const MAX_RESPONSE: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// No agent answered: socket missing, refused, broken or silent past the deadline.
    #[error("node agent unreachable at {socket}: {reason}")]
    Unreachable { socket: String, reason: String },
    /// Something answered, but not with HTTP we can read.
    #[error("node agent at {socket} answered garbage: {reason}")]
    Protocol { socket: String, reason: String },
}

/// How long an ambient pod's ADD waits for an agent to listen again (an agent restarting or being
/// upgraded is back within this on a healthy node) before it fails and the runtime retries the
/// sandbox, seconds later.
pub const RESTART_WAIT: Duration = Duration::from_secs(3);

/// How often the socket is tried while waiting for an agent to listen.
const RECONNECT_EVERY: Duration = Duration::from_millis(50);

pub fn post(
    socket: &Path,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Response, AgentError> {
    post_waiting(socket, path, body, timeout, Duration::ZERO)
}

/// [`post`], trying to connect again for up to `wait` while nothing listens on the socket (it is
/// missing, or refuses: an agent between its exit and its successor's start). `timeout` then runs
/// from the connection.
pub fn post_waiting(
    socket: &Path,
    path: &str,
    body: &[u8],
    timeout: Duration,
    wait: Duration,
) -> Result<Response, AgentError> {
    let name = socket.display().to_string();
    let unreachable = |reason: String| AgentError::Unreachable {
        socket: name.clone(),
        reason,
    };
    let stream = connect_waiting(socket, wait).map_err(|e| unreachable(e.to_string()))?;
    let until = Instant::now() + timeout;
    let mut stream = Deadline::new(stream, until);
    let req = Request {
        method: "POST",
        host: "unix",
        path,
        headers: &[("Content-Type", "application/json")],
        body,
    };
    http::exchange(&mut stream, &req, MAX_RESPONSE).map_err(|e| match e {
        HttpError::Io(io) => unreachable(io.to_string()),
        other => AgentError::Protocol {
            socket: name.clone(),
            reason: other.to_string(),
        },
    })
}

fn connect_waiting(socket: &Path, wait: Duration) -> std::io::Result<UnixStream> {
    use std::io::ErrorKind::{ConnectionRefused, NotFound};
    let until = Instant::now() + wait;
    loop {
        match UnixStream::connect(socket) {
            Err(e)
                if matches!(e.kind(), NotFound | ConnectionRefused) && Instant::now() < until =>
            {
                std::thread::sleep(RECONNECT_EVERY)
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_a_listener_only_as_long_as_asked() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("pluginevent.sock");
        let started = Instant::now();
        let err = connect_waiting(&socket, Duration::ZERO).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);

        // An agent that binds the socket while the plugin waits is reached.
        let late = socket.clone();
        let agent = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let listener = std::os::unix::net::UnixListener::bind(&late).unwrap();
            listener.accept().map(drop)
        });
        connect_waiting(&socket, Duration::from_secs(10)).expect("connected once bound");
        agent.join().unwrap().unwrap();
        assert!(started.elapsed() >= Duration::from_millis(300));

        // Refused (a socket file nobody listens on, as a killed agent leaves): waits, then fails.
        std::fs::remove_file(&socket).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        let started = Instant::now();
        let err = connect_waiting(&socket, Duration::from_millis(200)).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(started.elapsed() >= Duration::from_millis(200));
    }
}
