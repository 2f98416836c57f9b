//! One ztunnel connection: hello, snapshot, then queued requests, each answered by its ack.
//!
//! Requests are written ahead of their acks, up to [`WRITE_AHEAD`] at a time. ztunnel reads one
//! datagram, handles it, acks it and only then reads the next, so its acks come back in the order
//! of the requests: the next ack always answers the oldest request not yet answered. Istio writes
//! one request and waits for its ack before the next; the peer sees the same sequence either way,
//! and a restart's snapshot of hundreds of pods no longer waits a round trip per pod.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use cni_core::zds::{Session, WorkloadRequest, decode_ack, decode_hello, encode_request};
use tokio::sync::{mpsc, oneshot};
use tokio_seqpacket::UnixSeqpacket;

use super::packet::{self, Datagram, PacketError};
use super::{Request, WRITE_AHEAD, ZdsConfig, ZdsError, ZdsMetrics};
use crate::netns_cache::NetnsCache;
use dataplane::netns::Netns;

pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) sock: UnixSeqpacket,
    pub(super) rx: mpsc::Receiver<Request>,
    pub(super) synced: Arc<AtomicBool>,
    pub(super) cache: Arc<NetnsCache>,
    pub(super) cfg: ZdsConfig,
    pub(super) metrics: ZdsMetrics,
}

/// Why a connection ended; only logged.
enum End {
    PeerClosed,
    ServerClosed,
    Failed(String),
}

/// A request written and waiting for its ack.
struct Written {
    kind: &'static str,
    /// A snapshot entry's pod UID, for the log of its nack (empty for the others).
    uid: String,
    at: Instant,
    /// The caller of a queued request; a snapshot entry has none (its nack is only logged).
    reply: Option<oneshot::Sender<Result<(), ZdsError>>>,
}

impl Conn {
    pub(super) async fn run(mut self) {
        let mut session = Session::default();
        let end = match self.handshake(&mut session).await {
            Ok(()) => {
                self.synced.store(true, Ordering::Release);
                self.steady(&mut session).await
            }
            Err(e) => End::Failed(e),
        };
        match end {
            End::PeerClosed => tracing::info!(conn = self.id, "ztunnel closed the connection"),
            End::ServerClosed => tracing::debug!(conn = self.id, "ZDS server closing connection"),
            End::Failed(why) => {
                tracing::warn!(conn = self.id, error = %why, "closing ztunnel connection")
            }
        }
        // Dropping `rx` and the requests written fails every caller still waiting with
        // ConnectionClosed.
    }

    async fn handshake(&mut self, session: &mut Session) -> Result<(), String> {
        let hello = tokio::time::timeout(self.cfg.hello_timeout, packet::recv(&self.sock))
            .await
            .map_err(|_| format!("no hello within {:?}", self.cfg.hello_timeout))?
            .map_err(|e| format!("reading hello: {e}"))?
            .ok_or("closed before hello")?;
        if !hello.fds.is_empty() {
            return Err("hello carried fds".into());
        }
        let hello = decode_hello(&hello.bytes).map_err(|e| e.to_string())?;
        session.hello_received().map_err(|e| e.to_string())?;
        tracing::info!(conn = self.id, version = hello.version, "ztunnel hello");

        let (mut adds, mut keeps) = (0usize, 0usize);
        let entries = self.cache.snapshot().into_iter().map(|item| {
            match (item.entry.workload, item.entry.netns) {
                (Some(workload), Some(netns)) => {
                    adds += 1;
                    (
                        WorkloadRequest::add(&item.uid, workload),
                        Some(netns),
                        item.uid,
                    )
                }
                _ => {
                    keeps += 1;
                    (WorkloadRequest::keep(&item.uid), None, item.uid)
                }
            }
        });
        let done = std::iter::once((WorkloadRequest::snapshot_sent(), None, String::new()));
        let mut written = VecDeque::with_capacity(WRITE_AHEAD);
        for (msg, fd, uid) in entries.chain(done) {
            if written.len() == WRITE_AHEAD {
                self.settle_snapshot(&mut written).await?;
            }
            if let Err(e) = self.write(session, &msg, fd.as_deref()).await {
                return Err(format!("snapshot {} {uid}: {e}", msg.kind()));
            }
            written.push_back(Written {
                kind: msg.kind(),
                uid,
                at: Instant::now(),
                reply: None,
            });
        }
        while !written.is_empty() {
            self.settle_snapshot(&mut written).await?;
        }
        tracing::info!(conn = self.id, adds, keeps, "snapshot sent");
        Ok(())
    }

    /// Reads the ack of the oldest snapshot entry written.
    async fn settle_snapshot(&self, written: &mut VecDeque<Written>) -> Result<(), String> {
        let Some(Written { kind, uid, at, .. }) = written.pop_front() else {
            return Ok(());
        };
        let verdict = next_ack(&self.sock, &self.cfg, &self.metrics, kind, at).await;
        match verdict {
            Ok(Ok(())) => Ok(()),
            Ok(Err(text)) if kind == "snapshot_sent" => {
                tracing::warn!(conn = self.id, error = %text, "SnapshotSent nack");
                Ok(())
            }
            Ok(Err(text)) => {
                tracing::warn!(conn = self.id, %uid, kind, error = %text, "snapshot nack");
                Ok(())
            }
            Err(e) => Err(format!("snapshot {kind} {uid}: {e}")),
        }
    }

