//! The node-scoped pod watch and its work queue: every change of a pod on this node queues its
//! key; one worker judges the pod as last seen and applies the configured action. A failed
//! action is retried with backoff, at most [`MAX_ATTEMPTS`] times per run of failures (Istio's
//! queue limit); the next change of the pod starts afresh.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent, watcher};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::{mpsc, oneshot};

use super::actions::{ActionError, Actions};
use super::config::{BrokenPodFilter, RepairAction, RepairConfig};
use super::events::EventRecorder;
use super::filter::{is_broken, is_candidate};
use crate::http::ReadyFlag;
use crate::metrics::RepairLabels;

pub const MAX_ATTEMPTS: u32 = 5;
const RETRY_BASE: Duration = Duration::from_millis(100);

/// `(namespace, name)`
type PodKey = (String, String);

/// Keys waiting to be processed; a key already waiting is not queued twice.
struct Queue {
    tx: mpsc::UnboundedSender<PodKey>,
    waiting: Mutex<HashSet<PodKey>>,
}

impl Queue {
    fn add(&self, key: PodKey) {
        if self.waiting.lock().unwrap().insert(key.clone()) {
            let _ = self.tx.send(key);
        }
    }

    fn add_after(self: &Arc<Self>, key: PodKey, delay: Duration) {
        let queue = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            queue.add(key);
        });
    }

    fn taken(&self, key: &PodKey) {
        self.waiting.lock().unwrap().remove(key);
    }
}

