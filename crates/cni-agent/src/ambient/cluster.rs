//! The agent's view of the cluster: pods of this node and namespace labels, kept current by
//! kube-rs watchers, plus the one write the agent makes (the redirection annotation on
//! `pods/status`). Watch errors are retried with backoff by the watcher and logged, never dropped.

use std::collections::HashMap;
use std::sync::{Arc, LockResult, RwLock, RwLockReadGuard, RwLockWriteGuard};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, PodSpec, PodStatus};
use kube::api::{Api, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent, watcher};
use tokio::sync::futures::Notified;
use tokio::sync::{Notify, mpsc};

use cni_core::enroll::{Labels, PodView, SIDECAR_STATUS_ANNOTATION};
use cni_core::reconcile::{PodFacts, REDIRECTION_ANNOTATION, Redirection};

use crate::http::ReadyFlag;

/// `namespace/name`
pub type PodKey = (String, String);

pub fn pod_key(pod: &Pod) -> PodKey {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// Last seen pods of this node and labels of every namespace.
#[derive(Default)]
pub struct ClusterCache {
    pub pods: HashMap<PodKey, Arc<Pod>>,
    pub namespaces: HashMap<String, Labels>,
}

/// The cache, and a signal rung whenever a pod or namespace is added or changed, so a CNI ADD
/// that arrives before the watch delivered its pod wakes the moment it does.
#[derive(Default)]
pub struct Cluster {
    state: RwLock<ClusterCache>,
    updated: Notify,
}

impl Cluster {
    pub fn read(&self) -> LockResult<RwLockReadGuard<'_, ClusterCache>> {
        self.state.read()
    }

    pub fn write(&self) -> LockResult<RwLockWriteGuard<'_, ClusterCache>> {
        self.state.write()
    }

    /// Completes at the next update; create it before looking, so an update in between counts.
    pub fn updated(&self) -> Notified<'_> {
        self.updated.notified()
    }

    /// Adds or replaces a pod; returns the one it replaced.
    pub fn upsert_pod(&self, pod: Arc<Pod>) -> Option<Arc<Pod>> {
        let old = self.state.write().unwrap().pods.insert(pod_key(&pod), pod);
        self.updated.notify_waiters();
        old
    }

    /// Caches a pod read from the API server unless the watch already delivered one; returns
    /// the cached pod.
    pub fn insert_if_absent(&self, pod: Arc<Pod>) -> Arc<Pod> {
        let mut c = self.state.write().unwrap();
        c.pods.entry(pod_key(&pod)).or_insert(pod).clone()
    }

    /// Sets a namespace's labels; returns the previous ones.
    pub fn upsert_namespace(&self, name: String, labels: Labels) -> Option<Labels> {
        let old = self.state.write().unwrap().namespaces.insert(name, labels);
        self.updated.notify_waiters();
        old
    }
}

pub type SharedCache = Arc<Cluster>;

/// A change the reconciler must look at.
#[derive(Debug, Clone)]
pub enum ClusterEvent {
    /// A pod was added or changed (`old` is `None` the first time we see it).
    Pod {
        old: Option<Arc<Pod>>,
        new: Arc<Pod>,
    },
    PodDeleted(Arc<Pod>),
    /// A namespace appeared or its labels changed.
    Namespace {
        name: String,
        old: Option<Labels>,
        new: Labels,
    },
    /// Both watches finished their initial list.
    Synced,
    /// The agent this one replaced has exited (`crate::handover`).
    PreviousAgentExited,
}

/// What a cached pod keeps. Hundreds of pods per node are kept for the agent's life, and of most
/// the agent reads only metadata, `hostNetwork`, the service account, phase and IPs: the rest of
/// spec and status (containers, volumes, conditions, container statuses: the bulk of a pod) is
/// dropped. A sidecar pod stays whole, as the plugin programs its rules from the pod it is handed.
/// `managedFields` (server-side apply bookkeeping, often a third of a pod) goes from every pod.
pub fn trim_pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    let sidecar = pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(SIDECAR_STATUS_ANNOTATION));
    if sidecar {
        return;
    }
    pod.spec = pod.spec.take().map(|s| PodSpec {
        host_network: s.host_network,
        service_account_name: s.service_account_name,
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|s| PodStatus {
        phase: s.phase,
        pod_ip: s.pod_ip,
        pod_ips: s.pod_ips,
        ..PodStatus::default()
    });
}

