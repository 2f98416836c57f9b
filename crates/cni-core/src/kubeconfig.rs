//! The kubeconfig the installer writes for the plugin (`<run dir>/istio-cni-kubeconfig`): its
//! text, in the exact layout Istio's installer writes, and the parser the plugin reads it back
//! with when the agent cannot answer, with the API server URL inside it.
//!
//! The parser is deliberately small: it reads the single-cluster, single-user layout our installer
//! (and Istio's) writes, key by key, not YAML in general. Both are pure so that they can be fuzzed
//! and compared with Istio's goldens; the agent reads the CA and token files, the plugin reads the
//! kubeconfig and resolves a `certificate-authority` path itself.

use base64::Engine as _;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum KubeconfigError {
    #[error("invalid kubeconfig: {0}")]
    Invalid(String),
    #[error("invalid API server URL {0:?}")]
    Url(String),
}

/// Where the cluster's CA bundle comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaSource {
    /// Decoded `certificate-authority-data`.
    Pem(Vec<u8>),
    /// `certificate-authority`: a file path, relative to the kubeconfig's directory.
    File(String),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kubeconfig {
    pub server: String,
    pub ca: Option<CaSource>,
    pub insecure_skip_tls_verify: bool,
    pub token: String,
}

/// How the plugin's kubeconfig trusts the API server's certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerTrust<'a> {
    /// `certificate-authority-data`: this CA bundle (PEM), base64-encoded into the file.
    CaData(&'a [u8]),
    /// `insecure-skip-tls-verify: true` (`SKIP_TLS_VERIFY`).
    SkipVerify,
}

/// The API server URL the installer writes: `<protocol>://<host>:<port>`, an IPv6 host in
/// brackets (Go's `net.JoinHostPort`, as Istio builds it).
pub fn server_url(protocol: &str, host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("{protocol}://[{host}]:{port}")
    } else {
        format!("{protocol}://{host}:{port}")
    }
}

/// The kubeconfig text the installer writes for the plugin, in Istio's layout (keys sorted,
/// two-space nesting): cluster `local`, user `istio-cni` with `token`, context
/// `istio-cni-context`. Values that would not read back as the same string in plain YAML are
/// double-quoted.
pub fn render(server: &str, trust: ServerTrust<'_>, token: &str) -> String {
    let tls = match trust {
        ServerTrust::SkipVerify => "    insecure-skip-tls-verify: true\n".to_string(),
        ServerTrust::CaData(pem) => format!(
            "    certificate-authority-data: {}\n",
            base64::engine::general_purpose::STANDARD.encode(pem)
        ),
    };
    format!(
        "apiVersion: v1\n\
         clusters:\n\
         - cluster:\n\
         {tls}    server: {server}\n  name: local\n\
         contexts:\n\
         - context:\n    cluster: local\n    user: istio-cni\n  name: istio-cni-context\n\
         current-context: istio-cni-context\n\
         kind: Config\n\
         users:\n\
         - name: istio-cni\n  user:\n    token: {token}\n",
        server = yaml_scalar(server),
        token = yaml_scalar(token),
    )
}

/// A plain YAML scalar when that reads back as the same string, else a double-quoted one
/// (JSON string syntax is valid YAML).
fn yaml_scalar(s: &str) -> String {
    let plain_char = |c: char| c.is_ascii_alphanumeric() || "._-/:[]@%+=~".contains(c);
    let safe_start = s
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '/');
    let ambiguous = ["true", "false", "null", "yes", "no", "on", "off", "~"]
        .contains(&s.to_ascii_lowercase().as_str())
        || s.parse::<f64>().is_ok()
        || s.contains(": ")
        || s.ends_with(':');
    if safe_start && s.chars().all(plain_char) && !ambiguous {
        s.to_string()
    } else {
        serde_json::to_string(s).expect("strings serialise")
    }
}

/// Reads the first `server`, `certificate-authority-data`, `certificate-authority`,
/// `insecure-skip-tls-verify` and `token` keys. Inline CA data wins over a CA file.
pub fn parse(text: &str) -> Result<Kubeconfig, KubeconfigError> {
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
    let server = server
        .filter(|s| !s.is_empty())
        .ok_or_else(|| KubeconfigError::Invalid("no cluster server".into()))?;
    let ca = if let Some(data) = ca_data.filter(|s| !s.is_empty()) {
        let pem = base64::engine::general_purpose::STANDARD
            .decode(data.as_bytes())
            .map_err(|e| KubeconfigError::Invalid(format!("certificate-authority-data: {e}")))?;
        Some(CaSource::Pem(pem))
    } else {
        ca_file.filter(|s| !s.is_empty()).map(CaSource::File)
    };
    Ok(Kubeconfig {
        server,
        ca,
        insecure_skip_tls_verify: insecure.is_some_and(|v| v == "true"),
        token: token.unwrap_or_default(),
    })
}

