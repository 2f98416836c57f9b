//! A Kubernetes node in a box, for end-to-end tests and the demo: a real kube-apiserver, a "node"
//! network namespace holding the CNI bridge, the real `install-cni` agent process with every host
//! path in a temp dir, Debian's CNI plugins chained with our `istio-cni` by the installer itself,
//! and pods as network namespaces created through that chain exactly as a runtime would.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dataplane::test_support::TestNetns;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::cni_runtime::{CniRuntime, CniRuntimeError, Sandbox};
use super::kube::KubeTestEnv;

/// Where `cargo build --workspace --bins` put our binaries (`target/<profile>`).
pub fn binary_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("own executable path");
    // target/<profile>/deps/<test>-<hash> or target/<profile>/<bin>
    let mut dir = exe.parent().expect("executable dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    for bin in ["istio-cni", "install-cni"] {
        assert!(
            dir.join(bin).is_file(),
            "{} is missing: build the binaries first (cargo build --workspace --bins)",
            dir.join(bin).display()
        );
    }
    dir
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Iptables,
    Nftables,
}

/// Whose token the agent (and the plugin, through the kubeconfig the installer writes) uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Identity {
    /// Cluster admin: RBAC out of the way.
    Admin,
    /// The `istio-cni` ServiceAccount bound to exactly the RBAC of the shipped ambient manifest.
    ShippedRbac,
}

/// The plugin the installer copies onto the test node: `$PLUGIN_BIN`, or this build's. The image
/// ships a static musl build, whose exec is about 1 ms shorter here than a dynamically linked
/// one's, so benchmarks point `PLUGIN_BIN` at that build.
pub fn plugin_binary() -> PathBuf {
    std::env::var_os("PLUGIN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| binary_dir().join("istio-cni"))
}

/// The agent the test node runs: `$AGENT_BIN`, or this build's. The real node's image
/// (`scripts/node-images`) and the `Dockerfile` ship a static musl build, without the 2.4 MiB of
/// shared C libraries a dynamically linked agent maps; `scripts/bench-node` points `AGENT_BIN`
/// at that build.
pub fn agent_binary() -> PathBuf {
    std::env::var_os("AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| binary_dir().join("install-cni"))
}

/// How [`TestNode::start_on`] sets the node up; the default is [`TestNode::start`]'s node.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub identity: Identity,
    /// The API server as the agent and the plugin see it: a port on 127.0.0.1 serving it with
    /// the server's certificate (a fault-injecting proxy); `None` means the server itself.
    pub api_port: Option<u16>,
    /// Mount a tmpfs of this many bytes on the agent's run dir, so a test can fill it (disk
    /// full), or so a bench's run dir is the tmpfs a node's is. Only inside a private mount
    /// namespace the caller made: never on the host's.
    pub run_dir_tmpfs: Option<u64>,
    /// Whose agent runs on the node.
    pub agent: Agent,
    /// [`TestNode::extra_env`] from the first agent start.
    pub extra_env: Vec<(String, String)>,
}

/// The node agent the kit starts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Agent {
    /// Our `install-cni` (this build's).
    #[default]
    Ours,
    /// Istio's `install-cni` from this directory (`tools/istio/build.sh install-cni istio-cni`),
    /// started as its DaemonSet would be (see [`crate::istio_agent`]); it installs Istio's
    /// `istio-cni` from the same directory.
    Istio(PathBuf),
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            identity: Identity::Admin,
            api_port: None,
            run_dir_tmpfs: None,
            agent: Agent::Ours,
            extra_env: Vec::new(),
        }
    }
}

/// Set once this process has its own mount namespace.
static PRIVATE_MOUNTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Gives this process its own mount namespace with nothing propagating to or from the host, so
/// mounts a test makes (a run dir tmpfs, `ip netns` bind mounts) die with it. Must be called
/// before the process starts a thread: a multithreaded process cannot unshare its mounts.
pub fn private_mount_namespace() -> nix::Result<()> {
    use nix::mount::{MsFlags, mount};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    PRIVATE_MOUNTS.store(true, std::sync::atomic::Ordering::SeqCst);
    Ok(())
}

