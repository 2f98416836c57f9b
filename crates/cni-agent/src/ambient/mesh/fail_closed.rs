//! Every failure branch of a CNI ADD through the recording fakes: what the ADD reports, what was
//! undone, and what the pod's annotation says afterwards; and the drift check that enrolls a pod
//! the agent kept without a namespace. The pod's namespace is the test's own, so no step of an
//! ADD needs root (the drift check's /proc scan does); nothing reaches an API server.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cni_core::reconcile::{REDIRECTION_ANNOTATION, Redirection};
use cni_core::redirect::ambient::InpodConfig;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tokio::sync::Notify;

use super::fakes::{Answer, Fakes};
use super::{Mesh, MeshError, NodeContext};
use crate::ambient::cluster::CachedPod;
use crate::ambient::hints::NetnsHints;
use crate::metrics::Metrics;
use crate::netns_cache::NetnsCache;

/// A pod UID as kubelet writes it into the pod's cgroup path.
const UID: &str = "0e8b1a5c-b29f-11e7-9350-020968147796";
const POD: &str = "default/web";
/// `CNI_NETNS` beneath the host prefix `/`: the test's own namespace.
const NETNS: &str = "/proc/self/ns/net";

fn ip() -> IpAddr {
    "10.244.0.7".parse().unwrap()
}

struct Bed {
    mesh: Arc<Mesh>,
    fakes: Fakes,
    _run_dir: tempfile::TempDir,
}

fn bed() -> Bed {
    let fakes = Fakes::new();
    let run_dir = tempfile::tempdir().unwrap();
    let node = NodeContext {
        cache: Arc::new(NetnsCache::new("/")),
        hints: NetnsHints::new(run_dir.path()),
        global: InpodConfig::default(),
        // Nothing to discover: the informer path finds pods through the cache alone.
        proc_dir: run_dir.path().join("proc"),
        host_prefix: "/".into(),
        // Not the test's namespace, which stands for the pod's.
        host_netns: dataplane::netns::NetnsId { dev: 0, ino: 0 },
        netns_dir: run_dir.path().join("pins"),
    };
    let metrics = Metrics::new(&mut prometheus_client::registry::Registry::default());
    Bed {
        mesh: Arc::new(Mesh::new(fakes.seams(), node, metrics)),
        fakes,
        _run_dir: run_dir,
    }
}

fn pod() -> CachedPod {
    let mut pod = CachedPod::default();
    pod.metadata = ObjectMeta {
        name: Some("web".into()),
        namespace: Some("default".into()),
        uid: Some(UID.into()),
        ..ObjectMeta::default()
    };
    pod.ips = vec![ip()];
    pod
}

/// The pod as the watch shows it after an earlier ADD left `state` (the API server too).
fn pod_annotated(bed: &Bed, state: Redirection) -> CachedPod {
    let mut pod = pod();
    let value = state.value().unwrap().to_string();
    pod.metadata.annotations = Some([(REDIRECTION_ANNOTATION.to_string(), value)].into());
    bed.fakes.annotations.found(POD, state);
    pod
}

impl Bed {
    async fn cni_add(&self) -> Result<(), MeshError> {
        self.mesh.add(&pod(), &[ip()], Some(NETNS)).await
    }

    fn annotation(&self) -> Redirection {
        self.fakes.annotations.on(POD)
    }

    fn answer(&self, answer: Answer) {
        *self.fakes.ztunnel.answer.lock().unwrap() = answer;
    }

    /// What a failed ADD leaves in any case: no probe entry for the pod, no namespace held for
    /// it (the runtime retries in a new sandbox), and its error kept for `explain`.
    fn assert_failed_add_cleaned(&self, err: &MeshError) {
        assert!(
            self.fakes.probes.entries().is_empty(),
            "probe entry left: {:?}",
            self.fakes.journal.lines()
        );
        assert!(self.mesh.cache.get(UID).is_none(), "namespace still held");
        assert_eq!(self.mesh.last_errors.get(UID), Some(err.to_string()));
    }
}

#[tokio::test]
async fn an_add_that_succeeds_leaves_the_pod_enrolled_everywhere() {
    let bed = bed();
    bed.cni_add().await.unwrap();
    assert_eq!(bed.annotation(), Redirection::Enabled);
    assert_eq!(
        bed.fakes.probes.entries().get(&ip()).map(String::as_str),
        Some(UID)
    );
    assert_eq!(bed.fakes.journal.of("rules"), ["rules enroll"]);
    assert_eq!(
        bed.fakes.journal.of("ztunnel"),
        [format!("ztunnel add {UID}")]
    );
    assert!(bed.mesh.cache.get(UID).and_then(|e| e.netns).is_some());
    assert_eq!(bed.mesh.last_errors.get(UID), None);
}

