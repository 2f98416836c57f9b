//! Istio's own node agent (`install-cni`, built from the pinned module by `tools/istio/build.sh`)
//! on the emulated node, started as its DaemonSet would start it, for side-by-side benchmarks.
//!
//! Istio's agent insists on fixed paths: the service account under
//! `/var/run/secrets/kubernetes.io/serviceaccount`, the plugin to install under `/opt/cni/bin`,
//! host mounts under `/host` (`/host/opt/cni/bin`, `/host/etc/cni/net.d`, `/host/proc`,
//! `/host/var/run/netns`) and ztunnel's socket under `/var/run/ztunnel`. The DaemonSet gives it
//! those as volumes; here a private mount namespace does: a tmpfs root made of bind mounts of the
//! machine's own directories, plus the node's temp dirs at Istio's paths, and `chroot` into it.
//! Nothing is mounted in the machine's namespace and nothing is written outside the node's temp
//! dir: the namespace is a slave of the machine's, so pods' namespaces mounted under
//! `/var/run/netns` later reach it (the chart's `HostToContainer`) and nothing goes back. Its run
//! dir (`CNI_AGENT_RUN_DIR`) is a hostPath in the chart, seen at the same path by the plugin;
//! here it is the node's `run` dir, at the same path on both sides.
//!
//! Network: the agent runs inside the node's network namespace, like the chart's
//! `ambient.shareHostNetworkNamespace: true` (host network, no `ALLOW_SWITCH_TO_HOST_NS`), so its
//! host rules land in the node's namespace, never the machine's. Its readiness port is fixed at
//! 8000, in that namespace. It also gets a PID namespace of its own, the node's, in which it is
//! PID 1: Istio reads the host's network namespace from `/host/proc/1/ns/net`, which must be the
//! node's (and the machine's PID 1 may not even be readable). `unshare` stays its parent and
//! kills it when killed itself; [`agent_process`] finds the agent below it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Istio's fixed readiness port (`constants.ReadinessPort`).
pub const READINESS_PORT: u16 = 8000;