/// Mounts a tmpfs of `bytes` on `dir`, refusing to unless [`private_mount_namespace`] ran: the
/// mount must never land in the host's namespace.
fn mount_private_tmpfs(dir: &Path, bytes: u64) {
    assert!(
        PRIVATE_MOUNTS.load(std::sync::atomic::Ordering::SeqCst),
        "a run dir tmpfs needs private_mount_namespace() first"
    );
    nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some(format!("size={bytes},mode=0755").as_str()),
    )
    .unwrap_or_else(|e| panic!("mount tmpfs on {}: {e}", dir.display()));
}

/// Debian's reference plugins.
const DEBIAN_CNI: &str = "/usr/lib/cni";
const POD_CIDR: &str = "10.88.0.0/16";

pub struct TestNode {
    pub kube: KubeTestEnv,
    pub dir: tempfile::TempDir,
    pub node_netns: TestNetns,
    pub node_name: String,
    pub health_port: u16,
    pub metrics_port: u16,
    pub backend: Backend,
    /// Added to (and overriding) [`agent_env`](Self::agent_env) from the next agent start.
    pub extra_env: Vec<(String, String)>,
    /// The loopback port the agent and the plugin reach the API server on (a proxy's, or the
    /// server's own).
    pub api_port: u16,
    run_dir_tmpfs: bool,
    /// Whose agent [`start_agent`](Self::start_agent) starts.
    pub agent_kind: Agent,
    agent: Option<Child>,
    /// Where the running agent's lines begin in `agent.log`.
    agent_log_start: u64,
    kubelet: Option<Child>,
    /// Plugins run in the node namespace (as on a node, where they run in the host's) but the API
    /// server listens on the test's loopback: the node's `127.0.0.1:<api port>` is forwarded to it.
    _api_forwarder: crate::relay::LoopbackForward,
}

/// The nftables host rule matches kubelet's UID, found from a process named kubelet.
/// A symlink, not a copy: a copy is written through a descriptor that a concurrent test's fork
/// can inherit until its exec, and executing the copy meanwhile fails with ETXTBSY (seen in CI).
/// The kernel names the process after the path it was executed by, so `comm` is `kubelet`.
fn fake_kubelet(dir: &Path) -> Child {
    let fake = dir.join("kubelet");
    std::os::unix::fs::symlink("/bin/sleep", &fake).unwrap();
    Command::new(&fake)
        .arg("infinity")
        .spawn()
        .expect("fake kubelet")
}

/// Our plugin's type in the installed chain.
const ISTIO_CNI: &str = "istio-cni";

/// The two parts of a chain around our plugin.
#[derive(Clone, Copy)]
enum Part {
    Primary,
    Ours,
}

/// A pod as the test created it: its API object and its sandbox.
pub struct TestPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub netns: TestNetns,
    pub ip: Option<IpAddr>,
    pub container_id: String,
}

impl TestPod {
    /// The pod's sandbox as the runtime hands it to the CNI chain.
    pub fn sandbox(&self) -> Sandbox {
        Sandbox::k8s(
            &self.container_id,
            self.netns.path(),
            &self.namespace,
            &self.name,
            &self.uid,
        )
    }
}

impl TestNode {
    pub async fn start(backend: Backend) -> TestNode {
        Self::start_as(backend, Identity::Admin).await
    }

    pub async fn start_as(backend: Backend, identity: Identity) -> TestNode {
        let options = NodeOptions {
            identity,
            ..NodeOptions::default()
        };
        Self::start_on(KubeTestEnv::start().await, backend, options).await
    }