fn unquote(v: &str) -> &str {
    for q in ['"', '\''] {
        if let Some(inner) = v.strip_prefix(q).and_then(|s| s.strip_suffix(q)) {
            return inner;
        }
    }
    v
}

/// An API server URL: scheme, host (IPv6 without brackets), port and path prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerUrl {
    pub https: bool,
    pub host: String,
    pub port: u16,
    /// Without a trailing `/`; empty for none.
    pub base_path: String,
}

pub fn parse_server_url(server: &str) -> Result<ServerUrl, KubeconfigError> {
    let bad = || KubeconfigError::Url(server.to_owned());
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
    Ok(ServerUrl {
        https,
        host,
        port,
        base_path: path.to_owned(),
    })
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
    fn renders_what_it_parses() {
        let text = render(
            &server_url("https", "fd00::1", 6443),
            ServerTrust::CaData(b"-----BEGIN CERTIFICATE-----\n"),
            "tok: en",
        );
        let kc = parse(&text).unwrap();
        assert_eq!(kc.server, "https://[fd00::1]:6443");
        assert_eq!(
            kc.ca,
            Some(CaSource::Pem(b"-----BEGIN CERTIFICATE-----\n".to_vec()))
        );
        assert!(text.contains("    token: \"tok: en\"\n"), "{text}");
        let text = render(&server_url("http", "h", 80), ServerTrust::SkipVerify, "t");
        let kc = parse(&text).unwrap();
        assert!(kc.insecure_skip_tls_verify && kc.ca.is_none());
        assert_eq!(
            (kc.server.as_str(), kc.token.as_str()),
            ("http://h:80", "t")
        );
    }

    #[test]
    fn odd_scalars_are_quoted() {
        assert_eq!(yaml_scalar("eyJhbGci.eyJ-_x.sig"), "eyJhbGci.eyJ-_x.sig");
        assert_eq!(
            yaml_scalar("https://10.96.0.1:443"),
            "https://10.96.0.1:443"
        );
        assert_eq!(yaml_scalar("tok\n"), "\"tok\\n\"");
        assert_eq!(yaml_scalar("true"), "\"true\"");
        assert_eq!(yaml_scalar("12345"), "\"12345\"");
        assert_eq!(yaml_scalar(""), "\"\"");
    }

    #[test]
    fn parses_the_installers_kubeconfig() {
        let kc = parse(GOLDEN).unwrap();
        assert_eq!(kc.server, "https://10.96.0.1:443");
        assert_eq!(
            kc.ca,
            Some(CaSource::Pem(b"-----BEGIN CERTIFICATE-----\n".to_vec()))
        );
        assert!(!kc.insecure_skip_tls_verify);
        assert_eq!(kc.token, "service_account_token_string");
    }

    #[test]
    fn insecure_and_quoted_values() {
        let text = "clusters:\n- cluster:\n    insecure-skip-tls-verify: true\n    server: \"https://[fd00::1]:6443\"\nusers:\n- name: u\n  user:\n    token: 'abc'\n";
        let kc = parse(text).unwrap();
        assert!(kc.insecure_skip_tls_verify && kc.ca.is_none());
        assert_eq!(kc.token, "abc");
        let url = parse_server_url(&kc.server).unwrap();
        assert_eq!(
            (url.host.as_str(), url.port, url.https),
            ("fd00::1", 6443, true)
        );
    }

    #[test]
    fn ca_file_when_no_inline_data() {
        let kc = parse("server: https://h\ncertificate-authority: ca.crt\n").unwrap();
        assert_eq!(kc.ca, Some(CaSource::File("ca.crt".into())));
    }

    #[test]
    fn bad_kubeconfigs() {
        assert!(matches!(
            parse("kind: Config\n"),
            Err(KubeconfigError::Invalid(_))
        ));
        assert!(matches!(
            parse("server: https://h\ncertificate-authority-data: !!!\n"),
            Err(KubeconfigError::Invalid(_))
        ));
    }

    #[test]
    fn urls() {
        let u = parse_server_url("https://10.96.0.1").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.base_path.as_str()),
            ("10.96.0.1", 443, "")
        );
        let u = parse_server_url("http://127.0.0.1:8080/prefix/").unwrap();
        assert_eq!(
            (u.https, u.port, u.base_path.as_str()),
            (false, 8080, "/prefix")
        );
        let u = parse_server_url("https://kubernetes.default.svc:443").unwrap();
        assert_eq!(u.host, "kubernetes.default.svc");
        for bad in ["ftp://x", "https://", "https://h:port", "https://[::1"] {
            assert!(parse_server_url(bad).is_err(), "{bad}");
        }
    }
}