/// Builds the mount namespace and execs Istio's agent: `$0 <node dir> <install-cni> [args...]`.
const LAUNCH: &str = r#"set -eu
d=$1 agent=$2; shift 2
root=$d/istio-root
mkdir -p "$root"
mount -t tmpfs -o mode=0755 istio-root "$root"
for e in /*; do
  n=${e#/}
  case $n in host|opt|run|var|proc|sys|dev|tmp) continue ;; esac
  if [ -L "$e" ]; then cp -P "$e" "$root/$n"
  elif [ -d "$e" ]; then mkdir "$root/$n"; mount --rbind "$e" "$root/$n"
  fi
done
# /tmp without its submounts: the new root itself lives beneath it. The node's run dir (a hostPath
# in the chart, the plugin reads the agent's kubeconfig there) again, in case it is a mount of its
# own (a tmpfs, as on a node).
mkdir "$root/tmp" && mount --bind /tmp "$root/tmp"
mount --bind "$d/run" "$root$d/run"
for n in sys dev var; do mkdir "$root/$n"; mount --rbind "/$n" "$root/$n"; done
# The node's own PID namespace (this shell is its PID 1, and execs into the agent): Istio takes
# /host/proc/1/ns/net for the host's network namespace, which must be the node's.
mkdir "$root/proc" && mount -t proc proc "$root/proc"
# The container's own /run (/var/run links to it): the service account and ztunnel's socket dir.
mkdir "$root/run" && mount -t tmpfs -o mode=0755 run "$root/run"
bind() { mkdir -p "$2" && mount --bind "$1" "$2"; }
bind "$d/sa" "$root/run/secrets/kubernetes.io/serviceaccount"
bind "$d/zt" "$root/run/ztunnel"
# The image's /opt/cni/bin holds the plugin to install.
mkdir "$root/opt" && mount -t tmpfs -o mode=0755 opt "$root/opt"
bind "$d/src-bin" "$root/opt/cni/bin"
# hostPath volumes.
mkdir "$root/host" && mount -t tmpfs -o mode=0755 host "$root/host"
bind "$d/bin" "$root/host/opt/cni/bin"
bind "$d/net.d" "$root/host/etc/cni/net.d"
mkdir -p "$root/host/proc" && mount -t proc proc "$root/host/proc"
mkdir -p "$root/host/var/run/netns" && mount --rbind /var/run/netns "$root/host/var/run/netns"
# The node's kubelet, for the nftables host rule that matches its UID (a copy of sleep the kit
# made); it dies with this PID namespace.
if [ -x "$d/kubelet" ]; then "$d/kubelet" infinity & fi
exec chroot "$root" "$agent" "$@"
"#;

/// The command that runs Istio's `install-cni` from `istio_bin` on the node: in the node's
/// network namespace `node_netns`, in a private mount namespace laid out as above. Env and
/// arguments are the caller's.
pub fn command(istio_bin: &Path, node_dir: &Path, node_netns: &Path) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net={}", node_netns.display()))
        .args([
            "unshare",
            "--mount",
            "--pid",
            "--kill-child",
            "--propagation",
            "slave",
        ])
        .args(["sh", "-c", LAUNCH, "istio-agent"])
        .arg(node_dir)
        .arg(istio_bin.join("install-cni"));
    c
}

/// Variables of our agent's environment that Istio's does not take: its paths are the fixed ones
/// the mount namespace provides, and it reads the API server from its service account (in-cluster
/// config), as in its DaemonSet.
pub const NOT_ISTIOS: &[&str] = &[
    "MOUNTED_CNI_NET_DIR",
    "CNI_BIN_DIR",
    "CNI_BIN_SOURCE_DIR",
    "SERVICE_ACCOUNT_DIR",
    "KUBECONFIG",
    "ZTUNNEL_UDS_ADDRESS",
    "HOST_PREFIX",
    "HOST_NETNS",
    "HEALTH_PORT",
    "DRIFT_CHECK_INTERVAL_SECONDS",
];

/// The chart's default `ambient.enablementSelectors` as its ConfigMap renders them (`toYaml`):
/// without it Istio's plugin and agent select no pod at all.
const ENABLEMENT_SELECTOR: &str = "- podSelector:
    matchLabels:
      istio.io/dataplane-mode: ambient
- namespaceSelector:
    matchLabels:
      istio.io/dataplane-mode: ambient
  podSelector:
    matchExpressions:
    - key: istio.io/dataplane-mode
      operator: NotIn
      values:
      - none
";

/// What Istio's DaemonSet sets besides our agent's variables: the chart ConfigMap's enablement
/// selectors, `REPAIR_*`, `POD_NAME`.
pub fn daemonset_env(node_name: &str) -> Vec<(String, String)> {
    [
        ("AMBIENT_ENABLEMENT_SELECTOR", ENABLEMENT_SELECTOR),
        ("REPAIR_NODE_NAME", node_name),
        ("REPAIR_RUN_AS_DAEMON", "true"),
        ("REPAIR_SIDECAR_ANNOTATION", "sidecar.istio.io/status"),
        ("POD_NAME", "istio-cni-node-bench"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// `$ISTIO_BIN`: a directory holding Istio's `install-cni` and `istio-cni`
/// (`tools/istio/build.sh install-cni istio-cni | tail -1`).
pub fn istio_bin() -> Option<PathBuf> {
    std::env::var_os("ISTIO_BIN").map(PathBuf::from)
}

/// The agent process below the launcher `pid` (`unshare`, which forks the agent into its PID
/// namespace): its first child.
pub fn agent_process(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Istio's agent alone on a node of its own that runs no pod, for what its watches cost the API
/// server: its own temp dir, network namespace (its host rules land there), PID and mount
/// namespaces ([`command`]) and node name, sharing the caller's API server. Its installer finds
/// no primary CNI config and waits, so it never turns ready; its watches are synced once it logs
/// [`WatchSide::SYNCED`]. Killed with its namespaces on drop.
pub struct WatchSide {
    dir: tempfile::TempDir,
    child: std::process::Child,
    _api: crate::relay::LoopbackForward,
    _netns: dataplane::test_support::TestNetns,
}

impl WatchSide {
    /// The line Istio's ambient server logs once its informers synced (`nodeagent.Server.Start`).
    pub const SYNCED: &'static str = "CNI ambient server kubeclient started";

    pub fn start(kube: &crate::kube::KubeTestEnv, istio_bin: &Path, node_name: &str) -> WatchSide {
        let dir = tempfile::Builder::new()
            .prefix("istio-watch-side")
            .tempdir()
            .unwrap();
        let d = dir.path();
        for sub in ["net.d", "bin", "src-bin", "run", "sa", "zt"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        // The installer copies the plugin it finds; no pod ever runs it, and 50 copies of
        // Istio's 77 MB plugin would fill the disk.
        std::os::unix::fs::symlink("/bin/true", d.join("src-bin/istio-cni")).unwrap();
        // The nftables host rule matches the kubelet's UID; [`LAUNCH`] runs this in the node.
        std::os::unix::fs::symlink("/bin/sleep", d.join("kubelet")).unwrap();
        std::fs::write(d.join("sa/token"), kube.admin_token()).unwrap();
        std::fs::write(d.join("sa/ca.crt"), kube.ca_pem()).unwrap();
        let netns = dataplane::test_support::TestNetns::new("istio-ws");
        let api = crate::relay::forward_loopback(&netns.open(), kube.port());
        let log = std::fs::File::create(d.join("agent.log")).unwrap();
        let mut env: Vec<(String, String)> = [
            ("NODE_NAME", node_name),
            ("AMBIENT_ENABLED", "true"),
            ("NATIVE_NFTABLES", "true"),
            ("CNI_AGENT_RUN_DIR", &d.join("run").display().to_string()),
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", &kube.port().to_string()),
            ("POD_NAMESPACE", "istio-system"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        env.extend(daemonset_env(node_name));
        let child = command(istio_bin, d, &netns.path())
            .arg("--log_output_level=info")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start Istio's install-cni");
        WatchSide {
            dir,
            child,
            _api: api,
            _netns: netns,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// Its watches have synced; an agent that exited is an error with its log.
    pub fn synced(&mut self) -> Result<bool, String> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Err(format!(
                "Istio's agent exited with {status}:\n{}",
                self.log()
            ));
        }
        Ok(self.log().contains(Self::SYNCED))
    }

    /// The agent's own process (below its launcher).
    pub fn agent_process(&self) -> Option<u32> {
        agent_process(self.child.id())
    }
}

impl Drop for WatchSide {
    fn drop(&mut self) {
        // The launcher (`unshare --kill-child`) takes the agent and its PID namespace with it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
