//! The installer's settings (Istio's `InstallConfig`): the CNI config it writes, where, and the
//! plugin entry's values.

use std::path::PathBuf;

use clap::{ArgAction, Args};
use cni_core::conflist::IstioEntry;
use serde_json::{Map, Value};

use crate::config::{ConfigError, file_mode, go_bool};
use crate::logging::LogArgs;

/// Installer settings (Istio's `InstallConfig`), plus the directories Istio hard-codes.
#[derive(Args, Debug, Clone)]
pub struct InstallArgs {
    /// Directory of the host's CNI network configs, as mounted in this container.
    #[arg(
        long,
        env = "MOUNTED_CNI_NET_DIR",
        default_value = "/host/etc/cni/net.d",
        global = true
    )]
    pub mounted_cni_net_dir: PathBuf,
    /// Primary CNI config file to chain into (chained) or file to write (standalone).
    #[arg(long, env = "CNI_CONF_NAME", global = true)]
    pub cni_conf_name: Option<String>,
    /// Chain into the primary CNI config instead of writing a standalone config.
    #[arg(long, env = "CHAINED_CNI_PLUGIN", default_value = "true", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub chained_cni_plugin: bool,
    /// Agent run directory (same path on host and in the container); embedded in the plugin config.
    #[arg(
        long,
        env = "CNI_AGENT_RUN_DIR",
        default_value = "/var/run/istio-cni",
        global = true
    )]
    pub cni_agent_run_dir: PathBuf,
    /// Write our own highest-priority config file instead of editing the primary (ambient, chained).
    #[arg(long, env = "ISTIO_OWNED_CNI_CONFIG", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub istio_owned_cni_config: bool,
    /// Name of the Istio-owned config file (default 02-istio-cni.conflist).
    #[arg(long, env = "ISTIO_OWNED_CNI_CONFIG_FILENAME", global = true)]
    pub istio_owned_cni_config_filename: Option<String>,
    /// The same setting under the key Istio's Helm chart writes into the ConfigMap.
    #[arg(
        long,
        env = "ISTIO_OWNED_CNI_CONF_FILENAME",
        hide = true,
        global = true
    )]
    pub istio_owned_cni_conf_filename: Option<String>,
    /// Mode of the plugin kubeconfig.
    #[arg(long, env = "KUBECONFIG_MODE", default_value = "0600", value_parser = file_mode, global = true)]
    pub kubeconfig_mode: u32,
    /// Create CNI config files 0640 instead of 0600.
    #[arg(long, env = "CNI_CONF_GROUP_READ", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub cni_conf_group_read: bool,
    /// CA bundle for the plugin kubeconfig (default: the service account's ca.crt).
    #[arg(long, env = "KUBE_CA_FILE", global = true)]
    pub kube_ca_file: Option<PathBuf>,
    /// Write `insecure-skip-tls-verify: true` into the plugin kubeconfig.
    #[arg(long, env = "SKIP_TLS_VERIFY", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub skip_tls_verify: bool,
    /// Comma-separated namespaces the plugin ignores.
    #[arg(long, env = "EXCLUDE_NAMESPACES", global = true)]
    pub exclude_namespaces: Option<String>,
    /// Namespace of this agent's pod.
    #[arg(long, env = "POD_NAMESPACE", default_value = "", global = true)]
    pub pod_namespace: String,
    /// Name of this agent's pod: a stopping agent whose token is refused looks it up in its pod
    /// watch to tell a force delete from an uninstall (`ambient::upgrade`).
    #[arg(long, env = "POD_NAME", default_value = "", global = true)]
    pub pod_name: String,
    /// Ambient mode.
    #[arg(long, env = "AMBIENT_ENABLED", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub ambient_enabled: bool,
    /// YAML list of {podSelector, namespaceSelector} deciding which pods are ambient.
    #[arg(long, env = "AMBIENT_ENABLEMENT_SELECTOR", global = true)]
    pub ambient_enablement_selector: Option<String>,
    /// Program nftables natively instead of iptables.
    #[arg(long, env = "NATIVE_NFTABLES", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub native_nftables: bool,
    /// Let the plugin retry ambient detection.
    #[arg(long, env = "ENABLE_AMBIENT_DETECTION_RETRY", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub enable_ambient_detection_retry: bool,
    /// Host CNI binary directories (comma-separated), as mounted in this container.
    #[arg(
        long,
        env = "CNI_BIN_DIR",
        default_value = "/host/opt/cni/bin",
        value_delimiter = ',',
        global = true
    )]
    pub cni_bin_dir: Vec<PathBuf>,
    /// Directory whose regular files are copied into the CNI binary directories.
    #[arg(
        long,
        env = "CNI_BIN_SOURCE_DIR",
        default_value = "/opt/cni/bin",
        global = true
    )]
    pub cni_bin_source_dir: PathBuf,
    /// Service account directory (token, ca.crt) for the plugin kubeconfig.
    #[arg(
        long,
        env = "SERVICE_ACCOUNT_DIR",
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount",
        global = true
    )]
    pub service_account_dir: PathBuf,
    /// Scheme of the API server URL written into the plugin kubeconfig.
    #[arg(
        long,
        env = "KUBERNETES_SERVICE_PROTOCOL",
        default_value = "https",
        global = true
    )]
    pub kubernetes_service_protocol: String,
    /// API server host for the plugin kubeconfig (set by Kubernetes in every pod).
    #[arg(long, env = "KUBERNETES_SERVICE_HOST", global = true)]
    pub kubernetes_service_host: Option<String>,
    /// API server port for the plugin kubeconfig.
    #[arg(long, env = "KUBERNETES_SERVICE_PORT", global = true)]
    pub kubernetes_service_port: Option<u16>,
}