fn key_of(pod: &Pod) -> PodKey {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// The watched pods that can be broken ([`is_candidate`]), by key. The other pods of the node,
/// most of an ambient node, are not kept at all.
#[derive(Default)]
struct Candidates {
    pods: HashMap<PodKey, Arc<Pod>>,
    /// The list in progress (initial, or after the watch fell behind), swapped in when it ends.
    listing: Option<HashMap<PodKey, Arc<Pod>>>,
}

impl Candidates {
    /// Applies one watch event; returns the keys of candidates that changed, appeared or left.
    fn apply(&mut self, event: WatchEvent<Pod>, filter: &BrokenPodFilter) -> Vec<PodKey> {
        match event {
            WatchEvent::Init => {
                self.listing = Some(HashMap::new());
                Vec::new()
            }
            WatchEvent::InitApply(pod) => {
                if let (Some(listing), Some((key, pod))) =
                    (self.listing.as_mut(), keep(pod, filter))
                {
                    listing.insert(key, pod);
                }
                Vec::new()
            }
            WatchEvent::InitDone => {
                let Some(listed) = self.listing.take() else {
                    return Vec::new();
                };
                let before = std::mem::replace(&mut self.pods, listed);
                let gone = before.into_keys().filter(|k| !self.pods.contains_key(k));
                self.pods.keys().cloned().chain(gone).collect()
            }
            WatchEvent::Apply(pod) => {
                let key = key_of(&pod);
                match keep(pod, filter) {
                    Some((key, pod)) => {
                        self.pods.insert(key.clone(), pod);
                        vec![key]
                    }
                    None => self.pods.remove(&key).map(|_| key).into_iter().collect(),
                }
            }
            WatchEvent::Delete(pod) => {
                let key = key_of(&pod);
                self.pods.remove(&key).map(|_| key).into_iter().collect()
            }
        }
    }

    fn get(&self, key: &PodKey) -> Option<Arc<Pod>> {
        self.pods.get(key).cloned()
    }
}

/// A candidate as kept: without `managedFields`, which is never read here.
fn keep(mut pod: Pod, filter: &BrokenPodFilter) -> Option<(PodKey, Arc<Pod>)> {
    if !is_candidate(&pod, filter) {
        return None;
    }
    pod.metadata.managed_fields = None;
    Some((key_of(&pod), Arc::new(pod)))
}

pub struct RepairController {
    actions: Actions,
    client: kube::Client,
    /// UIDs repaired in place, so later events of the same pod do not re-apply rules.
    repaired: HashMap<PodKey, String>,
    attempts: HashMap<PodKey, u32>,
}

impl RepairController {
    /// `client` needs exactly what `deploy/rbac/repair-clusterrole.yaml` grants.
    pub fn new(
        cfg: RepairConfig,
        client: kube::Client,
        metrics: Family<RepairLabels, Counter>,
    ) -> Self {
        let events = EventRecorder::new(client.clone(), cfg.node_name.clone());
        RepairController {
            actions: Actions {
                cfg: Arc::new(cfg),
                client: client.clone(),
                events,
                metrics,
                in_place: None,
            },
            client,
            repaired: HashMap::new(),
            attempts: HashMap::new(),
        }
    }

    /// The controller the agent runs: [`Self::new`] plus in-place repair when configured.
    pub fn from_setup(setup: super::RepairSetup, metrics: Family<RepairLabels, Counter>) -> Self {
        let mut c = Self::new(setup.cfg, setup.client, metrics);
        c.actions.in_place = setup.in_place;
        c.actions.export_counts();
        c
    }

    /// Enables in-place repair (`REPAIR_REPAIR_PODS`) with these host settings.
    pub fn with_in_place(mut self, in_place: super::inplace::InPlaceRepair) -> Self {
        self.actions.in_place = Some(in_place);
        self
    }

    /// Watches and repairs until `stopped` completes. `synced` turns true once the initial list
    /// is in; nothing is acted on before that.
    pub async fn run(mut self, synced: Option<ReadyFlag>, stopped: impl Future<Output = ()>) {
        let cfg = self.actions.cfg.clone();
        let mut wc = watcher::Config::default().fields(&cfg.field_selector);
        if !cfg.label_selector.is_empty() {
            wc = wc.labels(&cfg.label_selector);
        }
        let store = Arc::new(Mutex::new(Candidates::default()));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Queue {
            tx,
            waiting: Mutex::new(HashSet::new()),
        });
        let (synced_tx, synced_rx) = oneshot::channel();
        let watch = tokio::spawn(watch_pods(
            Api::<Pod>::all(self.client.clone()),
            wc,
            cfg.filter.clone(),
            store.clone(),
            queue.clone(),
            synced_tx,
        ));
        tokio::pin!(stopped);
        tokio::select! {
            r = synced_rx => if r.is_err() { return },
            () = &mut stopped => { watch.abort(); return }
        }
        tracing::info!(node = %cfg.node_name, action = ?cfg.action, "repair controller synced");
        if let Some(flag) = synced {
            flag.set(true);
        }
        loop {
            let key = tokio::select! {
                k = rx.recv() => match k { Some(k) => k, None => break },
                () = &mut stopped => break,
            };
            queue.taken(&key);
            match self.reconcile(&store, &key).await {
                Ok(()) => {
                    self.attempts.remove(&key);
                }
                Err(e) => {
                    let n = self.attempts.entry(key.clone()).or_insert(0);
                    *n += 1;
                    if *n >= MAX_ATTEMPTS {
                        tracing::error!(pod = %format!("{}/{}", key.0, key.1), error = %e, attempts = *n, "giving up on broken pod until it changes");
                        self.attempts.remove(&key);
                    } else {
                        let delay = RETRY_BASE * 2u32.pow(*n - 1);
                        tracing::warn!(pod = %format!("{}/{}", key.0, key.1), error = %e, retry_in = ?delay, "repair failed");
                        queue.add_after(key, delay);
                    }
                }
            }
        }
        watch.abort();
    }

    async fn reconcile(
        &mut self,
        store: &Mutex<Candidates>,
        key: &PodKey,
    ) -> Result<(), ActionError> {
        let pod = store.lock().unwrap().get(key);
        let Some(pod) = pod else {
            self.repaired.remove(key);
            self.attempts.remove(key);
            return Ok(());
        };
        if !is_broken(&pod, &self.actions.cfg.filter) {
            return Ok(());
        }
        match self.actions.cfg.action {
            RepairAction::Repair => {
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                if let Some(done) = self.repaired.get(key) {
                    if *done != uid {
                        tracing::error!(pod = %format!("{}/{}", key.0, key.1), %done, %uid, "already repaired under another UID; skipping");
                    }
                    return Ok(());
                }
                self.actions.repair(&pod).await?;
                self.repaired.insert(key.clone(), uid);
                Ok(())
            }
            // Deleting a pod that is already terminating would only repeat the Event and the
            // count on every status change until the kubelet removes it (Istio does repeat them).
            RepairAction::Delete if pod.metadata.deletion_timestamp.is_some() => Ok(()),
            RepairAction::Delete => self.actions.delete(&pod).await,
            RepairAction::Label => self.actions.label(&pod).await,
        }
    }
}

