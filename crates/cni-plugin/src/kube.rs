//! The plugin's own view of the API server, used only when the agent cannot answer: the
//! kubeconfig the installer writes (`<run dir>/istio-cni-kubeconfig`) and plain GETs of a pod and
//! its namespace over HTTPS (or HTTP, for test servers).
//!
//! The kubeconfig parser is deliberately small: it reads the single-cluster, single-user layout
//! our installer (and Istio's) writes, key by key, not YAML in general.

use std::io::Read as _;
use std::net::{IpAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    #[error("invalid kubeconfig: {0}")]
    Invalid(String),
    #[error("invalid API server URL {0:?}")]
    Url(String),
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

    /// Reads the first `server`, `certificate-authority-data`, `certificate-authority`,
    /// `insecure-skip-tls-verify` and `token` keys; relative file paths resolve against `dir`.
    pub fn parse(text: &str, dir: &Path) -> Result<Kubeconfig, KubeError> {
        use base64::Engine as _;
        let mut kc = Kubeconfig::default();
        let (mut server, mut ca_data, mut ca_file, mut insecure, mut token) =
            (None, None, None, None, None);
        for line in text.lines() {
            let line = line.trim_start().trim_start_matches("- ").trim();
            if line.starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let value = unquote(value.trim());
            let slot = match key.trim() {
                "server" => &mut server,
                "certificate-authority-data" => &mut ca_data,
                "certificate-authority" => &mut ca_file,
                "insecure-skip-tls-verify" => &mut insecure,
                "token" => &mut token,
                _ => continue,
            };
            if slot.is_none() {
                *slot = Some(value.to_owned());
            }
        }
        kc.server = server
            .filter(|s| !s.is_empty())
            .ok_or_else(|| KubeError::Invalid("no cluster server".into()))?;
        if let Some(data) = ca_data.filter(|s| !s.is_empty()) {
            let pem = base64::engine::general_purpose::STANDARD
                .decode(data.as_bytes())
                .map_err(|e| KubeError::Invalid(format!("certificate-authority-data: {e}")))?;
            kc.ca_pem = Some(pem);
        } else if let Some(file) = ca_file.filter(|s| !s.is_empty()) {
            let path = dir.join(&file);
            let pem = std::fs::read(&path).map_err(|source| KubeError::Read {
                path: path.display().to_string(),
                source,
            })?;
            kc.ca_pem = Some(pem);
        }
        kc.insecure_skip_tls_verify = insecure.is_some_and(|v| v == "true");
        kc.token = token.unwrap_or_default();
        Ok(kc)
    }
}

fn unquote(v: &str) -> &str {
    for q in ['"', '\''] {
        if let Some(inner) = v.strip_prefix(q).and_then(|s| s.strip_suffix(q)) {
            return inner;
        }
    }
    v
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Url {
    https: bool,
    host: String,
    port: u16,
    base_path: String,
}

fn parse_url(server: &str) -> Result<Url, KubeError> {
    let bad = || KubeError::Url(server.to_owned());
    let (https, rest) = if let Some(r) = server.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = server.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(bad());
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    let default_port = if https { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or_else(bad)?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| bad())?,
            None if after.is_empty() => default_port,
            None => return Err(bad()),
        };
        (h.to_owned(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), p.parse().map_err(|_| bad())?),
            None => (authority.to_owned(), default_port),
        }
    };
    if host.is_empty() {
        return Err(bad());
    }
    Ok(Url {
        https,
        host,
        port,
        base_path: path.to_owned(),
    })
}

/// One-shot GETs against the API server, each bounded by `timeout`.
pub struct ApiClient {
    kc: Kubeconfig,
    url: Url,
    tls: Option<Arc<rustls::ClientConfig>>,
    timeout: Duration,
}

impl ApiClient {
    pub fn new(kc: Kubeconfig, timeout: Duration) -> Result<ApiClient, KubeError> {
        let url = parse_url(&kc.server)?;
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

    /// The installer's layout (istio-cni.md §2.7, golden `kubeconfig-tls`).
    const GOLDEN: &str = "apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==
    server: https://10.96.0.1:443
  name: local
contexts:
- context:
    cluster: local
    user: istio-cni
  name: istio-cni-context
current-context: istio-cni-context
kind: Config
users:
- name: istio-cni
  user:
    token: service_account_token_string
";

    #[test]
    fn parses_the_installers_kubeconfig() {
        let kc = Kubeconfig::parse(GOLDEN, Path::new("/")).unwrap();
        assert_eq!(kc.server, "https://10.96.0.1:443");
        assert_eq!(
            kc.ca_pem.as_deref(),
            Some(&b"-----BEGIN CERTIFICATE-----\n"[..])
        );
        assert!(!kc.insecure_skip_tls_verify);
        assert_eq!(kc.token, "service_account_token_string");
    }

    #[test]
    fn insecure_and_quoted_values() {
        let text = "clusters:\n- cluster:\n    insecure-skip-tls-verify: true\n    server: \"https://[fd00::1]:6443\"\nusers:\n- name: u\n  user:\n    token: 'abc'\n";
        let kc = Kubeconfig::parse(text, Path::new("/")).unwrap();
        assert!(kc.insecure_skip_tls_verify && kc.ca_pem.is_none());
        assert_eq!(kc.token, "abc");
        let url = parse_url(&kc.server).unwrap();
        assert_eq!(
            (url.host.as_str(), url.port, url.https),
            ("fd00::1", 6443, true)
        );
    }

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
            Err(KubeError::Invalid(_))
        ));
        assert!(matches!(
            Kubeconfig::parse(
                "server: https://h\ncertificate-authority-data: !!!\n",
                Path::new("/")
            ),
            Err(KubeError::Invalid(_))
        ));
        assert!(matches!(
            Kubeconfig::load(Path::new("/nonexistent/istio-cni-kubeconfig")),
            Err(KubeError::Read { .. })
        ));
    }

    #[test]
    fn urls() {
        let u = parse_url("https://10.96.0.1").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.base_path.as_str()),
            ("10.96.0.1", 443, "")
        );
        let u = parse_url("http://127.0.0.1:8080/prefix/").unwrap();
        assert_eq!(
            (u.https, u.port, u.base_path.as_str()),
            (false, 8080, "/prefix")
        );
        let u = parse_url("https://kubernetes.default.svc:443").unwrap();
        assert_eq!(u.host, "kubernetes.default.svc");
        for bad in ["ftp://x", "https://", "https://h:port", "https://[::1"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