/// Default name of the Istio-owned config file.
pub const DEFAULT_OWNED_FILENAME: &str = "02-istio-cni.conflist";
/// Standalone config name when `CNI_CONF_NAME` is not set.
pub const DEFAULT_STANDALONE_FILENAME: &str = "YYY-istio-cni.conf";

/// How the installer hooks the plugin into the runtime's CNI configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfMode {
    /// Insert our entry into the primary config in place.
    Chained,
    /// Write `<owned>`: a copy of the primary with our entry, sorting before it.
    Owned { filename: String },
    /// Write our entry as its own config file.
    Standalone { filename: String },
}

/// Address of the API server the plugin talks to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeService {
    pub protocol: String,
    pub host: Option<String>,
    pub port: Option<u16>,
}

/// Validated installer configuration.
#[derive(Debug, Clone)]
pub struct InstallConfig {
    pub conf_dir: PathBuf,
    pub mode: ConfMode,
    /// The primary config named by `CNI_CONF_NAME` (chained and owned modes).
    pub primary_name: Option<String>,
    pub run_dir: PathBuf,
    pub kubeconfig_mode: u32,
    /// Mode of config files we create (not of primaries we edit, which keep theirs).
    pub created_conf_mode: u32,
    pub kube_ca_file: Option<PathBuf>,
    pub skip_tls_verify: bool,
    pub bin_dirs: Vec<PathBuf>,
    pub bin_source_dir: PathBuf,
    pub service_account_dir: PathBuf,
    pub kube_service: KubeService,
    pub entry: IstioEntry,
}

fn plain_file_name(option: &'static str, name: &str) -> Result<String, ConfigError> {
    if !crate::hostfs::is_plain_name(name.as_ref()) {
        return Err(ConfigError::invalid(
            option,
            format!("{name:?} must be a file name, not a path"),
        ));
    }
    Ok(name.to_string())
}

