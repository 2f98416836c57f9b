//! "Why is (or isn't) this pod meshed?": one answer gathered from every part that decides it — the
//! watch cache, the enablement selectors, the annotation, the pod's namespace handle, its rules as
//! the kernel has them now, and the ztunnel connections. Served on `<CNI_AGENT_RUN_DIR>/debug.sock`
//! (root only) and printed by `install-cni explain <namespace>/<pod>`.

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
        )
    }
}

async fn handler(
    State(explainer): State<Arc<Explainer>>,
    Path((namespace, name)): Path<(String, String)>,
) -> axum::Json<Explanation> {
    axum::Json(explainer.explain(&namespace, &name).await)
}

pub fn router(explainer: Arc<Explainer>) -> Router {
    Router::new()
        .route("/explain/{namespace}/{name}", get(handler))
        .with_state(explainer)
}

/// Client side, for `install-cni explain`: asks the running agent over `debug.sock`.
pub async fn query(
    socket: &std::path::Path,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Explanation> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the agent at {}: {e}", socket.display()))?;
    let req = format!(
        "GET /explain/{namespace}/{name} HTTP/1.1\r\nHost: unix\r\nConnection: close\r\n\r\n"
    );
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
    Ok(serde_json::from_str(body)?)
}
