//! Unix-socket HTTP listeners for the agent's local endpoints (plugin events, plugin logs, debug):
//! every connection's peer credentials are checked before a request is read.

use std::path::Path;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};

/// A unix listener that only hands out connections from allowed peer UIDs (`SO_PEERCRED`); the
/// container runtime runs the plugin as root.
pub struct PeerCheckedListener {
    inner: UnixListener,
    allowed_uids: Vec<u32>,
}

impl PeerCheckedListener {
    /// Binds `path`, replacing a stale socket file; the parent directory is created 0750.
    pub fn bind(path: &Path, allowed_uids: Vec<u32>) -> std::io::Result<Self> {
        use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o750)
                .create(dir)?;
        }
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
            Ok(_) => {
                return Err(std::io::Error::other(format!(
                    "{} exists and is not a socket",
                    path.display()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let inner = UnixListener::bind(path)?;
        // Reachable by any local process; who may talk is decided by the peer check.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
        Ok(PeerCheckedListener {
            inner,
            allowed_uids,
        })
    }
}

impl axum::serve::Listener for PeerCheckedListener {
    type Io = UnixStream;
    type Addr = tokio::net::unix::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => match stream.peer_cred() {
                    Ok(cred) if self.allowed_uids.contains(&cred.uid()) => return (stream, addr),
                    Ok(cred) => {
                        tracing::warn!(uid = cred.uid(), pid = ?cred.pid(), "refused plugin socket peer")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read plugin socket peer credentials")
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "plugin socket accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}
