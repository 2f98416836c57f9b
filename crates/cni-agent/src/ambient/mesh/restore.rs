//! Restoring the pods an earlier agent enrolled, after a restart or an upgrade.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::overrides::inpod_config;
use dataplane::inpod::RuleState;
use dataplane::netns::Netns;

use super::repair::{check, check_and_repair};
use super::{Mesh, PARALLEL_NETNS_WORK, in_netns, on_thread, workload_info};
use crate::ambient::cluster::CachedPod;
use crate::metrics::observe;
use crate::procfs::{HostNetns, NetnsOpener, WantedPod, addresses, addresses_contain_any};

impl Mesh {
    /// Keeps `pod` for ztunnel without a namespace, as the restore does.
    pub fn keep(&self, pod: &CachedPod) {
        if let Some(uid) = pod.metadata.uid.as_deref() {
            self.cache.ensure_with(uid, workload_info(pod));
        }
    }

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
            let f = crate::ambient::cluster::facts(pod);
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
        if !crate::ambient::hints::verified(uid, owns) {
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
