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

pub fn post(
    socket: &Path,
    path: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Response, AgentError> {
    let until = Instant::now() + timeout;
    let name = socket.display().to_string();
    let unreachable = |reason: String| AgentError::Unreachable {
        socket: name.clone(),
        reason,
    };
    let stream = UnixStream::connect(socket).map_err(|e| unreachable(e.to_string()))?;
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
