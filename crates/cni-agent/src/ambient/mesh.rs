//! Adding a pod to the mesh and removing it: the ordered steps, their failure rules, and the state
//! they leave behind. Fail closed: nothing reports success unless the pod's rules are in place and
//! ztunnel acked it.
//!
//! Add: netns (CNI path: open `CNI_NETNS`; informer path: cached or discovered under /proc) →
//! routes + rules in one transaction (on a thread of the pod's own) → ZDS Add, wait for the ack;
//! at the same time the host probe set entry (taken out again if the rest fails) and the
//! annotation `enabled` patch; success once all of them succeeded. A ztunnel failure leaves the
//! annotation `pending` and is retryable; a netns or rule failure is not (the pod's sandbox must
//! be retried or recreated), and puts the annotation back as it was.
//!
//! Remove: probe set entries (only those carrying this pod's UID) → rules out of the still-running
//! pod (not for deleted pods: their netns is going away) → ZDS Del to every ztunnel → annotation
//! removed.
//!
//! A pod is removed for good once: kubelet posts a deleted pod's terminal phase before the object
//! goes, and the reconciler removes the pod at the first event that shows it terminal
//! ([`Mesh::finished`]), so later updates (the cache shows the pod terminal and still annotated
//! until our annotation removal comes back) and the delete event have nothing left to do. Istio
//! removes it at each of them and ztunnel reads a second `Del` for a UID it already dropped.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cni_core::reconcile::Redirection;
use cni_core::redirect::InpodConfig;
use cni_core::redirect::overrides::inpod_config;
use cni_core::zds::WorkloadInfo;
use dataplane::inpod::RuleState;
use dataplane::netns::Netns;

use super::cluster::{Annotator, CachedPod};
use crate::metrics::{BackendLabel, DriftLabel, Metrics, observe};
use crate::netns_cache::NetnsCache;
use crate::procfs::{
    HostNetns, NetnsOpener, ProcScanner, WantedPod, addresses, addresses_contain_any,
};
use crate::zds::ZdsHandle;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Routes and rules inside a pod's namespace (the dataplane crate behind a seam, so the pipeline's
/// ordering and failure rules are testable without root).
pub trait PodRules: Send + Sync + 'static {
    fn backend(&self) -> &'static str;
    fn enroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError>;
    fn unenroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError>;
    fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, BoxError>;
    /// Whether the pod still holds rules of the backend the node used before a switch.
    fn leftovers(&self, netns: &Netns) -> Result<bool, BoxError>;
}

/// The host's set of enrolled pod IPs that kubelet probes are SNATed for.
pub trait ProbeSet: Send + Sync + 'static {
    /// Adds or replaces the entry for `ip`, tagged with the pod UID.
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError>;
    /// Deletes the entry for `ip` only if it carries `uid` (another pod may own the IP now).
    fn remove(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError>;
    /// Deletes every entry whose IP is not in `keep`.
    fn prune(&self, keep: &HashSet<IpAddr>) -> Result<(), BoxError>;
    /// Every entry: its address and the pod UID it is tagged with.
    fn list(&self) -> Result<Vec<(IpAddr, String)>, BoxError>;
    /// Many upserts at once; one transaction where the backend has them.
    fn upsert_many(&self, entries: &[(IpAddr, String)]) -> Result<(), BoxError> {
        entries
            .iter()
            .try_for_each(|(ip, uid)| self.upsert(*ip, uid))
    }
    /// Checks the host's probe SNAT rules and the sets themselves, and re-applies them where
    /// they drifted (the sets keep the entries they still hold). Returns what was found then.
    fn repair_rules(&self) -> Result<Option<RuleState>, BoxError>;
    /// The entries of `want` the set lacks (or holds for another pod), leaving out addresses the
    /// set never holds.
    fn missing(&self, want: &[(IpAddr, String)]) -> Result<Vec<(IpAddr, String)>, BoxError>;
}

#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("pod {0} has no uid")]
    NoUid(String),
    #[error("cannot find the network namespace of pod {pod}: {why}")]
    Netns { pod: String, why: String },
    #[error("invalid redirection override on pod {pod}: {source}")]
    Override {
        pod: String,
        #[source]
        source: cni_core::redirect::overrides::OverrideError,
    },
    #[error("{backend} rules for pod {pod}: {source}")]
    Rules {
        pod: String,
        backend: &'static str,
        source: BoxError,
    },
    #[error("ztunnel did not accept pod {pod}: {source}")]
    Ztunnel {
        pod: String,
        #[source]
        source: crate::zds::ZdsError,
    },
    #[error("host probe set for pod {pod}: {source}")]
    ProbeSet { pod: String, source: BoxError },
    #[error("annotating pod {pod}: {source}")]
    Annotate {
        pod: String,
        #[source]
        source: kube::Error,
    },
}

impl MeshError {
    /// Retrying the same step can succeed (ztunnel, API server, probe set); the others need a new
    /// sandbox or a fixed pod spec.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            MeshError::Ztunnel { .. } | MeshError::ProbeSet { .. } | MeshError::Annotate { .. }
        )
    }
}

/// When each step of an add's redirection finished.
struct Stages {
    resolved: Instant,
    applied: Instant,
    acked: Instant,
    probed: Instant,
}

/// Everything the add and remove pipelines touch.
pub struct Mesh {
    pub cache: Arc<NetnsCache>,
    pub zds: ZdsHandle,
    pub rules: Arc<dyn PodRules>,
    pub probes: Arc<dyn ProbeSet>,
    pub annotator: Annotator,
    /// Node-wide rule settings; pod annotations override them.
    pub global: InpodConfig,
    /// `/host/proc` (or `/proc`): where running pods' namespaces are discovered.
    pub proc_dir: std::path::PathBuf,
    /// Where the host's filesystem is mounted (`CNI_NETNS` paths resolve beneath it).
    pub host_prefix: std::path::PathBuf,
    /// The host's namespace: never a pod's, whatever /proc says.
    pub host_netns: dataplane::netns::NetnsId,
    pub hints: super::hints::NetnsHints,
    pub metrics: Metrics,
    /// One operation per pod at a time (see [`PodLocks`]).
    pub locks: PodLocks,
    pub probe_ips: ProbeIps,
    /// Pods removed for good while their object still existed (terminal phase).
    pub finished: FinishedPods,
    /// Why each pod's last add failed, for `install-cni explain`.
    pub last_errors: LastErrors,
}

/// The error of each pod's last failed add, by UID: kept until an add succeeds or the pod is
/// deleted, so the map holds only pods that are failing now.
#[derive(Default)]
pub struct LastErrors(std::sync::Mutex<HashMap<String, String>>);

