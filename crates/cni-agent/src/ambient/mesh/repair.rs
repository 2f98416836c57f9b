//! Drift repair: putting back what someone took from an enrolled pod or from the host.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use cni_core::redirect::ambient::InpodConfig;
use dataplane::inpod::RuleState;
use dataplane::netns::Netns;

use super::{
    BoxError, Mesh, PARALLEL_NETNS_WORK, PodRules, in_netns, name, on_thread, workload_info,
};
use crate::ambient::cluster::CachedPod;
use crate::metrics::DriftLabel;
use crate::procfs::{HostNetns, NetnsOpener, WantedPod};

impl Mesh {
    /// Verifies the rules of every enrolled pod the agent holds a namespace for and re-applies
    /// them where they drifted (someone flushed a table, a rule was deleted or added). Returns how
    /// many pods were repaired.
    pub async fn repair_drift(&self, pods: &[Arc<CachedPod>]) -> usize {
        self.repair_where(pods, false).await
    }

    /// [`repair_drift`](Self::repair_drift); with `leftovers_only`, only of the pods that hold
    /// the previous backend's rules.
    pub(super) async fn repair_where(
        &self,
        pods: &[Arc<CachedPod>],
        leftovers_only: bool,
    ) -> usize {
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
        let Some(cached) = self.cache.get(uid) else {
            return false;
        };
        let Ok(cfg) = self.pod_config(pod) else {
            return false;
        };
        // The check after a restore (leftovers only) runs on namespaces just verified to hold the
        // pod's addresses; the periodic one also asks whether the namespace still does.
        let ips = match leftovers_only {
            true => Vec::new(),
            false => crate::ambient::cluster::facts(pod).ips,
        };
        let Some(netns) = cached.netns else {
            // Kept without a namespace (the restore found none holding its addresses): looked
            // for again at every check, or it would stay unredirected until the agent restarts.
            return !ips.is_empty() && self.enroll_replaced(pod, uid, None, cfg, ips).await;
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
            Ok(Checked::Replaced) => self.enroll_replaced(pod, uid, Some(&netns), cfg, ips).await,
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
    /// the API shows the new address): the next check looks again. Without a `stale` namespace
    /// (a pod kept without one) any namespace of the pod's holding its addresses is taken.
    /// Returns whether it re-enrolled the pod.
    async fn enroll_replaced(
        &self,
        pod: &CachedPod,
        uid: &str,
        stale: Option<&Netns>,
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
            Ok(mut found) => found
                .remove(uid)
                .filter(|ns| stale.is_none_or(|stale| ns.id() != stale.id())),
            Err(e) => {
                tracing::warn!(pod = %pod_name, error = %e, "cannot look for the namespace of a pod whose addresses left its own");
                None
            }
        };
        let Some(fresh) = fresh else {
            match stale {
                Some(_) => {
                    tracing::info!(pod = %pod_name, "the pod's namespace holds none of its addresses, and no other one of its does yet")
                }
                None => {
                    tracing::debug!(pod = %pod_name, "no namespace of the pod's holds its addresses yet")
                }
            }
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
        // A hint names an old sandbox's namespace; a restart finds this one under /proc.
        self.hints.forget(uid);
        self.count_drift_repair("pod");
        match stale {
            Some(_) => {
                tracing::warn!(pod = %pod_name, "pod's network namespace was replaced without a CNI ADD; enrolled again in the new one")
            }
            None => {
                tracing::warn!(pod = %pod_name, "found the network namespace of a pod kept without one; enrolled in it")
            }
        }
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
    pub(super) fn report_repair(
        &self,
        pod: &CachedPod,
        result: Result<Option<RuleState>, BoxError>,
    ) -> bool {
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

/// What [`check_and_repair`] would repair: the state found, or `None` when the rules are in sync
/// (with `leftovers_only`, when the pod holds no rules of the previous backend).
pub(super) fn check(
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
pub(super) fn check_and_repair(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
