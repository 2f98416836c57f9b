//! Istio's own mesh around our agent on the real node (`scripts/real-node mesh`): istiod built
//! from the pinned Istio and installed with Istio's own `base` and `istiod` charts (profile
//! ambient), our chart in place of Istio's `cni` chart, and as ztunnel our ZDS test peer or the
//! real ztunnel from Istio's `ztunnel` chart (certificates and workloads from istiod).
//!
//! [`Mesh::up`] brings up a [`RealNode`] with the default images, imports the pilot image of
//! [`mesh_images_dir`] and runs `scripts/real-node mesh install`, the same install a user gets
//! from `scripts/real-node mesh up`. istiod's view of the mesh is read from its own debug endpoint
//! (`/debug/ambientz` on its `:8080`, with a token of istiod's service account: istiod serves
//! its debug endpoints over HTTP only to its own namespace or to loopback).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use dataplane::netns::Netns;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::Value;

use crate::real_node::RealNode;

/// Where Istio's components and ours live.
pub const SYSTEM_NAMESPACE: &str = "istio-system";
/// istiod's HTTP port (readiness and, with `ENABLE_DEBUG_ON_HTTP`, the debug endpoints).
pub const ISTIOD_HTTP_PORT: u16 = 8080;
/// The agent's metrics port on the node's network (`MONITORING_PORT`).
pub const AGENT_METRICS_PORT: u16 = 15014;
/// The ambient namespace label, and its opt-out value on a pod.
pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The images the mesh adds to the node's default ones: `$MESH_IMAGES` if set, else built once
/// per test process with `scripts/node-images build target/istiod-image pilot proxyv2` (istiod
/// and the sidecar image its injector names, from the pin in tools/istio: a first build takes
/// many minutes; cached afterwards).
pub fn mesh_images_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("MESH_IMAGES") {
            return dir.into();
        }
        let out = repo().join("target/istiod-image");
        let script = repo().join("scripts/node-images");
        let status = Command::new(&script)
            .arg("build")
            .arg(&out)
            .args(["pilot", "proxyv2"])
            .stdout(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            status.success(),
            "{} build {} pilot proxyv2 failed",
            script.display(),
            out.display()
        );
        out
    })
    .clone()
}

/// A workload as istiod describes it in `/debug/ambientz`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IstiodWorkload {
    pub uid: String,
    /// `HBONE` for a pod istiod considers captured by ztunnel, else `NONE`.
    pub tunnel_protocol: String,
    pub service_account: String,
    pub addresses: Vec<std::net::IpAddr>,
}

/// An address of `/debug/ambientz`: its raw bytes in base64.
fn decode_ip(b64: &str) -> Option<std::net::IpAddr> {
    use base64::Engine;
    let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    // istiod turned the 4 or 16 bytes into text already where it could; decode either.
    match std::str::from_utf8(&raw).ok().and_then(|t| t.parse().ok()) {
        Some(ip) => Some(ip),
        None => match raw.len() {
            4 => Some(std::net::IpAddr::from(<[u8; 4]>::try_from(raw).ok()?)),
            16 => Some(std::net::IpAddr::from(<[u8; 16]>::try_from(raw).ok()?)),
            _ => None,
        },
    }
}

pub struct Mesh {
    pub node: RealNode,
    /// Whether ztunnel is Istio's (chart + image from `ZTUNNEL_BIN`) rather than our peer.
    pub ztunnel: bool,
    token: Mutex<Option<String>>,
    /// The pod IP of the istiod that last answered.
    istiod: Mutex<Option<String>>,
    /// Held open for the process's life (see [`down_when_this_process_exits`]).
    _watchdog: std::process::ChildStdin,
}

impl Mesh {
    /// A node with the mesh installed: [`RealNode::up`], the mesh's images imported, then
    /// `scripts/real-node mesh install` (with `--ztunnel` when `ztunnel`), which returns once
    /// istiod, our agent and ztunnel are rolled out.
    ///
    /// The node is also torn down when this process exits, however it exits: a mesh shared by a
    /// test binary's tests lives in a static, which is never dropped.
    pub async fn up(ztunnel: bool) -> Mesh {
        let mut mesh = Mesh::bare(ztunnel).await;
        mesh.install().await;
        mesh
    }

