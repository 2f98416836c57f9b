//! Settings of the ambient node agent, with Istio's env names and defaults (reference §6.1), in
//! the style of [`crate::config`]: flags read from env through `EnvSource`, validated into
//! [`AmbientConfig`].

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;

use clap::{ArgAction, Args};

use cni_core::enroll::{CompiledSelectors, EnablementSelector};
use cni_core::redirect::ambient::InpodConfig;

use crate::config::{ConfigError, go_bool};

#[derive(Args, Debug, Clone)]
pub struct AmbientArgs {
    /// This node's name: the agent watches only pods scheduled here.
    #[arg(long, env = "NODE_NAME", global = true)]
    pub node_name: Option<String>,
    /// ZDS socket ztunnel connects to.
    #[arg(
        long,
        env = "ZTUNNEL_UDS_ADDRESS",
        default_value = "/var/run/ztunnel/ztunnel.sock",
        global = true
    )]
    pub ztunnel_uds_address: PathBuf,
    /// Prometheus port (`/metrics`); 0 or less disables it.
    #[arg(long, env = "MONITORING_PORT", default_value = "15014", global = true)]
    pub monitoring_port: i32,
    /// Health port (`/healthz`, `/readyz`).
    #[arg(long, env = "HEALTH_PORT", default_value = "8000", global = true)]
    pub health_port: u16,
    /// Capture DNS to ztunnel's DNS proxy (per-pod annotation overrides).
    #[arg(long, env = "AMBIENT_DNS_CAPTURE", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub ambient_dns_capture: bool,
    /// Program IPv6 rules too.
    #[arg(long, env = "AMBIENT_IPV6", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub ambient_ipv6: bool,
    /// Re-verify (and repair) in-pod rules of enrolled pods at startup.
    #[arg(long, env = "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", default_value = "false",
          action = ArgAction::Set, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = go_bool, global = true)]
    pub ambient_reconcile_pod_rules_on_startup: bool,
    /// Route kubelet probes to AWS branch-ENI pods (Security Groups for Pods) through their veth;
    /// acts only on nodes with `net.ipv4.tcp_early_demux=0`.
    #[arg(long, env = "AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE", default_value = "true",
          action = ArgAction::Set, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = go_bool, global = true)]
    pub ambient_enable_aws_branch_eni_probe: bool,
    /// Always clean up fully on shutdown, even during an upgrade.
    #[arg(long, env = "AMBIENT_DISABLE_SAFE_UPGRADE", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub ambient_disable_safe_upgrade: bool,
    /// Namespace of ztunnel pods (`app=ztunnel`), which are never enrolled.
    #[arg(
        long,
        env = "SYSTEM_NAMESPACE",
        default_value = "istio-system",
        global = true
    )]
    pub system_namespace: String,
    /// Source address kubelet probes are SNATed to.
    #[arg(
        long,
        env = "HOST_PROBE_SNAT_IP",
        default_value = "169.254.7.127",
        global = true
    )]
    pub host_probe_snat_ip: Ipv4Addr,
    #[arg(
        long,
        env = "HOST_PROBE_SNAT_IPV6",
        default_value = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff",
        global = true
    )]
    pub host_probe_snat_ipv6: Ipv6Addr,
    /// Where the host's filesystem is mounted: `CNI_NETNS` paths resolve beneath it.
    #[arg(long, env = "HOST_PREFIX", default_value = "/host", global = true)]
    pub host_prefix: PathBuf,
    /// Switch to the host netns (`<HOST_PREFIX>/proc/1/ns/net`) for host-side rules.
    #[arg(long, env = "ALLOW_SWITCH_TO_HOST_NS", default_value = "false", action = ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = go_bool, global = true)]
    pub allow_switch_to_host_ns: bool,
    /// Path of the network namespace host-side rules go to, when it is neither this process's nor
    /// `<HOST_PREFIX>/proc/1/ns/net` (a node simulated in a netns; exotic deployments).
    #[arg(long, env = "HOST_NETNS", global = true)]
    pub host_netns: Option<PathBuf>,
    /// `legacy` or `nft`: force the iptables variant instead of detecting it.
    #[arg(long, env = "FORCE_IPTABLES_BINARY", global = true)]
    pub force_iptables_binary: Option<String>,
    /// In-pod iptables commands take a lock file of their pod's own instead of the node's
    /// `/run/xtables.lock` (legacy iptables only; nft takes no lock).
    #[arg(long, env = "AMBIENT_USE_SCOPED_XTABLES_LOCKING", default_value = "true",
          action = ArgAction::Set, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = go_bool, global = true)]
    pub ambient_use_scoped_xtables_locking: bool,
    /// Seconds between checks of enrolled pods' rules against the kernel (drift repair); 0 disables.
    #[arg(
        long,
        env = "DRIFT_CHECK_INTERVAL_SECONDS",
        default_value = "30",
        global = true
    )]
    pub drift_check_interval_seconds: u64,
    /// UIDs allowed to connect to the plugin and ZDS sockets (`SO_PEERCRED`).
    #[arg(
        long,
        env = "ALLOWED_PEER_UIDS",
        default_value = "0",
        value_delimiter = ',',
        global = true
    )]
    pub allowed_peer_uids: Vec<u32>,
    /// Istio's dry run (rules written to this file instead of the kernel). Not honoured: read
    /// only to be named at start ([`AmbientArgs::unhonoured`]).
    #[arg(long, env = "DRY_RUN_FILE_PATH", global = true, hide = true)]
    pub dry_run_file_path: Option<String>,
}

