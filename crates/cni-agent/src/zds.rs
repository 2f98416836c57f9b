//! The ZDS server: ztunnel connects to our SEQPACKET socket and we hand it every ambient pod's
//! network namespace (istio-cni.md §5).
//!
//! Per connection: hello (5 s), snapshot from the [`NetnsCache`] (Add + fd for pods with a netns,
//! Keep for the others), SnapshotSent, then queued Add/Del requests, each answered by its ack in
//! order. Adds go to the newest connection, Dels to all of them, so an upgrading ztunnel takes
//! over new pods while the old one still serves the rest.
//!
//! Difference from Istio: a few requests are written ahead of their acks (see `conn`), where
//! Istio waits for each ack before the next write. ztunnel handles one datagram at a time and acks
//! it before reading the next, so it sees the same sequence, and its acks still answer the
//! requests in order.
//!
//! Difference from Istio (its QUIRK in §5.5): when an ack does not arrive in time we close the
//! connection instead of keeping it. Acks are correlated only by order, so a late ack would
//! otherwise be read as the reply to the next request. ztunnel reconnects and receives a full
//! snapshot, which is the only state it needs. Idle connections are also watched continuously,
//! so a ztunnel that goes away is dropped at once instead of at the next 5 s keepalive probe.

mod conn;
pub mod packet;
mod server;

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cni_core::zds::{CodecError, SessionError, WorkloadInfo, WorkloadRequest, encode_request};
use dataplane::netns::Netns;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio::sync::{Notify, mpsc, oneshot};

pub use server::ZdsServer;

/// Requests a connection writes before it has read their acks. A few kilobytes at most: far below
/// a unix socket's send buffer, so a write never waits for the peer to read, and the peer never
/// waits for us to read its acks while we wait to write.
pub const WRITE_AHEAD: usize = 8;

/// Default `ZTUNNEL_UDS_ADDRESS`, also ztunnel's default `INPOD_UDS`.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

#[derive(Debug, Clone)]
pub struct ZdsConfig {
    pub socket_path: PathBuf,
    /// Peer UIDs (`SO_PEERCRED`) allowed to connect; ztunnel runs as root.
    pub allowed_uids: Vec<u32>,
    pub hello_timeout: Duration,
    /// Deadline for one request: the write and its ack together.
    pub ack_timeout: Duration,
    /// Minimum spacing between accepts (Istio: 5 connections/s).
    pub accept_interval: Duration,
    /// Requests queued per connection before callers wait.
    pub queue_capacity: usize,
}