#[tokio::test]
async fn failed_rules_leave_no_probe_entry_and_put_the_annotation_back() {
    let bed = bed();
    let pod = pod_annotated(&bed, Redirection::Pending);
    bed.fakes.rules.fail_enroll.store(true, Ordering::SeqCst);
    let err = bed.mesh.add(&pod, &[ip()], Some(NETNS)).await.unwrap_err();
    assert!(matches!(err, MeshError::Rules { .. }), "{err}");
    assert!(!err.retryable(), "a new sandbox is needed");
    assert!(bed.fakes.journal.of("ztunnel").is_empty(), "no Add sent");
    // The patch to `enabled` overlapped the rules; it is undone to what the ADD found.
    assert_eq!(
        bed.fakes.journal.of("annotate"),
        [
            format!("annotate {POD} Enabled"),
            format!("annotate {POD} Pending")
        ]
    );
    assert_eq!(bed.annotation(), Redirection::Pending);
    // The entry is written after the rules, by the same job: never, here. Whatever entry of
    // this pod's is at its IP (a previous sandbox's) is taken out, as after any failed add.
    assert_eq!(
        bed.fakes.journal.of("probes"),
        [format!("probes remove {} {UID}", ip())]
    );
    bed.assert_failed_add_cleaned(&err);
}

/// A ztunnel that refuses the Add or does not ack it in time: the ADD fails retryably and the
/// annotation says `pending`, whatever it was.
async fn assert_ztunnel_failure_leaves_pending(answer: Answer) {
    let bed = bed();
    bed.answer(answer);
    let err = bed.cni_add().await.unwrap_err();
    assert!(matches!(err, MeshError::Ztunnel { .. }), "{err}");
    assert!(err.retryable());
    assert_eq!(bed.annotation(), Redirection::Pending);
    assert_eq!(
        bed.fakes.journal.of("probes"),
        [
            format!("probes upsert {} {UID}", ip()),
            format!("probes remove {} {UID}", ip())
        ]
    );
    bed.assert_failed_add_cleaned(&err);
}

#[tokio::test]
async fn a_ztunnel_that_refuses_leaves_the_pod_pending_without_a_probe_entry() {
    assert_ztunnel_failure_leaves_pending(Answer::Nack).await;
}

#[tokio::test]
async fn a_ztunnel_that_does_not_ack_leaves_the_pod_pending_without_a_probe_entry() {
    assert_ztunnel_failure_leaves_pending(Answer::Silent).await;
}

#[tokio::test]
async fn without_a_ztunnel_nothing_is_applied_and_the_pod_is_pending() {
    let bed = bed();
    bed.fakes.ztunnel.connected.store(false, Ordering::SeqCst);
    let err = bed.cni_add().await.unwrap_err();
    assert!(matches!(err, MeshError::Ztunnel { .. }), "{err}");
    assert!(err.retryable());
    // The only step taken: the annotation, never `enabled` while no ztunnel could take the pod.
    assert_eq!(
        bed.fakes.journal.lines(),
        [format!("annotate {POD} Pending")]
    );
    bed.assert_failed_add_cleaned(&err);
}

#[tokio::test]
async fn a_pending_annotation_that_cannot_be_written_is_the_error_reported() {
    let bed = bed();
    bed.answer(Answer::Nack);
    *bed.fakes.annotations.refuse.lock().unwrap() = vec![Redirection::Pending];
    let err = bed.cni_add().await.unwrap_err();
    assert!(matches!(err, MeshError::Annotate { .. }), "{err}");
    assert!(err.retryable());
    // The `enabled` patch went through before the refusal; the failed ADD says so.
    assert_eq!(bed.annotation(), Redirection::Enabled);
    bed.assert_failed_add_cleaned(&err);
}

#[tokio::test]
async fn an_annotation_that_cannot_be_put_back_after_failed_rules_leaves_the_rules_error() {
    let bed = bed();
    bed.fakes.rules.fail_enroll.store(true, Ordering::SeqCst);
    *bed.fakes.annotations.refuse.lock().unwrap() = vec![Redirection::Absent];
    let err = bed.cni_add().await.unwrap_err();
    assert!(matches!(err, MeshError::Rules { .. }), "{err}");
    assert_eq!(
        bed.fakes.journal.of("annotate"),
        [
            format!("annotate {POD} Enabled"),
            format!("annotate {POD} Absent")
        ]
    );
    bed.assert_failed_add_cleaned(&err);
}

