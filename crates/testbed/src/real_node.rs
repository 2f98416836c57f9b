//! A real Kubernetes node for the real-node e2e suite: `scripts/real-node` (etcd, kube-apiserver,
//! controller-manager, scheduler, containerd + runc, kubelet) in a mount + network namespace of
//! its own, under a temporary directory, torn down (`scripts/real-node down`) on drop.
//!
//! The API server listens on loopback inside the node's network namespace; [`RealNode::client`]
//! reaches it through a forwarder on the test's loopback whose upstream sockets are created in
//! the node's namespace (the netns rule: a socket keeps the namespace it was made in).
//!
//! [`RealNode::up_nodes`] starts a cluster of several nodes (`scripts/real-node up --nodes N`):
//! node 1 runs the control plane, every node its own containerd, kubelet and kube-proxy in its
//! own namespaces. [`RealNode::node`] is a handle on one node for what is per node (files,
//! processes, pod network namespaces, the peer's status); `RealNode`'s own methods of that kind
//! are node 1's.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use dataplane::netns::Netns;

use crate::api_proxy::{ApiProxy, Connect};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::Value;

/// Our chart, and the real node's values file and peer DaemonSet for it.
pub const CHART: &str = "deploy/charts/istio-cni";
pub const VALUES: &str = "deploy/node/values-real-node.yaml";
pub const PEER: &str = "deploy/node/ztunnel-peer.yaml";
/// The real ztunnel's DaemonSet, for images that carry one (`ZTUNNEL_BIN`).
pub const ZTUNNEL: &str = "deploy/node/ztunnel.yaml";

/// The node's name in the cluster (`scripts/real-node`); node K > 1 is `real-node-K`.
pub const NODE_NAME: &str = "real-node";
/// The label every kubelet sets on its Node to the node's name (what a `nodeSelector` pins).
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// The node's primary CNI config, where the installer chains our plugin: the default bridge
/// primary's ([`RealNode::conflist`] for the node's own, whatever `REAL_NODE_PRIMARY` chose).
pub const CONFLIST: &str = "/etc/cni/net.d/10-bridge.conflist";
/// The peer's view as JSON, on the node (`deploy/node/ztunnel-peer.yaml`).
pub const PEER_STATUS: &str = "/run/ztunnel-peer/status.json";
/// The pod label that puts a namespace's pods in the ambient mesh.
pub const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");
/// The annotation the agent sets on the pods it redirected.
pub const REDIRECTION: &str = "ambient.istio.io/redirection";
/// The node's bridge gateway (its pod CIDR's first address), the [`WITNESS`]'s target.
pub const GATEWAY: &str = "10.244.0.1";
/// A witness pod's first act: connect to a closed port on the node (the bridge gateway,
/// [`GATEWAY`]; [`witness_script`] for another node's). Redirected, the connection lands on a
/// proxy listener in the pod and succeeds (`REDIRECTED`); unredirected it is refused (`DIRECT`).
pub const WITNESS: &str =
    "if nc -w 2 10.244.0.1 9 </dev/null; then echo REDIRECTED; else echo DIRECT; fi";

/// The [`WITNESS`] against the gateway `gateway` (a node's bridge address).
pub fn witness_script(gateway: &str) -> String {
    format!("if nc -w 2 {gateway} 9 </dev/null; then echo REDIRECTED; else echo DIRECT; fi")
}

/// An injected sidecar pod: Istio's status annotation and an `istio-proxy` container, which here
/// listens on the sidecar's outbound port 15001 where Envoy would. The app retries its witness
/// (against `gateway`, the node's bridge address) for a few seconds, as its proxy container
/// starts after it, then prints it and sleeps.
pub fn sidecar_pod(name: &str, gateway: &str) -> serde_json::Value {
    let retried = format!(
        "for i in 1 2 3 4 5 6 7 8 9 10; do nc -w 1 {gateway} 9 </dev/null && break; sleep 0.5; done; \
         {}; sleep 3600",
        witness_script(gateway)
    );
    let mut p = busybox_pod(name, &["sh", "-c", &retried]);
    p["metadata"]["annotations"] =
        serde_json::json!({"sidecar.istio.io/status": "{\"containers\":[\"istio-proxy\"]}"});
    p["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "name": "istio-proxy",
            "image": "localhost/istio-cni-rs/busybox:dev",
            "imagePullPolicy": "Never",
            "command": ["nc", "-ll", "-p", "15001", "-e", "true"]
        }));
    p
}

