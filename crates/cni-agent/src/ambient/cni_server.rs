//! The plugin's socket, `<CNI_AGENT_RUN_DIR>/pluginevent.sock`: Istio's `POST /cmdadd` (so Istio's
//! own plugin works against this agent) and our `POST /v1/cmdadd`, which also tells the plugin
//! what to do with pods that are not ambient, so the plugin never calls the API server while the
//! agent is up. Both answer success only once the pod is redirected and ztunnel acked it.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;

use cni_core::cmdadd::{CmdAddRequest, CmdAddResponse};
use cni_core::reconcile::{Eligibility, Scope, eligibility};

use super::cluster::{Annotator, CachedPod, Cluster, SharedCache, facts};
use super::mesh::Mesh;
use super::reconciler::Policy;
use crate::metrics::{ResponseCodeLabel, observe};
use cni_core::enroll::{CompiledSelectors, Labels};

pub struct CniServer {
    pub cache: SharedCache,
    pub mesh: Arc<Mesh>,
    pub policy: Arc<Policy>,
    pub annotator: Annotator,
}

/// The cache may lag the API server by a moment when a pod's sandbox is created right after the
/// pod; Istio meant to retry but never re-read (its QUIRK). We wait for the watch to deliver the
/// pod (woken by each cache update, not polling), then ask the API server directly.
const CACHE_WAIT: Duration = Duration::from_millis(100);

/// The pod of a CNI request and its namespace's labels: from the cache, waiting up to
/// [`CACHE_WAIT`] for the watch to deliver them, else from the API server (the pod then cached
/// as the watch would keep it, with the labels `selectors` read).
async fn find_pod(
    cache: &Cluster,
    api: &Annotator,
    selectors: &CompiledSelectors,
    namespace: &str,
    name: &str,
) -> Result<(Arc<CachedPod>, Labels), String> {
    let key = (namespace.to_string(), name.to_string());
    let started = tokio::time::Instant::now();
    let deadline = started + CACHE_WAIT;
    let mut waited = false;
    loop {
        let updated = cache.updated();
        let found = {
            let c = cache.read().unwrap();
            c.pods
                .get(&key)
                .cloned()
                .zip(c.namespaces.get(namespace).cloned())
        };
        if let Some(found) = found {
            if waited {
                tracing::debug!(pod = %format!("{namespace}/{name}"), waited = ?started.elapsed(), "pod reached the cache after its CNI ADD");
            }
            return Ok(found);
        }
        if tokio::time::timeout_at(deadline, updated).await.is_err() {
            break;
        }
        waited = true;
    }
    let pod = api
        .get_pod(namespace, name)
        .await
        .map_err(|e| format!("failed to get pod {namespace}/{name}: {e}"))?
        .ok_or_else(|| format!("failed to get pod {namespace}/{name}: not found"))?;
    let labels = api
        .get_namespace_labels(namespace)
        .await
        .map_err(|e| format!("failed to get namespace {namespace}: {e}"))?
        .ok_or_else(|| format!("failed to get namespace {namespace}: not found"))?;
    // Into the cache unless the watch got there first: a pod the watch never delivered (it was
    // down) and that is deleted before it recovers would otherwise be missing from both the
    // cache and the relist, and its removal from the mesh would never happen.
    let pod = cache.insert_if_absent(Arc::new(CachedPod::new(pod, &selectors.pod_keys())));
    Ok((pod, labels))
}