/// Facts about a pod for the pure reconcile rules.
pub fn facts(pod: &Pod) -> PodFacts {
    let meta = &pod.metadata;
    let to_map =
        |m: &Option<std::collections::BTreeMap<String, String>>| m.clone().unwrap_or_default();
    let view = PodView {
        labels: to_map(&meta.labels),
        annotations: to_map(&meta.annotations),
        host_network: pod
            .spec
            .as_ref()
            .and_then(|s| s.host_network)
            .unwrap_or(false),
    };
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref());
    let mut ips: Vec<std::net::IpAddr> = status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|ips| ips.iter().filter_map(|ip| ip.ip.parse().ok()).collect())
        .unwrap_or_default();
    if ips.is_empty()
        && let Some(ip) = status
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse().ok())
    {
        ips.push(ip);
    }
    PodFacts {
        view,
        terminal: matches!(phase, Some("Succeeded" | "Failed")),
        ips,
    }
}

/// Starts the pod (node-scoped) and namespace watches. Events go to `tx` in the order seen;
/// `synced` turns true once both initial lists are in the cache.
pub fn spawn_watches(
    client: kube::Client,
    node: &str,
    cache: SharedCache,
    tx: mpsc::UnboundedSender<ClusterEvent>,
    synced: ReadyFlag,
) {
    let pods = Api::<Pod>::all(client.clone());
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let (pods_synced_tx, pods_synced) = tokio::sync::oneshot::channel::<()>();
    let (ns_synced_tx, ns_synced) = tokio::sync::oneshot::channel::<()>();

    let (cache_p, tx_p) = (cache.clone(), tx.clone());
    tokio::spawn(async move {
        let mut stream = watcher(pods, cfg)
            .default_backoff()
            .modify(trim_pod)
            .boxed();
        let mut relist: Option<HashMap<PodKey, Arc<Pod>>> = None;
        let mut signal = Some(pods_synced_tx);
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Init) => relist = Some(HashMap::new()),
                Ok(WatchEvent::InitApply(pod)) | Ok(WatchEvent::Apply(pod)) => {
                    let pod = Arc::new(pod);
                    if let Some(seen) = relist.as_mut() {
                        seen.insert(pod_key(&pod), pod.clone());
                    }
                    let old = cache_p.upsert_pod(pod.clone());
                    let _ = tx_p.send(ClusterEvent::Pod { old, new: pod });
                }
                Ok(WatchEvent::Delete(pod)) => {
                    cache_p.write().unwrap().pods.remove(&pod_key(&pod));
                    let _ = tx_p.send(ClusterEvent::PodDeleted(Arc::new(pod)));
                }
                Ok(WatchEvent::InitDone) => {
                    // Pods that vanished while the watch was down are deletes we never saw.
                    if let Some(seen) = relist.take() {
                        let gone: Vec<Arc<Pod>> = {
                            let mut c = cache_p.write().unwrap();
                            let keys: Vec<PodKey> = c
                                .pods
                                .keys()
                                .filter(|k| !seen.contains_key(*k))
                                .cloned()
                                .collect();
                            keys.iter().filter_map(|k| c.pods.remove(k)).collect()
                        };
                        for pod in gone {
                            let _ = tx_p.send(ClusterEvent::PodDeleted(pod));
                        }
                    }
                    if let Some(s) = signal.take() {
                        let _ = s.send(());
                    }
                }
                Err(e) => tracing::warn!(error = %e, "pod watch error, retrying with backoff"),
            }
        }
    });

    let namespaces = Api::<PartialObjectMeta<Namespace>>::all(client);
    let (cache_n, tx_n) = (cache.clone(), tx.clone());
    tokio::spawn(async move {
        let mut stream = watcher(namespaces, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut signal = Some(ns_synced_tx);
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::InitApply(ns)) | Ok(WatchEvent::Apply(ns)) => {
                    let name = ns.metadata.name.clone().unwrap_or_default();
                    let labels = ns.metadata.labels.clone().unwrap_or_default();
                    let old = cache_n.upsert_namespace(name.clone(), labels.clone());
                    let _ = tx_n.send(ClusterEvent::Namespace {
                        name,
                        old,
                        new: labels,
                    });
                }
                Ok(WatchEvent::Delete(ns)) => {
                    let name = ns.metadata.name.unwrap_or_default();
                    cache_n.write().unwrap().namespaces.remove(&name);
                }
                Ok(WatchEvent::InitDone) => {
                    if let Some(s) = signal.take() {
                        let _ = s.send(());
                    }
                }
                Ok(WatchEvent::Init) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "namespace watch error, retrying with backoff")
                }
            }
        }
    });

    tokio::spawn(async move {
        if pods_synced.await.is_ok() && ns_synced.await.is_ok() {
            tracing::info!("pod and namespace watches synced");
            synced.set(true);
            let _ = tx.send(ClusterEvent::Synced);
        }
    });
}