/// A busybox pod of the node's image whose one container `app` runs `command`.
pub fn busybox_pod(name: &str, command: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "app",
                "image": "localhost/istio-cni-rs/busybox:dev",
                "imagePullPolicy": "Never",
                "command": command
            }]
        }
    })
}

/// `pod` (a pod as JSON) pinned to node `node_name` by a `nodeSelector` on [`HOSTNAME_LABEL`].
pub fn on_node(mut pod: Value, node_name: &str) -> Value {
    pod["spec"]["nodeSelector"] = serde_json::json!({ HOSTNAME_LABEL: node_name });
    pod
}

/// A [`busybox_pod`] whose container runs the [`WITNESS`], then `then`.
pub fn witness_pod(name: &str, then: &str) -> serde_json::Value {
    busybox_pod(name, &["sh", "-c", &format!("{WITNESS}; {then}")])
}

/// Running with every container ready.
pub fn running(p: &Pod) -> bool {
    let st = p.status.as_ref();
    st.and_then(|s| s.phase.as_deref()) == Some("Running")
        && st
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|cs| cs.iter().all(|c| c.ready))
}

pub fn annotation(p: &Pod, key: &str) -> Option<String> {
    p.metadata.annotations.as_ref()?.get(key).cloned()
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// What `scripts/real-node env` prints for one node (`REAL_NODE_*=value` lines): the test bed's
/// only source for the script's layout (where the node's files, logs, certificates and cgroups
/// are, its name and addresses). A node that is not running has one too.
#[derive(Clone, Debug)]
pub struct NodeEnv(std::collections::BTreeMap<String, String>);

impl NodeEnv {
    /// Node `k`'s (1 is `real-node`) of the cluster in `dir`.
    pub fn read(dir: &Path, k: usize) -> Self {
        let k = k.to_string();
        let out = run_script(dir, &["--node", &k, "env"], &[]);
        assert!(
            out.status.success(),
            "scripts/real-node --node {k} env failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let vars = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        NodeEnv(vars)
    }

    /// The value of `name` (`REAL_NODE_...`); panics naming it if `env` printed none.
    pub fn get(&self, name: &str) -> &str {
        self.0
            .get(name)
            .unwrap_or_else(|| panic!("scripts/real-node env printed no {name}: {:?}", self.0))
    }

    /// [`NodeEnv::get`] as a path.
    pub fn path(&self, name: &str) -> PathBuf {
        PathBuf::from(self.get(name))
    }
}

pub struct RealNode {
    dir: tempfile::TempDir,
    images: PathBuf,
    /// How many nodes the cluster has (`scripts/real-node up --nodes`).
    nodes: usize,
    /// Extra environment of `scripts/real-node up` (its `REAL_NODE_*` knobs).
    up_env: Vec<(String, String)>,
    /// The node's network namespace, replaced at each start (a stopped node's is gone).
    netns: Arc<Mutex<Option<Netns>>>,
    /// `https://127.0.0.1:<port>` on the test's loopback, forwarded into the node.
    pub server: String,
    client: OnceLock<kube::Client>,
    forwarder: tokio::task::JoinHandle<()>,
    /// Every node's `scripts/real-node env`, node 1 first, read after the first start.
    envs: OnceLock<Vec<NodeEnv>>,
}

/// The node's images: `$REAL_NODE_IMAGES` if set (a directory of OCI archives), else built once per
/// test process with `scripts/node-images build`.
pub fn images_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("REAL_NODE_IMAGES") {
            return dir.into();
        }
        let out = repo().join("target/real-node-images");
        let script = repo().join("scripts/node-images");
        let status = Command::new(&script)
            .arg("build")
            .arg(&out)
            .stdout(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            status.success(),
            "{} build {} failed",
            script.display(),
            out.display()
        );
        out
    })
    .clone()
}

