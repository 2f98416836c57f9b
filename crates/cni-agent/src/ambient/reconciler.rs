//! Applies Istio's reconcile rules (`cni_core::reconcile`) to cluster events, one event at a time
//! (as Istio's single queue worker does), retrying failures with per-pod exponential backoff.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use cni_core::enroll::CompiledSelectors;
use cni_core::reconcile::{Action, Scope, on_delete, on_update};

use super::cluster::{CachedPod, ClusterEvent, PodKey, SharedCache, facts, pod_key};
use super::mesh::{Mesh, Prechecks};
use crate::metrics::{TypeLabel, observe};

/// Which pods the node enrolls.
pub struct Policy {
    pub selectors: CompiledSelectors,
    pub exclude_namespaces: BTreeSet<String>,
    /// `SYSTEM_NAMESPACE`: ztunnel pods (`app=ztunnel` there) are never reconciled.
    pub system_namespace: String,
}

impl Policy {
    pub fn is_ztunnel(&self, pod: &CachedPod) -> bool {
        pod.metadata.namespace.as_deref() == Some(self.system_namespace.as_str())
            && pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(crate::ambient::cluster::ZTUNNEL_LABEL))
                .map(String::as_str)
                == Some("ztunnel")
    }
}

pub struct Reconciler {
    pub cache: SharedCache,
    pub mesh: Arc<Mesh>,
    pub policy: Arc<Policy>,
    /// Verify and repair the rules of pods enrolled before this agent started.
    pub reconcile_on_startup: bool,
    /// The check of hinted namespaces started with the agent ([`Mesh::precheck_hinted`]).
    pub prechecks: Option<tokio::task::JoinHandle<Prechecks>>,
}

