//! "Why is (or isn't) this pod meshed?": one answer gathered from every part that decides it — the
//! watch cache, the enablement selectors, the annotation, the pod's namespace handle, its rules as
//! the kernel has them now, and the ztunnel connections. Served on `<CNI_AGENT_RUN_DIR>/debug.sock`
//! (root only) and printed by `install-cni explain <namespace>/<pod>`, or for every pod the agent
//! watches on this node by `install-cni explain --node`; `-o json` prints the same as JSON.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::routing::get;
use serde::{Deserialize, Serialize};

use cni_core::reconcile::{Redirection, Scope, eligibility};
use dataplane::inpod::RuleState;

use super::cluster::{SharedCache, facts};
use super::mesh::Mesh;
use super::reconciler::Policy;
use crate::zds::ZdsHandle;

pub struct Explainer {
    pub cache: SharedCache,
    pub mesh: Arc<Mesh>,
    pub policy: Arc<Policy>,
    pub zds: ZdsHandle,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Explanation {
    pub pod: String,
    pub meshed: bool,
    /// Why not, when `meshed` is false; each entry one missing condition.
    pub blockers: Vec<String>,
    pub uid: Option<String>,
    pub selection: String,
    pub annotation: Option<String>,
    pub netns: Option<String>,
    pub backend: String,
    pub rules: String,
    pub ztunnels_connected: usize,
    pub ztunnels_synced: usize,
    /// Why the pod's last add failed, while it keeps failing. Absent from an older agent.
    #[serde(default)]
    pub last_error: Option<String>,
}

/// `install-cni explain --node`: every pod the agent watches on this node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeExplanation {
    pub backend: String,
    pub ztunnels_connected: usize,
    pub ztunnels_synced: usize,
    /// By namespace, then name.
    pub pods: Vec<Explanation>,
}

impl Explainer {
    pub async fn explain(&self, namespace: &str, name: &str) -> Explanation {
        let key = (namespace.to_string(), name.to_string());
        let (pod, labels) = {
            let c = self.cache.read().unwrap();
            (
                c.pods.get(&key).cloned(),
                c.namespaces.get(namespace).cloned(),
            )
        };
        let mut e = Explanation {
            pod: format!("{namespace}/{name}"),
            meshed: false,
            blockers: Vec::new(),
            uid: None,
            selection: String::new(),
            annotation: None,
            netns: None,
            backend: self.mesh.rules.backend().to_string(),
            rules: "unknown".into(),
            ztunnels_connected: self.zds.connected(),
            ztunnels_synced: self.zds.synced(),
            last_error: None,
        };
        let Some(pod) = pod else {
            e.selection =
                "not known to this node's agent (not scheduled here, or not created yet)".into();
            e.blockers
                .push("the agent's pod watch has not seen this pod on this node".into());
            return e;
        };
        let f = facts(&pod);
        let labels = labels.unwrap_or_default();
        let scope = Scope {
            selectors: &self.policy.selectors,
            namespace_labels: &labels,
            excluded: self.policy.exclude_namespaces.contains(namespace),
        };
        let why = eligibility(&f.view, &scope);
        e.selection = why.to_string();
        e.uid = pod.metadata.uid.clone();
        e.last_error = e.uid.as_deref().and_then(|u| self.mesh.last_errors.get(u));
        e.annotation = f.redirection().value().map(str::to_string);
        if !why.is_selected() {
            e.blockers.push(format!("not selected: {why}"));
        }
        if f.redirection() != Redirection::Enabled {
            e.blockers.push(format!(
                "annotation ambient.istio.io/redirection is {}",
                e.annotation
                    .as_deref()
                    .map_or("absent".to_string(), |a| format!("{a:?}"))
            ));
        }
        let netns = e
            .uid
            .as_deref()
            .and_then(|uid| self.mesh.cache.get(uid))
            .and_then(|entry| entry.netns);
        match netns {
            None => {
                e.rules =
                    "not checked: the pod's network namespace is not held by the agent".into();
                e.blockers
                    .push("the agent holds no network namespace for this pod".into());
            }
            Some(ns) => {
                e.netns = Some(ns.id().to_string());
                let cfg = self
                    .mesh
                    .pod_config(&pod)
                    .unwrap_or_else(|_| self.mesh.global.clone());
                let rules = self.mesh.rules.clone();
                let state = tokio::task::spawn_blocking(move || rules.verify(&ns, &cfg)).await;
                e.rules = match state {
                    Ok(Ok(RuleState::InSync)) => "in sync".into(),
                    Ok(Ok(RuleState::Absent)) => {
                        e.blockers.push("no redirection rules in the pod".into());
                        "absent".into()
                    }
                    Ok(Ok(RuleState::Drifted(d))) => {
                        e.blockers
                            .push("the pod's rules drifted from the desired state".into());
                        format!("drifted:\n{d}")
                    }
                    Ok(Err(err)) => format!("cannot verify: {err}"),
                    Err(err) => format!("cannot verify: {err}"),
                };
            }
        }
        if e.ztunnels_synced == 0 {
            e.blockers.push("no ztunnel is connected and synced".into());
        }
        e.meshed = e.blockers.is_empty();
        e
    }

