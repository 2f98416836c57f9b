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
//!
//! One file per verb (`add`, `remove`, `restore`, `repair`); every side effect goes through the
//! [`seams`], so `fail_closed` drives each failure branch with the recording `fakes`.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::overrides::inpod_config;
use cni_core::zds::WorkloadInfo;
use dataplane::netns::Netns;

use super::cluster::CachedPod;
use crate::metrics::Metrics;
use crate::netns_cache::NetnsCache;
use crate::procfs::{HostNetns, ProcScanner, WantedPod};

mod add;
#[cfg(test)]
mod fail_closed;
#[cfg(test)]
mod fakes;
mod remove;
mod repair;
mod restore;
mod seams;

pub use restore::{Prechecked, Prechecks};
pub use seams::{Annotations, BoxError, PodRules, ProbeSet, Seams, Ztunnel};

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
        source: cni_core::redirect::ambient::overrides::OverrideError,
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

/// Everything the add and remove pipelines touch.
pub struct Mesh {
    pub cache: Arc<NetnsCache>,
    pub zds: Arc<dyn Ztunnel>,
    pub rules: Arc<dyn PodRules>,
    pub probes: Arc<dyn ProbeSet>,
    pub annotations: Arc<dyn Annotations>,
    /// Node-wide rule settings; pod annotations override them.
    pub global: InpodConfig,
    /// `/host/proc` (or `/proc`): where running pods' namespaces are discovered.
    pub proc_dir: std::path::PathBuf,
    /// Where the host's filesystem is mounted (`CNI_NETNS` paths resolve beneath it).
    pub host_prefix: std::path::PathBuf,
    /// The host's namespace: never a pod's, whatever /proc says.
    pub host_netns: dataplane::netns::NetnsId,
    /// Where the runtime pins pod namespaces (`<host_prefix>/var/run/netns`): searched for the
    /// pods /proc does not show (see [`crate::pinned_netns`]).
    pub netns_dir: std::path::PathBuf,
    pub hints: crate::ambient::hints::NetnsHints,
    pub metrics: Metrics,
    /// One operation per pod at a time (see [`PodLocks`]).
    pub locks: PodLocks,
    pub probe_ips: ProbeIps,
    /// Pods removed for good while their object still existed (terminal phase).
    pub finished: FinishedPods,
    /// Why each pod's last add failed, for `install-cni explain`.
    pub last_errors: LastErrors,
}

/// Where the node keeps its pods: their namespaces, and the settings the pipelines read.
pub struct NodeContext {
    pub cache: Arc<NetnsCache>,
    pub hints: crate::ambient::hints::NetnsHints,
    /// Node-wide rule settings; pod annotations override them.
    pub global: InpodConfig,
    /// `/host/proc` (or `/proc`): where running pods' namespaces are discovered.
    pub proc_dir: std::path::PathBuf,
    /// Where the host's filesystem is mounted (`CNI_NETNS` paths resolve beneath it).
    pub host_prefix: std::path::PathBuf,
    /// The host's namespace: never a pod's, whatever /proc says.
    pub host_netns: dataplane::netns::NetnsId,
    /// Where the runtime pins pod namespaces, as the agent sees it.
    pub netns_dir: std::path::PathBuf,
}

impl Mesh {
    /// A mesh acting through `seams` on the pods of `node`, with no pod in flight yet.
    pub fn new(seams: Seams, node: NodeContext, metrics: Metrics) -> Mesh {
        let Seams {
            rules,
            probes,
            annotations,
            ztunnel,
        } = seams;
        let NodeContext {
            cache,
            hints,
            global,
            proc_dir,
            host_prefix,
            host_netns,
            netns_dir,
        } = node;
        Mesh {
            cache,
            zds: ztunnel,
            rules,
            probes,
            annotations,
            global,
            proc_dir,
            host_prefix,
            host_netns,
            netns_dir,
            hints,
            metrics,
            locks: PodLocks::default(),
            probe_ips: ProbeIps::default(),
            finished: FinishedPods::default(),
            last_errors: LastErrors::default(),
        }
    }
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

#[cfg(test)]
impl PodLocks {
    /// Operations queued behind the one holding `uid`'s lock (the map holds one reference, the
    /// holder another).
    pub fn waiters(&self, uid: &str) -> usize {
        let locks = self.0.lock().unwrap();
        locks
            .get(uid)
            .map_or(0, |l| Arc::strong_count(l).saturating_sub(2))
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

    /// One probe-set transaction (netlink in the host namespace, so on a blocking thread).
    async fn upsert_probes(&self, entries: Vec<(IpAddr, String)>) -> Result<(), BoxError> {
        let probes = self.probes.clone();
        on_thread(move || probes.upsert_many(&entries)).await
    }

    /// Finds the namespaces of running pods under /proc (after an agent restart, or for pods that
    /// were enrolled by a namespace label rather than by their CNI ADD), then those of the rest
    /// among the runtime's pins: a sandbox with no process in it (CRI-O's `drop_infra_ctr`, all
    /// of the pod's containers down) is found there only.
    pub async fn discover(
        &self,
        wanted: HashMap<String, WantedPod>,
    ) -> Result<HashMap<String, Netns>, String> {
        let (proc_dir, host) = (self.proc_dir.clone(), self.host_netns);
        let netns_dir = self.netns_dir.clone();
        tokio::task::spawn_blocking(move || {
            let scanner = ProcScanner::with_host(&proc_dir, host);
            let mut found: HashMap<String, Netns> = scanner
                .find(&HostNetns, &wanted)
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|(uid, f)| (uid, f.netns))
                .collect();
            for (uid, pod) in &wanted {
                if found.contains_key(uid) {
                    continue;
                }
                match crate::pinned_netns::holding(&netns_dir, host, &pod.ips) {
                    Ok(Some(ns)) => {
                        found.insert(uid.clone(), ns);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(%uid, error = %e, "pod namespace not taken from the pins")
                    }
                }
            }
            Ok(found)
        })
        .await
        .map_err(|e| e.to_string())?
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

/// Runs blocking `f` (host-side syscalls: the probe set's netlink or `ipset`) off the runtime,
/// neither blocking a runtime worker nor waiting behind the blocking pool (two threads) or the
/// pod namespace jobs' slots. It runs on a pod namespace worker that stays in the agent's own
/// namespace ([`Netns::run_detached`]): a kept thread, where a thread per call cost every
/// ambient ADD a thread's start and exit (about 7 % of the agent's CPU in a 100-ADD burst). A
/// worker is started whenever none is idle, so a job that blocks holds up no other; one that
/// panics ends its worker and fails only its caller.
pub async fn on_thread<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BoxError> + Send + 'static,
) -> Result<T, BoxError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    own_netns()?.run_detached(move |_| f(), move |r| drop(tx.send(r)))?;
    match rx.await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err("host thread panicked".into()),
    }
}