const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Reconciler {
    /// Consumes events until the channel closes. `tx` is the same channel's sender, used to
    /// requeue failed events after their backoff. Once the watches have synced, the pods enrolled
    /// before this agent started are restored and `restored` fires (the ZDS server waits for it,
    /// so the first ztunnel gets a complete snapshot).
    pub async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<ClusterEvent>,
        tx: mpsc::UnboundedSender<ClusterEvent>,
        restored: tokio::sync::oneshot::Sender<()>,
    ) {
        let mut restored = Some(restored);
        let mut synced = false;
        let mut failures: HashMap<PodKey, u32> = HashMap::new();
        while let Some(event) = rx.recv().await {
            if !synced {
                // Until both initial lists are in, a pod's namespace may be unknown; the Synced
                // step below reconciles every cached pod instead.
                if let ClusterEvent::Synced = event {
                    synced = true;
                    let pods: Vec<Arc<CachedPod>> =
                        self.cache.read().unwrap().pods.values().cloned().collect();
                    // Pods deleted while no agent ran were never seen going.
                    let uids = pods.iter().filter_map(|p| p.metadata.uid.clone()).collect();
                    self.mesh.hints.retain(&uids);
                    let prechecked = match self.prechecks.take() {
                        Some(job) => job.await.unwrap_or_default(),
                        None => Prechecks::new(),
                    };
                    self.mesh
                        .restore(&self.enrolled(&pods), self.reconcile_on_startup, prechecked)
                        .await;
                    if let Some(r) = restored.take() {
                        let _ = r.send(());
                    }
                    for pod in pods {
                        let _ = tx.send(ClusterEvent::Pod {
                            old: Some(pod.clone()),
                            new: pod,
                        });
                    }
                }
                continue;
            }
            let key = match &event {
                ClusterEvent::Pod { new, .. } => Some(pod_key(new)),
                ClusterEvent::PodDeleted(pod) => Some(pod_key(pod)),
                _ => None,
            };
            let started = Instant::now();
            match self.handle(&event, &tx).await {
                Ok(enrolled) => {
                    if let Some(k) = key {
                        failures.remove(&k);
                    }
                    if enrolled {
                        observe(
                            &self.mesh.metrics.event_to_enrolled_seconds,
                            started.elapsed(),
                        );
                    }
                }
                Err(e) => {
                    let Some(k) = key else { continue };
                    let n = failures.entry(k).or_insert(0);
                    *n += 1;
                    let delay = BACKOFF_MIN
                        .saturating_mul(1 << (*n).min(10))
                        .min(BACKOFF_MAX);
                    tracing::warn!(error = %e, attempt = *n, retry_in = ?delay, "reconcile failed");
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = tx.send(event);
                    });
                }
            }
        }
    }

    fn count(&self, kind: &str) {
        self.mesh
            .metrics
            .reconcile_events
            .get_or_create(&TypeLabel {
                r#type: kind.to_string(),
            })
            .inc();
    }

    /// Handles one event; `Ok(true)` when a pod was enrolled.
    async fn handle(
        &self,
        event: &ClusterEvent,
        tx: &mpsc::UnboundedSender<ClusterEvent>,
    ) -> Result<bool, super::mesh::MeshError> {
        match event {
            ClusterEvent::Synced => Ok(false),
            ClusterEvent::PreviousAgentExited => {
                // Before the restore this event is dropped: the restore comes after the exit.
                let pods: Vec<Arc<CachedPod>> =
                    self.cache.read().unwrap().pods.values().cloned().collect();
                let enrolled = self.enrolled(&pods);
                let repaired = self
                    .mesh
                    .check_restored(&enrolled, self.reconcile_on_startup)
                    .await;
                tracing::info!(
                    checked = enrolled.len(),
                    repaired,
                    "enrolled pods' rules checked after the previous agent's exit"
                );
                Ok(false)
            }
            ClusterEvent::Namespace { name, old, new } => {
                self.count(if old.is_some() { "update" } else { "add" });
                let Some(old) = old else { return Ok(false) };
                let s = &self.policy.selectors;
                if s.matches_namespace(old) == s.matches_namespace(new) {
                    return Ok(false);
                }
                let pods: Vec<Arc<CachedPod>> = self
                    .cache
                    .read()
                    .unwrap()
                    .pods
                    .values()
                    .filter(|p| {
                        p.metadata.namespace.as_deref() == Some(name) && !self.policy.is_ztunnel(p)
                    })
                    .cloned()
                    .collect();
                for pod in pods {
                    let _ = tx.send(ClusterEvent::Pod {
                        old: Some(pod.clone()),
                        new: pod,
                    });
                }
                Ok(false)
            }
            ClusterEvent::PodDeleted(pod) => {
                self.count("delete");
                if let Some(uid) = &pod.metadata.uid {
                    self.mesh.hints.forget(uid);
                    // Removed for good at its terminal phase (kubelet posts it before the object
                    // goes): ztunnel already had its Del, the probe set its entries.
                    if self.mesh.finished.take(uid) {
                        tracing::debug!(pod = ?pod_key(pod), "deleted pod already left the mesh");
                        return Ok(false);
                    }
                }
                if self.policy.is_ztunnel(pod) {
                    return Ok(false);
                }
                let f = facts(pod);
                let ns = pod.metadata.namespace.clone().unwrap_or_default();
                let labels = self
                    .cache
                    .read()
                    .unwrap()
                    .namespaces
                    .get(&ns)
                    .cloned()
                    .unwrap_or_default();
                let scope = self.scope(&ns, &labels);
                if on_delete(&f, &scope) {
                    self.mesh.remove(pod, &f.ips, true).await?;
                }
                Ok(false)
            }
            ClusterEvent::Pod { old, new } => {
                self.count(if old.is_some() { "update" } else { "add" });
                if self.policy.is_ztunnel(new) {
                    return Ok(false);
                }
                // Always judge the newest object: a stale event must not undo what the CNI path did.
                let key = pod_key(new);
                let (current, labels) = {
                    let c = self.cache.read().unwrap();
                    let Some(current) = c.pods.get(&key).cloned() else {
                        return Ok(false);
                    };
                    let Some(labels) = c.namespaces.get(&key.0).cloned() else {
                        tracing::warn!(pod = ?key, "namespace not known yet; skipping");
                        return Ok(false);
                    };
                    (current, labels)
                };
                let old = old.clone().unwrap_or_else(|| current.clone());
                let (old_f, cur_f) = (facts(&old), facts(&current));
                let scope = self.scope(&key.0, &labels);
                let (mut enrolled, mut tried) = (false, false);
                for action in on_update(&old_f, &cur_f, &scope) {
                    match action {
                        Action::RemoveTerminated => {
                            // Every later event of a terminated pod still reads the cached pod
                            // as terminal and enrolled until our annotation removal comes back:
                            // it left the mesh at the first.
                            let uid = old.metadata.uid.as_deref().unwrap_or_default();
                            if !self.mesh.finished.contains(uid) {
                                self.mesh.remove(&old, &old_f.ips, true).await?;
                                self.mesh.finished.insert(uid);
                            }
                        }
                        Action::SyncProbeIps => {
                            let uid = current.metadata.uid.clone().unwrap_or_default();
                            self.mesh.sync_probe_ips(&current, &uid, &cur_f.ips).await?;
                        }
                        Action::Remove => self.mesh.remove(&current, &cur_f.ips, false).await?,
                        Action::Add => match self.mesh.add(&current, &cur_f.ips, None).await {
                            Ok(()) => (enrolled, tried) = (true, true),
                            Err(e) if !e.retryable() => {
                                tried = true;
                                tracing::error!(pod = ?key, error = %e, "cannot enroll pod; not retrying");
                            }
                            Err(e) => return Err(e),
                        },
                    }
                }
                let ip_appeared = old_f.ips.is_empty() && !cur_f.ips.is_empty();
                if !tried
                    && self
                        .enrolled_elsewhere(&current, &cur_f, ip_appeared, &scope)
                        .await
                {
                    tracing::info!(pod = ?key, "adopting a pod the previous agent enrolled");
                    let uid = current.metadata.uid.as_deref().unwrap_or_default();
                    let kept = self.mesh.cache.get(uid).is_some();
                    if let Err(e) = self.mesh.add(&current, &cur_f.ips, None).await {
                        // A failed add forgets the pod; one the restore kept stays kept for
                        // ztunnel until the retry.
                        if kept {
                            self.mesh.keep(&current);
                        }
                        return Err(e);
                    }
                    enrolled = true;
                }
                Ok(enrolled)
            }
        }
    }

    /// A pod another agent enrolled that this one does not hold a namespace for (the previous
    /// agent's last ADDs during a handover): annotated `enabled` and selected, but neither its ADD
    /// nor the restore gave this agent its namespace. Either the pod was enrolled after the
    /// restore, or the restore could not look for it: its IP was not in the API yet (the previous
    /// agent had just answered its ADD), so it was only kept, and `ip_appeared` is this event's
    /// news that it now can be. (A pod kept because its namespace is gone, after a reboot, keeps
    /// its IP until the runtime's ADD brings the new one.) Without adoption its rules would never
    /// be checked or moved to this agent's backend, and ztunnel would keep only what the previous
    /// agent gave it.
    async fn enrolled_elsewhere(
        &self,
        pod: &CachedPod,
        f: &cni_core::reconcile::PodFacts,
        ip_appeared: bool,
        scope: &Scope<'_>,
    ) -> bool {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return false;
        };
        if f.terminal
            || f.ips.is_empty()
            || f.redirection() != cni_core::reconcile::Redirection::Enabled
            || !cni_core::reconcile::eligibility(&f.view, scope).is_selected()
            || !self.adoptable(uid, ip_appeared)
            || self.mesh.finished.contains(uid)
        {
            return false;
        }
        // Our own ADD annotates while it holds the pod's lock, and caches the pod with its
        // namespace before letting go: under the lock, a pod without one is not one of ours.
        let _pod = self.mesh.locks.lock(uid).await;
        self.adoptable(uid, ip_appeared)
    }

    fn adoptable(&self, uid: &str, ip_appeared: bool) -> bool {
        match self.mesh.cache.get(uid) {
            None => true,
            Some(entry) => entry.netns.is_none() && ip_appeared,
        }
    }

    /// The pods this agent's restore and handover take over: enrolled, running, not ztunnel.
    fn enrolled(&self, pods: &[Arc<CachedPod>]) -> Vec<Arc<CachedPod>> {
        pods.iter()
            .filter(|p| {
                !self.policy.is_ztunnel(p)
                    && !p.terminal
                    && p.redirection() == cni_core::reconcile::Redirection::Enabled
            })
            .cloned()
            .collect()
    }

    fn scope<'a>(&'a self, namespace: &str, labels: &'a cni_core::enroll::Labels) -> Scope<'a> {
        Scope {
            selectors: &self.policy.selectors,
            namespace_labels: labels,
            excluded: self.policy.exclude_namespaces.contains(namespace),
        }
    }
}