impl InstallConfig {
    /// Logs the settings an operator checks first as the record's labels, readable in `kubectl
    /// logs` (`conf_dir=/host/etc/cni/net.d mode=chained ...`), where Istio prints its struct.
    pub fn log(&self, msg: &str) {
        let mode = match &self.mode {
            ConfMode::Chained => "chained".to_string(),
            ConfMode::Owned { filename } => format!("owned:{filename}"),
            ConfMode::Standalone { filename } => format!("standalone:{filename}"),
        };
        let paths = |dirs: &[PathBuf]| {
            let shown: Vec<_> = dirs.iter().map(|d| d.display().to_string()).collect();
            shown.join(",")
        };
        let k = &self.kube_service;
        let kube_service = match (&k.host, k.port) {
            (Some(host), Some(port)) => format!("{}://{host}:{port}", k.protocol),
            _ => "unset".to_string(),
        };
        tracing::info!(
            conf_dir = %self.conf_dir.display(),
            mode = %mode,
            // Empty: the first config in conf_dir.
            primary = self.primary_name.as_deref().unwrap_or(""),
            bin_source_dir = %self.bin_source_dir.display(),
            bin_dirs = %paths(&self.bin_dirs),
            run_dir = %self.run_dir.display(),
            kube_service = %kube_service,
            kubeconfig_mode = %format!("{:o}", self.kubeconfig_mode),
            skip_tls_verify = self.skip_tls_verify,
            plugin_log_level = %self.entry.plugin_log_level,
            ambient = self.entry.ambient_enabled,
            exclude_namespaces = %self.entry.exclude_namespaces.as_deref().unwrap_or_default().join(","),
            "{msg}"
        );
    }

    pub fn from_args(args: &InstallArgs, log: &LogArgs) -> Result<Self, ConfigError> {
        let conf_name = args
            .cni_conf_name
            .as_deref()
            .filter(|n| !n.is_empty())
            .map(|n| plain_file_name("CNI_CONF_NAME", n))
            .transpose()?;
        let owned_name = match (
            args.istio_owned_cni_config_filename
                .as_deref()
                .filter(|n| !n.is_empty()),
            args.istio_owned_cni_conf_filename
                .as_deref()
                .filter(|n| !n.is_empty()),
        ) {
            (Some(n), _) => Some(("ISTIO_OWNED_CNI_CONFIG_FILENAME", n)),
            (None, Some(n)) => Some(("ISTIO_OWNED_CNI_CONF_FILENAME", n)),
            (None, None) => None,
        };
        let mode = if !args.chained_cni_plugin {
            let filename = conf_name
                .clone()
                .unwrap_or_else(|| DEFAULT_STANDALONE_FILENAME.into());
            ConfMode::Standalone { filename }
        } else if args.istio_owned_cni_config && args.ambient_enabled {
            let filename = match owned_name {
                Some((option, n)) => {
                    let n = plain_file_name(option, n)?;
                    // libcni reads a `.conf` as a single plugin; a list there would be skipped.
                    if !n.ends_with(".conflist") {
                        return Err(ConfigError::invalid(
                            option,
                            format!("{n:?} must end in .conflist"),
                        ));
                    }
                    n
                }
                None => DEFAULT_OWNED_FILENAME.into(),
            };
            if conf_name.as_deref() == Some(filename.as_str()) {
                return Err(ConfigError::invalid(
                    "CNI_CONF_NAME",
                    format!("{filename:?} is the Istio-owned file; name the primary CNI config"),
                ));
            }
            ConfMode::Owned { filename }
        } else {
            if args.istio_owned_cni_config {
                tracing::warn!(
                    "ISTIO_OWNED_CNI_CONFIG needs AMBIENT_ENABLED and CHAINED_CNI_PLUGIN; editing the primary config instead"
                );
            }
            ConfMode::Chained
        };
        let kube_service = KubeService {
            protocol: args.kubernetes_service_protocol.clone(),
            host: args
                .kubernetes_service_host
                .clone()
                .filter(|h| !h.is_empty()),
            port: args.kubernetes_service_port,
        };
        if kube_service.protocol.is_empty()
            || !kube_service
                .protocol
                .bytes()
                .all(|b| b.is_ascii_alphanumeric())
        {
            return Err(ConfigError::invalid(
                "KUBERNETES_SERVICE_PROTOCOL",
                format!("{:?} is not a URL scheme", kube_service.protocol),
            ));
        }
        if args.cni_bin_dir.is_empty() {
            return Err(ConfigError::invalid("CNI_BIN_DIR", "no directory given"));
        }
        let run_dir = args.cni_agent_run_dir.to_str().ok_or_else(|| {
            ConfigError::invalid(
                "CNI_AGENT_RUN_DIR",
                "not valid UTF-8 (it is written into JSON)",
            )
        })?;
        let exclude: Vec<String> = args
            .exclude_namespaces
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        let entry = IstioEntry {
            plugin_log_level: log.level_of("cni-plugin")?,
            cni_agent_run_dir: run_dir.to_string(),
            ambient_enabled: args.ambient_enabled,
            enablement_selectors: enablement_selectors(
                args.ambient_enablement_selector.as_deref(),
            )?,
            exclude_namespaces: (!exclude.is_empty()).then_some(exclude),
            pod_namespace: args.pod_namespace.clone(),
            native_nftables: args.native_nftables,
            enable_ambient_detection_retry: args.enable_ambient_detection_retry,
        };
        Ok(InstallConfig {
            conf_dir: args.mounted_cni_net_dir.clone(),
            mode,
            primary_name: conf_name.filter(|_| args.chained_cni_plugin),
            run_dir: args.cni_agent_run_dir.clone(),
            kubeconfig_mode: args.kubeconfig_mode,
            created_conf_mode: if args.cni_conf_group_read {
                0o640
            } else {
                0o600
            },
            kube_ca_file: args.kube_ca_file.clone(),
            skip_tls_verify: args.skip_tls_verify,
            bin_dirs: args.cni_bin_dir.clone(),
            bin_source_dir: args.cni_bin_source_dir.clone(),
            service_account_dir: args.service_account_dir.clone(),
            kube_service,
            entry,
        })
    }
}

