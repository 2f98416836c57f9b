//! What the pipelines act through, each behind a trait of its own: the pod's rules, the host's
//! probe set, the pod's redirection annotation, and ztunnel. The agent plugs in the dataplane,
//! the API server and the ZDS server; the pipelines' unit tests plug in recording fakes, so
//! every failure branch of an ADD runs in milliseconds without root or an API server.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use cni_core::reconcile::Redirection;
use cni_core::redirect::ambient::InpodConfig;
use cni_core::zds::WorkloadInfo;
use dataplane::inpod::RuleState;
use dataplane::netns::Netns;
use futures::future::BoxFuture;

use crate::ambient::cluster::Annotator;
use crate::zds::{ZdsError, ZdsHandle};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Routes and rules inside a pod's namespace (the dataplane crate behind a seam, so the pipeline's
/// ordering and failure rules are testable without root).
pub trait PodRules: Send + Sync + 'static {
    fn backend(&self) -> &'static str;
    fn enroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError>;
    /// [`enroll`](Self::enroll) of the namespace the runtime just made for a sandbox (its CNI
    /// ADD), where the previous backend's rules are not looked for (`Mesh::add` says why).
    fn enroll_sandbox(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError> {
        self.enroll(netns, cfg)
    }
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

/// The pod's `ambient.istio.io/redirection` annotation, which istiod reads.
pub trait Annotations: Send + Sync + 'static {
    /// Sets the annotation to `state` (`Absent` removes it; a pod that is gone is no error then).
    fn set<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        state: Redirection,
    ) -> BoxFuture<'a, Result<(), kube::Error>>;
}

impl Annotations for Annotator {
    fn set<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        state: Redirection,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        Box::pin(Annotator::set(self, namespace, name, state))
    }
}

/// The hand-off to ztunnel (ZDS): a pod's namespace goes to the newest ztunnel, its removal to
/// every one connected.
pub trait Ztunnel: Send + Sync + 'static {
    /// Returns once a ztunnel is connected, waiting up to `wait` for one.
    fn wait_connected(&self, wait: Duration) -> BoxFuture<'_, Result<(), ZdsError>>;
    /// Hands the pod's namespace over and waits for the ack.
    fn pod_added<'a>(
        &'a self,
        uid: &'a str,
        workload: WorkloadInfo,
        netns: &'a Netns,
    ) -> BoxFuture<'a, Result<(), ZdsError>>;
    /// Tells every ztunnel the pod is gone.
    fn pod_deleted<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, Result<(), ZdsError>>;
}

impl Ztunnel for ZdsHandle {
    fn wait_connected(&self, wait: Duration) -> BoxFuture<'_, Result<(), ZdsError>> {
        Box::pin(ZdsHandle::wait_connected(self, wait))
    }

    fn pod_added<'a>(
        &'a self,
        uid: &'a str,
        workload: WorkloadInfo,
        netns: &'a Netns,
    ) -> BoxFuture<'a, Result<(), ZdsError>> {
        Box::pin(ZdsHandle::pod_added(self, uid, workload, netns))
    }

    fn pod_deleted<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, Result<(), ZdsError>> {
        Box::pin(ZdsHandle::pod_deleted(self, uid))
    }
}

/// The four seams of a [`Mesh`](super::Mesh).
pub struct Seams {
    pub rules: Arc<dyn PodRules>,
    pub probes: Arc<dyn ProbeSet>,
    pub annotations: Arc<dyn Annotations>,
    pub ztunnel: Arc<dyn Ztunnel>,
}