/// Runs `scripts/real-node` on the node in `dir`.
fn run_script(dir: &Path, args: &[&str], env: &[(String, String)]) -> Output {
    Command::new(repo().join("scripts/real-node"))
        .args(args)
        .env("REAL_NODE_DIR", dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output()
        .expect("scripts/real-node")
}

impl RealNode {
    /// Brings up a node with the images of [`images_dir`] imported, and waits until it is Ready.
    pub async fn up() -> Self {
        Self::up_with(&[]).await
    }

    /// [`RealNode::up`] with extra environment for `scripts/real-node up` (and every later
    /// start), e.g. `REAL_NODE_MAX_RESTART_BACKOFF`.
    pub async fn up_with(env: &[(&str, &str)]) -> Self {
        Self::up_cluster(1, env).await
    }

    /// A cluster of `n` nodes: node 1 (`real-node`, the control plane too) and workers
    /// `real-node-2`..`real-node-n`, each with its own containerd, kubelet and kube-proxy, pod
    /// traffic routed between them. Waits until every node is Ready.
    pub async fn up_nodes(n: usize) -> Self {
        Self::up_cluster(n, &[]).await
    }

    /// [`RealNode::up_nodes`] with extra environment for `scripts/real-node up`, e.g. the
    /// cluster's primary CNI (`REAL_NODE_PRIMARY`).
    pub async fn up_nodes_with(n: usize, env: &[(&str, &str)]) -> Self {
        Self::up_cluster(n, env).await
    }

    async fn up_cluster(nodes: usize, env: &[(&str, &str)]) -> Self {
        assert!(nodes >= 1, "a cluster has a node at least");
        let dir = tempfile::Builder::new()
            .prefix("real-node")
            .tempdir_in("/tmp")
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = format!("https://{}", listener.local_addr().unwrap());
        let netns = Arc::new(Mutex::new(None));
        let forwarder = tokio::spawn(forward(listener, netns.clone()));
        let node = RealNode {
            dir,
            images: images_dir(),
            nodes,
            up_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            netns,
            server,
            client: OnceLock::new(),
            forwarder,
            envs: OnceLock::new(),
        };
        node.start().await;
        node
    }

    /// The cluster's directory (`REAL_NODE_DIR`): what the test gives `scripts/real-node`; where
    /// each node keeps what is in it, `scripts/real-node env` says ([`Node::env`]).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Node `k` (1-based: 1 is `real-node`).
    pub fn node(&self, k: usize) -> Node<'_> {
        assert!(
            (1..=self.nodes).contains(&k),
            "node {k} of a cluster of {}",
            self.nodes
        );
        Node { real: self, k }
    }

    /// Every node, node 1 first.
    pub fn nodes(&self) -> Vec<Node<'_>> {
        (1..=self.nodes).map(|k| self.node(k)).collect()
    }

    /// Runs `scripts/real-node ARGS` for this node; panics with its output on failure.
    pub fn script(&self, args: &[&str]) -> String {
        let out = self.try_script(args);
        assert!(
            out.status.success(),
            "scripts/real-node {} failed ({}):\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    pub fn try_script(&self, args: &[&str]) -> Output {
        run_script(self.dir.path(), args, &[])
    }

    /// [`RealNode::try_script`] off the async workers, for the long-running commands.
    async fn try_script_blocking(&self, args: &[&str]) -> Output {
        let dir = self.dir.path().to_path_buf();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let env = self.up_env.clone();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run_script(&dir, &args, &env)
        })
        .await
        .unwrap()
    }

    /// kubectl as cluster admin inside the node.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let mut all = vec!["kubectl"];
        all.extend_from_slice(args);
        self.script(&all)
    }

    /// helm inside the node (give it absolute chart paths: it runs in the test's working directory).
    pub fn helm(&self, args: &[&str]) -> String {
        let mut all = vec!["helm"];
        all.extend_from_slice(args);
        self.script(&all)
    }

    /// A file as node 1 sees it (its /run, /etc and /opt are its own).
    pub fn read(&self, path: &str) -> Option<String> {
        self.node(1).read(path)
    }

    /// `127.0.0.1:port` of the test's loopback (a registry there) at the same address inside
    /// node 1, for its containerd's pulls and its helm: the node's network namespace has no route
    /// to the machine's loopback. Lasts until the returned forward is dropped.
    pub fn forward_loopback(&self, port: u16) -> crate::relay::LoopbackForward {
        let netns = self.netns.lock().unwrap();
        crate::relay::forward_loopback(netns.as_ref().expect("the node is running"), port)
    }

    /// Creates namespace `name`, in the ambient mesh or not.
    pub async fn namespace(&self, name: &str, ambient: bool) {
        let mut labels = std::collections::BTreeMap::new();
        if ambient {
            labels.insert(AMBIENT.0.to_string(), AMBIENT.1.to_string());
        }
        let ns: k8s_openapi::api::core::v1::Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": labels}
        }))
        .unwrap();
        kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(self.client())
            .create(&Default::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("cannot create namespace {name}: {e}"));
    }

    /// Node 1's init (its namespaces' holder) as the machine sees it.
    pub fn holder_pid(&self) -> u32 {
        self.node(1).holder_pid()
    }

    /// `path` inside node 1's mount namespace, as a path on the machine ([`Node::node_path`]).
    pub fn node_path(&self, path: &str) -> PathBuf {
        self.node(1).node_path(path)
    }

    /// The primary CNI's conflist on the node (`REAL_NODE_CONFLIST` of `scripts/real-node env`):
    /// [`CONFLIST`] for the default bridge, another file for another primary
    /// (`REAL_NODE_PRIMARY`, a cell of `scripts/matrix`).
    pub fn conflist(&self) -> String {
        self.node(1).env().get("REAL_NODE_CONFLIST").to_string()
    }

    /// Processes of node 1's pods ([`Node::pod_processes`]).
    pub fn pod_processes(&self, pattern: &str, comm: Option<&str>) -> Vec<u32> {
        self.node(1).pod_processes(pattern, comm)
    }

    /// Processes named `comm` in node 1's own mount namespace ([`Node::node_processes`]).
    pub fn node_processes(&self, comm: &str) -> Vec<u32> {
        self.node(1).node_processes(comm)
    }

    /// The network namespace of pod `uid`'s sandbox on node 1 ([`Node::pod_netns`]).
    pub fn pod_netns(&self, uid: &str) -> Option<PathBuf> {
        self.node(1).pod_netns(uid)
    }

    /// What a container on node 1 printed ([`Node::container_output`]).
    pub fn container_output(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        container: &str,
    ) -> Vec<String> {
        self.node(1).container_output(ns, name, uid, container)
    }

    /// The peer's status file on node 1 ([`Node::peer_status`]).
    pub fn peer_status(&self) -> Option<serde_json::Value> {
        self.node(1).peer_status()
    }

    /// `scripts/real-node up`: starts every component (again, after [`RealNode::stop`]).
    pub async fn start(&self) {
        let images = self.images.to_str().unwrap().to_string();
        let nodes = self.nodes.to_string();
        let mut args = vec!["up", "--images", &images];
        if self.nodes > 1 {
            args.extend(["--nodes", &nodes]);
        }
        let out = self.try_script_blocking(&args).await;
        assert!(
            out.status.success(),
            "scripts/real-node up failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.envs.get_or_init(|| {
            (1..=self.nodes)
                .map(|k| NodeEnv::read(self.dir.path(), k))
                .collect()
        });
        let ns = Netns::open(format!("/proc/{}/ns/net", self.holder_pid())).expect("node netns");
        *self.netns.lock().unwrap() = Some(ns);
    }

    /// Kills every process of the node and removes its mounts: with [`RealNode::start`], a reboot.
    pub fn stop(&self) {
        self.netns.lock().unwrap().take();
        self.script(&["stop"]);
    }

    /// Restarts one component of node 1 (`kubelet`, `containerd`, ...) and waits until it works
    /// again.
    pub async fn restart(&self, component: &str) {
        self.node(1).restart(component).await
    }

    /// A cluster-admin client (x509 `system:masters`), through the forwarder.
    pub fn client(&self) -> kube::Client {
        self.client
            .get_or_init(|| {
                use base64::Engine;
                let env = self.node(1).env();
                let b64 = |name: &str| {
                    base64::engine::general_purpose::STANDARD
                        .encode(std::fs::read(env.path(name)).unwrap())
                };
                let mut cfg = kube::Config::new(self.server.parse().unwrap());
                let ca = std::fs::read(env.path("REAL_NODE_CA")).unwrap();
                cfg.root_cert = Some(vec![super::kube::pem_to_der(&ca)]);
                cfg.auth_info.client_certificate_data = Some(b64("REAL_NODE_ADMIN_CERT"));
                cfg.auth_info.client_key_data = Some(b64("REAL_NODE_ADMIN_KEY").into());
                cfg.default_namespace = "default".into();
                kube::Client::try_from(cfg).expect("admin client")
            })
            .clone()
    }

    /// A fault-injecting proxy ([`ApiProxy`]) in front of the API server, for the node's own
    /// processes: it listens on node 1's IP (which the API server's certificate names) on a free
    /// port inside the node's network namespace, and passes each connection on to the API server
    /// there. Point the agent at it with [`RealNode::api_proxy_env`].
    pub fn api_proxy(&self) -> ApiProxy {
        let ip: std::net::Ipv4Addr = self.node(1).ip().parse().unwrap();
        let listener = {
            let netns = self.netns.lock().unwrap();
            let ns = netns.as_ref().expect("the node is running");
            ns.run(|| std::net::TcpListener::bind((ip, 0)))
                .expect("enter the node's netns")
                .expect("a free port on the node IP")
        };
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let netns = self.netns.clone();
        let connect: Connect = Arc::new(move || {
            let netns = netns.clone();
            Box::pin(async move { connect_inside(&netns).await })
        });
        let env = self.node(1).env();
        let ca = std::fs::read(env.path("REAL_NODE_CA")).expect("the node's CA");
        ApiProxy::serve(
            listener,
            &env.path("REAL_NODE_APISERVER_CERT"),
            &env.path("REAL_NODE_APISERVER_KEY"),
            &ca,
            API_SERVER.0.into(),
            connect,
        )
    }

    /// helm arguments that send the agent, and the plugin through the kubeconfig the agent
    /// writes for it, to `proxy` instead of the `kubernetes` Service (the in-cluster address
    /// kubelet gives every container, which the chart's `env` overrides).
    pub fn api_proxy_env(&self, proxy: &ApiProxy) -> Vec<String> {
        vec![
            "--set-string".into(),
            format!("env.KUBERNETES_SERVICE_HOST={}", self.node(1).ip()),
            "--set-string".into(),
            format!("env.KUBERNETES_SERVICE_PORT={}", proxy.port()),
        ]
    }

    /// Installs our chart with `deploy/node/values-real-node.yaml` (plus `extra` helm arguments)
    /// and the ztunnel-like peer of `deploy/node/ztunnel-peer.yaml`, and waits until both
    /// DaemonSets are rolled out.
    pub async fn install_chart(&self, extra: &[&str]) {
        self.install_chart_with(extra, PEER).await;
    }

    /// [`RealNode::install_chart`] with the ztunnel DaemonSet of manifest `ztunnel` ([`PEER`] or
    /// [`ZTUNNEL`]).
    pub async fn install_chart_with(&self, extra: &[&str], ztunnel: &str) {
        let path = |p: &str| repo().join(p).to_str().unwrap().to_string();
        let (chart, values) = (path(CHART), path(VALUES));
        let mut args = vec!["install", "istio-cni", &chart, "-n", "istio-system"];
        args.extend(["--create-namespace", "-f", &values]);
        args.extend_from_slice(extra);
        self.helm(&args);
        self.kubectl(&["apply", "-f", &path(ztunnel)]);
        self.rollout("istio-cni-node").await;
        self.rollout("ztunnel").await;
    }

    /// Whether the node's images include the real ztunnel (`ztunnel.tar`, built from `ZTUNNEL_BIN`).
    pub fn has_real_ztunnel(&self) -> bool {
        self.images.join("ztunnel.tar").is_file()
    }

    /// Waits until DaemonSet `ds` of istio-system is rolled out.
    pub async fn rollout(&self, ds: &str) {
        let ds = format!("ds/{ds}");
        self.eventually(&format!("{ds} rolled out"), Duration::from_secs(90), || {
            let out = self.try_script(&[
                "kubectl",
                "-n",
                "istio-system",
                "rollout",
                "status",
                &ds,
                "--timeout=2s",
            ]);
            async move { out.status.success().then_some(()) }
        })
        .await;
    }

    /// Waits until `check` returns `Some`, or panics after `timeout` naming `what`.
    pub async fn eventually<T, F, Fut>(&self, what: &str, timeout: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = check().await {
                return v;
            }
            if Instant::now() > deadline {
                panic!(
                    "{what}: not after {timeout:?}\n{}",
                    self.log_tails(&["kubelet", "containerd"])
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The last lines of node 1's components' logs, for failure messages.
    pub fn log_tails(&self, components: &[&str]) -> String {
        self.node(1).log_tails(components)
    }
}

/// One node of a [`RealNode`] cluster: what is per node (its directory, init, files, processes,
/// pods' network namespaces, the peer's status, its components). `From<&RealNode>` is node 1, so
/// helpers taking `impl Into<Node>` take either.
#[derive(Clone, Copy)]
pub struct Node<'a> {
    real: &'a RealNode,
    k: usize,
}

impl<'a> From<&'a RealNode> for Node<'a> {
    fn from(real: &'a RealNode) -> Self {
        real.node(1)
    }
}