#[tokio::test]
async fn a_failed_patch_fails_the_add_and_leaves_the_annotation_as_found() {
    let bed = bed();
    *bed.fakes.annotations.refuse.lock().unwrap() = vec![Redirection::Enabled];
    let err = bed.cni_add().await.unwrap_err();
    assert!(matches!(err, MeshError::Annotate { .. }), "{err}");
    assert!(err.retryable());
    assert_eq!(bed.annotation(), Redirection::Absent);
    // The redirection itself succeeded and is not undone: the runtime retries the sandbox,
    // whose ADD replaces the Add and the entry under the same UID.
    assert_eq!(
        bed.fakes.journal.of("ztunnel"),
        [format!("ztunnel add {UID}")]
    );
    assert!(bed.fakes.journal.of("rules unenroll").is_empty());
    assert!(bed.mesh.cache.get(UID).is_none(), "namespace still held");
    assert_eq!(bed.mesh.last_errors.get(UID), Some(err.to_string()));
}

#[tokio::test]
async fn a_failed_probe_set_fails_the_add_and_puts_the_annotation_back() {
    let bed = bed();
    bed.fakes.probes.fail_upsert.store(true, Ordering::SeqCst);
    let err = bed.cni_add().await.unwrap_err();
    assert!(matches!(err, MeshError::ProbeSet { .. }), "{err}");
    assert!(err.retryable());
    assert_eq!(
        bed.fakes.journal.of("annotate"),
        [
            format!("annotate {POD} Enabled"),
            format!("annotate {POD} Absent")
        ]
    );
    assert_eq!(bed.annotation(), Redirection::Absent);
    bed.assert_failed_add_cleaned(&err);
}

#[tokio::test]
async fn kubelets_report_of_the_address_the_add_wrote_writes_nothing_again() {
    let bed = bed();
    bed.cni_add().await.unwrap();
    bed.mesh.sync_probe_ips(&pod(), UID, &[ip()]).await.unwrap();
    assert_eq!(
        bed.fakes.journal.of("probes"),
        [format!("probes upsert {} {UID}", ip())]
    );
}

#[tokio::test]
async fn a_new_address_that_failed_to_go_in_is_written_on_the_retry() {
    let bed = bed();
    bed.cni_add().await.unwrap();
    let moved: IpAddr = "10.244.0.8".parse().unwrap();
    bed.fakes.probes.fail_upsert.store(true, Ordering::SeqCst);
    let err = bed.mesh.sync_probe_ips(&pod(), UID, &[moved]).await;
    assert!(matches!(err, Err(MeshError::ProbeSet { .. })), "{err:?}");
    bed.fakes.probes.fail_upsert.store(false, Ordering::SeqCst);
    bed.mesh
        .sync_probe_ips(&pod(), UID, &[moved])
        .await
        .unwrap();
    assert_eq!(
        bed.fakes.probes.entries(),
        [(moved, UID.to_string())].into()
    );
}

#[tokio::test]
async fn on_the_informer_path_failed_rules_patch_nothing() {
    let bed = bed();
    bed.fakes.rules.fail_enroll.store(true, Ordering::SeqCst);
    // The pod's namespace as an earlier ADD cached it.
    let netns = bed
        .mesh
        .cache
        .open_netns(NETNS, bed.mesh.host_netns)
        .unwrap();
    bed.mesh
        .cache
        .upsert(UID, super::workload_info(&pod()), netns);
    let err = bed.mesh.add(&pod(), &[ip()], None).await.unwrap_err();
    assert!(matches!(err, MeshError::Rules { .. }), "{err}");
    assert!(bed.fakes.journal.of("annotate").is_empty());
    assert!(bed.fakes.probes.entries().is_empty());
}