impl LastErrors {
    fn record(&self, uid: &str, result: &Result<(), MeshError>) {
        let mut m = self.0.lock().unwrap();
        match result {
            Ok(()) => m.remove(uid),
            Err(e) => m.insert(uid.to_string(), e.to_string()),
        };
    }

    fn forget(&self, uid: &str) {
        self.0.lock().unwrap().remove(uid);
    }

    pub fn get(&self, uid: &str) -> Option<String> {
        self.0.lock().unwrap().get(uid).cloned()
    }
}

/// UIDs of pods removed from the mesh because they terminated, and not added since. Their delete
/// event then sends no second ZDS `Del`. An entry lives from the terminal removal to the pod's
/// delete event (or an add of the same UID), so the set holds only pods between the two.
#[derive(Default)]
pub struct FinishedPods(std::sync::Mutex<HashSet<String>>);

impl FinishedPods {
    /// The pod `uid` left the mesh for good.
    pub fn insert(&self, uid: &str) {
        self.0.lock().unwrap().insert(uid.to_string());
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.0.lock().unwrap().contains(uid)
    }

    /// The pod is (being) added again: its next removal is a real one.
    pub fn forget(&self, uid: &str) {
        self.0.lock().unwrap().remove(uid);
    }

    /// Whether `uid` was removed for good; forgets it (its delete event is the last word).
    pub fn take(&self, uid: &str) -> bool {
        self.0.lock().unwrap().remove(uid)
    }
}

/// The IPs each pod's probe-set entries were made for. A deleted pod's object can lack them (a
/// pod the CNI path read before the kubelet wrote its status, deleted while the watch was down),
/// and its entries must still go.
#[derive(Default)]
pub struct ProbeIps(std::sync::Mutex<HashMap<String, HashSet<IpAddr>>>);

impl ProbeIps {
    fn record(&self, uid: &str, ips: impl IntoIterator<Item = IpAddr>) {
        let mut m = self.0.lock().unwrap();
        m.entry(uid.to_string()).or_default().extend(ips);
    }

    /// `ips` and every IP recorded for `uid`.
    fn with_recorded(&self, uid: &str, ips: &[IpAddr]) -> Vec<IpAddr> {
        let mut all: HashSet<IpAddr> = ips.iter().map(|ip| ip.to_canonical()).collect();
        if let Some(known) = self.0.lock().unwrap().get(uid) {
            all.extend(known);
        }
        all.into_iter().collect()
    }

    fn forget(&self, uid: &str) {
        self.0.lock().unwrap().remove(uid);
    }

    fn drop_ip(&self, uid: &str, ip: IpAddr) {
        if let Some(ips) = self.0.lock().unwrap().get_mut(uid) {
            ips.remove(&ip);
        }
    }

    /// Every recorded (IP, pod UID).
    fn entries(&self) -> Vec<(IpAddr, String)> {
        let m = self.0.lock().unwrap();
        m.iter()
            .flat_map(|(uid, ips)| ips.iter().map(move |ip| (*ip, uid.clone())))
            .collect()
    }

    fn holds(&self, uid: &str, ip: IpAddr) -> bool {
        self.0
            .lock()
            .unwrap()
            .get(uid)
            .is_some_and(|ips| ips.contains(&ip))
    }
}

/// Serialises the add, remove and drift repair of one pod. Without it a drift check that took a
/// pod's namespace just before the pod was unenrolled saw the rules gone and put them back,
/// leaving a pod that left the mesh redirected to a ztunnel that had dropped it.
#[derive(Default)]
pub struct PodLocks(std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl PodLocks {
    pub async fn lock(&self, uid: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.0.lock().unwrap();
            // Locks nobody holds or waits for are dropped, so the map only holds pods in flight.
            locks.retain(|_, l| Arc::strong_count(l) > 1);
            locks.entry(uid.to_string()).or_default().clone()
        };
        lock.lock_owned().await
    }
}