/// The agent's own namespace (its main thread's), where host-side jobs run: opened once.
fn own_netns() -> Result<Arc<Netns>, BoxError> {
    static OWN: std::sync::OnceLock<Arc<Netns>> = std::sync::OnceLock::new();
    if let Some(own) = OWN.get() {
        return Ok(own.clone());
    }
    let opened = Arc::new(Netns::open("/proc/self/ns/net")?);
    Ok(OWN.get_or_init(|| opened).clone())
}

/// Pods whose namespaces are checked at once (startup restore, drift checks): enough to overlap
/// the kernel's waits, few enough not to starve CNI ADDs on a small node.
const PARALLEL_NETNS_WORK: usize = 8;

fn ns_name(pod: &CachedPod) -> (&str, &str) {
    (
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ambient::hints::NetnsHints;
    use crate::pinned_netns::test_support::{Pin, pod_namespace};

    /// CRI-O's `drop_infra_ctr` (istio/istio#60478): a pod whose containers are all down has no
    /// process in its namespace, and after an upgrade the agent has no hint for it either.
    /// Discovery finds it among the runtime's pins by its IP; a pod whose IP no pin holds stays
    /// unfound.
    #[tokio::test]
    async fn discovery_finds_a_sandbox_without_a_process_among_the_pins() {
        dataplane::require_root!();
        let pod_ns = pod_namespace("mesh-pin", "10.251.5.7");
        let pins = tempfile::tempdir().unwrap();
        let _pin = Pin::new(&pod_ns, pins.path(), "sandbox");
        let (run_dir, empty_proc) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let fakes = super::fakes::Fakes::new();
        let node = NodeContext {
            cache: Arc::new(NetnsCache::new("/")),
            hints: NetnsHints::new(run_dir.path()),
            global: InpodConfig::default(),
            proc_dir: empty_proc.path().to_path_buf(),
            host_prefix: "/".into(),
            host_netns: Netns::current().unwrap().id(),
            netns_dir: pins.path().to_path_buf(),
        };
        let metrics = Metrics::new(&mut prometheus_client::registry::Registry::default());
        let mesh = Mesh::new(fakes.seams(), node, metrics);
        let wanted = |uid: &str, ip: &str| {
            let workload = WorkloadInfo::new("p", "apps", "sa");
            let ips = vec![ip.parse().unwrap()];
            (uid.to_string(), WantedPod { workload, ips })
        };
        let found = mesh
            .discover(HashMap::from([
                wanted("uid-1", "10.251.5.7"),
                wanted("uid-2", "10.251.5.8"),
            ]))
            .await
            .unwrap();
        assert_eq!(found.keys().collect::<Vec<_>>(), ["uid-1"]);
        assert_eq!(found["uid-1"].id(), pod_ns.open().id());
    }

    /// Host-side jobs run off the caller's thread, on threads that are kept; one that blocks
    /// holds up no other, and one that panics fails only its own caller.
    #[tokio::test]
    async fn host_jobs_neither_wait_for_a_blocked_one_nor_die_with_a_panicking_one() {
        let caller = std::thread::current().id();
        let (started, has_started) = tokio::sync::oneshot::channel();
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let first = tokio::spawn(on_thread(move || {
            let _ = started.send(());
            blocked.recv().map_err(BoxError::from)
        }));
        has_started.await.unwrap();
        // Queued behind the blocked job, this one would never run.
        let second = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            on_thread(|| Ok(std::thread::current().id())),
        )
        .await
        .expect("a host job waited for a blocked one")
        .unwrap();
        assert_ne!(second, caller);
        release.send(()).unwrap();
        first.await.unwrap().unwrap();

        let failed = on_thread(|| -> Result<(), BoxError> { panic!("a bug in a host job") }).await;
        assert_eq!(failed.unwrap_err().to_string(), "host thread panicked");

        // Kept threads: a later job runs on a thread an earlier one ran on (a fresh thread per
        // job never does), once the earlier one's worker is idle again.
        let mut seen = HashSet::new();
        let mut reused = false;
        for _ in 0..100 {
            let id = on_thread(|| Ok(std::thread::current().id())).await.unwrap();
            if !seen.insert(id) {
                reused = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(reused, "100 host jobs ran on 100 threads");
    }

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