    /// A node on an API server the caller started, with the agent and plugins configured by
    /// `options`.
    pub async fn start_on(kube: KubeTestEnv, backend: Backend, options: NodeOptions) -> TestNode {
        let identity = options.identity;
        let token = match identity {
            Identity::Admin => kube.admin_token().to_string(),
            Identity::ShippedRbac => super::manifests::install_shipped_rbac(&kube).await,
        };
        let dir = tempfile::Builder::new()
            .prefix("test-node")
            .tempdir()
            .unwrap();
        let d = dir.path();
        for sub in ["net.d", "bin", "src-bin", "run", "sa", "zt", "ipam"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        for plugin in ["bridge", "host-local", "loopback", "portmap"] {
            std::os::unix::fs::symlink(
                Path::new(DEBIAN_CNI).join(plugin),
                d.join("bin").join(plugin),
            )
            .unwrap();
        }
        // Each agent installs its own plugin.
        let plugin = match &options.agent {
            Agent::Ours => plugin_binary(),
            Agent::Istio(bin) => bin.join("istio-cni"),
        };
        std::fs::copy(plugin, d.join("src-bin/istio-cni")).unwrap();
        std::fs::write(d.join("sa/token"), &token).unwrap();
        std::fs::write(d.join("sa/ca.crt"), kube.ca_pem()).unwrap();
        let api_port = options.api_port.unwrap_or(kube.port());
        kube.write_kubeconfig_for(
            &d.join("kubeconfig"),
            &token,
            &format!("https://127.0.0.1:{api_port}"),
        );
        if let Some(bytes) = options.run_dir_tmpfs {
            mount_private_tmpfs(&d.join("run"), bytes);
        }
        let conflist = json!({
            "cniVersion": "1.0.0",
            "name": "e2e",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": d.join("ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]
        });
        std::fs::write(
            d.join("net.d/10-e2e.conflist"),
            serde_json::to_vec_pretty(&conflist).unwrap(),
        )
        .unwrap();

        let kubelet = (backend == Backend::Nftables).then(|| fake_kubelet(d));

        let node_netns = TestNetns::new("node");
        let api_forwarder = crate::relay::forward_loopback(&node_netns.open(), api_port);
        let health_port = match options.agent {
            Agent::Ours => crate::ports::unused(),
            Agent::Istio(_) => crate::istio_agent::READINESS_PORT,
        };
        let mut node = TestNode {
            agent_kind: options.agent,
            kube,
            api_port,
            run_dir_tmpfs: options.run_dir_tmpfs.is_some(),
            node_netns,
            _api_forwarder: api_forwarder,
            node_name: format!("node-{}", std::process::id()),
            health_port,
            metrics_port: crate::ports::unused(),
            backend,
            extra_env: options.extra_env,
            agent: None,
            agent_log_start: 0,
            kubelet,
            dir,
        };
        node.start_agent();
        node.wait_ready().await;
        node
    }

    pub fn path(&self, sub: &str) -> PathBuf {
        self.dir.path().join(sub)
    }

    /// The agent's environment: Istio's variables, every host path under the temp dir.
    pub fn agent_env(&self) -> Vec<(String, String)> {
        let p = |s: &str| self.path(s).display().to_string();
        let env = vec![
            ("NODE_NAME", self.node_name.clone()),
            ("AMBIENT_ENABLED", "true".into()),
            ("AMBIENT_DNS_CAPTURE", "true".into()),
            ("AMBIENT_RECONCILE_POD_RULES_ON_STARTUP", "true".into()),
            (
                "NATIVE_NFTABLES",
                (self.backend == Backend::Nftables).to_string(),
            ),
            ("MOUNTED_CNI_NET_DIR", p("net.d")),
            ("CNI_BIN_DIR", p("bin")),
            ("CNI_BIN_SOURCE_DIR", p("src-bin")),
            ("CNI_AGENT_RUN_DIR", p("run")),
            ("SERVICE_ACCOUNT_DIR", p("sa")),
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1".into()),
            ("KUBERNETES_SERVICE_PORT", self.api_port.to_string()),
            ("KUBECONFIG", p("kubeconfig")),
            ("ZTUNNEL_UDS_ADDRESS", p("zt/ztunnel.sock")),
            ("HOST_PREFIX", "/".into()),
            ("HOST_NETNS", self.node_netns.path().display().to_string()),
            ("HEALTH_PORT", self.health_port.to_string()),
            ("MONITORING_PORT", self.metrics_port.to_string()),
            ("POD_NAMESPACE", "istio-system".into()),
            ("EXCLUDE_NAMESPACES", "kube-system".into()),
            ("DRIFT_CHECK_INTERVAL_SECONDS", "1".into()),
        ];
        let mut env: Vec<(String, String)> =
            env.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        for (k, v) in &self.extra_env {
            env.retain(|(have, _)| have != k);
            env.push((k.clone(), v.clone()));
        }
        env
    }

