//! Real peers for the plugin binary: HTTP/1.1 servers on a unix socket (the agent) and on
//! 127.0.0.1 (the API server), each a std thread that records every request it got; and the
//! plugin config and chain inputs both test files start from.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A bridge plugin's result, handed to ours as `prevResult`.
pub const PREV: &str = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/x"}],"ips":[{"interface":0,"address":"10.244.1.5/24","gateway":"10.244.1.1"}],"dns":{}}"#;
/// The `CNI_ARGS` containerd sends for pod `default/web-0`.
pub const POD_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc123;K8S_POD_UID=uid-1";

/// Our plugin's entry in the chain, as the installer writes it (no `prevResult`).
pub fn plugin_conf(run_dir: &Path, ambient: bool) -> serde_json::Value {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "type": "istio-cni",
        "plugin_log_level": "debug",
        "cni_agent_run_dir": run_dir,
        "ambient_enabled": ambient,
        "enablement_selectors": cni_core::enroll::default_selectors(),
        "exclude_namespaces": ["kube-system"],
        "pod_namespace": "istio-system",
    })
}

#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

pub type Handler = dyn Fn(&Recorded) -> (u16, Vec<u8>) + Send + Sync;

enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
    Tls(TcpListener, Arc<rustls::ServerConfig>),
}

pub struct Server {
    pub requests: Arc<Mutex<Vec<Recorded>>>,
    stop: Arc<AtomicBool>,
    wake: Box<dyn Fn() + Send>,
    thread: Option<JoinHandle<()>>,
    pub port: u16,
}

impl Server {
    /// An agent on `socket`.
    pub fn unix(
        socket: &Path,
        handler: impl Fn(&Recorded) -> (u16, Vec<u8>) + Send + Sync + 'static,
    ) -> Server {
        let l = UnixListener::bind(socket).expect("bind unix socket");
        let path = socket.to_owned();
        Server::start(
            Listener::Unix(l, path.clone()),
            Arc::new(handler),
            Box::new(move || {
                let _ = UnixStream::connect(&path);
            }),
        )
    }

    /// An API server on 127.0.0.1.
    pub fn tcp(handler: impl Fn(&Recorded) -> (u16, Vec<u8>) + Send + Sync + 'static) -> Server {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
        let port = l.local_addr().unwrap().port();
        let mut s = Server::start(
            Listener::Tcp(l),
            Arc::new(handler),
            Box::new(move || {
                let _ = TcpStream::connect(("127.0.0.1", port));
            }),
        );
        s.port = port;
        s
    }

    /// An API server on 127.0.0.1 speaking HTTPS with `cert_chain` (PEM) and `key` (PKCS#8 PEM).
    pub fn tls(
        cert_chain: &str,
        key: &str,
        handler: impl Fn(&Recorded) -> (u16, Vec<u8>) + Send + Sync + 'static,
    ) -> Server {
        use rustls::pki_types::pem::PemObject as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(cert_chain.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap();
        let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        let l = TcpListener::bind("127.0.0.1:0").expect("bind tcp");
        let port = l.local_addr().unwrap().port();
        let mut s = Server::start(
            Listener::Tls(l, Arc::new(config)),
            Arc::new(handler),
            Box::new(move || {
                let _ = TcpStream::connect(("127.0.0.1", port));
            }),
        );
        s.port = port;
        s
    }

    fn start(listener: Listener, handler: Arc<Handler>, wake: Box<dyn Fn() + Send>) -> Server {
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, st) = (requests.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            loop {
                let conn: Box<dyn ReadWrite> = match &listener {
                    Listener::Unix(l, _) => match l.accept() {
                        Ok((c, _)) => Box::new(c),
                        Err(_) => continue,
                    },
                    Listener::Tcp(l) => match l.accept() {
                        Ok((c, _)) => Box::new(c),
                        Err(_) => continue,
                    },
                    Listener::Tls(l, config) => match l.accept() {
                        Ok((c, _)) => {
                            let conn = rustls::ServerConnection::new(config.clone()).unwrap();
                            Box::new(rustls::StreamOwned::new(conn, c))
                        }
                        Err(_) => continue,
                    },
                };
                if st.load(Ordering::SeqCst) {
                    break;
                }
                serve(conn, &r, handler.as_ref());
            }
            if let Listener::Unix(_, path) = &listener {
                let _ = std::fs::remove_file(path);
            }
        });
        Server {
            requests,
            stop,
            wake,
            thread: Some(thread),
            port: 0,
        }
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        (self.wake)();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

fn serve(mut conn: Box<dyn ReadWrite>, log: &Mutex<Vec<Recorded>>, handler: &Handler) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let method = first.next().unwrap_or_default().to_owned();
    let path = first.next().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    let req = Recorded {
        method,
        path,
        headers,
        body,
    };
    log.lock().unwrap().push(req.clone());
    let (status, reply) = handler(&req);
    if status == 0 {
        // Status 0: accept and stay silent, like a hung agent.
        std::thread::sleep(std::time::Duration::from_secs(7));
        return;
    }
    let head = format!(
        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reply.len()
    );
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(&reply);
    let _ = conn.flush();
}

pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the built plugin with exactly `env` (nothing inherited) and `stdin`.
pub fn run_plugin(env: &[(&str, &str)], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_istio-cni"))
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn istio-cni");
    // VERSION never reads stdin: a closed pipe is fine then.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    let out = child.wait_with_output().unwrap();
    Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}