    /// Every pod in the watch cache, one after the other (each check enters the pod's netns).
    pub async fn explain_node(&self) -> NodeExplanation {
        let mut keys: Vec<_> = self.cache.read().unwrap().pods.keys().cloned().collect();
        keys.sort();
        let mut pods = Vec::with_capacity(keys.len());
        for (namespace, name) in keys {
            pods.push(self.explain(&namespace, &name).await);
        }
        NodeExplanation {
            backend: self.mesh.rules.backend().to_string(),
            ztunnels_connected: self.zds.connected(),
            ztunnels_synced: self.zds.synced(),
            pods,
        }
    }
}

impl std::fmt::Display for Explanation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "pod:         {}", self.pod)?;
        writeln!(f, "meshed:      {}", if self.meshed { "yes" } else { "NO" })?;
        for b in &self.blockers {
            writeln!(f, "  because    {b}")?;
        }
        writeln!(f, "uid:         {}", self.uid.as_deref().unwrap_or("-"))?;
        writeln!(f, "selection:   {}", self.selection)?;
        writeln!(
            f,
            "annotation:  {}",
            self.annotation.as_deref().unwrap_or("-")
        )?;
        writeln!(f, "netns:       {}", self.netns.as_deref().unwrap_or("-"))?;
        writeln!(f, "backend:     {}", self.backend)?;
        writeln!(f, "rules:       {}", self.rules)?;
        writeln!(
            f,
            "ztunnel:     {} connected, {} synced",
            self.ztunnels_connected, self.ztunnels_synced
        )?;
        writeln!(
            f,
            "last error:  {}",
            self.last_error.as_deref().unwrap_or("-")
        )
    }
}

/// One line per pod: whether it is meshed, the first reason it is not, its last add error.
impl std::fmt::Display for NodeExplanation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "backend: {}  ztunnel: {} connected, {} synced  pods: {}",
            self.backend,
            self.ztunnels_connected,
            self.ztunnels_synced,
            self.pods.len()
        )?;
        let width = self
            .pods
            .iter()
            .map(|p| p.pod.len())
            .max()
            .unwrap_or(0)
            .max(3);
        writeln!(f, "{:width$}  MESHED  WHY NOT / LAST ERROR", "POD")?;
        for p in &self.pods {
            let meshed = if p.meshed { "yes" } else { "NO" };
            let why = match (p.blockers.first(), &p.last_error) {
                (_, Some(err)) => format!("last error: {err}"),
                (Some(b), None) => b.clone(),
                (None, None) => "-".into(),
            };
            writeln!(f, "{:width$}  {meshed:6}  {why}", p.pod)?;
        }
        Ok(())
    }
}

async fn handler(
    State(explainer): State<Arc<Explainer>>,
    Path((namespace, name)): Path<(String, String)>,
) -> axum::Json<Explanation> {
    axum::Json(explainer.explain(&namespace, &name).await)
}

async fn node_handler(State(explainer): State<Arc<Explainer>>) -> axum::Json<NodeExplanation> {
    axum::Json(explainer.explain_node().await)
}

pub fn router(explainer: Arc<Explainer>) -> Router {
    Router::new()
        .route("/explain", get(node_handler))
        .route("/explain/{namespace}/{name}", get(handler))
        .with_state(explainer)
}

/// What `install-cni explain` asks about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// `<namespace>/<pod>`.
    Pod { namespace: String, name: String },
    /// Every pod the agent watches on this node.
    Node,
}

impl Subject {
    /// `<namespace>/<pod>`, or the node; a malformed pod name is an error naming it.
    pub fn new(pod: Option<&str>, node: bool) -> anyhow::Result<Subject> {
        match (pod, node) {
            (None, true) => Ok(Subject::Node),
            (Some(pod), false) => {
                // Kubernetes names; anything else could not be a pod and would break the request.
                let k8s_name = |n: &str| {
                    !n.is_empty()
                        && n.bytes().all(|b| {
                            b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b)
                        })
                };
                match pod.split_once('/') {
                    Some((ns, name)) if k8s_name(ns) && k8s_name(name) => Ok(Subject::Pod {
                        namespace: ns.into(),
                        name: name.into(),
                    }),
                    _ => anyhow::bail!("expected <namespace>/<pod>, got {pod:?}"),
                }
            }
            _ => anyhow::bail!("explain takes <namespace>/<pod> or --node"),
        }
    }
}

/// Client side, for `install-cni explain`: the running agent's answer over `debug.sock`, as
/// text or (`json`) as the JSON the agent sent.
pub async fn explain(
    socket: &std::path::Path,
    subject: &Subject,
    json: bool,
) -> anyhow::Result<String> {
    let path = match subject {
        Subject::Pod { namespace, name } => format!("/explain/{namespace}/{name}"),
        Subject::Node => "/explain".into(),
    };
    let body = query(socket, &path).await?;
    let text = match subject {
        Subject::Pod { .. } => render::<Explanation>(&body, json)?,
        Subject::Node => render::<NodeExplanation>(&body, json)?,
    };
    Ok(text)
}

