//! The `istio-cni` entry of a CNI config list, as Istio's installer (and ours) writes it: the
//! standard fields plus Istio's keys. Unknown keys are ignored so configs written by other Istio
//! versions (legacy `kubernetes{...}` blocks, future keys) still load.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::cni::{CniError, nullable};
use crate::enroll::EnablementSelector;

/// Default `cni_agent_run_dir` (host path) when a config leaves it empty.
pub const DEFAULT_RUN_DIR: &str = "/var/run/istio-cni";

#[derive(Debug, Default, Deserialize)]
pub struct PluginConf {
    #[serde(rename = "cniVersion", default, deserialize_with = "nullable")]
    pub cni_version: String,
    #[serde(default, deserialize_with = "nullable")]
    pub name: String,
    #[serde(rename = "type", default, deserialize_with = "nullable")]
    pub plugin_type: String,
    #[serde(rename = "prevResult", default)]
    pub prev_result: Option<Box<RawValue>>,

    /// "debug", "info", "warn", "error" or "none"; empty keeps the default (info).
    #[serde(default, deserialize_with = "nullable")]
    pub plugin_log_level: String,
    /// Holds `pluginevent.sock`, `log.sock` and `istio-cni-kubeconfig`.
    #[serde(default, deserialize_with = "nullable")]
    pub cni_agent_run_dir: String,
    #[serde(default, deserialize_with = "nullable")]
    pub ambient_enabled: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub enablement_selectors: Vec<EnablementSelector>,
    #[serde(default, deserialize_with = "nullable")]
    pub exclude_namespaces: Vec<String>,
    /// The agent's own namespace, to recognise its own pod.
    #[serde(default, deserialize_with = "nullable")]
    pub pod_namespace: String,
    #[serde(default, deserialize_with = "nullable")]
    pub native_nftables: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub enable_ambient_detection_retry: bool,
}

impl PluginConf {
    pub fn parse(stdin: &[u8]) -> Result<PluginConf, CniError> {
        serde_json::from_slice(stdin).map_err(|e| {
            CniError::with_details(
                crate::cni::error::code::DECODING_FAILURE,
                "failed to parse network configuration",
                e.to_string(),
            )
        })
    }

    pub fn run_dir(&self) -> PathBuf {
        if self.cni_agent_run_dir.is_empty() {
            PathBuf::from(DEFAULT_RUN_DIR)
        } else {
            PathBuf::from(&self.cni_agent_run_dir)
        }
    }

    pub fn is_excluded(&self, namespace: &str) -> bool {
        self.exclude_namespaces.iter().any(|n| n == namespace)
    }

    /// The agent's own pod (`istio-cni-node-*` in `pod_namespace`): always let through, before any
    /// dependency on the agent or the API server, so a node can bring its agent back after a reboot.
    pub fn is_own_agent_pod(&self, pod_name: &str, pod_namespace: &str) -> bool {
        pod_name.starts_with("istio-cni-node-") && pod_namespace == self.pod_namespace
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enroll::default_selectors;

    /// The entry as the installer writes it (istio-cni.md §2.5), inside a list with a prevResult.
    const WRITTEN: &str = r#"{
  "cniVersion": "1.0.0",
  "name": "k8s-pod-network",
  "type": "istio-cni",
  "ipam": {},
  "dns": {},
  "plugin_log_level": "debug",
  "cni_agent_run_dir": "/var/run/istio-cni",
  "ambient_enabled": true,
  "enablement_selectors": [
    {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}, "namespaceSelector": {}},
    {"podSelector": {"matchExpressions": [{"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}]},
     "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}
  ],
  "exclude_namespaces": ["kube-system"],
  "pod_namespace": "istio-system",
  "native_nftables": false,
  "enable_ambient_detection_retry": false,
  "kubernetes": {"kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig"},
  "prevResult": {"cniVersion": "1.0.0", "ips": []}
}"#;

    #[test]
    fn parses_the_installers_entry() {
        let c = PluginConf::parse(WRITTEN.as_bytes()).unwrap();
        assert_eq!(c.cni_version, "1.0.0");
        assert_eq!(c.plugin_type, "istio-cni");
        assert_eq!(c.plugin_log_level, "debug");
        assert_eq!(c.run_dir(), PathBuf::from("/var/run/istio-cni"));
        assert!(c.ambient_enabled);
        assert_eq!(c.enablement_selectors, default_selectors());
        assert!(c.is_excluded("kube-system"));
        assert!(!c.is_excluded("kube"));
        assert_eq!(c.pod_namespace, "istio-system");
        assert!(!c.native_nftables && !c.enable_ambient_detection_retry);
        assert_eq!(
            c.prev_result.unwrap().get(),
            r#"{"cniVersion": "1.0.0", "ips": []}"#
        );
    }

    #[test]
    fn nulls_and_missing_keys_are_defaults() {
        let c = PluginConf::parse(
            br#"{"name":"n","exclude_namespaces":null,"enablement_selectors":null,"ambient_enabled":null}"#,
        )
        .unwrap();
        assert!(c.exclude_namespaces.is_empty() && c.enablement_selectors.is_empty());
        assert!(!c.ambient_enabled);
        assert_eq!(c.run_dir(), PathBuf::from(DEFAULT_RUN_DIR));
    }

    #[test]
    fn wrong_types_fail() {
        let e = PluginConf::parse(br#"{"name":"n","ambient_enabled":"yes"}"#).unwrap_err();
        assert_eq!(e.code, 6);
        assert_eq!(e.msg, "failed to parse network configuration");
    }

    #[test]
    fn own_agent_pod() {
        let c = PluginConf {
            pod_namespace: "istio-system".into(),
            ..Default::default()
        };
        assert!(c.is_own_agent_pod("istio-cni-node-x7k2p", "istio-system"));
        assert!(!c.is_own_agent_pod("istio-cni-node-x7k2p", "default"));
        assert!(!c.is_own_agent_pod("istio-cni-x7k2p", "istio-system"));
        assert!(!c.is_own_agent_pod("my-istio-cni-node-1", "istio-system"));
    }
}