impl AmbientArgs {
    /// Istio settings given a value this agent cannot honour, each with what it does instead:
    /// logged at start and shown by `/readyz`, never silently ignored.
    pub fn unhonoured(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(path) = self.dry_run_file_path.as_deref().filter(|p| !p.is_empty()) {
            out.push(format!(
                "DRY_RUN_FILE_PATH={path}: rules are applied to the kernel, not written to the \
                 file (`install-cni dataplane ... --dry-run` prints them)"
            ));
        }
        out
    }
}

/// Validated ambient settings.
#[derive(Debug, Clone)]
pub struct AmbientConfig {
    pub node_name: String,
    pub zds_socket: PathBuf,
    pub monitoring_port: Option<u16>,
    pub health_port: u16,
    pub inpod: InpodConfig,
    pub reconcile_on_startup: bool,
    pub aws_branch_eni_probe: bool,
    pub disable_safe_upgrade: bool,
    pub system_namespace: String,
    pub host_prefix: PathBuf,
    pub proc_dir: PathBuf,
    pub switch_to_host_ns: bool,
    pub host_netns: Option<PathBuf>,
    pub force_iptables_binary: Option<String>,
    /// `AMBIENT_USE_SCOPED_XTABLES_LOCKING`
    pub scoped_xtables_locking: bool,
    pub allowed_peer_uids: Vec<u32>,
    pub drift_check_interval: Option<std::time::Duration>,
    pub selectors: CompiledSelectors,
    pub exclude_namespaces: BTreeSet<String>,
}

impl AmbientConfig {
    /// `selectors` is the parsed `AMBIENT_ENABLEMENT_SELECTOR` (the installer parses it too, for
    /// the plugin config); `exclude` the split `EXCLUDE_NAMESPACES`.
    pub fn from_args(
        a: &AmbientArgs,
        selectors: &[EnablementSelector],
        exclude: impl IntoIterator<Item = String>,
    ) -> Result<Self, ConfigError> {
        let node_name = a
            .node_name
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| ConfigError::Invalid {
                option: "NODE_NAME",
                reason: "required in ambient mode".into(),
            })?;
        if !a.host_probe_snat_ip.is_link_local() {
            return Err(ConfigError::Invalid {
                option: "HOST_PROBE_SNAT_IP",
                reason: format!("{} is not in 169.254.0.0/16", a.host_probe_snat_ip),
            });
        }
        if let Some(f) = a.force_iptables_binary.as_deref().filter(|f| !f.is_empty())
            && f != "legacy"
            && f != "nft"
        {
            return Err(ConfigError::Invalid {
                option: "FORCE_IPTABLES_BINARY",
                reason: format!("{f:?} is neither \"legacy\" nor \"nft\""),
            });
        }
        let selectors =
            CompiledSelectors::compile(selectors).map_err(|e| ConfigError::Invalid {
                option: "AMBIENT_ENABLEMENT_SELECTOR",
                reason: e.to_string(),
            })?;
        Ok(AmbientConfig {
            node_name,
            zds_socket: a.ztunnel_uds_address.clone(),
            monitoring_port: u16::try_from(a.monitoring_port).ok().filter(|p| *p > 0),
            health_port: a.health_port,
            inpod: InpodConfig {
                redirect_dns: a.ambient_dns_capture,
                ipv6: a.ambient_ipv6,
                probe_snat_v4: a.host_probe_snat_ip,
                probe_snat_v6: a.host_probe_snat_ipv6,
                ..InpodConfig::default()
            },
            reconcile_on_startup: a.ambient_reconcile_pod_rules_on_startup,
            aws_branch_eni_probe: a.ambient_enable_aws_branch_eni_probe,
            disable_safe_upgrade: a.ambient_disable_safe_upgrade,
            system_namespace: a.system_namespace.clone(),
            proc_dir: a.host_prefix.join("proc"),
            host_prefix: a.host_prefix.clone(),
            switch_to_host_ns: a.allow_switch_to_host_ns,
            host_netns: a.host_netns.clone().filter(|p| !p.as_os_str().is_empty()),
            force_iptables_binary: a.force_iptables_binary.clone().filter(|f| !f.is_empty()),
            scoped_xtables_locking: a.ambient_use_scoped_xtables_locking,
            allowed_peer_uids: a.allowed_peer_uids.clone(),
            drift_check_interval: (a.drift_check_interval_seconds > 0)
                .then(|| std::time::Duration::from_secs(a.drift_check_interval_seconds)),
            selectors,
            exclude_namespaces: exclude.into_iter().collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(clap::Parser)]
    struct TestCli {
        #[command(flatten)]
        ambient: AmbientArgs,
    }

    fn parse(env: &[(&str, &str)]) -> Result<AmbientConfig, String> {
        let mut env: HashMap<&str, &str> = env.iter().copied().collect();
        env.insert("NODE_NAME", "node-a");
        let cli: TestCli =
            crate::config::parse_from(["install-cni"], &env).map_err(|e| e.to_string())?;
        AmbientConfig::from_args(&cli.ambient, &[], []).map_err(|e| e.to_string())
    }

    #[test]
    fn aws_branch_eni_probe_is_on_unless_disabled() {
        assert!(parse(&[]).unwrap().aws_branch_eni_probe);
        let off = [("AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE", "false")];
        assert!(!parse(&off).unwrap().aws_branch_eni_probe);
        let bad = [("AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE", "maybe")];
        assert!(parse(&bad).unwrap_err().contains("maybe"));
    }

    #[test]
    fn scoped_xtables_locking_is_on_unless_turned_off() {
        assert!(parse(&[]).unwrap().scoped_xtables_locking);
        let off = [("AMBIENT_USE_SCOPED_XTABLES_LOCKING", "false")];
        assert!(!parse(&off).unwrap().scoped_xtables_locking);
        let bad = [("AMBIENT_USE_SCOPED_XTABLES_LOCKING", "sometimes")];
        assert!(parse(&bad).unwrap_err().contains("sometimes"));
    }
}