    /// A node ready for the mesh but without it: [`RealNode::up`] and the mesh's images imported,
    /// for a test that installs Istio its own way (`istioctl install`, the `ambient` chart).
    /// Torn down when this process exits, as with [`Mesh::up`].
    pub async fn bare(ztunnel: bool) -> Mesh {
        let node = RealNode::up().await;
        let watchdog = down_when_this_process_exits(node.dir());
        let sock = node.node(1).env().path("REAL_NODE_CONTAINERD_SOCK");
        let images = mesh_images_dir();
        let out = blocking(move || {
            Command::new(repo().join("scripts/node-images"))
                .arg("import")
                .arg(&sock)
                .arg(&images)
                .output()
                .expect("scripts/node-images")
        })
        .await;
        assert!(
            out.status.success(),
            "importing the mesh images failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Mesh {
            node,
            ztunnel,
            token: Mutex::new(None),
            istiod: Mutex::new(None),
            _watchdog: watchdog,
        }
    }

    /// `scripts/real-node mesh install [--ztunnel]` on this node (idempotent: helm upgrades).
    pub async fn install(&mut self) {
        let mut args = vec!["mesh", "install"];
        if self.ztunnel {
            args.push("--ztunnel");
        }
        let out = self.script_blocking(&args).await;
        assert!(
            out.status.success(),
            "scripts/real-node mesh install failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `scripts/real-node ARGS` for this node, off the async workers.
    pub async fn script_blocking(&self, args: &[&str]) -> std::process::Output {
        let dir = self.node.dir().to_path_buf();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        blocking(move || {
            Command::new(repo().join("scripts/real-node"))
                .args(&args)
                .env("REAL_NODE_DIR", &dir)
                .stdin(Stdio::null())
                .output()
                .expect("scripts/real-node")
        })
        .await
    }

    /// `GET path` on `ip:port` from inside the node's network namespace (HTTP/1.0, so the server
    /// closes after the body): status code and body.
    pub async fn http_get(
        &self,
        ip: &str,
        port: u16,
        path: &str,
        bearer: Option<&str>,
    ) -> std::io::Result<(u16, String)> {
        let netns = format!("/proc/{}/ns/net", self.node.holder_pid());
        let (ip, path) = (ip.to_string(), path.to_string());
        let auth = bearer
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        blocking(move || {
            let ns = Netns::open(&netns).map_err(std::io::Error::other)?;
            let addr: std::net::SocketAddr = format!("{ip}:{port}")
                .parse()
                .map_err(std::io::Error::other)?;
            let mut conn = ns
                .run(|| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)))
                .map_err(std::io::Error::other)??;
            conn.set_read_timeout(Some(Duration::from_secs(10)))?;
            write!(
                conn,
                "GET {path} HTTP/1.0\r\nHost: {ip}\r\n{auth}Accept: */*\r\n\r\n"
            )?;
            let mut raw = Vec::new();
            conn.read_to_end(&mut raw)?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
            let code = head
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .ok_or_else(|| std::io::Error::other(format!("not HTTP: {head:?}")))?;
            Ok((code, body.to_string()))
        })
        .await
    }

    /// The agent's `/metrics` (host network: the node's loopback).
    pub async fn agent_metrics(&self) -> String {
        self.http_get("127.0.0.1", AGENT_METRICS_PORT, "/metrics", None)
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// The IP of a running, ready istiod pod, if there is one.
    pub async fn istiod_ip(&self) -> Option<String> {
        let pods = Api::<Pod>::namespaced(self.node.client(), SYSTEM_NAMESPACE)
            .list(&ListParams::default().labels("app=istiod"))
            .await
            .ok()?;
        pods.items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && crate::real_node::running(p))
            .find_map(|p| p.status.as_ref()?.pod_ip.clone())
    }