    /// Stops the agent without cleanup (as a DaemonSet rollout does), and starts it again with
    /// `backend`, leaving everything the old agent programmed in place.
    pub async fn switch_backend(&mut self, backend: Backend) {
        self.kill_agent();
        self.backend = backend;
        if backend == Backend::Nftables && self.kubelet.is_none() {
            self.kubelet = Some(fake_kubelet(self.dir.path()));
        }
        self.start_agent();
        self.wait_ready().await;
    }

    pub fn start_agent(&mut self) {
        assert!(self.agent.is_none(), "agent already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("agent.log"))
            .unwrap();
        self.agent_log_start = log.metadata().unwrap().len();
        // `AGENT_LOG_LEVEL=debug` means every scope: a bare level sets only `default` in Istio's
        // flag syntax, and the agent logs under `cni-agent`.
        let level = match std::env::var("AGENT_LOG_LEVEL") {
            Ok(l) if !l.contains(':') => format!("all:{l}"),
            Ok(l) => l,
            Err(_) => "info".into(),
        };
        // `AGENT_WRAPPER="heaptrack -o /tmp/agent"` (or perf, valgrind...) runs the agent under a
        // profiler; memory readings are then the wrapper's.
        let mut command = match &self.agent_kind {
            Agent::Ours => {
                let agent = agent_binary();
                let wrapper = std::env::var("AGENT_WRAPPER").unwrap_or_default();
                let mut argv: Vec<std::ffi::OsString> =
                    wrapper.split_whitespace().map(Into::into).collect();
                argv.push(agent.into());
                let mut c = Command::new(&argv[0]);
                c.args(&argv[1..]);
                c
            }
            Agent::Istio(bin) => {
                crate::istio_agent::command(bin, self.dir.path(), &self.node_netns.path())
            }
        };
        let mut env = self.agent_env();
        if let Agent::Istio(_) = self.agent_kind {
            env.retain(|(k, _)| !crate::istio_agent::NOT_ISTIOS.contains(&k.as_str()));
            env.extend(crate::istio_agent::daemonset_env(&self.node_name));
        }
        let child = command
            .arg(format!("--log_output_level={level}"))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env)
            .stdout(match self.agent_kind {
                // Istio logs to stdout.
                Agent::Istio(_) => Stdio::from(log.try_clone().unwrap()),
                Agent::Ours => Stdio::null(),
            })
            .stderr(log)
            .spawn()
            .expect("start install-cni");
        self.agent = Some(child);
    }