impl Default for ZdsConfig {
    fn default() -> Self {
        ZdsConfig {
            socket_path: PathBuf::from(DEFAULT_SOCKET),
            allowed_uids: vec![0],
            hello_timeout: Duration::from_secs(5),
            ack_timeout: Duration::from_secs(5),
            accept_interval: Duration::from_millis(200),
            queue_capacity: 100,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("no ztunnel connection")]
    NoConnection,
    #[error("got ack error: {0}")]
    Nack(String),
    #[error("ztunnel connection closed before the {kind} response was received")]
    ConnectionClosed { kind: &'static str },
    #[error("no ack for {kind} within {timeout:?}; connection closed")]
    AckTimeout {
        kind: &'static str,
        timeout: Duration,
    },
    #[error("ztunnel protocol error: {0}")]
    Protocol(String),
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("refusing to send: {0}")]
    Session(#[from] SessionError),
    #[error("cannot duplicate the netns fd: {0}")]
    DupFd(io::Error),
    #[error("ZDS socket {path}: {source}")]
    Socket { path: PathBuf, source: io::Error },
    #[error("sending {kind}: {source}")]
    Send {
        kind: &'static str,
        source: io::Error,
    },
}

/// ZDS metrics. The agent passes clones of `metrics::AgentMetrics::{ztunnel_connected,
/// zds_ack_seconds}` so the values show up on /metrics; the default is unregistered.
#[derive(Debug, Clone)]
pub struct ZdsMetrics {
    pub ztunnel_connected: Gauge,
    /// Seconds from writing a request to reading its ack (acks and nacks).
    pub ack_latency: Histogram,
}

impl Default for ZdsMetrics {
    fn default() -> Self {
        ZdsMetrics {
            ztunnel_connected: Gauge::default(),
            ack_latency: Histogram::new(exponential_buckets(0.000_1, 2.0, 16)),
        }
    }
}

/// A request waiting for a connection's writer. The fd is a dup owned by the request so the
/// caller's handle may go away while it is queued.
pub(crate) struct Request {
    pub(crate) msg: WorkloadRequest,
    pub(crate) fd: Option<Netns>,
    pub(crate) reply: oneshot::Sender<Result<(), ZdsError>>,
}

pub(crate) struct ConnSlot {
    pub(crate) id: u64,
    pub(crate) tx: mpsc::Sender<Request>,
    pub(crate) synced: Arc<AtomicBool>,
}

pub(crate) struct Shared {
    /// Oldest first; the last entry receives Adds.
    pub(crate) conns: Mutex<Vec<ConnSlot>>,
    pub(crate) next_id: AtomicU64,
    pub(crate) serving: AtomicBool,
    /// Rung when a connection is admitted, for [`ZdsHandle::wait_connected`].
    pub(crate) admitted: Notify,
    pub(crate) metrics: ZdsMetrics,
    pub(crate) queue_capacity: usize,
}

impl Shared {
    pub(crate) fn conns(&self) -> MutexGuard<'_, Vec<ConnSlot>> {
        self.conns
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The agent's side of the server: enroll and remove pods, observe connections.
#[derive(Clone)]
pub struct ZdsHandle {
    shared: Arc<Shared>,
}

impl ZdsHandle {
    /// Sends `AddWorkload` with the pod's netns to the newest ztunnel and waits for its ack.
    ///
    /// Record the pod in the [`NetnsCache`](crate::netns_cache::NetnsCache) *before* calling:
    /// a ztunnel that connects meanwhile then gets the pod either in its snapshot or through
    /// this request, never in neither.
    pub async fn pod_added(
        &self,
        uid: &str,
        workload: WorkloadInfo,
        netns: &Netns,
    ) -> Result<(), ZdsError> {
        let msg = WorkloadRequest::add(uid, workload);
        encode_request(&msg)?;
        let fd = netns.try_clone().map_err(ZdsError::DupFd)?;
        let tx = self
            .shared
            .conns()
            .last()
            .map(|c| c.tx.clone())
            .ok_or(ZdsError::NoConnection)?;
        Self::request(tx, msg, Some(fd)).await
    }

    /// Returns once a ztunnel is connected, waiting up to `wait` for one (a ztunnel restarting,
    /// or reconnecting to a restarted agent, is back within about a second).
    pub async fn wait_connected(&self, wait: Duration) -> Result<(), ZdsError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Armed before looking, so a connection admitted in between wakes us.
            let admitted = self.shared.admitted.notified();
            tokio::pin!(admitted);
            admitted.as_mut().enable();
            if !self.shared.conns().is_empty() {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, admitted).await.is_err() {
                return Err(ZdsError::NoConnection);
            }
        }
    }

    /// Sends `DelWorkload` to every connected ztunnel and waits for all of them.
    ///
    /// Remove the pod from the cache first. A connection that closes before acking is not an
    /// error: the ztunnel behind it gets a snapshot without the pod when it reconnects, and
    /// drains it then. Nacks are logged and ignored, as in Istio (ztunnel acks unknown UIDs).
    pub async fn pod_deleted(&self, uid: &str) -> Result<(), ZdsError> {
        let msg = WorkloadRequest::del(uid);
        encode_request(&msg)?;
        let targets: Vec<_> = self.shared.conns().iter().map(|c| c.tx.clone()).collect();
        let results = futures::future::join_all(
            targets
                .into_iter()
                .map(|tx| Self::request(tx, msg.clone(), None)),
        )
        .await;
        let mut first_err = None;
        for result in results {
            match result {
                Ok(()) | Err(ZdsError::ConnectionClosed { .. }) => {}
                Err(ZdsError::Nack(text)) => {
                    tracing::warn!(uid, error = %text, "ztunnel nacked del")
                }
                Err(e) => {
                    tracing::warn!(uid, error = %e, "del not delivered");
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    async fn request(
        tx: mpsc::Sender<Request>,
        msg: WorkloadRequest,
        fd: Option<Netns>,
    ) -> Result<(), ZdsError> {
        let kind = msg.kind();
        let (reply, rx) = oneshot::channel();
        tx.send(Request { msg, fd, reply })
            .await
            .map_err(|_| ZdsError::ConnectionClosed { kind })?;
        rx.await.map_err(|_| ZdsError::ConnectionClosed { kind })?
    }

    /// Connected ztunnels (accepted and allowed, whether or not their snapshot is done).
    pub fn connected(&self) -> usize {
        self.shared.conns().len()
    }

    /// Connections that have acked their snapshot.
    pub fn synced(&self) -> usize {
        self.shared
            .conns()
            .iter()
            .filter(|c| c.synced.load(Ordering::Acquire))
            .count()
    }

    /// Readiness: the socket is bound and the accept loop has not stopped.
    pub fn serving(&self) -> bool {
        self.shared.serving.load(Ordering::Acquire)
    }

    pub fn metrics(&self) -> &ZdsMetrics {
        &self.shared.metrics
    }
}