const SELECTOR_OPTION: &str = "AMBIENT_ENABLEMENT_SELECTOR";

/// Parses the YAML selector list into the JSON the plugin reads: every element becomes
/// `{"podSelector": <LabelSelector>, "namespaceSelector": <LabelSelector>}` with both keys present
/// (`{}` when unset) and empty `matchLabels` / `matchExpressions` omitted, as Istio serialises it.
pub fn enablement_selectors(yaml: Option<&str>) -> Result<Value, ConfigError> {
    let bad = |reason: String| ConfigError::invalid(SELECTOR_OPTION, reason);
    let Some(yaml) = yaml.filter(|y| !y.trim().is_empty()) else {
        return Ok(Value::Array(Vec::new()));
    };
    let parsed: Value = serde_yaml::from_str(yaml).map_err(|e| bad(format!("not YAML: {e}")))?;
    let items = match parsed {
        Value::Null => Vec::new(),
        Value::Array(items) => items,
        _ => {
            return Err(bad(
                "must be a list of {podSelector, namespaceSelector}".into()
            ));
        }
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let obj = match item {
            Value::Object(o) => o,
            Value::Null => Map::new(),
            _ => return Err(bad(format!("element {i} is not a mapping"))),
        };
        let mut norm = Map::new();
        for key in ["podSelector", "namespaceSelector"] {
            let sel =
                label_selector(obj.get(key)).map_err(|r| bad(format!("element {i} {key}: {r}")))?;
            norm.insert(key.into(), sel);
        }
        out.push(Value::Object(norm));
    }
    Ok(Value::Array(out))
}

