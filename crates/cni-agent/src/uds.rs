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

/// Serves `router` on `listener`: each connection straight to hyper's HTTP/1 server. The local
/// sockets' callers (the plugin, one connection per CNI ADD, and debug clients) speak HTTP/1.1
/// only; `axum::serve` first reads a connection's opening bytes to tell HTTP/2 apart (a read and
/// a copy per connection) and keeps a shutdown watch per connection nothing here uses. The
/// responses are the same hyper HTTP/1 encoding with the same settings.
pub async fn serve_http1(mut listener: PeerCheckedListener, router: axum::Router) {
    use axum::serve::Listener;
    loop {
        let (stream, _) = listener.accept().await;
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .with_upgrades();
            if let Err(e) = conn.await {
                tracing::trace!(error = %e, "local socket connection ended");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio::io::AsyncReadExt;

    /// A uid listed in `ALLOWED_PEER_UIDS` (a rootless runtime's) is admitted; a peer whose uid is
    /// not listed is closed without its connection reaching the server. Tests run as one user, so
    /// that user is listed or not.
    #[tokio::test]
    async fn only_listed_peer_uids_are_handed_out() {
        let me = nix::unistd::geteuid().as_raw();
        let other = me.wrapping_add(4242);
        let dir = tempfile::tempdir().unwrap();

        let path = dir.path().join("sock/allowed.sock");
        let mut listener = PeerCheckedListener::bind(&path, vec![other, me]).unwrap();
        let _client = UnixStream::connect(&path).await.unwrap();
        let (stream, _) = tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("a listed uid is admitted");
        assert_eq!(stream.peer_cred().unwrap().uid(), me);

        let path = dir.path().join("sock/refused.sock");
        let mut listener = PeerCheckedListener::bind(&path, vec![other]).unwrap();
        let mut client = UnixStream::connect(&path).await.unwrap();
        let accepted = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
        assert!(accepted.is_err(), "an unlisted uid must not be handed out");
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), client.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0, "the refused connection is closed");
    }
}