    async fn steady(&mut self, session: &mut Session) -> End {
        let mut written: VecDeque<Written> = VecDeque::with_capacity(WRITE_AHEAD);
        loop {
            let oldest = written.front().map(|w| (w.kind, w.at));
            let (sock, cfg, metrics) = (&self.sock, &self.cfg, &self.metrics);
            let read = async move {
                match oldest {
                    Some((kind, at)) => Read::Ack(next_ack(sock, cfg, metrics, kind, at).await),
                    None => Read::Idle(packet::recv(sock).await),
                }
            };
            let req = tokio::select! {
                read = read => match read {
                    Read::Ack(verdict) => {
                        let fatal = verdict.as_ref().err().map(ToString::to_string);
                        if let Some(reply) = written.pop_front().and_then(|w| w.reply) {
                            let _ = reply.send(verdict.and_then(|v| v.map_err(ZdsError::Nack)));
                        }
                        if let Some(why) = fatal {
                            return End::Failed(why);
                        }
                        continue;
                    }
                    // ztunnel never speaks unprompted: readability here is EOF or a protocol error.
                    Read::Idle(got) => return match got {
                        Ok(None) => End::PeerClosed,
                        Ok(Some(d)) => End::Failed(format!("unexpected {}-byte message while idle", d.bytes.len())),
                        Err(e) => End::Failed(format!("idle read: {e}")),
                    },
                },
                req = self.rx.recv(), if written.len() < WRITE_AHEAD => match req {
                    Some(req) => req,
                    None => return End::ServerClosed,
                },
            };
            if req.reply.is_closed() {
                // The caller gave up before we got to it; sending now would only race its retry.
                continue;
            }
            let kind = req.msg.kind();
            match self.write(session, &req.msg, req.fd.as_ref()).await {
                Ok(()) => written.push_back(Written {
                    kind,
                    uid: String::new(),
                    at: Instant::now(),
                    reply: Some(req.reply),
                }),
                Err(e @ (ZdsError::Session(_) | ZdsError::Codec(_))) => {
                    // Nothing was written: the acks still answer the requests in order.
                    tracing::warn!(conn = self.id, kind, error = %e, "request refused before sending");
                    let _ = req.reply.send(Err(e));
                }
                Err(e) => {
                    let why = e.to_string();
                    let _ = req.reply.send(Err(e));
                    return End::Failed(why);
                }
            }
        }
    }

    /// Writes one request. Any error other than a refusal before writing leaves the acks out of
    /// step with the requests and must close the connection.
    async fn write(
        &self,
        session: &mut Session,
        msg: &WorkloadRequest,
        fd: Option<&Netns>,
    ) -> Result<(), ZdsError> {
        let kind = msg.kind();
        session.check_send(msg, fd.is_some())?;
        let bytes = encode_request(msg)?;
        let sent = packet::send(&self.sock, &bytes, fd.map(|ns| ns.as_fd()));
        tokio::time::timeout(self.cfg.ack_timeout, sent)
            .await
            .map_err(|_| ZdsError::AckTimeout {
                kind,
                timeout: self.cfg.ack_timeout,
            })?
            .map_err(|source| {
                if peer_gone(&source) {
                    ZdsError::ConnectionClosed { kind }
                } else {
                    ZdsError::Send { kind, source }
                }
            })
    }
}

enum Read {
    Ack(Result<Result<(), String>, ZdsError>),
    Idle(Result<Option<Datagram>, PacketError>),
}

/// Reads the ack of a `kind` request written at `at`, by `at` + the ack timeout. `Ok(Err(text))`
/// is a nack; an `Err` leaves the connection out of step and must close it.
async fn next_ack(
    sock: &UnixSeqpacket,
    cfg: &ZdsConfig,
    metrics: &ZdsMetrics,
    kind: &'static str,
    at: Instant,
) -> Result<Result<(), String>, ZdsError> {
    let timeout = cfg.ack_timeout;
    let deadline = tokio::time::Instant::from_std(at + timeout);
    let reply = tokio::time::timeout_at(deadline, packet::recv(sock))
        .await
        .map_err(|_| ZdsError::AckTimeout { kind, timeout })?
        .map_err(|e| match e {
            PacketError::Io(io) if peer_gone(&io) => ZdsError::ConnectionClosed { kind },
            other => ZdsError::Protocol(format!("reading {kind} ack: {other}")),
        })?;
    let Datagram { bytes, fds } = reply.ok_or(ZdsError::ConnectionClosed { kind })?;
    if !fds.is_empty() {
        return Err(ZdsError::Protocol(format!(
            "{kind} ack carried {} fds",
            fds.len()
        )));
    }
    let verdict = decode_ack(&bytes).map_err(|e| ZdsError::Protocol(e.to_string()))?;
    metrics.ack_latency.observe(at.elapsed().as_secs_f64());
    Ok(verdict)
}

/// The peer closed its end: a reset or broken pipe is how an abrupt close shows up mid-exchange.
fn peer_gone(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    )
}