    /// Whether the agent process exited on its own (and its status), reaping it.
    pub fn agent_exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.agent.as_mut()?.try_wait().ok()??;
        self.agent = None;
        Some(status)
    }

    /// The running agent's PID.
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.as_ref().map(Child::id)
    }

    /// SIGKILL: no cleanup runs (a crash).
    pub fn kill_agent(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait: the agent's shutdown path runs.
    pub fn stop_agent(&mut self) -> std::process::ExitStatus {
        let mut c = self.agent.take().expect("agent running");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "agent did not stop within 20s\n{}",
                self.agent_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A memory figure of the agent from `/proc/<pid>/status` (`VmRSS`: resident now, `VmHWM`:
    /// its peak, `RssAnon`, `RssFile`), in KiB.
    pub fn agent_memory_kib(&self, field: &str) -> Option<u64> {
        let pid = self.agent_process()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// The CPU the agent process has used since it started, all its threads (exited ones too),
    /// from its CPU clock: nanoseconds, where `/proc/<pid>/stat` counts 10 ms ticks.
    pub fn agent_cpu_time(&self) -> Option<Duration> {
        dataplane::test_support::process_cpu_time(self.agent_process()?).ok()
    }

    /// The CPU the agent has used since `before` (an [`agent_cpu_time`](Self::agent_cpu_time)),
    /// if both readings are of the same agent process.
    pub fn agent_cpu_since(&self, before: Option<Duration>) -> Option<Duration> {
        self.agent_cpu_time()?.checked_sub(before?)
    }

    /// The agent's own process: ours as started; Istio's below its launcher, which forks it into
    /// a PID namespace ([`crate::istio_agent::agent_process`]).
    fn agent_process(&self) -> Option<u32> {
        let pid = self.agent.as_ref()?.id();
        match self.agent_kind {
            Agent::Istio(_) => crate::istio_agent::agent_process(pid),
            Agent::Ours => Some(pid),
        }
    }

    pub fn agent_log(&self) -> String {
        let log = std::fs::read_to_string(self.path("agent.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// `GET /readyz` on the agent's health port: status code and body.
    pub fn readyz(&self) -> Option<(u16, String)> {
        self.agent_http(self.health_port, "/readyz")
    }

    /// An HTTP GET to the agent: Istio's listens in the node's namespace (host network).
    fn agent_http(&self, port: u16, path: &str) -> Option<(u16, String)> {
        match self.agent_kind {
            Agent::Ours => http_get(port, path),
            Agent::Istio(_) => {
                let path = path.to_string();
                self.node_netns
                    .open()
                    .run(move || http_get(port, &path))
                    .ok()
                    .flatten()
            }
        }
    }

    pub fn metrics(&self) -> String {
        self.agent_http(self.metrics_port, "/metrics")
            .map(|(_, b)| b)
            .unwrap_or_default()
    }

    /// Waits until `/readyz` is 200 (installer, watches and ZDS server all ready).
    ///
    /// Our agent's health and metrics ports are only found free ([`crate::ports::unused`]) and
    /// live in the machine's network namespace, where another process may take one before the
    /// agent binds it: the agent then says so in its log, and is started again on fresh ports.
    pub async fn wait_ready(&mut self) {
        let mut deadline = Instant::now() + Duration::from_secs(60);
        let mut starts = 1;
        loop {
            if let Some(c) = self.agent.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!("agent exited with {status}:\n{}", self.agent_log());
            }
            if let Some(line) = self.port_taken() {
                assert!(
                    starts < crate::ports::START_ATTEMPTS,
                    "the agent found its ports taken {starts} times:\n{}",
                    self.agent_log()
                );
                starts += 1;
                eprintln!("test node: starting the agent again on fresh ports: {line}");
                self.kill_agent();
                self.health_port = crate::ports::unused();
                self.metrics_port = crate::ports::unused();
                self.start_agent();
                deadline = Instant::now() + Duration::from_secs(60);
                continue;
            }
            if let Some((200, _)) = self.readyz()
                && self.agent_listens(self.health_port)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "agent not ready after 60s: {:?}\n{}",
                self.readyz(),
                self.agent_log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Our agent's log line saying that a port it was given is held by another process.
    fn port_taken(&self) -> Option<String> {
        if self.agent_kind != Agent::Ours {
            // Istio's agent listens in the node's network namespace, where nothing else does.
            return None;
        }
        let log = std::fs::read(self.path("agent.log")).unwrap_or_default();
        let start = usize::try_from(self.agent_log_start).map_or(log.len(), |s| s.min(log.len()));
        String::from_utf8_lossy(&log[start..])
            .lines()
            .find(|l| l.contains("port in use"))
            .map(str::to_string)
    }

    /// Whether the agent (or a process below it, under `AGENT_WRAPPER`) holds the listener on
    /// `port`: a process that took the port first, another test's agent, may answer `/readyz`
    /// as well.
    fn agent_listens(&self, port: u16) -> bool {
        let Some(pid) = self.agent_pid() else {
            return false;
        };
        if self.agent_kind != Agent::Ours {
            return true;
        }
        let listeners = listening_sockets(port);
        process_tree(pid).into_iter().any(|p| {
            std::fs::read_dir(format!("/proc/{p}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .any(|target| listeners.contains(&target.to_string_lossy().into_owned()))
        })
    }

    /// The CNI config the installer wrote (the primary with our entry chained).
    pub fn conflist(&self) -> String {
        std::fs::read_to_string(self.path("net.d/10-e2e.conflist")).unwrap()
    }

    /// A runtime that runs the installed chain in the node namespace.
    pub fn runtime(&self) -> CniRuntime {
        CniRuntime::new(&self.conflist(), vec![self.path("bin")])
            .unwrap()
            .in_netns(self.node_netns.open())
    }

    pub async fn create_namespace(&self, name: &str, labels: &[(&str, &str)]) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), Value::from(*v)))
            .collect();
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
        Api::<Namespace>::all(self.kube.client())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
    }

    /// Creates istio-system and the agent's DaemonSet in it, as a cluster has them: a stopping
    /// agent then reads an upgrade and keeps the plugin, its config entry and the host rules.
    pub async fn create_agent_daemonset(&self) {
        use k8s_openapi::api::apps::v1::DaemonSet;
        self.create_namespace("istio-system", &[]).await;
        let ds: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": cni_agent::ambient::upgrade::DAEMONSET},
            "spec": {"selector": {"matchLabels": {"k8s-app": "istio-cni-node"}},
                     "template": {"metadata": {"labels": {"k8s-app": "istio-cni-node"}},
                                  "spec": {"containers": [{"name": "install-cni", "image": "install-cni"}]}}}
        }))
        .unwrap();
        Api::<DaemonSet>::namespaced(self.kube.client(), "istio-system")
            .create(&PostParams::default(), &ds)
            .await
            .unwrap();
    }

    pub async fn label_namespace(&self, name: &str, key: &str, value: Option<&str>) {
        let patch = json!({"metadata": {"labels": {key: value}}});
        Api::<Namespace>::all(self.kube.client())
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    pub async fn label_pod(&self, pod: &TestPod, key: &str, value: Option<&str>) {
        let patch = json!({"metadata": {"labels": {key: value}}});
        self.pods(&pod.namespace)
            .patch(&pod.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    pub fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.kube.client(), namespace)
    }

    /// Creates the Pod object (scheduled to this node), then its sandbox through the CNI chain,
    /// then writes the status the kubelet would (IP, Running). The ADD error, if any, is returned
    /// with the pod (whose sandbox then has no network).
    pub async fn create_pod(
        &self,
        namespace: &str,
        name: &str,
        labels: &[(&str, &str)],
    ) -> (TestPod, Result<Value, CniRuntimeError>) {
        let mut pod = self.create_pod_object(namespace, name, labels).await;
        let result = self.sandbox_add(&mut pod).await;
        (pod, result)
    }

    /// Only the Pod object (scheduled here) and its still unconnected sandbox namespace; the caller
    /// runs [`sandbox_add`](Self::sandbox_add) when it wants (benchmarks time just the ADD).
    pub async fn create_pod_object(
        &self,
        namespace: &str,
        name: &str,
        labels: &[(&str, &str)],
    ) -> TestPod {
        self.create_annotated_pod_object(namespace, name, labels, &[])
            .await
    }

    /// [`create_pod_object`](Self::create_pod_object) with annotations (a pod's own redirection
    /// settings).
    pub async fn create_annotated_pod_object(
        &self,
        namespace: &str,
        name: &str,
        labels: &[(&str, &str)],
        annotations: &[(&str, &str)],
    ) -> TestPod {
        let map = |kv: &[(&str, &str)]| -> serde_json::Map<String, Value> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), Value::from(*v)))
                .collect()
        };
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": map(labels), "annotations": map(annotations)},
            "spec": {"nodeName": self.node_name, "serviceAccountName": "default",
                     "containers": [{"name": "app", "image": "app"}]}
        }))
        .unwrap();
        let created = self
            .pods(namespace)
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
        let uid = created.metadata.uid.clone().unwrap();
        TestPod {
            // Unique per pod object, as a runtime's sandbox IDs are.
            container_id: uid.replace('-', ""),
            namespace: namespace.into(),
            name: name.into(),
            uid,
            netns: TestNetns::new("pod"),
            ip: None,
        }
    }

    /// Runs CNI ADD for the pod's sandbox and, on success, writes the pod's IP and phase like the
    /// kubelet.
    #[allow(
        clippy::result_large_err,
        reason = "the error carries the failing plugin's whole output"
    )]
    pub async fn sandbox_add(&self, pod: &mut TestPod) -> Result<Value, CniRuntimeError> {
        self.sandbox_add_on(pod, self.runtime()).await
    }

    /// [`sandbox_add`](Self::sandbox_add) with the chain `runtime` read: one read of the config
    /// for the whole ADD, as a runtime does, even while another writer rewrites the file.
    #[allow(
        clippy::result_large_err,
        reason = "the error carries the failing plugin's whole output"
    )]
    pub async fn sandbox_add_on(
        &self,
        pod: &mut TestPod,
        runtime: CniRuntime,
    ) -> Result<Value, CniRuntimeError> {
        let runtime = std::sync::Arc::new(runtime);
        let prev = self.add_part(&runtime, pod, Part::Primary, None).await?;
        let prev = prev.expect("the installed chain has a primary plugin");
        let result = self.add_part(&runtime, pod, Part::Ours, Some(prev)).await?;
        let result = result.expect("prev is passed through an empty part");
        self.report_running(pod, &result).await;
        Ok(result)
    }

    /// The first part of the pod's ADD: the plugins before ours (all of them when ours is not
    /// installed). The sandbox gets its interface and IP; returns the result ours is handed.
    #[allow(
        clippy::result_large_err,
        reason = "the error carries the failing plugin's whole output"
    )]
    pub async fn sandbox_add_primary(&self, pod: &TestPod) -> Result<Value, CniRuntimeError> {
        let runtime = std::sync::Arc::new(self.runtime());
        let result = self.add_part(&runtime, pod, Part::Primary, None).await?;
        Ok(result.expect("the installed chain has a primary plugin"))
    }

    /// The rest of the pod's ADD: our plugin (and anything after it) with `prev` from
    /// [`sandbox_add_primary`](Self::sandbox_add_primary), so a benchmark can time our plugin's
    /// exec alone.
    #[allow(
        clippy::result_large_err,
        reason = "the error carries the failing plugin's whole output"
    )]
    pub async fn sandbox_add_ours(
        &self,
        pod: &TestPod,
        prev: Value,
    ) -> Result<Value, CniRuntimeError> {
        let runtime = std::sync::Arc::new(self.runtime());
        let result = self.add_part(&runtime, pod, Part::Ours, Some(prev)).await?;
        Ok(result.expect("prev is passed through an empty part"))
    }

    /// Runs one part of the chain in a blocking thread (the agent may take a while).
    #[allow(
        clippy::result_large_err,
        reason = "the error carries the failing plugin's whole output"
    )]
    async fn add_part(
        &self,
        runtime: &std::sync::Arc<CniRuntime>,
        pod: &TestPod,
        part: Part,
        prev: Option<Value>,
    ) -> Result<Option<Value>, CniRuntimeError> {
        let runtime = runtime.clone();
        let sandbox = pod.sandbox();
        tokio::task::spawn_blocking(move || {
            let count = runtime.plugin_count();
            let ours = runtime.position(ISTIO_CNI).unwrap_or(count);
            let range = match part {
                Part::Primary => 0..ours,
                Part::Ours => ours..count,
            };
            runtime.add_plugins(&sandbox, range, prev, &mut |_| {})
        })
        .await
        .unwrap()
    }

    /// What the kubelet writes once the sandbox is up: the pod's IP from the ADD result, Running.
    pub async fn report_running(&self, pod: &mut TestPod, result: &Value) {
        let ip: IpAddr = result["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        pod.ip = Some(ip);
        let status = json!({"status": {"phase": "Running", "podIP": ip.to_string(),
                                        "podIPs": [{"ip": ip.to_string()}]}});
        self.pods(&pod.namespace)
            .patch_status(&pod.name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }

    /// `install-cni explain <ns>/<pod>` against the running agent: (exit success, stdout + stderr).
    pub fn explain(&self, pod: &TestPod) -> (bool, String) {
        let out = Command::new(binary_dir().join("install-cni"))
            .args(["explain", &format!("{}/{}", pod.namespace, pod.name)])
            .env("CNI_AGENT_RUN_DIR", self.path("run"))
            .output()
            .expect("run install-cni explain");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// The pod's `ambient.istio.io/redirection` annotation.
    pub async fn redirection(&self, pod: &TestPod) -> Option<String> {
        let p = self.pods(&pod.namespace).get(&pod.name).await.unwrap();
        p.metadata
            .annotations
            .and_then(|a| a.get(cni_core::reconcile::REDIRECTION_ANNOTATION).cloned())
    }

    /// Polls until the annotation equals `want` (None = absent).
    pub async fn wait_redirection(&self, pod: &TestPod, want: Option<&str>) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let got = self.redirection(pod).await;
            if got.as_deref() == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}/{}: redirection {got:?}, want {want:?}\n{}",
                pod.namespace,
                pod.name,
                self.agent_log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// CNI DEL for the pod's sandbox through the installed chain (as the runtime does when it
    /// stops the sandbox), with `cached` the ADD result when there was one.
    #[allow(
        clippy::result_large_err,
        reason = "the error carries the failing plugin's whole output"
    )]
    pub async fn sandbox_del(
        &self,
        pod: &TestPod,
        cached: Option<Value>,
    ) -> Result<(), CniRuntimeError> {
        let runtime = self.runtime();
        let sandbox = pod.sandbox();
        tokio::task::spawn_blocking(move || runtime.del(&sandbox, cached.as_ref()))
            .await
            .unwrap()
    }

    pub async fn delete_pod(&self, pod: &TestPod) {
        self.pods(&pod.namespace)
            .delete(&pod.name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
}

/// An application in a pod: answers every TCP connection on `port` with `hello from <pod>` and
/// closes it. Runs until the pod's namespace goes away.
pub fn serve_hello(pod: &TestPod, port: u16) {
    let listener = pod
        .netns
        .open()
        .run(|| std::net::TcpListener::bind(("0.0.0.0", port)))
        .unwrap()
        .expect("app listener in the pod");
    let name = pod.name.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { return };
            use std::io::Write;
            let _ = writeln!(c, "hello from {name}");
        }
    });
}

