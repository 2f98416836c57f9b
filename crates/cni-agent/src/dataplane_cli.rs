//! `install-cni dataplane …`: program, check or remove the redirection of one pod namespace (or
//! the host probe rules) by hand, with the same code the agent uses. For debugging a node and
//! for tests; `verify` exits 1 and prints the difference when the namespace has drifted.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{ArgAction, Args, Subcommand, ValueEnum};
use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::overrides::interface_list;
use cni_core::redirect::parse_go_bool;
use dataplane::inpod::{InpodRules as _, RuleState};
use dataplane::netns::Netns;
use dataplane::node::{NodeDataplane, NodeOptions};
use dataplane::{BackendOptions, RuleBackend, pod};

#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct DataplaneArgs {
    #[command(subcommand)]
    pub target: Target,
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Routes and rules inside a pod network namespace.
    Inpod(InpodArgs),
    /// Probe SNAT rules (and probe address sets) in this process's (host) namespace.
    Host(HostArgs),
    /// Sidecar redirection inside a pod network namespace, from a Pod manifest, exactly as the
    /// `istio-cni` plugin programs it.
    Sidecar(SidecarArgs),
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Apply,
    Verify,
    Remove,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendName {
    Iptables,
    Nftables,
}

impl BackendName {
    fn as_str(self) -> &'static str {
        match self {
            BackendName::Iptables => "iptables",
            BackendName::Nftables => "nftables",
        }
    }
}

fn go_bool(s: &str) -> Result<bool, String> {
    parse_go_bool(s).ok_or_else(|| {
        format!("{s:?} is not a boolean (1/t/T/TRUE/true/True, 0/f/F/FALSE/false/False)")
    })
}

#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct Common {
    #[arg(long, value_enum, default_value = "iptables")]
    pub backend: BackendName,
    /// Also program IPv6.
    #[arg(long, env = "AMBIENT_IPV6", default_value = "false", value_parser = go_bool, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub ipv6: bool,
    /// Force the iptables variant (`legacy` or `nft`) instead of detecting it.
    #[arg(long, env = "FORCE_IPTABLES_BINARY")]
    pub force_iptables_binary: Option<String>,
    /// Print what would be programmed and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct InpodArgs {
    #[arg(value_enum)]
    pub action: Action,
    /// Network namespace file (`/var/run/netns/<name>`, `/proc/<pid>/ns/net`).
    #[arg(long)]
    pub netns: PathBuf,
    #[command(flatten)]
    pub common: Common,
    /// Capture DNS to ztunnel's DNS proxy.
    #[arg(long, env = "AMBIENT_DNS_CAPTURE", default_value = "true", value_parser = go_bool, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub dns_capture: bool,
    /// Capture outbound only (`ambient.istio.io/bypass-inbound-capture`).
    #[arg(long)]
    pub bypass_inbound: bool,
    /// Interfaces whose inbound TCP is treated as outbound (comma-separated).
    #[arg(long, default_value = "")]
    pub reroute_virtual_interfaces: String,
}

#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct HostArgs {
    #[arg(value_enum)]
    pub action: Action,
    #[command(flatten)]
    pub common: Common,
    /// nftables only: where to look for kubelet to learn its socket UID.
    #[arg(long, default_value = "/proc")]
    pub proc_root: PathBuf,
}

#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct SidecarArgs {
    #[arg(value_enum)]
    pub action: Action,
    /// Network namespace file (`/var/run/netns/<name>`, `/proc/<pid>/ns/net`).
    #[arg(long)]
    pub netns: PathBuf,
    /// The Pod manifest (JSON or YAML, as `kubectl get pod -o json|yaml` prints it).
    #[arg(long)]
    pub pod: PathBuf,
    #[command(flatten)]
    pub common: Common,
}

fn options(c: &Common) -> BackendOptions {
    BackendOptions {
        force_iptables: c.force_iptables_binary.clone(),
        ipv6: c.ipv6,
    }
}