fn label_selector(v: Option<&Value>) -> Result<Value, String> {
    let obj = match v {
        None | Some(Value::Null) => return Ok(Value::Object(Map::new())),
        Some(Value::Object(o)) => o,
        Some(_) => return Err("not a mapping".into()),
    };
    let mut out = Map::new();
    match obj.get("matchLabels") {
        None | Some(Value::Null) => {}
        Some(Value::Object(labels)) => {
            if let Some((k, _)) = labels.iter().find(|(_, v)| !v.is_string()) {
                return Err(format!("matchLabels value of {k:?} is not a string"));
            }
            if !labels.is_empty() {
                out.insert("matchLabels".into(), Value::Object(labels.clone()));
            }
        }
        Some(_) => return Err("matchLabels is not a mapping".into()),
    }
    match obj.get("matchExpressions") {
        None | Some(Value::Null) => {}
        Some(Value::Array(exprs)) => {
            let mut norm = Vec::with_capacity(exprs.len());
            for (j, e) in exprs.iter().enumerate() {
                norm.push(expression(e).map_err(|r| format!("matchExpressions[{j}]: {r}"))?);
            }
            if !norm.is_empty() {
                out.insert("matchExpressions".into(), Value::Array(norm));
            }
        }
        Some(_) => return Err("matchExpressions is not a list".into()),
    }
    Ok(Value::Object(out))
}