impl<'a> Node<'a> {
    /// The cluster this node belongs to.
    pub fn cluster(&self) -> &'a RealNode {
        self.real
    }

    /// 1-based: 1 is `real-node`, the control-plane node.
    pub fn index(&self) -> usize {
        self.k
    }

    /// The node's `scripts/real-node env` (read once the cluster first started).
    pub fn env(&self) -> &'a NodeEnv {
        let envs = self.real.envs.get().expect("the cluster has started");
        &envs[self.k - 1]
    }

    /// The node's name in the cluster (its [`HOSTNAME_LABEL`]): `real-node`, `real-node-K`.
    pub fn name(&self) -> String {
        self.env().get("REAL_NODE_NAME").to_string()
    }

    /// The node IP: 10.240.0.(9+K).
    pub fn ip(&self) -> String {
        self.env().get("REAL_NODE_IP").to_string()
    }

    /// The node's pod CIDR: 10.244.(K-1).0/24.
    pub fn pod_cidr(&self) -> String {
        self.env().get("REAL_NODE_POD_CIDR").to_string()
    }

    /// Where kubelet writes the node's container logs (the node's `/var/log/pods`).
    pub fn pod_logs_dir(&self) -> PathBuf {
        self.env().path("REAL_NODE_POD_LOGS")
    }

    /// `args` for `scripts/real-node` on this node (`--node K` first, but for node 1).
    fn args<'b>(&self, k: &'b str, args: &[&'b str]) -> Vec<&'b str> {
        let mut all = Vec::with_capacity(args.len() + 2);
        if self.k != 1 {
            all.extend(["--node", k]);
        }
        all.extend_from_slice(args);
        all
    }

    /// `scripts/real-node ARGS` on this node (`exec`, `env`, ...).
    pub fn try_script(&self, args: &[&str]) -> Output {
        let k = self.k.to_string();
        self.real.try_script(&self.args(&k, args))
    }

    /// [`Node::try_script`]; panics with its output on failure.
    pub fn script(&self, args: &[&str]) -> String {
        let k = self.k.to_string();
        self.real.script(&self.args(&k, args))
    }

    /// A command inside the node (its namespaces, `KUBECONFIG` set); panics on failure.
    pub fn exec(&self, cmd: &[&str]) -> String {
        let mut all = vec!["exec"];
        all.extend_from_slice(cmd);
        self.script(&all)
    }

    /// A file as the node sees it (its /run, /etc and /opt are its own).
    pub fn read(&self, path: &str) -> Option<String> {
        let out = self.try_script(&["exec", "cat", path]);
        out.status
            .success()
            .then(|| String::from_utf8(out.stdout).unwrap())
    }

    /// Restarts one of the node's components (`kubelet`, `containerd`, `kube-proxy`; on node 1
    /// also the control plane's) and waits until it works again.
    pub async fn restart(&self, component: &str) {
        let k = self.k.to_string();
        let out = self
            .real
            .try_script_blocking(&self.args(&k, &["restart", component]))
            .await;
        assert!(
            out.status.success(),
            "restart of {component} on {} failed:\n{}",
            self.name(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The last lines of the node's components' logs, for failure messages.
    pub fn log_tails(&self, components: &[&str]) -> String {
        let mut s = String::new();
        for c in components {
            let logs = self.env().path("REAL_NODE_LOGS");
            let text = std::fs::read_to_string(logs.join(format!("{c}.log"))).unwrap_or_default();
            let lines: Vec<_> = text.lines().collect();
            s += &format!("--- {} {c}.log (last 15 lines)\n", self.name());
            for l in &lines[lines.len().saturating_sub(15)..] {
                s += l;
                s.push('\n');
            }
        }
        s
    }

    /// The node's init (its namespaces' holder) as the machine sees it.
    pub fn holder_pid(&self) -> u32 {
        let file = self.env().path("REAL_NODE_HOLDER_PID_FILE");
        let pid = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("the node is running ({}: {e})", file.display()));
        pid.trim().parse().expect("holder.pid holds a pid")
    }

    /// `path` inside the node's mount namespace, as a path on the machine (through its init's
    /// `/proc/<pid>/root`): for reads, writes and renames without a process per access. `path`
    /// must have no symlink in it (an absolute one would resolve on the machine): `/run/...`,
    /// not `/var/run/...`.
    pub fn node_path(&self, path: &str) -> PathBuf {
        let rel = path
            .strip_prefix('/')
            .expect("an absolute path on the node");
        PathBuf::from(format!("/proc/{}/root", self.holder_pid())).join(rel)
    }

    /// The parent of every pod cgroup of this node (`cgroupRoot` of its kubelet).
    fn cgroup_root(&self) -> &'a str {
        self.env().get("REAL_NODE_CGROUP_ROOT")
    }

    /// Processes of this node's pods (by their cgroups, so another node's never match) whose
    /// cgroup path contains `pattern` (e.g. `pod<uid>/`) and whose name is `comm`, if given.
    pub fn pod_processes(&self, pattern: &str, comm: Option<&str>) -> Vec<u32> {
        let root = format!("{}/kubepods", self.cgroup_root());
        processes(|pid| {
            let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            let ours = cg.lines().any(|l| l.contains(&root) && l.contains(pattern));
            ours && comm.is_none_or(|c| comm_of(pid).as_deref() == Some(c))
        })
    }

    /// Processes named `comm` in the node's own mount namespace (its components and what they
    /// run: containerd's CNI plugins), not in a container's.
    pub fn node_processes(&self, comm: &str) -> Vec<u32> {
        let mnt = std::fs::read_link(format!("/proc/{}/ns/mnt", self.holder_pid())).ok();
        processes(|pid| {
            comm_of(pid).as_deref() == Some(comm)
                && std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok() == mnt
        })
    }

    /// The network namespace of pod `uid`'s sandbox, as `/proc/<pid>/ns/net` of one of its
    /// processes (the sandbox's pause process or a container's).
    pub fn pod_netns(&self, uid: &str) -> Option<PathBuf> {
        let pid = *self.pod_processes(&format!("pod{uid}/"), None).first()?;
        Some(PathBuf::from(format!("/proc/{pid}/ns/net")))
    }

    /// Every line container `container` of pod `ns/name` (UID `uid`) printed, each of its runs
    /// in order, from kubelet's log files (`/var/log/pods`, the node's `var-log`).
    pub fn container_output(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        container: &str,
    ) -> Vec<String> {
        let dir = self
            .pod_logs_dir()
            .join(format!("{ns}_{name}_{uid}/{container}"));
        let mut runs: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let n = e
                    .file_name()
                    .to_string_lossy()
                    .strip_suffix(".log")?
                    .parse()
                    .ok()?;
                Some((n, e.path()))
            })
            .collect();
        runs.sort();
        // CRI log lines: `<time> stdout|stderr F|P <text>`.
        runs.iter()
            .flat_map(|(_, p)| {
                std::fs::read_to_string(p)
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| Some(l.splitn(4, ' ').nth(3)?.to_string()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The peer's status file (`deploy/node/ztunnel-peer.yaml`), if it wrote one.
    pub fn peer_status(&self) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(self.node_path(PEER_STATUS)).ok()?;
        serde_json::from_str(&text).ok()
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.forwarder.abort();
        let out = self.try_script(&["down"]);
        if !out.status.success() {
            eprintln!(
                "scripts/real-node down failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// Every process of the machine for which `keep` holds.
fn processes(keep: impl Fn(u32) -> bool) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|pid| keep(*pid))
        .collect()
}

fn comm_of(pid: u32) -> Option<String> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim_end().to_string())
}

/// The API server's address inside node 1 (its certificate names it).
const API_SERVER: (std::net::Ipv4Addr, u16) = (std::net::Ipv4Addr::LOCALHOST, 443);

/// A connection to the API server made inside the node's network namespace (the netns rule: a
/// socket keeps the namespace it was made in).
async fn connect_inside(netns: &Mutex<Option<Netns>>) -> std::io::Result<tokio::net::TcpStream> {
    let ns = netns
        .lock()
        .unwrap()
        .as_ref()
        .map(Netns::try_clone)
        .transpose()?
        .ok_or_else(|| std::io::Error::other("the node is not running"))?;
    let upstream =
        tokio::task::spawn_blocking(move || ns.run(|| std::net::TcpStream::connect(API_SERVER)))
            .await
            .map_err(std::io::Error::other)?
            .map_err(std::io::Error::other)??;
    upstream.set_nonblocking(true)?;
    tokio::net::TcpStream::from_std(upstream)
}

/// Accepts on the test's loopback and connects each client to the API server inside the node.
async fn forward(listener: tokio::net::TcpListener, netns: Arc<Mutex<Option<Netns>>>) {
    loop {
        let Ok((mut downstream, _)) = listener.accept().await else {
            return;
        };
        let netns = netns.clone();
        tokio::spawn(async move {
            let Ok(mut upstream) = connect_inside(&netns).await else {
                return;
            };
            let _ = tokio::io::copy_bidirectional(&mut downstream, &mut upstream).await;
        });
    }
}

/// Creates `pod` in `ns` through the API; its UID.
pub async fn create(node: &RealNode, ns: &str, pod: Value) -> String {
    let pod: Pod = serde_json::from_value(pod).unwrap();
    let created = Api::<Pod>::namespaced(node.client(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    created.metadata.uid.unwrap()
}

/// Pod `ns/name`, if it exists.
pub async fn get(node: &RealNode, ns: &str, name: &str) -> Option<Pod> {
    Api::<Pod>::namespaced(node.client(), ns)
        .get_opt(name)
        .await
        .unwrap()
}

/// Waits until pod `ns/name` runs and has its IP.
pub async fn wait_running(node: &RealNode, ns: &str, name: &str) -> Pod {
    node.eventually(
        &format!("pod {ns}/{name} Running"),
        Duration::from_secs(120),
        || async {
            get(node, ns, name)
                .await
                .filter(|p| running(p) && p.status.as_ref().unwrap().pod_ip.is_some())
        },
    )
    .await
}

/// Waits until pod `ns/name` carries the redirection annotation `want` (`None`: none).
pub async fn wait_redirection(node: &RealNode, ns: &str, name: &str, want: Option<&str>) {
    node.eventually(
        &format!("{ns}/{name} redirection {want:?}"),
        Duration::from_secs(60),
        || async {
            let p = get(node, ns, name).await?;
            (annotation(&p, REDIRECTION).as_deref() == want).then_some(())
        },
    )
    .await
}

/// What the current container of `name` printed first: `REDIRECTED` or `DIRECT`. A sidecar
/// pod's app retries for a while before it prints (see [`sidecar_pod`]), and a pod is Running
/// before that: its logs are read again until the line is there, for up to a minute.
pub fn witness(node: &RealNode, ns: &str, name: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let logs = node.kubectl(&["-n", ns, "logs", name, "-c", "app"]);
        if let Some(seen) = logs.lines().rfind(|l| *l == "REDIRECTED" || *l == "DIRECT") {
            return seen.to_string();
        }
        if Instant::now() > deadline {
            panic!("{ns}/{name} printed no witness: {logs:?}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Puts namespace `name` in the ambient mesh, or takes it out (the label removed).
pub async fn label_namespace(node: &RealNode, name: &str, ambient: bool) {
    let value = if ambient {
        serde_json::json!(AMBIENT.1)
    } else {
        Value::Null
    };
    let patch = serde_json::json!({"metadata": {"labels": {AMBIENT.0: value}}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(node.client())
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
}

/// Processes whose command line names `dir`: whatever a node there started.
pub fn processes_under(dir: &std::path::Path) -> Vec<String> {
    let needle = dir.to_str().unwrap().as_bytes();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let cmdline = std::fs::read(e.ok()?.path().join("cmdline")).ok()?;
            cmdline
                .windows(needle.len())
                .any(|w| w == needle)
                .then(|| String::from_utf8_lossy(&cmdline).replace('\0', " "))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_witness_is_the_script_against_the_gateway() {
        assert_eq!(super::WITNESS, super::witness_script(super::GATEWAY));
    }
}