/// Runs the command: exit 0 on success (or in sync), 1 when `verify` finds drift or absence.
pub fn run(args: DataplaneArgs) -> anyhow::Result<ExitCode> {
    match args.target {
        Target::Inpod(a) => inpod(a),
        Target::Host(a) => host(a),
        Target::Sidecar(a) => sidecar(a),
    }
}

/// The sidecar config the plugin would derive for this manifest: IPv6 rules when asked for, or
/// when the pod has an IPv6 address (the plugin takes the addresses from the previous plugin).
fn sidecar_config(
    a: &SidecarArgs,
) -> anyhow::Result<Result<cni_core::redirect::sidecar::SidecarConfig, String>> {
    use cni_core::redirect::sidecar::{Detection, detect, has_ipv6};
    let text = std::fs::read_to_string(&a.pod)
        .with_context(|| format!("cannot read {}", a.pod.display()))?;
    // YAML is a superset of JSON, so one parser reads both manifest forms.
    let pod: serde_json::Value = serde_yaml::from_str(&text)
        .with_context(|| format!("{} is not a JSON or YAML manifest", a.pod.display()))?;
    let ips = pod
        .pointer("/status/podIPs")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("ip")?.as_str()?.parse().ok());
    let ipv6 = a.common.ipv6 || has_ipv6(ips);
    Ok(match detect(&pod, ipv6)? {
        Detection::Sidecar(cfg) => Ok(*cfg),
        Detection::Skip(why) => Err(why),
    })
}

fn sidecar(a: SidecarArgs) -> anyhow::Result<ExitCode> {
    let cfg = match sidecar_config(&a)? {
        Ok(cfg) => cfg,
        Err(why) => {
            println!("not a sidecar pod ({why}): nothing to program");
            return Ok(ExitCode::SUCCESS);
        }
    };
    let nftables = a.common.backend == BackendName::Nftables;
    if a.common.dry_run {
        print!("{}", dataplane::sidecar::render(nftables, &cfg));
        return Ok(ExitCode::SUCCESS);
    }
    let b = dataplane::sidecar::SidecarBackend::new(
        a.common.backend.as_str(),
        a.common.force_iptables_binary.as_deref(),
        cfg.ipv6,
    )?;
    let netns = Netns::open(&a.netns)?;
    match a.action {
        Action::Apply => b.apply(&netns, &cfg).context("apply")?,
        Action::Remove => b.remove(&netns, &cfg).context("remove")?,
        Action::Verify => return Ok(report(b.verify(&netns, &cfg)?)),
    }
    Ok(ExitCode::SUCCESS)
}

fn inpod(a: InpodArgs) -> anyhow::Result<ExitCode> {
    let cfg = InpodConfig {
        redirect_dns: a.dns_capture,
        ipv6: a.common.ipv6,
        ingress_mode: a.bypass_inbound,
        reroute_virtual_interfaces: interface_list(&a.reroute_virtual_interfaces)?,
        ..InpodConfig::default()
    };
    let b = RuleBackend::new(a.common.backend.as_str(), &options(&a.common))?;
    if a.common.dry_run {
        print!("{}", b.render(&cfg));
        return Ok(ExitCode::SUCCESS);
    }
    let netns = Netns::open(&a.netns)?;
    match a.action {
        Action::Apply => pod::enroll(&netns, &cfg, &b).context("apply")?,
        Action::Remove => pod::unenroll(&netns, &cfg, &b).context("remove")?,
        Action::Verify => return Ok(report(pod::verify(&netns, &cfg, &b)?)),
    }
    Ok(ExitCode::SUCCESS)
}

fn report(state: RuleState) -> ExitCode {
    match state {
        RuleState::InSync => {
            println!("in sync");
            ExitCode::SUCCESS
        }
        RuleState::Absent => {
            println!("absent: no redirection programmed");
            ExitCode::FAILURE
        }
        RuleState::Drifted(d) => {
            println!("drifted (- missing, + unexpected):");
            print!("{d}");
            ExitCode::FAILURE
        }
    }
}