/// The application in `from` connects to `to`'s IP on `port` (the socket is made inside `from`'s
/// namespace, so the pod's own rules apply) and returns what it reads.
pub fn app_request(from: &TestPod, to: &TestPod, port: u16) -> std::io::Result<String> {
    let dst = std::net::SocketAddr::new(to.ip.expect("target pod has an IP"), port);
    from.netns
        .open()
        .run(move || {
            use std::io::Read;
            let mut s = std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out)
        })
        .map_err(std::io::Error::other)?
}

/// The listening TCP sockets on `port` in this process's network namespace, as their fd links
/// read (`socket:[inode]`).
fn listening_sockets(port: u16) -> Vec<String> {
    const LISTEN: &str = "0A";
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    let (local, state, inode) = (f.get(1)?, f.get(3)?, f.get(9)?);
                    let local_port = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
                    (local_port == port && *state == LISTEN).then(|| format!("socket:[{inode}]"))
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `pid` and every process below it.
fn process_tree(pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut i = 0;
    while let Some(&p) = tree.get(i) {
        let tasks = std::fs::read_dir(format!("/proc/{p}/task"))
            .into_iter()
            .flatten()
            .flatten();
        for task in tasks {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            tree.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
        i += 1;
    }
    tree
}

fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let code = resp.get(9..12)?.parse().ok()?;
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((code, body))
}

impl Drop for TestNode {
    fn drop(&mut self) {
        self.kill_agent();
        if let Some(mut k) = self.kubelet.take() {
            let _ = k.kill();
            let _ = k.wait();
        }
        // Before the temp dir goes: a mount point cannot be removed.
        if self.run_dir_tmpfs {
            let _ = nix::mount::umount2(&self.path("run"), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}