    /// A token istiod accepts on its debug endpoints: its own service account's, audience
    /// `istio-ca` (what its Kubernetes JWT authenticator asks for).
    fn token(&self) -> String {
        let mut cached = self.token.lock().unwrap();
        cached
            .get_or_insert_with(|| {
                self.node
                    .kubectl(&[
                        "-n",
                        SYSTEM_NAMESPACE,
                        "create",
                        "token",
                        "istiod",
                        "--audience",
                        "istio-ca",
                        "--duration",
                        "2h",
                    ])
                    .trim()
                    .to_string()
            })
            .clone()
    }

    /// istiod's `/debug/ambientz`, if istiod is up and answers.
    pub async fn ambientz(&self) -> Option<Value> {
        // The last istiod that answered first; the API server's current one when it does not.
        let known = self.istiod.lock().unwrap().clone();
        if let Some(ip) = known
            && let Some(z) = self.ambientz_at(&ip).await
        {
            return Some(z);
        }
        let ip = self.istiod_ip().await?;
        *self.istiod.lock().unwrap() = Some(ip.clone());
        self.ambientz_at(&ip).await
    }

    async fn ambientz_at(&self, ip: &str) -> Option<Value> {
        let token = self.token();
        let (code, body) = self
            .http_get(ip, ISTIOD_HTTP_PORT, "/debug/ambientz", Some(&token))
            .await
            .ok()?;
        (code == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// istiod's workloads by (namespace, name), if istiod answers.
    pub async fn istiod_workloads(&self) -> Option<BTreeMap<(String, String), IstiodWorkload>> {
        let z = self.ambientz().await?;
        let list = z["workloads"].as_array().cloned().unwrap_or_default();
        Some(
            list.iter()
                .map(|w| {
                    let s = |k: &str| w[k].as_str().unwrap_or_default().to_string();
                    let key = (s("namespace"), s("name"));
                    let tunnel = w["tunnelProtocol"].as_str().unwrap_or("NONE").to_string();
                    // Raw address bytes, base64 in JSON (istiod's own comment says as much).
                    let addresses = w["addresses"]
                        .as_array()
                        .map(|a| a.iter().filter_map(|x| decode_ip(x.as_str()?)).collect())
                        .unwrap_or_default();
                    let wl = IstiodWorkload {
                        uid: s("uid"),
                        tunnel_protocol: tunnel,
                        service_account: s("serviceAccount"),
                        addresses,
                    };
                    (key, wl)
                })
                .collect(),
        )
    }

    /// istiod's HBONE workloads among `pods` (all of istiod's when `pods` is empty), once istiod
    /// answers.
    pub async fn istiod_hbone(
        &self,
        pods: &[(String, String)],
    ) -> Option<BTreeSet<(String, String)>> {
        let w = self.istiod_workloads().await?;
        Some(
            w.into_iter()
                .filter(|(k, w)| {
                    w.tunnel_protocol == "HBONE" && (pods.is_empty() || pods.contains(k))
                })
                .map(|(k, _)| k)
                .collect(),
        )
    }

    /// Every pod of the cluster our agent annotated `enabled` is HBONE in istiod's view, and
    /// istiod has no other HBONE workload (eventually: istiod follows the annotation within
    /// moments). Panics after 30 s naming both sets.
    pub async fn assert_istiod_agrees_with_the_agent(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let pods = Api::<Pod>::all(self.node.client())
                .list(&ListParams::default())
                .await
                .unwrap();
            let enrolled: BTreeSet<(String, String)> = pods
                .items
                .iter()
                .filter(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && crate::real_node::annotation(p, crate::real_node::REDIRECTION).as_deref()
                            == Some("enabled")
                })
                .map(|p| {
                    (
                        p.metadata.namespace.clone().unwrap_or_default(),
                        p.metadata.name.clone().unwrap_or_default(),
                    )
                })
                .collect();
            let hbone = self.istiod_hbone(&[]).await;
            if hbone.as_ref() == Some(&enrolled) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "istiod's HBONE workloads {hbone:?} are not the pods our agent enrolled {enrolled:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The ZDS peer's event log (`add <uid>`, `del <uid>`, ...), from its status file on the node.
    pub fn peer_log(&self) -> Vec<String> {
        self.node
            .peer_status()
            .and_then(|s| {
                s["log"].as_array().map(|l| {
                    l.iter()
                        .filter_map(|e| e.as_str().map(str::to_string))
                        .collect()
                })
            })
            .unwrap_or_default()
    }
}

/// A detached shell that runs `scripts/real-node down` for the node in `dir` once its stdin, held
/// only by this process, closes: when this process exits, also when it panics or is killed.
#[expect(
    clippy::zombie_processes,
    reason = "the watchdog outlives this process by design; init reaps it"
)]
fn down_when_this_process_exits(dir: &Path) -> std::process::ChildStdin {
    let mut child = Command::new("setsid")
        .args([
            "sh",
            "-c",
            "cat >/dev/null; exec \"$0\" down >/dev/null 2>&1",
        ])
        .arg(repo().join("scripts/real-node"))
        .env("REAL_NODE_DIR", dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the node's watchdog");
    child.stdin.take().expect("piped stdin")
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// The value of the first sample of `metric` whose line contains every one of `labels`.
pub fn sample(metrics: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(metric) && labels.iter().all(|want| l.contains(want)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Istio's `istioctl`, built from the pin (`tools/istio/build.sh istioctl`; cached).
pub fn istioctl() -> PathBuf {
    let out = Command::new(repo().join("tools/istio/build.sh"))
        .arg("istioctl")
        .stderr(Stdio::inherit())
        .output()
        .expect("tools/istio/build.sh");
    assert!(out.status.success(), "tools/istio/build.sh istioctl failed");
    let stdout = String::from_utf8(out.stdout).unwrap();
    PathBuf::from(stdout.lines().last().expect("the cache dir").trim()).join("istioctl")
}

/// Istio's `ambient` umbrella chart (`manifests/sample-charts/ambient` in the pinned module)
/// with its dependencies resolved from the module, without copying a file of it: a directory of
/// symbolic links, `ambient/{Chart.yaml,values.yaml}` to the module's and `ambient/charts/<name>`
/// to each sibling chart its `file://` dependencies name (helm loads a chart's `charts/` as its
/// resolved dependencies and follows the links). `helm dependency build` would write packaged
/// copies into the module's read-only directory instead. The chart is `<dir>/ambient`.
pub fn ambient_chart() -> tempfile::TempDir {
    let moddir = crate::migrate::istio_moddir();
    let umbrella = moddir.join("manifests/sample-charts/ambient");
    let chart: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(umbrella.join("Chart.yaml")).expect("the ambient chart"),
    )
    .expect("the ambient chart's Chart.yaml");
    let dir = tempfile::Builder::new()
        .prefix("istio-ambient-chart")
        .tempdir_in("/tmp")
        .unwrap();
    let top = dir.path().join("ambient");
    std::fs::create_dir_all(top.join("charts")).unwrap();
    for f in ["Chart.yaml", "values.yaml"] {
        std::os::unix::fs::symlink(umbrella.join(f), top.join(f)).unwrap();
    }
    for dep in chart["dependencies"].as_sequence().expect("dependencies") {
        let name = dep["name"].as_str().expect("a dependency's name");
        let repo = dep["repository"]
            .as_str()
            .expect("a dependency's repository");
        let rel = repo
            .strip_prefix("file://")
            .unwrap_or_else(|| panic!("dependency {name} is not a file:// chart: {repo}"));
        let target = umbrella.join(rel);
        assert!(
            target.join("Chart.yaml").is_file(),
            "dependency {name}: no chart at {}",
            target.display()
        );
        std::os::unix::fs::symlink(&target, top.join("charts").join(name)).unwrap();
    }
    dir
}
