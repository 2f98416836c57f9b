//! One ztunnel connection: hello, snapshot, then queued requests in lockstep with their acks.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use cni_core::zds::{Session, WorkloadRequest, decode_ack, decode_hello, encode_request};
use tokio::sync::mpsc;
use tokio_seqpacket::UnixSeqpacket;

use super::packet::{self, Datagram, PacketError};
use super::{Request, ZdsConfig, ZdsError, ZdsMetrics};
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
        // Dropping `rx` fails every queued request with ConnectionClosed.
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

        let snapshot = self.cache.snapshot();
        let (mut adds, mut keeps) = (0usize, 0usize);
        for item in snapshot {
            let (msg, fd) = match (item.entry.workload, item.entry.netns) {
                (Some(workload), Some(netns)) => {
                    (WorkloadRequest::add(&item.uid, workload), Some(netns))
                }
                _ => (WorkloadRequest::keep(&item.uid), None),
            };
            if fd.is_some() {
                adds += 1;
            } else {
                keeps += 1;
            }
            match self.exchange(session, &msg, fd.as_deref()).await {
                Ok(()) => {}
                Err(ZdsError::Nack(text)) => {
                    tracing::warn!(conn = self.id, uid = %item.uid, kind = msg.kind(), error = %text, "snapshot nack")
                }
                Err(e) => return Err(format!("snapshot {} {}: {e}", msg.kind(), item.uid)),
            }
        }
        match self
            .exchange(session, &WorkloadRequest::snapshot_sent(), None)
            .await
        {
            Ok(()) => {}
            Err(ZdsError::Nack(text)) => {
                tracing::warn!(conn = self.id, error = %text, "SnapshotSent nack")
            }
            Err(e) => return Err(format!("SnapshotSent: {e}")),
        }
        tracing::info!(conn = self.id, adds, keeps, "snapshot sent");
        Ok(())
    }

    async fn steady(&mut self, session: &mut Session) -> End {
        loop {
            let req = tokio::select! {
                req = self.rx.recv() => match req {
                    Some(req) => req,
                    None => return End::ServerClosed,
                },
                // ztunnel never speaks unprompted: readability here is EOF or a protocol error.
                got = packet::recv(&self.sock) => return match got {
                    Ok(None) => End::PeerClosed,
                    Ok(Some(d)) => End::Failed(format!("unexpected {}-byte message while idle", d.bytes.len())),
                    Err(e) => End::Failed(format!("idle read: {e}")),
                },
            };
            if req.reply.is_closed() {
                // The caller gave up before we got to it; sending now would only race its retry.
                continue;
            }
            let kind = req.msg.kind();
            let result = self.exchange(session, &req.msg, req.fd.as_ref()).await;
            let fatal = match &result {
                Ok(()) | Err(ZdsError::Nack(_)) => None,
                Err(e @ ZdsError::Session(_)) | Err(e @ ZdsError::Codec(_)) => {
                    // Nothing was written: the connection is still in lockstep.
                    tracing::warn!(conn = self.id, kind, error = %e, "request refused before sending");
                    None
                }
                Err(e) => Some(e.to_string()),
            };
            let _ = req.reply.send(result);
            if let Some(why) = fatal {
                return End::Failed(why);
            }
        }
    }

    /// Writes one request and reads its ack within `ack_timeout`. Any error other than a nack or
    /// a refusal before writing leaves the connection out of lockstep and must close it.
    async fn exchange(
        &self,
        session: &mut Session,
        msg: &WorkloadRequest,
        fd: Option<&Netns>,
    ) -> Result<(), ZdsError> {
        let kind = msg.kind();
        session.check_send(msg, fd.is_some())?;
        let bytes = encode_request(msg)?;
        let started = Instant::now();
        let timeout = self.cfg.ack_timeout;
        let reply = tokio::time::timeout(timeout, async {
            packet::send(&self.sock, &bytes, fd.map(|ns| ns.as_fd()))
                .await
                .map_err(|source| {
                    if peer_gone(&source) {
                        ZdsError::ConnectionClosed { kind }
                    } else {
                        ZdsError::Send { kind, source }
                    }
                })?;
            packet::recv(&self.sock).await.map_err(|e| match e {
                PacketError::Io(io) if peer_gone(&io) => ZdsError::ConnectionClosed { kind },
                other => ZdsError::Protocol(format!("reading {kind} ack: {other}")),
            })
        })
        .await
        .map_err(|_| ZdsError::AckTimeout { kind, timeout })??;
        let Datagram { bytes, fds } = reply.ok_or(ZdsError::ConnectionClosed { kind })?;
        if !fds.is_empty() {
            return Err(ZdsError::Protocol(format!(
                "{kind} ack carried {} fds",
                fds.len()
            )));
        }
        let verdict = decode_ack(&bytes).map_err(|e| ZdsError::Protocol(e.to_string()))?;
        self.metrics
            .ack_latency
            .observe(started.elapsed().as_secs_f64());
        verdict.map_err(ZdsError::Nack)
    }
}

/// The peer closed its end: a reset or broken pipe is how an abrupt close shows up mid-exchange.
fn peer_gone(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    )
}
