//! Socket setup and the accept loop.

use std::fs::{self, DirBuilder, Permissions};
use std::future::Future;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;
use tokio_seqpacket::{UnixSeqpacket, UnixSeqpacketListener};

use super::{ConnSlot, Shared, ZdsConfig, ZdsError, ZdsHandle, ZdsMetrics, conn};
use crate::handover::SocketFile;
use crate::netns_cache::NetnsCache;

pub struct ZdsServer {
    listener: UnixSeqpacketListener,
    cfg: ZdsConfig,
    /// Owner of the socket directory when not root: the ztunnel identity the node was set up for.
    dir_owner: Option<u32>,
    cache: Arc<NetnsCache>,
    shared: Arc<Shared>,
    socket: SocketFile,
}

fn socket_err(path: &Path, source: std::io::Error) -> ZdsError {
    ZdsError::Socket {
        path: path.to_owned(),
        source,
    }
}

/// Creates the socket's directory root-only (0750 at most), tightening an existing one, and
/// removes a stale socket left by a previous agent. Anything at the path that is not a socket is
/// left alone and reported: we never delete a file we did not create. Returns the directory's
/// owner UID when it is not root.
///
/// A non-root ztunnel can only reach the socket through a directory its UID owns (or its group
/// may enter), so the directory's owner is the ztunnel identity the operator set up: that UID is
/// trusted on the socket besides `allowed_uids`, and nobody else gains access by it.
fn prepare_path(path: &Path) -> Result<Option<u32>, ZdsError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(dir)
        .map_err(|e| socket_err(dir, e))?;
    let meta = fs::symlink_metadata(dir).map_err(|e| socket_err(dir, e))?;
    if !meta.is_dir() {
        return Err(socket_err(
            dir,
            std::io::Error::other("socket directory is not a directory"),
        ));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & !0o750 != 0 {
        fs::set_permissions(dir, Permissions::from_mode(mode & 0o750))
            .map_err(|e| socket_err(dir, e))?;
    }
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            fs::remove_file(path).map_err(|e| socket_err(path, e))?
        }
        Ok(_) => {
            return Err(socket_err(
                path,
                std::io::Error::other("exists and is not a socket"),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(socket_err(path, e)),
    }
    use std::os::unix::fs::MetadataExt;
    Ok(Some(meta.uid()).filter(|uid| *uid != 0))
}

impl ZdsServer {
    /// Binds the listener (inside a tokio runtime). Connections wait in the backlog until
    /// [`serve`](Self::serve) runs, so the agent can bind early and build its cache first.
    pub fn bind(
        cfg: ZdsConfig,
        cache: Arc<NetnsCache>,
    ) -> Result<(ZdsServer, ZdsHandle), ZdsError> {
        Self::bind_with_metrics(cfg, cache, ZdsMetrics::default())
    }

    pub fn bind_with_metrics(
        cfg: ZdsConfig,
        cache: Arc<NetnsCache>,
        metrics: ZdsMetrics,
    ) -> Result<(ZdsServer, ZdsHandle), ZdsError> {
        let dir_owner = prepare_path(&cfg.socket_path)?;
        let listener = UnixSeqpacketListener::bind(&cfg.socket_path)
            .map_err(|e| socket_err(&cfg.socket_path, e))?;
        let socket =
            SocketFile::bound(&cfg.socket_path).map_err(|e| socket_err(&cfg.socket_path, e))?;
        // Connecting needs write access to the socket file; the 0750 directory decides who can
        // reach it, and the peer check who may stay.
        fs::set_permissions(&cfg.socket_path, Permissions::from_mode(0o666))
            .map_err(|e| socket_err(&cfg.socket_path, e))?;
        let shared = Arc::new(Shared {
            conns: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            serving: AtomicBool::new(false),
            admitted: Notify::new(),
            metrics,
            queue_capacity: cfg.queue_capacity.max(1),
        });
        let handle = ZdsHandle {
            shared: shared.clone(),
        };
        Ok((
            ZdsServer {
                listener,
                cfg,
                dir_owner,
                cache,
                shared,
                socket,
            },
            handle,
        ))
    }

    /// Accepts ztunnels until `shutdown` completes, then closes every connection and unlinks the
    /// socket unless the next agent already bound its own (ztunnel keeps retrying until one
    /// does).
    pub async fn serve(mut self, shutdown: impl Future<Output = ()>) {
        self.shared.serving.store(true, Ordering::Release);
        tracing::info!(path = %self.cfg.socket_path.display(), "ZDS server accepting ztunnel connections");
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                () = &mut shutdown => break,
                Some(_) = conns.join_next(), if !conns.is_empty() => continue,
                accepted = self.listener.accept() => accepted,
            };
            match accepted {
                Ok(sock) => {
                    if let Some(task) = self.admit(sock) {
                        conns.spawn(task);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "ZDS accept failed"),
            }
            tokio::time::sleep(self.cfg.accept_interval).await;
        }
        self.shared.serving.store(false, Ordering::Release);
        conns.shutdown().await;
        self.socket.remove();
    }

    /// Checks the peer's credentials and registers the connection. It is registered before its
    /// hello: an Add queued from now on is delivered after this connection's snapshot, and any
    /// pod cached before now is in that snapshot.
    fn admit(&self, sock: UnixSeqpacket) -> Option<impl Future<Output = ()> + Send + 'static> {
        let cred = match sock.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "ZDS peer credentials unavailable; closing");
                return None;
            }
        };
        if !self.cfg.allowed_uids.contains(&cred.uid()) && self.dir_owner != Some(cred.uid()) {
            tracing::warn!(uid = cred.uid(), pid = ?cred.pid(), "ZDS peer uid not allowed; closing");
            return None;
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(self.shared.queue_capacity);
        let synced = Arc::new(AtomicBool::new(false));
        self.shared.conns().push(ConnSlot {
            id,
            tx,
            synced: synced.clone(),
        });
        self.shared.metrics.ztunnel_connected.inc();
        self.shared.admitted.notify_waiters();
        tracing::info!(conn = id, pid = ?cred.pid(), "ztunnel connected");
        let ctx = conn::Conn {
            id,
            sock,
            rx,
            synced,
            cache: self.cache.clone(),
            cfg: self.cfg.clone(),
            metrics: self.shared.metrics.clone(),
        };
        let shared = self.shared.clone();
        Some(async move {
            // Deregisters even when the task is aborted at shutdown.
            let _guard = Deregister { shared, id };
            ctx.run().await;
        })
    }
}

struct Deregister {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Deregister {
    fn drop(&mut self) {
        let mut conns = self.shared.conns();
        if let Some(pos) = conns.iter().position(|c| c.id == self.id) {
            conns.remove(pos);
            self.shared.metrics.ztunnel_connected.dec();
        }
        tracing::info!(
            conn = self.id,
            remaining = conns.len(),
            "ztunnel disconnected"
        );
    }
}