/// Writes the redirection annotation with a JSON merge patch on `pods/status` (what istiod reads).
#[derive(Clone)]
pub struct Annotator {
    client: kube::Client,
}

impl Annotator {
    pub fn new(client: kube::Client) -> Self {
        Annotator { client }
    }

    /// Sets (`Some`) or removes (`None`) the annotation. A pod that no longer exists is not an error.
    pub async fn set(
        &self,
        namespace: &str,
        name: &str,
        state: Redirection,
    ) -> Result<(), kube::Error> {
        let patch = serde_json::json!({"metadata": {"annotations": {REDIRECTION_ANNOTATION: state.value()}}});
        // The request `Api::patch_status` makes, but the pod it returns is not decoded: nothing
        // reads it, and decoding a whole pod is CPU spent on every ADD and removal.
        let mut req = kube::core::Request::new(format!("/api/v1/namespaces/{namespace}/pods"))
            .patch_subresource(
                "status",
                name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .map_err(kube::Error::BuildRequest)?;
        req.extensions_mut().insert("patch_status");
        match self.client.request_text(req).await.map(drop) {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 && state == Redirection::Absent => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Reads a pod straight from the API server (the CNI path when the watch has not seen it yet).
    pub async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, kube::Error> {
        Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
    }

    pub async fn get_namespace_labels(&self, name: &str) -> Result<Option<Labels>, kube::Error> {
        let ns = Api::<Namespace>::all(self.client.clone())
            .get_metadata_opt(name)
            .await?;
        Ok(ns.map(|n| n.metadata.labels.unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::ambient::mesh::workload_info;

    fn pod(annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": "p", "uid": "u1", "annotations": annotations,
                         "labels": {"app": "a"}, "managedFields": [{"manager": "kubelet"}]},
            "spec": {"hostNetwork": true, "serviceAccountName": "sa",
                     "containers": [{"name": "app", "image": "app:1", "ports": [{"containerPort": 8080}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}],
                       "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap()
    }

    /// A pod with `annotations`, whole and as cached; no cached pod keeps `managedFields`.
    fn whole_and_cached(annotations: serde_json::Value) -> (Pod, Pod) {
        let whole = pod(annotations);
        let mut cached = whole.clone();
        trim_pod(&mut cached);
        assert!(cached.metadata.managed_fields.is_none());
        (whole, cached)
    }

    #[test]
    fn a_cached_pod_keeps_what_enrollment_reads() {
        let (whole, cached) = whole_and_cached(json!({"ambient.istio.io/redirection": "enabled"}));
        assert_eq!(facts(&cached), facts(&whole));
        assert_eq!(workload_info(&cached), workload_info(&whole));
        let spec = cached.spec.unwrap();
        assert!(spec.containers.is_empty());
        assert!(cached.status.unwrap().conditions.is_none());
    }

    #[test]
    fn a_sidecar_pod_is_cached_whole_but_for_managed_fields() {
        let (whole, cached) = whole_and_cached(json!({"sidecar.istio.io/status": "{}"}));
        assert_eq!(cached.spec, whole.spec);
        assert_eq!(cached.status, whole.status);
    }
}
