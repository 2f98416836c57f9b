//! A fault-injecting proxy in front of the test API server, for the churn harness: the agent's and
//! the plugin's kubeconfigs point at it instead of the server. It terminates TLS with the server's
//! own certificate (so clients trusting the test CA accept it) and passes every request through,
//! until told to answer every request with an error status (a 429 or 5xx burst, as an overloaded
//! or restarting API server sends), to answer slowly (every new connection waits before it is
//! passed on), or to reset every open connection (watches included). Connections speak HTTP/1.1
//! (the only ALPN offered), one request per connection while failing.
//!
//! [`ApiProxy::start`] fronts the test API server from the test's loopback;
//! [`ApiProxy::serve`] takes its listener and its way to the server from the caller, so the real
//! node's proxy listens and connects inside the node's network namespace.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::kube::KubeTestEnv;

/// Opens a connection to the API server.
pub type Connect =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send>> + Send + Sync>;

struct Shared {
    /// `Some(status)`: every request is answered with it.
    failing: Mutex<Option<u16>>,
    /// How long each new connection waits before it is passed on.
    delay: Mutex<Option<Duration>>,
    /// Bumped to reset every open connection.
    generation: watch::Sender<u64>,
    rejected: AtomicU64,
    connect: Connect,
    /// The API server's address, as its certificate names it.
    server: IpAddr,
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

pub struct ApiProxy {
    port: u16,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for ApiProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.generation.send_modify(|g| *g += 1);
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl ApiProxy {
    /// Listens on a free port of 127.0.0.1 (inside a tokio runtime) and forwards to `kube`.
    pub async fn start(kube: &KubeTestEnv) -> ApiProxy {
        let (cert, key) = kube.serving_cert();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = SocketAddr::from(([127, 0, 0, 1], kube.port()));
        let connect: Connect = Arc::new(move || Box::pin(TcpStream::connect(upstream)));
        Self::serve(
            listener,
            &cert,
            &key,
            &kube.ca_pem(),
            upstream.ip(),
            connect,
        )
    }

    /// Serves `listener` (inside a tokio runtime) with the API server's certificate `cert` and
    /// `key`, and forwards each connection over `connect` to the server at `server`, whose
    /// certificate `ca_pem` signs.
    pub fn serve(
        listener: TcpListener,
        cert: &Path,
        key: &Path,
        ca_pem: &[u8],
        server: IpAddr,
        connect: Connect,
    ) -> ApiProxy {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .expect("API server certificate")
            .collect::<Result<_, _>>()
            .expect("API server certificate PEM");
        let key = PrivateKeyDer::from_pem_file(key).expect("API server key PEM");
        let mut tls = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("proxy TLS server config");
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca_pem) {
            roots.add(ca.expect("CA PEM")).unwrap();
        }
        let mut client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];

        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            failing: Mutex::new(None),
            delay: Mutex::new(None),
            generation: watch::channel(0).0,
            rejected: AtomicU64::new(0),
            connect,
            server,
            acceptor: TlsAcceptor::from(Arc::new(tls)),
            connector: TlsConnector::from(Arc::new(client)),
        });
        let task = tokio::spawn(accept_loop(listener, shared.clone()));
        ApiProxy { port, shared, task }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on every request gets `status` (`None`: pass through again). Open connections
    /// are reset when a burst starts, so long-running watches meet it too.
    pub fn set_failing(&self, status: Option<u16>) {
        *self.shared.failing.lock().unwrap() = status;
        if status.is_some() {
            self.reset_connections();
        }
    }

    /// From now on each new connection waits `delay` before it reaches the API server (`None`:
    /// at once again): slow answers, as from an API server under load.
    pub fn set_delay(&self, delay: Option<Duration>) {
        *self.shared.delay.lock().unwrap() = delay;
    }

    /// Closes every open connection (an API server restart or a load balancer reset, seen from
    /// the client).
    pub fn reset_connections(&self) {
        self.shared.generation.send_modify(|g| *g += 1);
    }

    /// Requests answered with an error status so far.
    pub fn rejected(&self) -> u64 {
        self.shared.rejected.load(Ordering::Relaxed)
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((down, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut reset = shared.generation.subscribe();
            reset.mark_unchanged();
            tokio::select! {
                () = serve(down, &shared) => {}
                _ = reset.changed() => {}
            }
        });
    }
}

async fn serve(down: TcpStream, shared: &Shared) {
    let Ok(mut down) = shared.acceptor.accept(down).await else {
        return;
    };
    let failing = *shared.failing.lock().unwrap();
    if let Some(status) = failing {
        // Counted before the answer goes out: a caller that got it must see it counted.
        shared.rejected.fetch_add(1, Ordering::Relaxed);
        reject(&mut down, status).await;
        return;
    }
    let delay = *shared.delay.lock().unwrap();
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    let Ok(up) = (shared.connect)().await else {
        return;
    };
    let name = ServerName::IpAddress(shared.server.into());
    let Ok(mut up) = shared.connector.connect(name, up).await else {
        return;
    };
    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
}

/// Reads the request head and answers with `status` and a Kubernetes `Status` body, then closes.
async fn reject<S: AsyncReadExt + AsyncWriteExt + Unpin>(conn: &mut S, status: u16) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let (reason, why) = match status {
        429 => ("Too Many Requests", "TooManyRequests"),
        500 => ("Internal Server Error", "InternalError"),
        502 => ("Bad Gateway", "InternalError"),
        _ => ("Service Unavailable", "ServiceUnavailable"),
    };
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": format!("injected by the test API proxy: {reason}"),
        "reason": why, "code": status,
    })
    .to_string();
    let resp = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nRetry-After: 1\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.write_all(resp.as_bytes()).await;
    let _ = conn.shutdown().await;
}
