//! The kubeconfig the plugin uses to reach the API server, written into the agent run dir (not
//! the CNI conf dir, which other software reads). Rewritten on every install pass, so a rotated
//! service account token reaches the plugin.

use std::path::PathBuf;

use cni_core::kubeconfig::ServerTrust;

use crate::hostfs::{FileMode, HostDir, HostFsError};
use crate::install::config::InstallConfig;

/// File name inside the agent run dir.
pub const KUBECONFIG_FILENAME: &str = "istio-cni-kubeconfig";

#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error("KUBERNETES_SERVICE_HOST is not set")]
    MissingHost,
    #[error("KUBERNETES_SERVICE_PORT is not set")]
    MissingPort,
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    HostFs(#[from] HostFsError),
}

/// Renders the kubeconfig in the exact layout Istio writes (`cni_core::kubeconfig::render`,
/// compared with Istio's goldens by cni-core's installer conformance test).
pub fn render(cfg: &InstallConfig) -> Result<String, KubeconfigError> {
    let host = cfg
        .kube_service
        .host
        .as_deref()
        .ok_or(KubeconfigError::MissingHost)?;
    let port = cfg.kube_service.port.ok_or(KubeconfigError::MissingPort)?;
    let server = cni_core::kubeconfig::server_url(&cfg.kube_service.protocol, host, port);
    let read = |path: PathBuf| {
        std::fs::read(&path).map_err(|source| KubeconfigError::Read { path, source })
    };
    let ca = if cfg.skip_tls_verify {
        None
    } else {
        let ca_path = cfg
            .kube_ca_file
            .clone()
            .unwrap_or_else(|| cfg.service_account_dir.join("ca.crt"));
        Some(read(ca_path)?)
    };
    let trust = match &ca {
        Some(pem) => ServerTrust::CaData(pem),
        None => ServerTrust::SkipVerify,
    };
    let token = read(cfg.service_account_dir.join("token"))?;
    Ok(cni_core::kubeconfig::render(
        &server,
        trust,
        &String::from_utf8_lossy(&token),
    ))
}

/// Writes the kubeconfig with `KUBECONFIG_MODE`; returns its path.
pub fn write(cfg: &InstallConfig) -> Result<PathBuf, KubeconfigError> {
    let content = render(cfg)?;
    let dir = HostDir::open_or_create(&cfg.run_dir)?;
    dir.write_atomic(
        KUBECONFIG_FILENAME,
        content.as_bytes(),
        FileMode::Exactly(cfg.kubeconfig_mode),
    )?;
    Ok(dir.join(KUBECONFIG_FILENAME))
}

/// The content with secrets replaced, for the log.
pub fn redacted(content: &str) -> String {
    content
        .lines()
        .map(|l| match l.split_once(": ") {
            Some((k, _))
                if k.trim_start() == "token" || k.trim_start() == "certificate-authority-data" =>
            {
                format!("{k}: REDACTED")
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::install::config::{ConfMode, KubeService};
    use std::os::unix::fs::PermissionsExt;

    const TLS_GOLDEN: &str = "apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCmZha2UtY2EKLS0tLS1FTkQgQ0VSVElGSUNBVEUtLS0tLQo=
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

    fn config(sa: &std::path::Path, run: &std::path::Path) -> InstallConfig {
        std::fs::write(sa.join("token"), "service_account_token_string").unwrap();
        std::fs::write(
            sa.join("ca.crt"),
            "-----BEGIN CERTIFICATE-----\nfake-ca\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        InstallConfig {
            conf_dir: run.into(),
            mode: ConfMode::Chained,
            primary_name: None,
            run_dir: run.into(),
            kubeconfig_mode: 0o600,
            created_conf_mode: 0o600,
            kube_ca_file: None,
            skip_tls_verify: false,
            bin_dirs: vec![],
            bin_source_dir: run.into(),
            service_account_dir: sa.into(),
            kube_service: KubeService {
                protocol: "https".into(),
                host: Some("10.96.0.1".into()),
                port: Some(443),
            },
            entry: cni_core::conflist::IstioEntry {
                plugin_log_level: "info".into(),
                cni_agent_run_dir: run.display().to_string(),
                ambient_enabled: false,
                enablement_selectors: serde_json::json!([]),
                exclude_namespaces: None,
                pod_namespace: String::new(),
                native_nftables: false,
                enable_ambient_detection_retry: false,
            },
        }
    }

    #[test]
    fn istio_kubeconfig_goldens() {
        let sa = tempfile::tempdir().unwrap();
        let run = tempfile::tempdir().unwrap();
        let mut cfg = config(sa.path(), run.path());
        let path = write(&cfg).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), TLS_GOLDEN);
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );

        cfg.skip_tls_verify = true;
        let skip = render(&cfg).unwrap();
        assert!(skip.contains("- cluster:\n    insecure-skip-tls-verify: true\n    server: https://10.96.0.1:443\n"), "{skip}");
        assert!(!skip.contains("certificate-authority-data"));

        cfg.kube_service.host = Some("50.76.2.1".into());
        cfg.kubeconfig_mode = 0o640;
        write(&cfg).unwrap();
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .contains("server: https://50.76.2.1:443\n")
        );
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o640
        );

        cfg.kube_service.host = Some("fd00::1".into());
        assert!(
            render(&cfg)
                .unwrap()
                .contains("server: https://[fd00::1]:443\n")
        );
        cfg.kube_ca_file = Some(sa.path().join("token"));
        cfg.skip_tls_verify = false;
        assert!(
            render(&cfg)
                .unwrap()
                .contains("certificate-authority-data: c2VydmljZV9hY2NvdW50X3Rva2VuX3N0cmluZw==\n")
        );
    }

    #[test]
    fn missing_host_or_port_fails() {
        let sa = tempfile::tempdir().unwrap();
        let mut cfg = config(sa.path(), sa.path());
        cfg.kube_service.host = None;
        assert!(matches!(render(&cfg), Err(KubeconfigError::MissingHost)));
        cfg.kube_service.host = Some("h".into());
        cfg.kube_service.port = None;
        assert!(matches!(render(&cfg), Err(KubeconfigError::MissingPort)));
    }

    #[test]
    fn logs_are_redacted() {
        let r = redacted(TLS_GOLDEN);
        assert!(
            !r.contains("service_account_token_string") && !r.contains("LS0t"),
            "{r}"
        );
        assert!(r.contains("    token: REDACTED"));
    }
}