fn name(pod: &CachedPod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

pub fn workload_info(pod: &CachedPod) -> WorkloadInfo {
    WorkloadInfo {
        name: pod.metadata.name.clone().unwrap_or_default(),
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        service_account: pod.service_account.clone().unwrap_or_default(),
    }
}

impl Mesh {
    /// The rule configuration for this pod: node settings plus its annotations.
    pub fn pod_config(&self, pod: &CachedPod) -> Result<InpodConfig, MeshError> {
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        let (cfg, ignored) = inpod_config(
            &self.global,
            annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        )
        .map_err(|source| MeshError::Override {
            pod: name(pod),
            source,
        })?;
        for i in ignored {
            tracing::warn!(pod = %name(pod), annotation = i.annotation, value = %i.value, "ignoring non-boolean annotation");
        }
        Ok(cfg)
    }

    /// Enrolls a pod. `netns_path` is `CNI_NETNS` on the CNI path, `None` on the informer path.
    pub async fn add(
        &self,
        pod: &CachedPod,
        ips: &[IpAddr],
        netns_path: Option<&str>,
    ) -> Result<(), MeshError> {
        let uid = pod
            .metadata
            .uid
            .clone()
            .ok_or_else(|| MeshError::NoUid(name(pod)))?;
        let _pod_lock = self.locks.lock(&uid).await;
        self.finished.forget(&uid);
        let added = self.add_locked(pod, &uid, ips, netns_path).await;
        self.last_errors.record(&uid, &added);
        if added.is_ok() && netns_path.is_some() {
            // A sandbox's ADD carries all of the pod's addresses: any other recorded for it were
            // a replaced sandbox's, and kubelet's status may go from the old address to none to
            // the new one, so the reconciler never sees a change to follow (found on the real
            // node: the old entry stayed, put back at every host repair).
            if let Err(e) = self.drop_probe_ips_except(pod, &uid, ips) {
                tracing::warn!(error = %e, "cannot remove a replaced sandbox's probe set entries");
            }
        }
        if added.is_err() && netns_path.is_some() {
            // A failed ADD's sandbox is torn down by the runtime, which retries with a new one:
            // holding its namespace would keep a dead sandbox alive, and the informer path could
            // later enroll it instead of the pod's real one (found by the churn harness).
            self.cache.take(&uid);
        }
        added
    }

    /// The add pipeline with the annotation patch overlapped: the `pods/status` patch to
    /// `enabled` (on this machine's API server three quarters of an ADD) runs while the netns is
    /// opened, the rules applied, ztunnel acks and the probe set is written. Success is reported
    /// only once all of them succeeded, so a pod never runs unredirected nor before istiod can
    /// see it as HBONE. When a step fails, the patch is awaited and then compensated: the
    /// annotation goes back to what it was (`pending` when ztunnel refused or did not answer,
    /// as before), so a failed ADD never leaves `enabled` behind that it did not find.
    async fn add_locked(
        &self,
        pod: &CachedPod,
        uid: &str,
        ips: &[IpAddr],
        netns_path: Option<&str>,
    ) -> Result<(), MeshError> {
        let pod_name = name(pod);
        let cfg = self.pod_config(pod)?;
        let (namespace, pod_only) = ns_name(pod);
        let previous = pod.redirection();

        let began = Instant::now();
        // Without ztunnel, the sandbox of a CNI ADD would fail and wait for the runtime's retry,
        // seconds later: it waits for a ztunnel to connect instead, before the patch goes out (a
        // pod must not show `enabled` while it waits). The informer path does not hold its pod's
        // lock that long; its failure is retried with the reconciler's backoff.
        let connected = match netns_path {
            Some(_) => self.zds.wait_connected(ZTUNNEL_WAIT).await,
            None => Ok(()),
        };
        let ((annotated, annotated_at), redirected) = match connected {
            Err(source) => {
                let failed = MeshError::Ztunnel {
                    pod: pod_name.clone(),
                    source,
                };
                ((Ok(()), Instant::now()), Err(failed))
            }
            Ok(()) => {
                let annotate = async {
                    let result = self
                        .annotator
                        .set(namespace, pod_only, Redirection::Enabled)
                        .await;
                    (result, Instant::now())
                };
                let redirect = self.redirect(pod, uid, &pod_name, &cfg, ips, netns_path);
                if netns_path.is_some() {
                    // The sandbox of a CNI ADD cannot receive traffic before we answer (the
                    // kubelet publishes its IP only after the ADD), so the patch may go first.
                    tokio::join!(annotate, redirect)
                } else {
                    // A running pod enrolled by the informer path would be sent HBONE before it
                    // is redirected: the annotation follows the redirection, as always.
                    match redirect.await {
                        Ok(stages) => (annotate.await, Ok(stages)),
                        Err(failed) => ((Ok(()), Instant::now()), Err(failed)),
                    }
                }
            }
        };
        let stages = match redirected {
            Ok(stages) => stages,
            Err(failed) => {
                // The patch is done (or failed) by now: the compensation cannot be overtaken.
                let undo = match failed {
                    MeshError::Ztunnel { .. } => Redirection::Pending,
                    // Nothing was patched on the informer path.
                    _ if netns_path.is_none() => return Err(failed),
                    _ => previous,
                };
                if undo == Redirection::Enabled {
                    // As the failed ADD found it (a previous sandbox's).
                    return Err(failed);
                }
                if let Err(source) = self.annotator.set(namespace, pod_only, undo).await {
                    if matches!(failed, MeshError::Ztunnel { .. }) {
                        return Err(MeshError::Annotate {
                            pod: pod_name,
                            source,
                        });
                    }
                    tracing::error!(pod = %pod_name, error = %source, "cannot revert the redirection annotation of a failed ADD");
                }
                return Err(failed);
            }
        };
        annotated.map_err(|source| MeshError::Annotate {
            pod: pod_name.clone(),
            source,
        })?;
        // Where the time went, for "why was this sandbox slow to start". The stages after the
        // netns overlap the annotation patch.
        tracing::info!(
            pod = %pod_name,
            backend = self.rules.backend(),
            took = ?began.elapsed(),
            netns = ?(stages.resolved - began),
            rules = ?(stages.applied - stages.resolved),
            ztunnel = ?(stages.acked - stages.applied),
            probe_set = ?(stages.probed - began),
            annotated = ?(annotated_at - began),
            "pod enrolled in the ambient mesh"
        );
        Ok(())
    }

    /// The redirection half of an add: netns, routes + rules, ZDS Add and its ack, and the host
    /// probe set entry at the same time (it needs only the pod's IPs). When the rest fails, the
    /// entry is taken out again: a pod that is not enrolled gets no probe SNAT.
    async fn redirect(
        &self,
        pod: &CachedPod,
        uid: &str,
        pod_name: &str,
        cfg: &InpodConfig,
        ips: &[IpAddr],
        netns_path: Option<&str>,
    ) -> Result<Stages, MeshError> {
        let probe = async {
            let result = self.upsert_probe_ips(pod, uid, ips).await;
            (result, Instant::now())
        };
        let (probed, redirected) = tokio::join!(
            probe,
            self.rules_and_ack(pod, uid, pod_name, cfg, ips, netns_path)
        );
        match (redirected, probed) {
            (Ok((resolved, applied, acked)), (Ok(()), probed)) => Ok(Stages {
                resolved,
                applied,
                acked,
                probed,
            }),
            (Ok(_), (Err(failed), _)) => Err(failed),
            (Err(failed), _) => {
                self.remove_probe_ips(uid, ips).await;
                Err(failed)
            }
        }
    }

    /// Takes a failed add's probe set entries out again (only those carrying its UID); best
    /// effort, the failure is what the caller reports.
    async fn remove_probe_ips(&self, uid: &str, ips: &[IpAddr]) {
        let probes = self.probes.clone();
        let (uid, ips) = (uid.to_string(), ips.to_vec());
        let removed = on_thread(move || {
            ips.iter()
                .try_for_each(|ip| probes.remove(ip.to_canonical(), &uid))
        })
        .await;
        if let Err(e) = removed {
            tracing::warn!(error = %e, "cannot remove the probe set entries of a failed add");
        }
    }

    /// Netns, routes + rules, ZDS Add and its ack; returns when the first three finished.
    async fn rules_and_ack(
        &self,
        pod: &CachedPod,
        uid: &str,
        pod_name: &str,
        cfg: &InpodConfig,
        ips: &[IpAddr],
        netns_path: Option<&str>,
    ) -> Result<(Instant, Instant, Instant), MeshError> {
        let uid = uid.to_string();
        let workload = workload_info(pod);
        let began = Instant::now();
        let netns = match self.resolve_netns(&uid, &workload, ips, netns_path).await {
            Ok(ns) => ns,
            Err(why) => {
                self.cache.take(&uid);
                return Err(MeshError::Netns {
                    pod: pod_name.to_string(),
                    why,
                });
            }
        };
        let resolved = Instant::now();
        observe(&self.metrics.netns_resolve_seconds, resolved - began);

        let rules = self.rules.clone();
        let c = cfg.clone();
        let applied = in_netns(&netns, move |ns| rules.enroll(ns, &c)).await;
        if let Err(source) = applied {
            self.cache.take(&uid);
            return Err(MeshError::Rules {
                pod: pod_name.to_string(),
                backend: self.rules.backend(),
                source,
            });
        }
        let backend = BackendLabel {
            backend: self.rules.backend().to_string(),
        };
        let applied = Instant::now();
        observe(
            &self.metrics.rule_apply_seconds.get_or_create(&backend),
            applied - resolved,
        );

        if let Err(source) = self.zds.pod_added(&uid, workload, &netns).await {
            return Err(MeshError::Ztunnel {
                pod: pod_name.to_string(),
                source,
            });
        }
        Ok((resolved, applied, Instant::now()))
    }

    /// The IPs of an enrolled pod changed, with no empty step between (an address reassigned, a
    /// sandbox replaced under the same pod): the new ones go into the host probe set and the
    /// ones the pod no longer has come out (only where still tagged with this pod), so kubelet's
    /// probes follow the pod and no other pod inherits its SNAT.
    pub async fn sync_probe_ips(
        &self,
        pod: &CachedPod,
        uid: &str,
        ips: &[IpAddr],
    ) -> Result<(), MeshError> {
        let _pod_lock = self.locks.lock(uid).await;
        self.upsert_probe_ips(pod, uid, ips).await?;
        self.drop_probe_ips_except(pod, uid, ips)
    }

    /// Takes out the probe set entries recorded for `uid` at addresses other than `ips` (only
    /// where still tagged with this pod: another pod may own the address now).
    fn drop_probe_ips_except(
        &self,
        pod: &CachedPod,
        uid: &str,
        ips: &[IpAddr],
    ) -> Result<(), MeshError> {
        let current: HashSet<IpAddr> = ips.iter().map(|ip| ip.to_canonical()).collect();
        let gone: Vec<IpAddr> = self
            .probe_ips
            .with_recorded(uid, &[])
            .into_iter()
            .filter(|ip| !current.contains(ip))
            .collect();
        for ip in gone {
            self.probes
                .remove(ip, uid)
                .map_err(|source| MeshError::ProbeSet {
                    pod: name(pod),
                    source,
                })?;
            self.probe_ips.drop_ip(uid, ip);
        }
        Ok(())
    }

    /// Adds the pod's IPs to the host probe set.
    pub async fn upsert_probe_ips(
        &self,
        pod: &CachedPod,
        uid: &str,
        ips: &[IpAddr],
    ) -> Result<(), MeshError> {
        let entries: Vec<(IpAddr, String)> = ips
            .iter()
            .map(|ip| (ip.to_canonical(), uid.to_string()))
            .collect();
        self.probe_ips
            .record(uid, entries.iter().map(|(ip, _)| *ip));
        self.upsert_probes(entries)
            .await
            .map_err(|source| MeshError::ProbeSet {
                pod: name(pod),
                source,
            })
    }

    /// One probe-set transaction (netlink in the host namespace, so on a blocking thread).
    async fn upsert_probes(&self, entries: Vec<(IpAddr, String)>) -> Result<(), BoxError> {
        let probes = self.probes.clone();
        on_thread(move || probes.upsert_many(&entries)).await
    }

    async fn resolve_netns(
        &self,
        uid: &str,
        workload: &WorkloadInfo,
        ips: &[IpAddr],
        netns_path: Option<&str>,
    ) -> Result<Arc<Netns>, String> {
        if let Some(path) = netns_path {
            let ns = self
                .cache
                .open_netns(path, self.host_netns)
                .map_err(|e| e.to_string())?;
            self.hints.record(uid, path);
            return Ok(self.cache.upsert(uid, workload.clone(), ns));
        }
        if let Some(ns) = self.cache.get(uid).and_then(|e| e.netns) {
            return Ok(ns);
        }
        if let Some(ns) = self.hints.open_verified(uid, ips, &self.host_prefix) {
            return Ok(self.cache.upsert(uid, workload.clone(), ns));
        }
        self.cache.ensure_with(uid, workload.clone());
        let wanted = HashMap::from([(
            uid.to_string(),
            WantedPod {
                workload: workload.clone(),
                ips: ips.to_vec(),
            },
        )]);
        let mut found = self.discover(wanted).await?;
        let hit = found.remove(uid).ok_or_else(|| {
            "no process of the pod found under /proc (normal for a pod still being created)"
                .to_string()
        })?;
        Ok(self.cache.upsert(uid, workload.clone(), hit))
    }

    /// Finds the namespaces of running pods under /proc (after an agent restart, or for pods that
    /// were enrolled by a namespace label rather than by their CNI ADD).
    pub async fn discover(
        &self,
        wanted: HashMap<String, WantedPod>,
    ) -> Result<HashMap<String, Netns>, String> {
        let (proc_dir, host) = (self.proc_dir.clone(), self.host_netns);
        tokio::task::spawn_blocking(move || {
            let scanner = ProcScanner::with_host(&proc_dir, host);
            let found = scanner
                .find(&HostNetns, &wanted)
                .map_err(|e| e.to_string())?;
            Ok(found.into_iter().map(|(uid, f)| (uid, f.netns)).collect())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Keeps `pod` for ztunnel without a namespace, as the restore does.
    pub fn keep(&self, pod: &CachedPod) {
        if let Some(uid) = pod.metadata.uid.as_deref() {
            self.cache.ensure_with(uid, workload_info(pod));
        }
    }

    /// Removes a pod from the mesh. `is_delete`: the pod object is gone (no rule removal, and
    /// annotation errors are not reported).
    pub async fn remove(
        &self,
        pod: &CachedPod,
        ips: &[IpAddr],
        is_delete: bool,
    ) -> Result<(), MeshError> {
        let pod_name = name(pod);
        let uid = pod
            .metadata
            .uid
            .clone()
            .ok_or_else(|| MeshError::NoUid(pod_name.clone()))?;
        let _pod_lock = self.locks.lock(&uid).await;
        if is_delete {
            self.last_errors.forget(&uid);
        }
        // Also every entry tagged with the pod that this agent never recorded: one made for a
        // sandbox the runtime replaced while no agent ran (an ADD cut short by the agent's kill,
        // retried in a new sandbox with a new address) would otherwise stay for good.
        let tagged = self.probes.list().map_err(|source| MeshError::ProbeSet {
            pod: pod_name.clone(),
            source,
        })?;
        let mut gone = self.probe_ips.with_recorded(&uid, ips);
        for (ip, tag) in tagged {
            if tag == uid && !gone.contains(&ip) {
                gone.push(ip);
            }
        }
        for ip in gone {
            self.probes
                .remove(ip, &uid)
                .map_err(|source| MeshError::ProbeSet {
                    pod: pod_name.clone(),
                    source,
                })?;
        }
        self.probe_ips.forget(&uid);
        let entry = self.cache.take(&uid);
        if is_delete {
            self.hints.forget(&uid);
        } else {
            match entry.and_then(|e| e.netns) {
                Some(netns) => {
                    let cfg = self.pod_config(pod).unwrap_or_else(|_| self.global.clone());
                    let rules = self.rules.clone();
                    in_netns(&netns, move |ns| rules.unenroll(ns, &cfg))
                        .await
                        .map_err(|source| MeshError::Rules {
                            pod: pod_name.clone(),
                            backend: self.rules.backend(),
                            source,
                        })?;
                }
                None => {
                    tracing::warn!(pod = %pod_name, "netns unknown: cannot remove in-pod rules")
                }
            }
        }
        self.zds
            .pod_deleted(&uid)
            .await
            .map_err(|source| MeshError::Ztunnel {
                pod: pod_name.clone(),
                source,
            })?;
        let (namespace, pod_only) = ns_name(pod);
        match self
            .annotator
            .set(namespace, pod_only, Redirection::Absent)
            .await
        {
            Err(source) if !is_delete => Err(MeshError::Annotate {
                pod: pod_name,
                source,
            }),
            _ => {
                tracing::info!(pod = %pod_name, deleted = is_delete, "pod removed from the ambient mesh");
                Ok(())
            }
        }
    }
}

impl Mesh {
    /// Rebuilds the agent's state for pods enrolled before it started (agent restart, upgrade):
    /// their IPs go back into the probe set (stale entries pruned only when every pod's IPs are
    /// known), their namespaces are found under /proc, and with `reconcile` their rules are
    /// verified and repaired where they drifted. Pods whose namespace is not found stay in the
    /// cache without one, so ztunnel is told to keep them rather than drop them. A pod found in
    /// `prechecked` as it is listed (its IPs there, the node's settings) is not checked again.
    pub async fn restore(
        &self,
        pods: &[Arc<CachedPod>],
        reconcile: bool,
        mut prechecked: Prechecks,
    ) {
        let mut keep = HashSet::new();
        let mut without_ips = HashSet::new();
        let mut wanted = HashMap::new();
        let mut entries = Vec::new();
        for pod in pods {
            let Some(uid) = pod.metadata.uid.clone() else {
                continue;
            };
            let f = super::cluster::facts(pod);
            if f.ips.is_empty() {
                without_ips.insert(uid.clone());
            }
            for ip in &f.ips {
                let ip = ip.to_canonical();
                keep.insert(ip);
                entries.push((ip, uid.clone()));
            }
            self.probe_ips
                .record(&uid, f.ips.iter().map(|ip| ip.to_canonical()));
            let workload = workload_info(pod);
            self.cache.ensure_with(&uid, workload.clone());
            wanted.insert(
                uid,
                (
                    pod.clone(),
                    WantedPod {
                        workload,
                        ips: f.ips,
                    },
                ),
            );
        }
        // The host's probe set and the pods' namespaces are independent: both at once.
        let probes = async {
            if let Err(e) = self.upsert_probes(entries).await {
                tracing::warn!(error = %e, "cannot restore the probe set entries of enrolled pods");
            }
            // An enrolled pod whose IP is not in the API yet keeps the entries tagged with it;
            // any other entry is of a pod deleted while no agent ran, and goes. (Pruning nothing
            // while one pod lacked its IP, as an ADD cut short by the agent's kill leaves it, kept
            // the entries of pods deleted meanwhile for good.)
            let probes = self.probes.clone();
            let pruned = on_thread(move || {
                let mut keep = keep;
                keep.extend(
                    probes
                        .list()?
                        .into_iter()
                        .filter(|(_, uid)| without_ips.contains(uid))
                        .map(|(ip, _)| ip),
                );
                probes.prune(&keep)
            });
            if let Err(e) = pruned.await {
                tracing::warn!(error = %e, "cannot prune the probe set");
            }
        };
        let started = Instant::now();
        // Each hinted pod in one job inside its namespace: that the namespace still holds the
        // pod's IPs, then the check of its rules, so the check starts as soon as the pod's
        // namespace is found rather than after every pod's (the restart is this pipeline).
        let hinted = async {
            use futures::StreamExt;
            let lookups: Vec<_> = wanted
                .iter()
                .filter(|(_, (_, w))| !w.ips.is_empty())
                .map(|(uid, (pod, w))| {
                    self.restore_hinted(uid, pod, w, reconcile, prechecked.remove(uid))
                })
                .collect();
            futures::stream::iter(lookups)
                .buffer_unordered(PARALLEL_NETNS_WORK)
                .collect::<Vec<_>>()
                .await
        };
        let ((), hits) = tokio::join!(probes, hinted);
        let mut found = HashSet::new();
        let mut repaired = 0;
        for (uid, was_repaired) in hits.into_iter().flatten() {
            repaired += usize::from(was_repaired);
            found.insert(uid);
        }
        let lookup: HashMap<String, WantedPod> = wanted
            .iter()
            .filter(|(uid, _)| !found.contains(*uid))
            .map(|(uid, (_, w))| (uid.clone(), w.clone()))
            .collect();
        let mut discovered = Vec::new();
        if !lookup.is_empty() {
            let scan = Instant::now();
            let more = self.discover(lookup).await;
            observe(&self.metrics.netns_resolve_seconds, scan.elapsed());
            match more {
                Ok(more) => {
                    for (uid, netns) in more {
                        if let Some((pod, w)) = wanted.get(&uid) {
                            self.cache.upsert(&uid, w.workload.clone(), netns);
                            discovered.push(pod.clone());
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "netns discovery under /proc failed; those pods are kept, not re-handed")
                }
            }
        }
        tracing::info!(
            enrolled = wanted.len(),
            found = found.len() + discovered.len(),
            "restored enrolled pods"
        );
        repaired += self.check_restored(&discovered, reconcile).await;
        tracing::info!(
            checked = found.len() + discovered.len(),
            repaired,
            took = ?started.elapsed(),
            "enrolled pods' rules checked"
        );
    }

    /// A pod found through its netns hint, cached with that namespace once it is verified to
    /// hold one of the pod's IPs, and checked in the same job inside it as
    /// [`check_restored`](Self::check_restored) does (no check when the pod's overrides cannot be
    /// read). Returns the pod's UID and whether it was repaired; `None` when the hint is missing
    /// or stale.
    async fn restore_hinted(
        &self,
        uid: &str,
        pod: &CachedPod,
        wanted: &WantedPod,
        reconcile: bool,
        prechecked: Option<Prechecked>,
    ) -> Option<(String, bool)> {
        let cfg = self.pod_config(pod).ok();
        if let Some(pre) = prechecked.filter(|pre| {
            cfg.as_ref() == Some(&pre.cfg) && addresses_contain_any(&pre.addrs, &wanted.ips)
        }) {
            return self
                .restore_prechecked(uid, pod, wanted, reconcile, pre)
                .await;
        }
        // Reading the hint (tmpfs) and opening its path (nsfs) do not block; the rest goes to a
        // pod namespace worker.
        let ns = self.hints.open_unverified(uid, &self.host_prefix)?;
        let inside = Arc::new(ns.try_clone().ok()?);
        let (ips, rules) = (wanted.ips.clone(), self.rules.clone());
        // Held until the pod is cached with its namespace, as an ADD or a removal would hold it.
        let _pod_lock = self.locks.lock(uid).await;
        if self.enrolled_since_start(uid) {
            return Some((uid.to_string(), false));
        }
        let job = in_netns(&inside, move |inside| {
            let owns = HostNetns.owns(inside, &ips);
            let checked = (owns == Ok(true))
                .then_some(cfg)
                .flatten()
                .map(|cfg| check_and_repair(&*rules, inside, &cfg, !reconcile));
            Ok((owns, checked))
        })
        .await;
        let (owns, checked) = job.unwrap_or_else(|e| (Err(e.to_string()), None));
        if !super::hints::verified(uid, owns) {
            return None;
        }
        self.cache.upsert(uid, wanted.workload.clone(), ns);
        let repaired = checked.is_some_and(|result| self.report_repair(pod, result));
        Some((uid.to_string(), repaired))
    }

    /// [`restore_hinted`](Self::restore_hinted) for a pod whose namespace was checked before the
    /// lists arrived: cached at once when that check found nothing to repair; otherwise checked
    /// again under the pod's lock (the first check did not hold it) and repaired.
    async fn restore_prechecked(
        &self,
        uid: &str,
        pod: &CachedPod,
        wanted: &WantedPod,
        reconcile: bool,
        pre: Prechecked,
    ) -> Option<(String, bool)> {
        let _pod_lock = self.locks.lock(uid).await;
        if self.enrolled_since_start(uid) {
            return Some((uid.to_string(), false));
        }
        let result = match pre.found {
            Ok(None) => Ok(None),
            Ok(Some(_)) | Err(_) => {
                let (inside, rules, cfg) = (
                    Arc::new(pre.netns.try_clone().ok()?),
                    self.rules.clone(),
                    pre.cfg,
                );
                in_netns(&inside, move |inside| {
                    check_and_repair(&*rules, inside, &cfg, !reconcile)
                })
                .await
            }
        };
        self.cache.upsert(uid, wanted.workload.clone(), pre.netns);
        Some((uid.to_string(), self.report_repair(pod, result)))
    }

    /// Whether a CNI ADD enrolled `uid` since this agent started (it holds the namespace the
    /// runtime just gave the pod, which a restore must not replace with the hinted one).
    fn enrolled_since_start(&self, uid: &str) -> bool {
        self.cache.get(uid).is_some_and(|e| e.netns.is_some())
    }

    /// Checks every hinted namespace before the API server's lists say which pods are enrolled,
    /// so that after a restart the namespace work overlaps the lists rather than following them:
    /// each namespace's addresses, and its rules against the node's settings (what a pod without
    /// overrides has), read only. [`restore`](Self::restore) uses a result only for a listed pod
    /// whose IPs the namespace holds and whose settings are those; any other pod is checked as
    /// before.
    pub async fn precheck_hinted(&self, reconcile: bool) -> Prechecks {
        use futures::StreamExt;
        let started = Instant::now();
        let Ok((cfg, _)) = inpod_config(&self.global, std::iter::empty()) else {
            return Prechecks::new();
        };
        let jobs: Vec<_> = self
            .hints
            .uids()
            .into_iter()
            .map(|uid| {
                let (cfg, rules) = (cfg.clone(), self.rules.clone());
                async move {
                    let netns = self.hints.open_unverified(&uid, &self.host_prefix)?;
                    let inside = Arc::new(netns.try_clone().ok()?);
                    let check_cfg = cfg.clone();
                    let (addrs, found) = in_netns(&inside, move |inside| {
                        let found = check(&*rules, inside, &check_cfg, !reconcile);
                        Ok((addresses(inside), found.map_err(|e| e.to_string())))
                    })
                    .await
                    .ok()?;
                    let pre = Prechecked {
                        netns,
                        addrs: addrs.ok()?,
                        cfg,
                        found,
                    };
                    Some((uid, pre))
                }
            })
            .collect();
        let prechecked: Prechecks = futures::stream::iter(jobs)
            .buffer_unordered(PARALLEL_NETNS_WORK)
            .filter_map(std::future::ready)
            .collect()
            .await;
        tracing::info!(
            namespaces = prechecked.len(),
            took = ?started.elapsed(),
            "hinted namespaces checked"
        );
        prechecked
    }

    /// The check of pods another agent enrolled: with `reconcile` their rules are verified and
    /// repaired where they drifted; either way a pod still redirected by the backend used before a
    /// switch is repaired (left alone it would keep redirecting after it leaves the mesh). Returns
    /// how many pods were repaired.
    pub async fn check_restored(&self, pods: &[Arc<CachedPod>], reconcile: bool) -> usize {
        if reconcile {
            self.repair_drift(pods).await
        } else {
            self.repair_where(pods, true).await
        }
    }

    /// Verifies the rules of every enrolled pod the agent holds a namespace for and re-applies
    /// them where they drifted (someone flushed a table, a rule was deleted or added). Returns how
    /// many pods were repaired.
    pub async fn repair_drift(&self, pods: &[Arc<CachedPod>]) -> usize {
        self.repair_where(pods, false).await
    }

    /// [`repair_drift`](Self::repair_drift); with `leftovers_only`, only of the pods that hold
    /// the previous backend's rules.
    async fn repair_where(&self, pods: &[Arc<CachedPod>], leftovers_only: bool) -> usize {
        use futures::StreamExt;
        // Futures collected first: a closure inside the stream would make the whole reconciler
        // future lose `Send` (a known higher-ranked lifetime limit).
        let checks: Vec<_> = pods
            .iter()
            .map(|pod| self.repair_one(pod, leftovers_only))
            .collect();
        let results: Vec<bool> = futures::stream::iter(checks)
            .buffer_unordered(PARALLEL_NETNS_WORK)
            .collect()
            .await;
        results.into_iter().filter(|repaired| *repaired).count()
    }

    async fn repair_one(&self, pod: &Arc<CachedPod>, leftovers_only: bool) -> bool {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return false;
        };
        // Held across the check and the repair; a pod removed meanwhile is no longer cached.
        let _pod_lock = self.locks.lock(uid).await;
        let Some(netns) = self.cache.get(uid).and_then(|e| e.netns) else {
            return false;
        };
        let Ok(cfg) = self.pod_config(pod) else {
            return false;
        };
        // The check after a restore (leftovers only) runs on namespaces just verified to hold the
        // pod's addresses; the periodic one also asks whether the namespace still does.
        let ips = match leftovers_only {
            true => Vec::new(),
            false => super::cluster::facts(pod).ips,
        };
        let (rules, owned, c) = (self.rules.clone(), ips.clone(), cfg.clone());
        let found = in_netns(&netns, move |netns| {
            if replaced(&owned, |ips| HostNetns.owns(netns, ips)) {
                return Ok(Checked::Replaced);
            }
            check_and_repair(&*rules, netns, &c, leftovers_only).map(Checked::Rules)
        })
        .await;
        match found {
            Ok(Checked::Replaced) => self.enroll_replaced(pod, uid, &netns, cfg, ips).await,
            Ok(Checked::Rules(result)) => self.report_repair(pod, Ok(result)),
            Err(e) => self.report_repair(pod, Err(e)),
        }
    }

    /// The drift check found the pod's namespace holding none of the pod's addresses: its
    /// sandbox was replaced (or its address moved elsewhere) without a CNI ADD reaching this
    /// agent, e.g. the runtime set the new sandbox up from a config another writer had just
    /// replaced. The new sandbox then runs unredirected while the old namespace, kept alive by
    /// our fd, still reads in sync: the pod would be lost for good (istio/istio#61182). The
    /// namespace that holds the addresses now is looked up under /proc, gets the pod's rules,
    /// and goes to ztunnel as an Add of the same UID (ztunnel drains the old proxy and starts
    /// one in the new namespace); only then does it replace the cached one, so a failed step is
    /// found and retried at the next check. Nothing is found while the new sandbox has no
    /// process yet, nor while the ADD that made it is in flight (it caches its namespace before
    /// the API shows the new address): the next check looks again. Returns whether it
    /// re-enrolled the pod.
    async fn enroll_replaced(
        &self,
        pod: &CachedPod,
        uid: &str,
        stale: &Netns,
        cfg: InpodConfig,
        ips: Vec<IpAddr>,
    ) -> bool {
        let pod_name = name(pod);
        let workload = workload_info(pod);
        let wanted = HashMap::from([(
            uid.to_string(),
            WantedPod {
                workload: workload.clone(),
                ips,
            },
        )]);
        let fresh = match self.discover(wanted).await {
            Ok(mut found) => found.remove(uid).filter(|ns| ns.id() != stale.id()),
            Err(e) => {
                tracing::warn!(pod = %pod_name, error = %e, "cannot look for the namespace of a pod whose addresses left its own");
                None
            }
        };
        let Some(fresh) = fresh else {
            tracing::info!(pod = %pod_name, "the pod's namespace holds none of its addresses, and no other one of its does yet");
            return false;
        };
        let fresh = Arc::new(fresh);
        let rules = self.rules.clone();
        if let Err(e) = in_netns(&fresh, move |ns| rules.enroll(ns, &cfg)).await {
            tracing::error!(pod = %pod_name, backend = self.rules.backend(), error = %e, "cannot redirect the pod's replaced namespace");
            return false;
        }
        if let Err(e) = self.zds.pod_added(uid, workload.clone(), &fresh).await {
            tracing::error!(pod = %pod_name, error = %e, "ztunnel did not accept the pod's replaced namespace");
            return false;
        }
        let Ok(cached) = fresh.try_clone() else {
            return false;
        };
        self.cache.upsert(uid, workload, cached);
        // The hint names the old sandbox's namespace; a restart finds the new one under /proc.
        self.hints.forget(uid);
        self.count_drift_repair("pod");
        tracing::warn!(pod = %pod_name, "pod's network namespace was replaced without a CNI ADD; enrolled again in the new one");
        true
    }

    fn drift_label(&self, scope: &'static str) -> DriftLabel {
        DriftLabel {
            backend: self.rules.backend().to_string(),
            scope,
        }
    }

    fn count_drift_repair(&self, scope: &'static str) {
        let label = self.drift_label(scope);
        self.metrics.drift_repairs.get_or_create(&label).inc();
    }

    /// Exports both scopes' repair counts at 0 before the first drift check: an alert's
    /// `increase()` sees the first repair only on a series that existed before it.
    pub fn export_drift_repairs(&self) {
        for scope in ["pod", "host"] {
            let _ = self
                .metrics
                .drift_repairs
                .get_or_create(&self.drift_label(scope));
        }
    }

    /// Beyond Istio, the host side under the same drift repair as pods: a firewall reload or a
    /// tuning daemon that flushes nat (or `nft flush ruleset`) takes the probe SNAT rules and set
    /// entries, and kubelet's probes to every ambient pod fail while the agent lives. The rules
    /// are re-applied where they drifted, and every entry this agent made and still holds is put
    /// back. Returns whether anything was repaired; an error leaves the host as it was found.
    pub async fn repair_host(&self) -> Result<bool, BoxError> {
        let probes = self.probes.clone();
        let want = self.probe_ips.entries();
        let (rules, missing) = on_thread(move || {
            let rules = probes.repair_rules()?;
            Ok((rules, probes.missing(&want)?))
        })
        .await?;
        if let Some(was) = &rules {
            tracing::warn!(?was, "host probe rules drifted; re-applied");
        }
        let mut restored = 0;
        for (ip, uid) in missing {
            // Under the pod's lock, and only while still recorded: an entry of a pod removed
            // since the list was taken must stay removed.
            let _pod_lock = self.locks.lock(&uid).await;
            if !self.probe_ips.holds(&uid, ip) {
                continue;
            }
            self.upsert_probes(vec![(ip, uid)]).await?;
            restored += 1;
        }
        if restored > 0 {
            tracing::warn!(entries = restored, "host probe set lost entries; restored");
        }
        let repaired = rules.is_some() || restored > 0;
        if repaired {
            self.count_drift_repair("host");
        }
        Ok(repaired)
    }

    /// Logs and counts what [`check_and_repair`] found; returns whether the pod was repaired.
    fn report_repair(&self, pod: &CachedPod, result: Result<Option<RuleState>, BoxError>) -> bool {
        match result {
            Ok(None) => false,
            Ok(Some(was)) => {
                self.count_drift_repair("pod");
                tracing::warn!(pod = %name(pod), ?was, "in-pod rules drifted; re-applied");
                true
            }
            Err(e) => {
                tracing::error!(pod = %name(pod), error = %e, "cannot check or repair in-pod rules");
                false
            }
        }
    }
}

/// What a drift check found in a pod's cached namespace.
enum Checked {
    /// The rules, as [`check_and_repair`] left them.
    Rules(Option<RuleState>),
    /// The namespace holds none of the pod's addresses any more.
    Replaced,
}

/// Whether a pod's namespace was replaced under it: the pod has addresses and the namespace
/// (`owns` lists its addresses) holds none of them. A pod without addresses yet, or a namespace
/// whose addresses cannot be read, is no evidence either way.
fn replaced(ips: &[IpAddr], owns: impl FnOnce(&[IpAddr]) -> Result<bool, String>) -> bool {
    !ips.is_empty() && owns(ips) == Ok(false)
}

/// A hinted namespace as [`Mesh::precheck_hinted`] found it.
pub struct Prechecked {
    netns: Netns,
    addrs: Vec<IpAddr>,
    /// The settings its rules were checked against.
    cfg: InpodConfig,
    /// What [`check`] found.
    found: Result<Option<RuleState>, String>,
}

/// Prechecked namespaces by pod UID.
pub type Prechecks = HashMap<String, Prechecked>;

/// What [`check_and_repair`] would repair: the state found, or `None` when the rules are in sync
/// (with `leftovers_only`, when the pod holds no rules of the previous backend).
fn check(
    rules: &dyn PodRules,
    netns: &Netns,
    cfg: &InpodConfig,
    leftovers_only: bool,
) -> Result<Option<RuleState>, BoxError> {
    if leftovers_only && !rules.leftovers(netns)? {
        return Ok(None);
    }
    match rules.verify(netns, cfg)? {
        RuleState::InSync => Ok(None),
        state => Ok(Some(state)),
    }
}

/// Verifies a pod's rules and re-applies them where they drifted (with `leftovers_only`, only
/// when it holds the previous backend's rules); returns the state found when it repaired.
fn check_and_repair(
    rules: &dyn PodRules,
    netns: &Netns,
    cfg: &InpodConfig,
    leftovers_only: bool,
) -> Result<Option<RuleState>, BoxError> {
    match check(rules, netns, cfg, leftovers_only)? {
        None => Ok(None),
        Some(state) => rules.enroll(netns, cfg).map(|()| Some(state)),
    }
}

/// Runs `f` inside `netns` on a pod namespace worker (see [`Netns::run_detached`]); the pod's
/// rule work neither blocks a runtime worker nor waits for a blocking-pool thread behind other
/// pods.
///
/// At most one such job per CPU at a time ([`netns_slots`]): the work is CPU-bound, and more
/// threads than cores would only contend for the CPUs and the allocator's locks (musl's is
/// global), as the two pooled threads never did.
pub async fn in_netns<T: Send + 'static>(
    netns: &Arc<Netns>,
    f: impl FnOnce(&Netns) -> Result<T, BoxError> + Send + 'static,
) -> Result<T, BoxError> {
    let _slot = netns_slots().acquire().await?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    netns.clone().run_detached(f, move |r| drop(tx.send(r)))?;
    match rx.await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err("netns thread panicked".into()),
    }
}

/// Pod namespace threads allowed at once: one per CPU, at least two.
fn netns_slots() -> &'static tokio::sync::Semaphore {
    static SLOTS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        tokio::sync::Semaphore::new(cpus.max(2))
    })
}