fn host(a: HostArgs) -> anyhow::Result<ExitCode> {
    let node = NodeDataplane::new(
        Netns::current()?,
        NodeOptions {
            backend: a.common.backend.as_str(),
            force_iptables: a.common.force_iptables_binary.as_deref(),
            // Host rules take the node-wide xtables lock whatever this says.
            scoped_xtables_locking: false,
            cfg: InpodConfig {
                ipv6: a.common.ipv6,
                ..InpodConfig::default()
            },
            proc_dir: &a.proc_root,
            aws_branch_eni: false,
        },
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    if a.common.dry_run {
        print!("{}", node.render_host_rules());
        return Ok(ExitCode::SUCCESS);
    }
    let state = match a.action {
        Action::Apply => node.apply_host_rules().map(|()| None),
        Action::Remove => node.remove_host_rules().map(|()| None),
        Action::Verify => node.verify_host_rules().map(Some),
    }
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(state.map_or(ExitCode::SUCCESS, report))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct T {
        #[command(subcommand)]
        target: Target,
    }

    fn parse(args: &[&str]) -> Result<Target, clap::Error> {
        T::try_parse_from(std::iter::once("dataplane").chain(args.iter().copied()))
            .map(|t| t.target)
    }

    #[test]
    fn inpod_flags() {
        let Target::Inpod(a) = parse(&[
            "inpod",
            "verify",
            "--netns",
            "/var/run/netns/x",
            "--backend",
            "nftables",
            "--dns-capture=F",
            "--ipv6",
            "--bypass-inbound",
            "--reroute-virtual-interfaces",
            "vm0,vm1",
        ])
        .unwrap() else {
            panic!("not inpod")
        };
        assert_eq!(a.action, Action::Verify);
        assert_eq!(a.common.backend, BackendName::Nftables);
        assert!(!a.dns_capture && a.common.ipv6 && a.bypass_inbound);
        assert_eq!(a.reroute_virtual_interfaces, "vm0,vm1");
    }

    fn pod_file(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    const SIDECAR_POD_YAML: &str = "apiVersion: v1
kind: Pod
metadata:
  name: web-0
  annotations:
    sidecar.istio.io/status: '{}'
    traffic.sidecar.istio.io/excludeOutboundPorts: '5555'
spec:
  containers:
  - name: app
  - name: istio-proxy
    args: [proxy, sidecar]
status:
  podIPs:
  - ip: 10.0.0.5
  - ip: fd00::5
";

    fn sidecar_args(args: &[&str]) -> SidecarArgs {
        let Target::Sidecar(a) = parse(args).unwrap() else {
            panic!("not sidecar")
        };
        a
    }

    /// `sidecar apply` for the manifest at `pod` against no namespace, plus `extra` flags.
    fn sidecar_apply(pod: &std::path::Path, extra: &[&str]) -> SidecarArgs {
        let mut args = vec![
            "sidecar",
            "apply",
            "--netns",
            "/nonexistent",
            "--pod",
            pod.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        sidecar_args(&args)
    }

    #[test]
    fn sidecar_manifest_yaml_and_json_give_the_plugins_config() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = pod_file(dir.path(), "pod.yaml", SIDECAR_POD_YAML);
        let a = sidecar_apply(&yaml, &[]);
        let from_yaml = sidecar_config(&a).unwrap().unwrap();
        assert_eq!(from_yaml.exclude_outbound_ports, [5555]);
        assert!(from_yaml.ipv6, "the pod has an IPv6 address");

        let value: serde_json::Value = serde_yaml::from_str(SIDECAR_POD_YAML).unwrap();
        let json = pod_file(dir.path(), "pod.json", &value.to_string());
        let a = sidecar_apply(&json, &[]);
        assert_eq!(sidecar_config(&a).unwrap().unwrap(), from_yaml);
    }

    #[test]
    fn sidecar_dry_run_prints_the_plugins_rules_and_bad_values_name_the_annotation() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = pod_file(dir.path(), "pod.yaml", SIDECAR_POD_YAML);
        for backend in ["iptables", "nftables"] {
            let a = sidecar_apply(&yaml, &["--backend", backend, "--dry-run"]);
            assert_eq!(sidecar(a).unwrap(), ExitCode::SUCCESS);
        }
        let bad = SIDECAR_POD_YAML.replace("'5555'", "'55555555'");
        let path = pod_file(dir.path(), "bad.yaml", &bad);
        let a = sidecar_apply(&path, &[]);
        let err = crate::logging::describe_error(&sidecar(a).unwrap_err());
        assert!(
            err.contains("traffic.sidecar.istio.io/excludeOutboundPorts"),
            "{err}"
        );
    }

    #[test]
    fn sidecar_apply_verify_remove_in_a_real_netns() {
        dataplane::require_root!();
        let dir = tempfile::tempdir().unwrap();
        let yaml = pod_file(dir.path(), "pod.yaml", SIDECAR_POD_YAML);
        for backend in ["iptables", "nftables"] {
            let ns = dataplane::test_support::TestNetns::new("cli-sc");
            let run = |action: &str| {
                sidecar(sidecar_args(&[
                    "sidecar",
                    action,
                    "--netns",
                    ns.path().to_str().unwrap(),
                    "--pod",
                    yaml.to_str().unwrap(),
                    "--backend",
                    backend,
                ]))
                .unwrap()
            };
            assert_eq!(run("verify"), ExitCode::FAILURE, "{backend}: absent");
            assert_eq!(run("apply"), ExitCode::SUCCESS);
            assert_eq!(run("verify"), ExitCode::SUCCESS, "{backend}: in sync");
            assert_eq!(run("remove"), ExitCode::SUCCESS);
            assert_eq!(run("verify"), ExitCode::FAILURE, "{backend}: removed");
        }
    }

    /// Issue #15 as a user met it: the host's kubelet and kube-proxy use nft, some tool once
    /// touched legacy (empty legacy tables). `inpod apply --backend iptables` run on that host
    /// programs the pod in nft only.
    #[test]
    fn inpod_apply_on_an_nft_host_with_empty_legacy_tables_programs_nft() {
        dataplane::require_root!();
        let host = dataplane::test_support::TestNetns::new("cli-host");
        host.exec("iptables-legacy", &["-t", "nat", "-N", "ONCE"]);
        host.exec("iptables-legacy", &["-t", "nat", "-X", "ONCE"]);
        host.exec(
            "iptables-nft",
            &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
        );
        let pod = dataplane::test_support::TestNetns::new("cli-pod");
        let Target::Inpod(a) = parse(&[
            "inpod",
            "apply",
            "--netns",
            pod.path().to_str().unwrap(),
            "--backend",
            "iptables",
        ])
        .unwrap() else {
            panic!()
        };
        let code = host.open().run(|| inpod(a).unwrap()).unwrap();
        assert_eq!(code, ExitCode::SUCCESS);
        let nft = pod.exec("iptables-nft-save", &[]);
        assert!(nft.contains("-j ISTIO_OUTPUT"), "{nft}");
        let legacy = pod.exec("iptables-legacy-save", &[]);
        assert!(!legacy.contains("ISTIO"), "{legacy}");
    }

    #[test]
    fn bad_bool_is_a_usage_error() {
        assert!(parse(&["inpod", "apply", "--netns", "/x", "--dns-capture=yes"]).is_err());
    }

    #[test]
    fn bad_interface_fails_before_touching_anything() {
        let Target::Inpod(a) = parse(&[
            "inpod",
            "apply",
            "--netns",
            "/nonexistent",
            "--reroute-virtual-interfaces",
            "a b",
        ])
        .unwrap() else {
            panic!()
        };
        let err = inpod(a).unwrap_err().to_string();
        assert!(err.contains("istio.io/reroute-virtual-interfaces"), "{err}");
    }

    #[test]
    fn dry_run_prints_the_rules() {
        let Target::Inpod(a) = parse(&[
            "inpod",
            "apply",
            "--netns",
            "/nonexistent",
            "--dry-run",
            "--backend",
            "nftables",
        ])
        .unwrap() else {
            panic!()
        };
        assert_eq!(inpod(a).unwrap(), ExitCode::SUCCESS);
    }
}
