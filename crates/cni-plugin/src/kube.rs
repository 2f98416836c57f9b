//! The plugin's own view of the API server, used only when the agent cannot answer: the
//! kubeconfig the installer writes (`<run dir>/istio-cni-kubeconfig`) and plain GETs of a pod and
//! its namespace over HTTPS (or HTTP, for test servers).
//!
//! The kubeconfig text is parsed by `cni_core::kubeconfig` (pure, fuzzed); this module reads the
//! files.

use std::io::Read as _;
use std::net::{IpAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cni_core::kubeconfig::{self, CaSource, KubeconfigError, ServerUrl, parse_server_url};
use serde_json::Value;

use crate::http::{self, Deadline, HttpError, Request};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kubeconfig {
    pub server: String,
    /// PEM bundle from `certificate-authority-data` (or the `certificate-authority` file).
    pub ca_pem: Option<Vec<u8>>,
    pub insecure_skip_tls_verify: bool,
    pub token: String,
}

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("cannot read kubeconfig {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Invalid(#[from] KubeconfigError),
    #[error("cannot reach the API server at {server}: {source}")]
    Connect {
        server: String,
        source: std::io::Error,
    },
    #[error("TLS setup failed: {0}")]
    Tls(String),
    #[error("GET {path} failed: {source}")]
    Http { path: String, source: HttpError },
    #[error("GET {path} returned {status}: {body}")]
    Status {
        path: String,
        status: u16,
        body: String,
    },
    #[error("GET {path} returned invalid JSON: {0}", path = .1)]
    Json(String, String),
}

impl Kubeconfig {
    pub fn load(path: &Path) -> Result<Kubeconfig, KubeError> {
        let text = std::fs::read_to_string(path).map_err(|source| KubeError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Kubeconfig::parse(&text, path.parent().unwrap_or(Path::new("/")))
    }

    /// Parses `text` (see [`cni_core::kubeconfig::parse`]); a relative `certificate-authority`
    /// path resolves against `dir`.
    pub fn parse(text: &str, dir: &Path) -> Result<Kubeconfig, KubeError> {
        let parsed = kubeconfig::parse(text)?;
        let ca_pem = match parsed.ca {
            None => None,
            Some(CaSource::Pem(pem)) => Some(pem),
            Some(CaSource::File(file)) => {
                let path = dir.join(file);
                Some(std::fs::read(&path).map_err(|source| KubeError::Read {
                    path: path.display().to_string(),
                    source,
                })?)
            }
        };
        Ok(Kubeconfig {
            server: parsed.server,
            ca_pem,
            insecure_skip_tls_verify: parsed.insecure_skip_tls_verify,
            token: parsed.token,
        })
    }
}

/// One-shot GETs against the API server, each bounded by `timeout`.
pub struct ApiClient {
    kc: Kubeconfig,
    url: ServerUrl,
    tls: Option<Arc<rustls::ClientConfig>>,
    timeout: Duration,
}

impl ApiClient {
    pub fn new(kc: Kubeconfig, timeout: Duration) -> Result<ApiClient, KubeError> {
        let url = parse_server_url(&kc.server)?;
        let tls = if url.https {
            Some(
                crate::tls::client_config(kc.ca_pem.as_deref(), kc.insecure_skip_tls_verify)
                    .map_err(KubeError::Tls)?,
            )
        } else {
            None
        };
        Ok(ApiClient {
            kc,
            url,
            tls,
            timeout,
        })
    }

    pub fn get_pod(&self, namespace: &str, name: &str) -> Result<Value, KubeError> {
        self.get(&format!("/api/v1/namespaces/{namespace}/pods/{name}"))
    }

    pub fn get_namespace(&self, name: &str) -> Result<Value, KubeError> {
        self.get(&format!("/api/v1/namespaces/{name}"))
    }

    pub fn get(&self, path: &str) -> Result<Value, KubeError> {
        let until = Instant::now() + self.timeout;
        let full_path = format!("{}{path}", self.url.base_path);
        let tcp = self.connect()?;
        let stream = Deadline::new(tcp, until);
        let auth = format!("Bearer {}", self.kc.token);
        let mut headers = vec![("Accept", "application/json")];
        if !self.kc.token.is_empty() {
            headers.push(("Authorization", auth.as_str()));
        }
        let host_header = if self.url.host.contains(':') {
            format!("[{}]:{}", self.url.host, self.url.port)
        } else {
            format!("{}:{}", self.url.host, self.url.port)
        };
        let req = Request {
            method: "GET",
            host: &host_header,
            path: &full_path,
            headers: &headers,
            body: &[],
        };
        let http_err = |source| KubeError::Http {
            path: path.to_owned(),
            source,
        };
        let resp = match &self.tls {
            None => {
                let mut s = stream;
                http::exchange(&mut s, &req, MAX_OBJECT).map_err(http_err)?
            }
            Some(cfg) => {
                let name = server_name(&self.url.host).map_err(KubeError::Tls)?;
                let conn = rustls::ClientConnection::new(cfg.clone(), name)
                    .map_err(|e| KubeError::Tls(e.to_string()))?;
                let mut s = rustls::StreamOwned::new(conn, stream);
                let r = http::exchange(&mut s, &req, MAX_OBJECT).map_err(http_err)?;
                // Drain close_notify so the server sees an orderly close; errors do not matter here.
                let _ = s.read(&mut [0u8; 64]);
                r
            }
        };
        if resp.status != 200 {
            let mut body = resp.text();
            body.truncate(512);
            return Err(KubeError::Status {
                path: path.to_owned(),
                status: resp.status,
                body,
            });
        }
        serde_json::from_slice(&resp.body)
            .map_err(|e| KubeError::Json(e.to_string(), path.to_owned()))
    }

    fn connect(&self) -> Result<TcpStream, KubeError> {
        let server = self.kc.server.clone();
        let addrs = (self.url.host.as_str(), self.url.port)
            .to_socket_addrs()
            .map_err(|source| KubeError::Connect {
                server: server.clone(),
                source,
            })?;
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.timeout) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = e,
            }
        }
        Err(KubeError::Connect {
            server,
            source: last,
        })
    }
}

/// A pod can carry large annotations; 8 MiB is well above anything the API server stores.
const MAX_OBJECT: usize = 8 << 20;

fn server_name(host: &str) -> Result<rustls::pki_types::ServerName<'static>, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(rustls::pki_types::ServerName::IpAddress(ip.into()));
    }
    rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| format!("server name {host:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ca_file_is_relative_to_the_kubeconfig() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.crt"), b"PEM").unwrap();
        let kc = Kubeconfig::parse(
            "server: https://h\ncertificate-authority: ca.crt\n",
            dir.path(),
        )
        .unwrap();
        assert_eq!(kc.ca_pem.as_deref(), Some(&b"PEM"[..]));
    }

    #[test]
    fn bad_kubeconfigs() {
        assert!(matches!(
            Kubeconfig::parse("kind: Config\n", Path::new("/")),
            Err(KubeError::Invalid(KubeconfigError::Invalid(_)))
        ));
        assert!(matches!(
            Kubeconfig::parse(
                "server: https://h\ncertificate-authority: missing.crt\n",
                Path::new("/nonexistent")
            ),
            Err(KubeError::Read { .. })
        ));
        assert!(matches!(
            Kubeconfig::load(Path::new("/nonexistent/istio-cni-kubeconfig")),
            Err(KubeError::Read { .. })
        ));
    }
}