impl CniServer {
    async fn lookup(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<(Arc<CachedPod>, Eligibility), String> {
        let (pod, labels) = find_pod(
            &self.cache,
            &self.annotator,
            &self.policy.selectors,
            namespace,
            name,
        )
        .await?;
        let scope = Scope {
            selectors: &self.policy.selectors,
            namespace_labels: &labels,
            excluded: self.policy.exclude_namespaces.contains(namespace),
        };
        let why = eligibility(&facts(&pod).view, &scope);
        Ok((pod, why))
    }

    async fn enroll(&self, pod: &CachedPod, req: &CmdAddRequest) -> Result<(), String> {
        let ips: Vec<IpAddr> = req
            .ips
            .iter()
            .map(|c| c.address.addr().to_canonical())
            .collect();
        self.mesh
            .add(pod, &ips, Some(&req.netns))
            .await
            .map_err(|e| e.to_string())
    }

    fn count(&self, code: StatusCode, started: Instant) {
        let label = ResponseCodeLabel {
            response_code: code.as_u16().to_string(),
        };
        self.mesh
            .metrics
            .plugin_requests
            .get_or_create(&label)
            .inc();
        observe(&self.mesh.metrics.cni_add_seconds, started.elapsed());
    }
}

fn parse(body: &[u8]) -> Result<CmdAddRequest, String> {
    if body.is_empty() {
        return Err("empty request body".into());
    }
    CmdAddRequest::from_json(body).map_err(|e| e.to_string())
}

fn bad_request(msg: String) -> Response {
    (StatusCode::BAD_REQUEST, format!("{msg}\n")).into_response()
}

fn internal(msg: String) -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, format!("{msg}\n")).into_response()
}

/// Istio's endpoint: 200 with an empty body once enrolled; 500 with the reason otherwise.
async fn istio_cmdadd(State(s): State<Arc<CniServer>>, body: Bytes) -> Response {
    let started = Instant::now();
    let resp = match parse(&body) {
        Err(e) => bad_request(e),
        Ok(req) => match s.lookup(&req.pod_namespace, &req.pod_name).await {
            Err(e) => internal(e),
            Ok((_, why)) if !why.is_selected() => internal(format!(
                "pod {}/{} is unexpectedly not eligible for ambient enrollment: {why}",
                req.pod_namespace, req.pod_name
            )),
            Ok((pod, _)) => match s.enroll(&pod, &req).await {
                Ok(()) => StatusCode::OK.into_response(),
                Err(e) => internal(e),
            },
        },
    };
    s.count(resp.status(), started);
    resp
}

/// Our endpoint: the decision for any pod, enrolling it when it is ambient.
async fn v1_cmdadd(State(s): State<Arc<CniServer>>, body: Bytes) -> Response {
    let started = Instant::now();
    let resp = match parse(&body) {
        Err(e) => bad_request(e),
        Ok(req) => match s.lookup(&req.pod_namespace, &req.pod_name).await {
            Err(e) => internal(e),
            Ok((pod, why)) => {
                // Remembered for every pod, so a later namespace label enrolls it without a
                // /proc scan (see `hints`); enrolling records it itself.
                if !why.is_selected()
                    && let Some(uid) = &pod.metadata.uid
                {
                    s.mesh.hints.record(uid, &req.netns);
                }
                let decision = match why {
                    Eligibility::Selected => match s.enroll(&pod, &req).await {
                        Ok(()) => Ok(CmdAddResponse::Enrolled),
                        Err(e) => Err(e),
                    },
                    // Kept whole by the same annotation that makes it a sidecar pod.
                    Eligibility::SidecarPod => pod
                        .sidecar_pod()
                        .map(|whole| CmdAddResponse::Sidecar {
                            pod: serde_json::to_value(whole).unwrap_or_default(),
                        })
                        .ok_or_else(|| {
                            format!(
                                "sidecar pod {}/{} was not cached whole",
                                req.pod_namespace, req.pod_name
                            )
                        }),
                    other => Ok(CmdAddResponse::NotAmbient {
                        reason: other.to_string(),
                    }),
                };
                match decision {
                    Ok(d) => axum::Json(d).into_response(),
                    Err(e) => internal(e),
                }
            }
        },
    };
    s.count(resp.status(), started);
    resp
}