fn render<T>(body: &str, json: bool) -> anyhow::Result<String>
where
    T: serde::de::DeserializeOwned + Serialize + std::fmt::Display,
{
    let answer: T = serde_json::from_str(body)?;
    Ok(if json {
        format!("{}\n", serde_json::to_string_pretty(&answer)?)
    } else {
        answer.to_string()
    })
}

async fn query(socket: &std::path::Path, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the agent at {}: {e}", socket.display()))?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: unix\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await?;
    let mut resp = Vec::new();
    stream.read_to_end(&mut resp).await?;
    let text = String::from_utf8_lossy(&resp);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("malformed answer"))?;
    anyhow::ensure!(
        head.starts_with("HTTP/1.1 200"),
        "agent answered: {}",
        head.lines().next().unwrap_or("")
    );
    Ok(body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, meshed: bool, last_error: Option<&str>) -> Explanation {
        Explanation {
            pod: name.into(),
            meshed,
            blockers: if meshed {
                vec![]
            } else {
                vec!["annotation ambient.istio.io/redirection is absent".into()]
            },
            uid: Some("u1".into()),
            selection: "selected".into(),
            annotation: None,
            netns: None,
            backend: "nftables".into(),
            rules: "in sync".into(),
            ztunnels_connected: 1,
            ztunnels_synced: 1,
            last_error: last_error.map(Into::into),
        }
    }

    #[test]
    fn subjects() {
        assert_eq!(
            Subject::new(Some("default/web-0"), false).unwrap(),
            Subject::Pod {
                namespace: "default".into(),
                name: "web-0".into()
            }
        );
        assert_eq!(Subject::new(None, true).unwrap(), Subject::Node);
        for bad in [
            "web-0",
            "default/",
            "/web-0",
            "a/b/c",
            "default/web 0",
            "Default/web",
        ] {
            let err = Subject::new(Some(bad), false).unwrap_err().to_string();
            assert_eq!(err, format!("expected <namespace>/<pod>, got {bad:?}"));
        }
    }

    #[test]
    fn a_node_is_one_line_per_pod() {
        let node = NodeExplanation {
            backend: "nftables".into(),
            ztunnels_connected: 1,
            ztunnels_synced: 0,
            pods: vec![
                pod("default/web-0", true, None),
                pod("default/web-1", false, None),
                pod(
                    "shop/cart-7",
                    false,
                    Some("ztunnel did not accept pod shop/cart-7: timeout"),
                ),
            ],
        };
        assert_eq!(
            node.to_string(),
            "backend: nftables  ztunnel: 1 connected, 0 synced  pods: 3\n\
             POD            MESHED  WHY NOT / LAST ERROR\n\
             default/web-0  yes     -\n\
             default/web-1  NO      annotation ambient.istio.io/redirection is absent\n\
             shop/cart-7    NO      last error: ztunnel did not accept pod shop/cart-7: timeout\n"
        );
    }

    /// The client against a real socket: text by default, the agent's JSON with `-o json`, and
    /// an answer from an agent without `last_error` still reads.
    #[tokio::test]
    async fn the_client_prints_text_or_json() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("debug.sock");
        let mut old = serde_json::to_value(pod("default/web-0", true, None)).unwrap();
        old.as_object_mut().unwrap().remove("last_error");
        let node = NodeExplanation {
            backend: "iptables".into(),
            ztunnels_connected: 1,
            ztunnels_synced: 1,
            pods: vec![pod("default/web-0", false, Some("boom"))],
        };
        let node_json = serde_json::to_value(&node).unwrap();
        let app = Router::new()
            .route(
                "/explain",
                get(move || async move { axum::Json(node_json) }),
            )
            .route(
                "/explain/{namespace}/{name}",
                get(move || async move { axum::Json(old) }),
            );
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });

        let one = Subject::new(Some("default/web-0"), false).unwrap();
        let text = explain(&socket, &one, false).await.unwrap();
        assert!(text.contains("meshed:      yes\n"), "{text}");
        assert!(text.ends_with("last error:  -\n"), "{text}");
        let json: Explanation =
            serde_json::from_str(&explain(&socket, &one, true).await.unwrap()).unwrap();
        assert_eq!(json, pod("default/web-0", true, None));

        let text = explain(&socket, &Subject::Node, false).await.unwrap();
        assert_eq!(text, node.to_string());
        let json: NodeExplanation =
            serde_json::from_str(&explain(&socket, &Subject::Node, true).await.unwrap()).unwrap();
        assert_eq!(json, node);

        let gone = dir.path().join("none.sock");
        let err = explain(&gone, &Subject::Node, false).await.unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("cannot reach the agent at {}", gone.display()))
        );
    }
}