#[tokio::test]
async fn a_delete_during_an_add_waits_for_it_and_then_removes_everything() {
    let bed = bed();
    let (reached, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    bed.answer(Answer::Held {
        reached: reached.clone(),
        release: release.clone(),
    });
    let add = tokio::spawn({
        let mesh = bed.mesh.clone();
        async move { mesh.add(&pod(), &[ip()], Some(NETNS)).await }
    });
    // The ADD is inside ztunnel's hand-off, holding the pod's lock.
    reached.notified().await;
    let del = tokio::spawn({
        let mesh = bed.mesh.clone();
        async move { mesh.remove(&pod(), &[ip()], true).await }
    });
    // The DEL is queued on the pod's lock (held by the ADD, and by the lock map) before the ack.
    while bed.mesh.locks.waiters(UID) < 1 {
        tokio::task::yield_now().await;
    }
    assert!(bed.fakes.journal.of("ztunnel del").is_empty());
    release.notify_one();
    add.await.unwrap().unwrap();
    del.await.unwrap().unwrap();
    let lines = bed.fakes.journal.lines();
    let at = |line: &str| lines.iter().position(|l| l == line).unwrap();
    assert!(
        at(&format!("ztunnel ack {UID}")) < at(&format!("ztunnel del {UID}")),
        "{lines:?}"
    );
    assert!(
        at(&format!("annotate {POD} Enabled")) < at(&format!("annotate {POD} Absent")),
        "{lines:?}"
    );
    assert_eq!(bed.annotation(), Redirection::Absent);
    assert!(bed.fakes.probes.entries().is_empty());
    assert!(bed.mesh.cache.get(UID).is_none());
}

#[tokio::test]
async fn failed_rules_of_a_replaced_sandbox_leave_enabled_as_found() {
    let bed = bed();
    let pod = pod_annotated(&bed, Redirection::Enabled);
    bed.fakes.rules.fail_enroll.store(true, Ordering::SeqCst);
    let err = bed.mesh.add(&pod, &[ip()], Some(NETNS)).await.unwrap_err();
    assert!(matches!(err, MeshError::Rules { .. }), "{err}");
    // No compensation to write: the annotation is what the previous sandbox's ADD left.
    assert_eq!(
        bed.fakes.journal.of("annotate"),
        [format!("annotate {POD} Enabled")]
    );
    assert_eq!(bed.annotation(), Redirection::Enabled);
    bed.assert_failed_add_cleaned(&err);
}

/// A process of pod `uid` in the test's own namespace, as `/proc/<pid>` shows one: its `ns/net`,
/// its `stat` (the test's own), and a cgroup path naming the pod.
fn fake_process(proc_dir: &std::path::Path, pid: u32, uid: &str) {
    let dir = proc_dir.join(pid.to_string());
    std::fs::create_dir_all(dir.join("ns")).unwrap();
    std::os::unix::fs::symlink(NETNS, dir.join("ns/net")).unwrap();
    std::fs::copy("/proc/self/stat", dir.join("stat")).unwrap();
    let cgroup = format!(
        "0::/kubepods/besteffort/pod{uid}/9bca8d63d5fa610783847915bcff0ecac1273e5b4bed3f6fa1b07350e0135961\n"
    );
    std::fs::write(dir.join("cgroup"), cgroup).unwrap();
}

/// A pod an agent restart kept without a namespace (none held its addresses at the restore): the
/// drift check looks for it under /proc again each time, and once a process of the pod runs in a
/// namespace holding its address, enrolls that namespace, hands it to ztunnel as an Add and
/// caches it, counted as a pod repair. Before the fix it was skipped at every check for good.
#[tokio::test]
async fn the_drift_check_enrolls_a_pod_kept_without_a_namespace_once_it_is_found() {
    // The /proc scan reads a candidate's addresses from inside it: setns, which needs
    // CAP_SYS_ADMIN even into the caller's own namespace.
    dataplane::require_root!();
    let bed = bed();
    let own = bed
        .mesh
        .cache
        .open_netns(NETNS, bed.mesh.host_netns)
        .unwrap();
    let held = crate::procfs::addresses(&own).unwrap();
    let ip = *held.first().expect("the test's namespace holds an address");
    let mut pod = pod();
    pod.ips = vec![ip];
    let pod = Arc::new(pod);
    bed.mesh.keep(&pod);
    let proc_dir = bed.mesh.proc_dir.clone();
    std::fs::create_dir_all(&proc_dir).unwrap();
    let repairs = || {
        let label = crate::metrics::DriftLabel {
            backend: "fake".into(),
            scope: "pod",
        };
        bed.mesh.metrics.drift_repairs.get_or_create(&label).get()
    };

    // No process of the pod's yet (its sandbox not back): nothing done, nothing counted.
    assert_eq!(bed.mesh.repair_drift(std::slice::from_ref(&pod)).await, 0);
    assert!(
        bed.fakes.journal.lines().is_empty(),
        "{:?}",
        bed.fakes.journal.lines()
    );
    assert!(bed.mesh.cache.get(UID).unwrap().netns.is_none());

    // A process of another pod in a namespace holding the address is not the pod's.
    fake_process(&proc_dir, 41, "1f8b1a5c-b29f-11e7-9350-020968147796");
    assert_eq!(bed.mesh.repair_drift(std::slice::from_ref(&pod)).await, 0);
    assert!(
        bed.fakes.journal.lines().is_empty(),
        "{:?}",
        bed.fakes.journal.lines()
    );

    fake_process(&proc_dir, 42, UID);
    assert_eq!(bed.mesh.repair_drift(std::slice::from_ref(&pod)).await, 1);
    assert_eq!(
        bed.fakes.journal.lines(),
        ["rules enroll".to_string(), format!("ztunnel add {UID}")]
    );
    let cached = bed.mesh.cache.get(UID).unwrap().netns.expect("cached now");
    assert_eq!(cached.id(), own.id());
    assert_eq!(repairs(), 1);

    // Found, it is checked like any enrolled pod: in sync, nothing more.
    assert_eq!(bed.mesh.repair_drift(std::slice::from_ref(&pod)).await, 0);
    assert_eq!(bed.fakes.journal.lines().len(), 2);
}
