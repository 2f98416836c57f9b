//! The agent's view of the cluster: pods of this node and namespace labels, kept current by
//! kube-rs watchers, plus the one write the agent makes (the redirection annotation on
//! `pods/status`). Watch errors are retried with backoff by the watcher and logged, never dropped.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, LockResult, RwLock, RwLockReadGuard, RwLockWriteGuard};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent, watcher};
use tokio::sync::futures::Notified;
use tokio::sync::{Notify, mpsc};

use cni_core::enroll::{CompiledSelectors, LabelKeys, Labels, PodView, SIDECAR_STATUS_ANNOTATION};
use cni_core::reconcile::{PodFacts, REDIRECTION_ANNOTATION, Redirection};
use cni_core::redirect::ambient::overrides::{
    BYPASS_INBOUND_CAPTURE, DNS_CAPTURE, REROUTE_VIRTUAL_INTERFACES,
};

use super::watched::WirePod;
use crate::http::ReadyFlag;

/// `namespace/name`
pub type PodKey = (String, String);

pub fn pod_key(pod: &CachedPod) -> PodKey {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// Last seen pods of this node and labels of every namespace.
#[derive(Default)]
pub struct ClusterCache {
    pub pods: HashMap<PodKey, Arc<CachedPod>>,
    /// Each namespace with only the labels the enablement selectors read
    /// ([`CompiledSelectors::namespace_keys`](cni_core::enroll::CompiledSelectors::namespace_keys)):
    /// every namespace of the cluster is kept for the agent's life, and the rest of its labels
    /// (at least `kubernetes.io/metadata.name`, on every one) were most of what each cost.
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
    pub fn upsert_pod(&self, pod: Arc<CachedPod>) -> Option<Arc<CachedPod>> {
        let old = self.state.write().unwrap().pods.insert(pod_key(&pod), pod);
        self.updated.notify_waiters();
        old
    }

    /// Caches a pod read from the API server unless the watch already delivered one; returns
    /// the cached pod.
    pub fn insert_if_absent(&self, pod: Arc<CachedPod>) -> Arc<CachedPod> {
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
        old: Option<Arc<CachedPod>>,
        new: Arc<CachedPod>,
    },
    PodDeleted(Arc<CachedPod>),
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

/// What the agent keeps of a pod. Hundreds of pods per node are kept for the agent's life, and of
/// most the agent reads only its name, namespace, UID and deletion mark, the labels the
/// enablement selectors name, the annotations of [`READ_ANNOTATIONS`], `hostNetwork`, the service
/// account, whether the pod finished and its IPs: the rest of spec and status (containers,
/// volumes, conditions, container statuses) is never decoded ([`WirePod`]), and the room `Pod`
/// reserves for them (2 KiB of empty fields per pod, most of a loaded agent's pod cache) is not
/// kept, nor are its other labels and annotations (a pod may carry hundreds of KiB of them). A
/// sidecar pod keeps its whole metadata, spec and status, as the plugin programs its rules from
/// the pod it is handed. No pod has `managedFields` (server-side apply bookkeeping, often a third
/// of a pod).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CachedPod {
    pub metadata: ObjectMeta,
    pub host_network: bool,
    pub service_account: Option<String>,
    /// Phase `Succeeded` or `Failed`.
    pub terminal: bool,
    /// `status.podIPs`, else `status.podIP`.
    pub ips: Vec<IpAddr>,
    sidecar: Option<Box<(Option<PodSpec>, Option<PodStatus>)>>,
}

/// The annotations read of a pod without a sidecar: the state the agent records, and the per-pod
/// overrides of its in-pod rules (`inpod_config`).
pub const READ_ANNOTATIONS: &[&str] = &[
    REDIRECTION_ANNOTATION,
    BYPASS_INBOUND_CAPTURE,
    DNS_CAPTURE,
    REROUTE_VIRTUAL_INTERFACES,
];

/// The label that tells ztunnel's own pods (`app=ztunnel` in the system namespace), which are
/// never reconciled whatever the selectors say.
pub const ZTUNNEL_LABEL: &str = "app";

/// Of a pod without a sidecar, the metadata the agent reads: labels among `label_keys` (the pod
/// selectors' keys, [`CompiledSelectors::pod_keys`]) and [`ZTUNNEL_LABEL`], and annotations
/// among [`READ_ANNOTATIONS`].
fn kept_metadata(meta: ObjectMeta, label_keys: &LabelKeys) -> ObjectMeta {
    let non_empty = |m: Labels| (!m.is_empty()).then_some(m);
    ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        uid: meta.uid,
        deletion_timestamp: meta.deletion_timestamp,
        labels: meta
            .labels
            .map(|mut l| {
                let ztunnel = l.remove_entry(ZTUNNEL_LABEL);
                let mut kept = label_keys.retain(l);
                kept.extend(ztunnel);
                kept
            })
            .and_then(non_empty),
        annotations: meta
            .annotations
            .map(|mut a| {
                a.retain(|k, _| READ_ANNOTATIONS.contains(&k.as_str()));
                a
            })
            .and_then(non_empty),
        ..ObjectMeta::default()
    }
}