/// Runs blocking `f` on a thread of its own, for host-side work that must not wait behind the
/// blocking pool (two threads) nor block a runtime worker.
pub async fn on_thread<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BoxError> + Send + 'static,
) -> Result<T, BoxError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("host-op".into())
        .spawn(move || drop(tx.send(f())))?;
    rx.await
        .unwrap_or_else(|_| Err("host thread panicked".into()))
}

/// Pods whose namespaces are checked at once (startup restore, drift checks): enough to overlap
/// the kernel's waits, few enough not to starve CNI ADDs on a small node.
const PARALLEL_NETNS_WORK: usize = 8;

/// How long a CNI ADD waits for a ztunnel to connect: ztunnel reconnects to a restarted agent
/// within about a second (its backoff doubles from 20 ms), and the plugin gives the whole ADD 5 s.
const ZTUNNEL_WAIT: Duration = Duration::from_secs(3);

fn ns_name(pod: &CachedPod) -> (&str, &str) {
    (
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_pod_is_finished_until_deleted_or_added_again() {
        let finished = FinishedPods::default();
        assert!(!finished.take("uid-a"), "never removed");
        finished.insert("uid-a");
        assert!(finished.contains("uid-a"), "a later update finds it");
        assert!(finished.take("uid-a"), "its delete event finds it");
        assert!(!finished.take("uid-a"), "and only that one");
        finished.insert("uid-b");
        finished.forget("uid-b");
        assert!(
            !finished.take("uid-b"),
            "added again: its delete removes it"
        );
    }

    #[test]
    fn a_namespace_is_replaced_only_when_it_holds_none_of_the_pods_addresses() {
        let ip: IpAddr = "10.244.0.7".parse().unwrap();
        assert!(replaced(&[ip], |_| Ok(false)), "the addresses left it");
        assert!(!replaced(&[ip], |_| Ok(true)), "it still holds one");
        assert!(
            !replaced(&[ip], |_| Err("netlink".into())),
            "an unreadable namespace is no evidence"
        );
        assert!(
            !replaced(&[], |_| unreachable!("nothing to look for")),
            "a pod without addresses yet"
        );
    }

    #[test]
    fn removal_covers_the_ips_a_pod_object_no_longer_shows() {
        let known = ProbeIps::default();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        known.record("uid-a", [ip("10.88.0.7")]);
        let mut got = known.with_recorded("uid-a", &[]);
        got.sort();
        assert_eq!(got, [ip("10.88.0.7")]);
        let mut got = known.with_recorded("uid-a", &[ip("10.88.0.8"), ip("::ffff:10.88.0.7")]);
        got.sort();
        assert_eq!(got, [ip("10.88.0.7"), ip("10.88.0.8")]);
        assert!(known.with_recorded("uid-b", &[]).is_empty());
        known.forget("uid-a");
        assert!(known.with_recorded("uid-a", &[]).is_empty());
    }

    #[tokio::test]
    async fn one_operation_per_pod_at_a_time() {
        let locks = Arc::new(PodLocks::default());
        let held = locks.lock("pod-a").await;
        // Another pod is not held up.
        let other = tokio::time::timeout(std::time::Duration::from_secs(1), locks.lock("pod-b"))
            .await
            .expect("a different pod waits for nothing");
        drop(other);
        // The same pod waits until the first operation is done.
        let waiter = tokio::spawn({
            let locks = locks.clone();
            async move { drop(locks.lock("pod-a").await) }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        drop(held);
        waiter.await.unwrap();
        // Locks nobody holds are not kept.
        drop(locks.lock("pod-c").await);
        assert_eq!(locks.0.lock().unwrap().len(), 1);
    }
}