fn expression(e: &Value) -> Result<Value, String> {
    let obj = e.as_object().ok_or("not a mapping")?;
    let string = |k: &str| match obj.get(k) {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) => Ok(String::new()),
        Some(_) => Err(format!("{k} is not a string")),
    };
    let (key, operator) = (string("key")?, string("operator")?);
    if !["In", "NotIn", "Exists", "DoesNotExist"].contains(&operator.as_str()) {
        return Err(format!("unknown operator {operator:?}"));
    }
    let mut out = Map::new();
    out.insert("key".into(), Value::String(key));
    out.insert("operator".into(), Value::String(operator));
    match obj.get("values") {
        None | Some(Value::Null) => {}
        Some(Value::Array(vals)) if vals.iter().all(Value::is_string) => {
            if !vals.is_empty() {
                out.insert("values".into(), Value::Array(vals.clone()));
            }
        }
        Some(_) => return Err("values is not a list of strings".into()),
    }
    Ok(Value::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_from;
    use crate::logging::LogArgs;
    use clap::Parser;
    use serde_json::json;
    use std::collections::HashMap;

    #[derive(Parser, Debug)]
    struct TestCli {
        #[command(flatten)]
        install: InstallArgs,
        #[command(flatten)]
        log: LogArgs,
    }

    fn parse(argv: &[&str], env: &[(&str, &str)]) -> Result<InstallConfig, String> {
        let env: HashMap<&str, &str> = env.iter().copied().collect();
        let argv = std::iter::once("install-cni").chain(argv.iter().copied());
        let cli: TestCli = parse_from(argv, &env).map_err(|e| e.to_string())?;
        InstallConfig::from_args(&cli.install, &cli.log).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_match_istio() {
        let c = parse(&[], &[]).unwrap();
        assert_eq!(c.conf_dir, PathBuf::from("/host/etc/cni/net.d"));
        assert_eq!(c.mode, ConfMode::Chained);
        assert_eq!(c.primary_name, None);
        assert_eq!(c.run_dir, PathBuf::from("/var/run/istio-cni"));
        assert_eq!(c.kubeconfig_mode, 0o600);
        assert_eq!(c.created_conf_mode, 0o600);
        assert_eq!(c.bin_dirs, [PathBuf::from("/host/opt/cni/bin")]);
        assert_eq!(c.bin_source_dir, PathBuf::from("/opt/cni/bin"));
        assert_eq!(
            c.service_account_dir,
            PathBuf::from("/var/run/secrets/kubernetes.io/serviceaccount")
        );
        assert_eq!(c.kube_service.protocol, "https");
        assert_eq!(c.entry.plugin_log_level, "info");
        assert_eq!(c.entry.exclude_namespaces, None);
        assert_eq!(c.entry.enablement_selectors, json!([]));
        assert!(!c.entry.ambient_enabled);
    }

    #[test]
    fn env_is_read_and_flags_win() {
        let env = [
            ("MOUNTED_CNI_NET_DIR", "/env/net.d"),
            ("CNI_CONF_NAME", "10-calico.conflist"),
            ("EXCLUDE_NAMESPACES", " kube-system, ,istio-system "),
            ("POD_NAMESPACE", "istio-system"),
            ("KUBECONFIG_MODE", "0640"),
            ("CNI_CONF_GROUP_READ", "true"),
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("AMBIENT_ENABLED", "True"),
            ("NATIVE_NFTABLES", "1"),
        ];
        let c = parse(&["--mounted-cni-net-dir", "/flag/net.d"], &env).unwrap();
        assert_eq!(c.conf_dir, PathBuf::from("/flag/net.d"));
        assert_eq!(c.primary_name.as_deref(), Some("10-calico.conflist"));
        assert_eq!(
            c.entry.exclude_namespaces,
            Some(vec!["kube-system".into(), "istio-system".into()])
        );
        assert_eq!(c.entry.pod_namespace, "istio-system");
        assert_eq!(c.kubeconfig_mode, 0o640);
        assert_eq!(c.created_conf_mode, 0o640);
        assert_eq!(c.kube_service.host.as_deref(), Some("10.96.0.1"));
        assert_eq!(c.kube_service.port, Some(443));
        assert!(c.entry.ambient_enabled && c.entry.native_nftables);
    }

    #[test]
    fn booleans_accept_go_forms_and_flag_equals_false() {
        let c = parse(
            &["--chained-cni-plugin=false"],
            &[("CHAINED_CNI_PLUGIN", "true")],
        )
        .unwrap();
        assert!(
            matches!(c.mode, ConfMode::Standalone { ref filename } if filename == "YYY-istio-cni.conf")
        );
        let c = parse(
            &[],
            &[
                ("CHAINED_CNI_PLUGIN", "F"),
                ("CNI_CONF_NAME", "istio-cni.conf"),
            ],
        )
        .unwrap();
        assert_eq!(
            c.mode,
            ConfMode::Standalone {
                filename: "istio-cni.conf".into()
            }
        );
        assert_eq!(c.primary_name, None);
        let c = parse(&["--skip-tls-verify"], &[]).unwrap();
        assert!(c.skip_tls_verify);
        // An empty variable is unset, as with viper.
        let c = parse(&[], &[("CHAINED_CNI_PLUGIN", "")]).unwrap();
        assert_eq!(c.mode, ConfMode::Chained);
    }

    #[test]
    fn invalid_values_name_the_option() {
        let err = parse(&[], &[("CHAINED_CNI_PLUGIN", "yes")]).unwrap_err();
        assert!(
            err.contains("chained-cni-plugin") && err.contains("not a boolean"),
            "{err}"
        );
        let err = parse(&[], &[("KUBECONFIG_MODE", "600")]).unwrap_err();
        assert!(
            err.contains("kubeconfig-mode") && err.contains("0600"),
            "{err}"
        );
        let err = parse(&[], &[("KUBERNETES_SERVICE_PORT", "https")]).unwrap_err();
        assert!(err.contains("kubernetes-service-port"), "{err}");
        let err = parse(&[], &[("CNI_CONF_NAME", "../etc/passwd")]).unwrap_err();
        assert!(err.contains("CNI_CONF_NAME"), "{err}");
        let err = parse(&[], &[("AMBIENT_ENABLEMENT_SELECTOR", "podSelector: {}")]).unwrap_err();
        assert!(err.contains("AMBIENT_ENABLEMENT_SELECTOR"), "{err}");
        let err = parse(&["--log_output_level=cni-plugin:loud"], &[]).unwrap_err();
        assert!(err.contains("--log_output_level"), "{err}");
        let err = parse(
            &[],
            &[
                ("AMBIENT_ENABLED", "true"),
                ("ISTIO_OWNED_CNI_CONFIG", "true"),
                ("ISTIO_OWNED_CNI_CONF_FILENAME", "02-istio.conf"),
            ],
        )
        .unwrap_err();
        assert!(
            err.contains("ISTIO_OWNED_CNI_CONF_FILENAME") && err.contains(".conflist"),
            "{err}"
        );
    }

    #[test]
    fn kubeconfig_mode_parses_like_go() {
        assert_eq!(file_mode("0600"), Ok(0o600));
        assert_eq!(file_mode("384"), Ok(0o600));
        assert_eq!(file_mode("0o644"), Ok(0o644));
        assert_eq!(file_mode("0x1a4"), Ok(0o644));
        assert!(file_mode("0800").is_err());
        assert!(file_mode("600").is_err());
    }

    #[test]
    fn istio_owned_mode_honours_both_filename_keys() {
        let owned = [
            ("AMBIENT_ENABLED", "true"),
            ("ISTIO_OWNED_CNI_CONFIG", "true"),
        ];
        let c = parse(&[], &owned).unwrap();
        assert_eq!(
            c.mode,
            ConfMode::Owned {
                filename: DEFAULT_OWNED_FILENAME.into()
            }
        );
        // The Helm chart's key (ignored by Istio's agent) works...
        let helm = [
            owned[0],
            owned[1],
            ("ISTIO_OWNED_CNI_CONF_FILENAME", "01-helm.conflist"),
        ];
        assert_eq!(
            parse(&[], &helm).unwrap().mode,
            ConfMode::Owned {
                filename: "01-helm.conflist".into()
            }
        );
        // ...and the agent's own key takes precedence when both are set.
        let both = [
            helm[0],
            helm[1],
            helm[2],
            ("ISTIO_OWNED_CNI_CONFIG_FILENAME", "00-agent.conflist"),
        ];
        assert_eq!(
            parse(&[], &both).unwrap().mode,
            ConfMode::Owned {
                filename: "00-agent.conflist".into()
            }
        );
        // Without ambient the flag has no effect: the primary is edited in place.
        let c = parse(&[], &[("ISTIO_OWNED_CNI_CONFIG", "true")]).unwrap();
        assert_eq!(c.mode, ConfMode::Chained);
    }

    #[test]
    fn plugin_log_level_comes_from_the_cni_plugin_scope() {
        let c = parse(&["--log_output_level=warn,cni-plugin:debug"], &[]).unwrap();
        assert_eq!(c.entry.plugin_log_level, "debug");
        // As in Istio, an unscoped level is the `default` scope's: the plugin stays at info.
        let c = parse(&["--log_output_level=error"], &[]).unwrap();
        assert_eq!(c.entry.plugin_log_level, "info");
        let c = parse(&["--log_output_level=all:warn"], &[]).unwrap();
        assert_eq!(c.entry.plugin_log_level, "warn");
        let c = parse(&["--log_output_level=cni-plugin:debug,default:error"], &[]).unwrap();
        assert_eq!(c.entry.plugin_log_level, "debug");
    }

    #[test]
    fn helm_default_selectors_become_plugin_json() {
        let yaml = "- podSelector: {matchLabels: {istio.io/dataplane-mode: ambient}}\n- podSelector:\n    matchExpressions: [{key: istio.io/dataplane-mode, operator: NotIn, values: [none]}]\n  namespaceSelector: {matchLabels: {istio.io/dataplane-mode: ambient}}\n";
        let c = parse(&[], &[("AMBIENT_ENABLEMENT_SELECTOR", yaml)]).unwrap();
        assert_eq!(
            c.entry.enablement_selectors,
            json!([
                {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}, "namespaceSelector": {}},
                {
                    "podSelector": {"matchExpressions": [{"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}]},
                    "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}
                }
            ])
        );
        assert!(enablement_selectors(Some("- podSelector: {matchLabels: {a: 1}}")).is_err());
        assert!(
            enablement_selectors(Some(
                "- podSelector: {matchExpressions: [{key: a, operator: Maybe}]}"
            ))
            .is_err()
        );
    }
}