impl CachedPod {
    /// The pod as kept: see [`CachedPod`]; `label_keys` are the labels the pod selectors read.
    pub fn new(pod: WirePod, label_keys: &LabelKeys) -> Self {
        let sidecar = pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(SIDECAR_STATUS_ANNOTATION))
            .then(|| Box::new(pod.spec_and_status()));
        let (spec, status) = (pod.spec_facts(), pod.status_facts());
        let metadata = match sidecar {
            Some(_) => pod.metadata,
            None => kept_metadata(pod.metadata, label_keys),
        };
        CachedPod {
            host_network: spec.host_network.unwrap_or(false),
            service_account: spec.service_account_name,
            terminal: matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")),
            ips: ips_of(
                status.pod_ips.iter().flatten().map(|ip| ip.ip.as_str()),
                status.pod_ip.as_deref(),
            ),
            sidecar,
            metadata,
        }
    }
}

/// `status.podIPs`, else `status.podIP`.
pub fn pod_ips(status: Option<&PodStatus>) -> Vec<IpAddr> {
    let Some(status) = status else {
        return Vec::new();
    };
    ips_of(
        status.pod_ips.iter().flatten().map(|ip| ip.ip.as_str()),
        status.pod_ip.as_deref(),
    )
}

/// The parsed `podIPs`, else `podIP`.
fn ips_of<'a>(pod_ips: impl Iterator<Item = &'a str>, pod_ip: Option<&str>) -> Vec<IpAddr> {
    let ips: Vec<IpAddr> = pod_ips.filter_map(|ip| ip.parse().ok()).collect();
    if !ips.is_empty() {
        return ips;
    }
    pod_ip.and_then(|ip| ip.parse().ok()).into_iter().collect()
}

impl CachedPod {
    /// The state its `ambient.istio.io/redirection` annotation records (without the map copies
    /// of [`facts`], for the walks over every cached pod).
    pub fn redirection(&self) -> Redirection {
        self.metadata
            .annotations
            .as_ref()
            .map_or(Redirection::Absent, Redirection::of)
    }

    /// The pod as the API server sent it (without `managedFields`), for sidecar pods: the only
    /// ones kept whole.
    pub fn sidecar_pod(&self) -> Option<Pod> {
        let (spec, status) = self.sidecar.as_deref()?.clone();
        Some(Pod {
            metadata: self.metadata.clone(),
            spec,
            status,
        })
    }
}

/// Facts about a pod for the pure reconcile rules.
pub fn facts(pod: &CachedPod) -> PodFacts {
    let meta = &pod.metadata;
    let to_map =
        |m: &Option<std::collections::BTreeMap<String, String>>| m.clone().unwrap_or_default();
    PodFacts {
        view: PodView {
            labels: to_map(&meta.labels),
            annotations: to_map(&meta.annotations),
            host_network: pod.host_network,
        },
        terminal: pod.terminal,
        ips: pod.ips.clone(),
    }
}