async fn watch_pods(
    api: Api<Pod>,
    wc: watcher::Config,
    filter: BrokenPodFilter,
    store: Arc<Mutex<Candidates>>,
    queue: Arc<Queue>,
    synced: oneshot::Sender<()>,
) {
    let mut synced = Some(synced);
    let mut stream = watcher(api, wc).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                let listed = matches!(event, WatchEvent::InitDone);
                let changed = store.lock().unwrap().apply(event, &filter);
                for key in changed {
                    queue.add(key);
                }
                if listed && let Some(s) = synced.take() {
                    let _ = s.send(());
                }
            }
            Err(e) => tracing::warn!(error = %e, "repair pod watch error, retrying with backoff"),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(name: &str, sidecar: bool) -> Pod {
        let annotations = if sidecar {
            json!({"sidecar.istio.io/status": "{}"})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": name, "annotations": annotations,
                         "managedFields": [{"manager": "kubelet"}]},
            "spec": {"containers": [{"name": "app"}]}
        }))
        .unwrap()
    }

    fn key(name: &str) -> PodKey {
        ("ns".into(), name.into())
    }

    fn list(c: &mut Candidates, pods: Vec<Pod>, filter: &BrokenPodFilter) -> Vec<PodKey> {
        assert!(c.apply(WatchEvent::Init, filter).is_empty());
        for p in pods {
            assert!(c.apply(WatchEvent::InitApply(p), filter).is_empty());
        }
        let mut changed = c.apply(WatchEvent::InitDone, filter);
        changed.sort();
        changed
    }

    #[test]
    fn only_pods_that_can_be_broken_are_kept_and_queued() {
        let filter = BrokenPodFilter::default();
        let mut c = Candidates::default();
        let listed = list(
            &mut c,
            vec![pod("side", true), pod("plain", false)],
            &filter,
        );
        assert_eq!(listed, vec![key("side")]);
        let kept = c.get(&key("side")).expect("sidecar pod kept");
        assert!(kept.metadata.managed_fields.is_none());
        assert!(kept.spec.is_some(), "a candidate is kept whole");
        assert!(c.get(&key("plain")).is_none());

        assert!(
            c.apply(WatchEvent::Apply(pod("plain", false)), &filter)
                .is_empty()
        );
        assert!(
            c.apply(WatchEvent::Delete(pod("plain", false)), &filter)
                .is_empty()
        );
    }

    #[test]
    fn a_pod_that_gains_or_loses_the_annotation_comes_and_goes() {
        let filter = BrokenPodFilter::default();
        let mut c = Candidates::default();
        list(&mut c, vec![pod("p", false)], &filter);
        assert_eq!(
            c.apply(WatchEvent::Apply(pod("p", true)), &filter),
            vec![key("p")]
        );
        assert!(c.get(&key("p")).is_some());
        // Queued so the worker forgets what it knew of the pod.
        assert_eq!(
            c.apply(WatchEvent::Apply(pod("p", false)), &filter),
            vec![key("p")]
        );
        assert!(c.get(&key("p")).is_none());
        c.apply(WatchEvent::Apply(pod("p", true)), &filter);
        assert_eq!(
            c.apply(WatchEvent::Delete(pod("p", true)), &filter),
            vec![key("p")]
        );
        assert!(c.get(&key("p")).is_none());
    }

    #[test]
    fn a_relist_replaces_the_pods_and_queues_the_ones_that_vanished() {
        let filter = BrokenPodFilter::default();
        let mut c = Candidates::default();
        list(&mut c, vec![pod("a", true), pod("b", true)], &filter);
        assert!(c.apply(WatchEvent::Init, &filter).is_empty());
        c.apply(WatchEvent::InitApply(pod("b", true)), &filter);
        assert!(
            c.get(&key("a")).is_some(),
            "the old list serves until the new one is in"
        );
        let mut changed = c.apply(WatchEvent::InitDone, &filter);
        changed.sort();
        assert_eq!(changed, vec![key("a"), key("b")]);
        assert!(c.get(&key("a")).is_none());
        assert!(c.get(&key("b")).is_some());
    }

    #[test]
    fn without_an_annotation_to_look_for_every_pod_is_kept() {
        let filter = BrokenPodFilter {
            sidecar_annotation: String::new(),
            ..BrokenPodFilter::default()
        };
        let mut c = Candidates::default();
        assert_eq!(
            list(&mut c, vec![pod("plain", false)], &filter),
            vec![key("plain")]
        );
    }
}
