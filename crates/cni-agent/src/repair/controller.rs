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
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event as WatchEvent, watcher};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::{mpsc, oneshot};

use super::actions::{ActionError, Actions};
use super::config::{BrokenPodFilter, RepairAction, RepairConfig};
use super::events::EventRecorder;
use super::filter::{is_broken, trim_for_cache};
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
        let (store, writer) = reflector::store();
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
            writer,
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

    async fn reconcile(&mut self, store: &Store<Pod>, key: &PodKey) -> Result<(), ActionError> {
        let Some(pod) = store.get(&ObjectRef::new(&key.1).within(&key.0)) else {
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
    writer: reflector::store::Writer<Pod>,
    queue: Arc<Queue>,
    synced: oneshot::Sender<()>,
) {
    let mut synced = Some(synced);
    let pods = watcher(api, wc)
        .default_backoff()
        .modify(move |pod| trim_for_cache(pod, &filter));
    let mut stream = reflector::reflector(writer, pods).boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(WatchEvent::Apply(pod) | WatchEvent::InitApply(pod) | WatchEvent::Delete(pod)) => {
                queue.add(key_of(&pod))
            }
            Ok(WatchEvent::InitDone) => {
                if let Some(s) = synced.take() {
                    let _ = s.send(());
                }
            }
            Ok(WatchEvent::Init) => {}
            Err(e) => tracing::warn!(error = %e, "repair pod watch error, retrying with backoff"),
        }
    }
}