/// Starts the pod (node-scoped) and namespace watches. Events go to `tx` in the order seen;
/// `synced` turns true once both initial lists are in the cache. Namespaces and pods are kept
/// and sent with only the labels `selectors` read (and pods as [`CachedPod::new`] keeps them).
pub fn spawn_watches(
    client: kube::Client,
    node: &str,
    selectors: &CompiledSelectors,
    cache: SharedCache,
    tx: mpsc::UnboundedSender<ClusterEvent>,
    synced: ReadyFlag,
) {
    let pods = Api::<WirePod>::all(client.clone());
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let (pods_synced_tx, pods_synced) = tokio::sync::oneshot::channel::<()>();
    let (pod_keys, namespace_keys) = (selectors.pod_keys(), selectors.namespace_keys());
    let (ns_synced_tx, ns_synced) = tokio::sync::oneshot::channel::<()>();

    let (cache_p, tx_p) = (cache.clone(), tx.clone());
    tokio::spawn(async move {
        let mut stream = watcher(pods, cfg).default_backoff().boxed();
        let mut relist: Option<HashMap<PodKey, Arc<CachedPod>>> = None;
        let mut signal = Some(pods_synced_tx);
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Init) => relist = Some(HashMap::new()),
                Ok(WatchEvent::InitApply(pod)) | Ok(WatchEvent::Apply(pod)) => {
                    let pod = Arc::new(CachedPod::new(pod, &pod_keys));
                    if let Some(seen) = relist.as_mut() {
                        seen.insert(pod_key(&pod), pod.clone());
                    }
                    let old = cache_p.upsert_pod(pod.clone());
                    let _ = tx_p.send(ClusterEvent::Pod { old, new: pod });
                }
                Ok(WatchEvent::Delete(pod)) => {
                    let pod = Arc::new(CachedPod::new(pod, &pod_keys));
                    cache_p.write().unwrap().pods.remove(&pod_key(&pod));
                    let _ = tx_p.send(ClusterEvent::PodDeleted(pod));
                }
                Ok(WatchEvent::InitDone) => {
                    // Pods that vanished while the watch was down are deletes we never saw.
                    if let Some(seen) = relist.take() {
                        let gone: Vec<Arc<CachedPod>> = {
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
        let mut relist: Option<HashSet<String>> = None;
        while let Some(event) = stream.next().await {
            match event {
                // The first list has nothing to take out: only a relist tracks what it saw.
                Ok(WatchEvent::Init) => relist = signal.is_none().then(HashSet::new),
                Ok(WatchEvent::InitApply(ns)) | Ok(WatchEvent::Apply(ns)) => {
                    let name = ns.metadata.name.unwrap_or_default();
                    let labels = namespace_keys.retain(ns.metadata.labels.unwrap_or_default());
                    if let Some(seen) = relist.as_mut() {
                        seen.insert(name.clone());
                    }
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
                    // Namespaces deleted while the watch was down (a relist after 410 Gone)
                    // would otherwise be kept for the agent's life.
                    if let Some(seen) = relist.take() {
                        cache_n
                            .write()
                            .unwrap()
                            .namespaces
                            .retain(|name, _| seen.contains(name));
                    }
                    if let Some(s) = signal.take() {
                        let _ = s.send(());
                    }
                }
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
    pub async fn get_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<WirePod>, kube::Error> {
        Api::<WirePod>::namespaced(self.client.clone(), namespace)
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

    fn pod_json(annotations: serde_json::Value) -> serde_json::Value {
        json!({
            "metadata": {"namespace": "ns", "name": "p", "uid": "u1", "annotations": annotations,
                         "labels": {"app": "a", "istio.io/dataplane-mode": "ambient"},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                              "name": "r", "uid": "u0"}],
                         "managedFields": [{"manager": "kubelet"}]},
            "spec": {"hostNetwork": true, "serviceAccountName": "sa",
                     "containers": [{"name": "app", "image": "app:1", "ports": [{"containerPort": 8080}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}],
                       "conditions": [{"type": "Ready", "status": "True"}]}
        })
    }

    /// Kept as the agent keeps it with Istio's default enablement selectors.
    fn cached(pod: serde_json::Value) -> CachedPod {
        let keys = CompiledSelectors::compile(&cni_core::enroll::default_selectors())
            .unwrap()
            .pod_keys();
        CachedPod::new(serde_json::from_value::<WirePod>(pod).unwrap(), &keys)
    }

    #[test]
    fn a_cached_pod_keeps_what_enrollment_reads() {
        let cached = cached(pod_json(json!({
            "ambient.istio.io/redirection": "enabled",
            "ambient.istio.io/dns-capture": "false",
            "kubectl.kubernetes.io/last-applied-configuration": "{\"a whole pod\": 1}",
        })));
        assert!(cached.metadata.managed_fields.is_none());
        assert!(cached.sidecar_pod().is_none());
        let f = facts(&cached);
        assert_eq!(f.redirection(), Redirection::Enabled);
        // Only the label the default selectors read and the one that tells ztunnel's pods, and
        // the annotations the agent reads.
        assert_eq!(
            f.view.labels,
            Labels::from([
                ("app".into(), "a".into()),
                ("istio.io/dataplane-mode".into(), "ambient".into())
            ])
        );
        assert_eq!(
            f.view.annotations.keys().collect::<Vec<_>>(),
            [
                "ambient.istio.io/dns-capture",
                "ambient.istio.io/redirection"
            ]
        );
        assert!(cached.metadata.owner_references.is_none());
        assert_eq!(cached.metadata.uid.as_deref(), Some("u1"));
        assert_eq!(pod_key(&cached), ("ns".to_string(), "p".to_string()));
        assert!(f.view.host_network);
        assert!(!f.terminal);
        assert_eq!(f.ips, vec!["10.0.0.5".parse::<IpAddr>().unwrap()]);
        assert_eq!(workload_info(&cached).service_account, "sa");
    }

    /// ztunnel's own pods are told by a label no enablement selector names: trimming must keep
    /// it, or a labelled system namespace would have its ztunnel enrolled into itself.
    #[test]
    fn a_cached_ztunnel_pod_is_still_told_as_ztunnel() {
        let mut pod = pod_json(json!({}));
        pod["metadata"]["namespace"] = json!("istio-system");
        pod["metadata"]["labels"] = json!({"app": "ztunnel", "sidecar.istio.io/inject": "false"});
        let policy = crate::ambient::reconciler::Policy {
            selectors: CompiledSelectors::compile(&cni_core::enroll::default_selectors()).unwrap(),
            exclude_namespaces: Default::default(),
            system_namespace: "istio-system".into(),
        };
        let kept = cached(pod);
        assert!(policy.is_ztunnel(&kept), "{:?}", kept.metadata.labels);
        assert_eq!(
            kept.metadata.labels,
            Some(Labels::from([("app".into(), "ztunnel".into())]))
        );
    }

    #[test]
    fn pod_ip_stands_in_for_missing_pod_ips_and_finished_phases_are_terminal() {
        let mut whole = pod_json(json!({}));
        whole["status"]["podIPs"] = serde_json::Value::Null;
        whole["status"]["phase"] = json!("Failed");
        let cached = cached(whole);
        assert_eq!(cached.ips, vec!["10.0.0.5".parse::<IpAddr>().unwrap()]);
        assert!(cached.terminal);
    }

    #[test]
    fn a_pod_without_spec_or_status_is_cached_with_neither() {
        let mut bare = pod_json(json!({}));
        bare.as_object_mut().unwrap().remove("spec");
        bare["status"] = serde_json::Value::Null;
        let cached = cached(bare);
        assert!(!cached.host_network && !cached.terminal);
        assert_eq!(cached.service_account, None);
        assert!(cached.ips.is_empty());
    }

    #[test]
    fn a_sidecar_pod_is_cached_whole_but_for_managed_fields() {
        let json = pod_json(json!({"sidecar.istio.io/status": "{}"}));
        let whole: Pod = serde_json::from_value(json.clone()).unwrap();
        let kept = cached(json).sidecar_pod().unwrap();
        assert!(kept.metadata.managed_fields.is_none());
        assert_eq!(kept.metadata.labels, whole.metadata.labels);
        assert_eq!(
            kept.metadata.owner_references,
            whole.metadata.owner_references
        );
        assert_eq!(kept.spec, whole.spec);
        assert_eq!(kept.status, whole.status);
    }
}