pub fn router(server: Arc<CniServer>) -> Router {
    Router::new()
        .route("/cmdadd", post(istio_cmdadd))
        .route("/v1/cmdadd", post(v1_cmdadd))
        .with_state(server)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ambient::watched::WirePod;

    fn selectors() -> CompiledSelectors {
        CompiledSelectors::compile(&cni_core::enroll::default_selectors()).unwrap()
    }

    fn pod(namespace: &str, name: &str) -> Arc<CachedPod> {
        let pod: WirePod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": namespace, "name": name, "uid": "u1"}
        }))
        .unwrap();
        Arc::new(CachedPod::new(pod, &Default::default()))
    }

    /// An API client that can never answer: a lookup that succeeds did not use it.
    fn unreachable_api() -> Annotator {
        let cfg = kube::Config::new("http://127.0.0.1:1".parse().unwrap());
        Annotator::new(kube::Client::try_from(cfg).unwrap())
    }

    #[tokio::test]
    async fn a_pod_the_watch_delivers_late_is_found_in_the_cache() {
        let cache = Arc::new(Cluster::default());
        cache.upsert_namespace("apps".into(), Labels::new());
        let writer = cache.clone();
        // On this single-threaded runtime the writer first runs when find_pod has missed the
        // cache and waits: the pods arrive late, and without a sleep racing the wait's deadline
        // on a loaded machine (the woken wait is polled before its timer).
        tokio::spawn(async move {
            writer.upsert_pod(pod("apps", "other"));
            writer.upsert_pod(pod("apps", "web"));
        });
        // The API server here can never answer, so success means the wait was woken by the
        // update (a wait that ran out asks the API server and fails).
        let (found, _) = find_pod(&cache, &unreachable_api(), &selectors(), "apps", "web")
            .await
            .unwrap();
        assert_eq!(found.metadata.name.as_deref(), Some("web"));
    }

    /// An API server answering the pod and namespace reads of [`find_pod`] for `apps/web`.
    fn api_with_pod() -> Annotator {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut c) = conn else { return };
                let mut buf = [0u8; 4096];
                let n = c.read(&mut buf).unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]);
                let body = if head.starts_with("GET /api/v1/namespaces/apps/pods/web") {
                    r#"{"apiVersion":"v1","kind":"Pod","metadata":{"namespace":"apps","name":"web","uid":"u1"}}"#
                } else {
                    r#"{"apiVersion":"meta.k8s.io/v1","kind":"PartialObjectMetadata","metadata":{"name":"apps"}}"#
                };
                let _ = write!(
                    c,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let cfg = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        Annotator::new(kube::Client::try_from(cfg).unwrap())
    }

    #[tokio::test]
    async fn a_pod_read_from_the_api_server_is_cached_for_the_watch_to_reconcile() {
        let cache = Arc::new(Cluster::default());
        let (found, _) = find_pod(&cache, &api_with_pod(), &selectors(), "apps", "web")
            .await
            .unwrap();
        assert_eq!(found.metadata.uid.as_deref(), Some("u1"));
        // Now in the cache: a relist that lacks it reports it deleted.
        let key = ("apps".to_string(), "web".to_string());
        assert!(cache.read().unwrap().pods.contains_key(&key));

        // A version the watch delivered meanwhile is not replaced by the read.
        let cache = Arc::new(Cluster::default());
        let mut newer = (*pod("apps", "web")).clone();
        newer.metadata.uid = Some("from-watch".into());
        cache.upsert_pod(Arc::new(newer));
        let got = cache.insert_if_absent(pod("apps", "web"));
        assert_eq!(got.metadata.uid.as_deref(), Some("from-watch"));
    }

    #[tokio::test]
    async fn a_pod_the_watch_never_delivers_is_asked_of_the_api_server() {
        let cache = Arc::new(Cluster::default());
        cache.upsert_namespace("apps".into(), Labels::new());
        let started = Instant::now();
        let err = find_pod(&cache, &unreachable_api(), &selectors(), "apps", "web")
            .await
            .unwrap_err();
        assert!(started.elapsed() >= CACHE_WAIT);
        assert!(err.starts_with("failed to get pod apps/web: "), "{err}");
    }
}
