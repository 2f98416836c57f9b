//! Adding a pod: the ordered steps of an ADD and what each failure undoes.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cni_core::reconcile::Redirection;
use cni_core::redirect::ambient::InpodConfig;
use cni_core::zds::WorkloadInfo;
use dataplane::netns::Netns;

use super::{BoxError, Mesh, MeshError, in_netns, name, ns_name, on_thread, workload_info};
use crate::ambient::cluster::CachedPod;
use crate::metrics::{BackendLabel, observe};
use crate::procfs::WantedPod;

/// When each step of an add's redirection finished.
struct Stages {
    resolved: Instant,
    applied: Instant,
    acked: Instant,
    probed: Instant,
}

impl Mesh {
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
    ///
    /// ztunnel's acked Add is not taken back when the patch or the probe set fails after it: the
    /// pod is redirected, and the runtime retries the sandbox, whose ADD sends an Add of the same
    /// UID that replaces it (a pod deleted instead is removed by the informer's delete). A Del
    /// here would only tear down what that Add replaces anyway (pinned by the `fail_closed`
    /// tests of a failed patch and a failed probe set).
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
                        .annotations
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
                if let Err(source) = self.annotations.set(namespace, pod_only, undo).await {
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

    /// The redirection half of an add: netns, routes + rules and the host probe set entry (it
    /// needs only the pod's IPs), then the ZDS Add and its ack. When the rules or ztunnel fail,
    /// the entry is taken out again: a pod that is not enrolled gets no probe SNAT. A failed
    /// probe set entry fails the add after ztunnel's ack, which is not taken back (see
    /// [`add_locked`](Self::add_locked)).
    async fn redirect(
        &self,
        pod: &CachedPod,
        uid: &str,
        pod_name: &str,
        cfg: &InpodConfig,
        ips: &[IpAddr],
        netns_path: Option<&str>,
    ) -> Result<Stages, MeshError> {
        match self
            .rules_and_ack(pod, uid, pod_name, cfg, ips, netns_path)
            .await
        {
            Ok((stages, Ok(()))) => Ok(stages),
            Ok((_, Err(source))) => Err(MeshError::ProbeSet {
                pod: name(pod),
                source,
            }),
            Err(failed) => {
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

    /// Netns, routes + rules and the probe set entry on one pod namespace job, then the ZDS Add
    /// and its ack; returns the stages and the probe set's own result.
    async fn rules_and_ack(
        &self,
        pod: &CachedPod,
        uid: &str,
        pod_name: &str,
        cfg: &InpodConfig,
        ips: &[IpAddr],
        netns_path: Option<&str>,
    ) -> Result<(Stages, Result<(), BoxError>), MeshError> {
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
        let probes = self.probes.clone();
        let entries = self.record_probe_ips(&uid, ips);
        // The previous backend's rules (a switch between iptables and nftables) are looked for
        // in a namespace that may predate the switch: at the informer's and a restart's
        // enrollments, at drift checks and repairs, at removal. Not at a CNI ADD: the runtime
        // made this namespace for the sandbox, and the one earlier writer it can have had is an
        // agent of the other backend that died while serving this same ADD, which our plugin
        // then posts again (Istio's plugin and our plugin's flow for Istio's agent post once;
        // the runtime tears a failed sandbox down and makes a new namespace). That pod is
        // redirected by both, which redirect alike, until the next drift check (its verify
        // looks for them) or its removal takes the old rules out. The look costs every ADD two
        // /proc reads and a netlink dump in the pod's namespace.
        //
        // The probe set entry is written by the same job, after the rules: its socket lives in
        // the host's namespace and serves from any thread, and a job of its own cost every ADD
        // a second thread's wake-up.
        let sandbox = netns_path.is_some();
        let done = in_netns(&netns, move |ns| {
            match sandbox {
                true => rules.enroll_sandbox(ns, &c),
                false => rules.enroll(ns, &c),
            }?;
            let applied = Instant::now();
            let probed = probes.upsert_many(&entries);
            Ok((applied, probed, Instant::now()))
        })
        .await;
        let (applied, probed_result, probed) = match done {
            Ok(done) => done,
            Err(source) => {
                self.cache.take(&uid);
                return Err(MeshError::Rules {
                    pod: pod_name.to_string(),
                    backend: self.rules.backend(),
                    source,
                });
            }
        };
        let backend = BackendLabel {
            backend: self.rules.backend().to_string(),
        };
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
        let stages = Stages {
            resolved,
            applied,
            acked: Instant::now(),
            probed,
        };
        Ok((stages, probed_result))
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
        // The addresses this agent wrote for the pod are in the set already (the drift check
        // puts back any that went missing). Kubelet reports a pod's first address only after
        // its CNI ADD wrote it, and writing it again found it there and replaced it: two more
        // nf_tables batches, the second waiting out the kernel's release of the old element.
        let new: Vec<IpAddr> = ips
            .iter()
            .map(|ip| ip.to_canonical())
            .filter(|ip| !self.probe_ips.holds(uid, *ip))
            .collect();
        if !new.is_empty()
            && let Err(e) = self.upsert_probe_ips(pod, uid, &new).await
        {
            // Not written: the retry must not take them as written.
            for ip in new {
                self.probe_ips.drop_ip(uid, ip);
            }
            return Err(e);
        }
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
        let entries = self.record_probe_ips(uid, ips);
        self.upsert_probes(entries)
            .await
            .map_err(|source| MeshError::ProbeSet {
                pod: name(pod),
                source,
            })
    }

    /// Records the pod's IPs as its probe set entries; returns the entries to write.
    fn record_probe_ips(&self, uid: &str, ips: &[IpAddr]) -> Vec<(IpAddr, String)> {
        let entries: Vec<(IpAddr, String)> = ips
            .iter()
            .map(|ip| (ip.to_canonical(), uid.to_string()))
            .collect();
        self.probe_ips
            .record(uid, entries.iter().map(|(ip, _)| *ip));
        entries
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
}

/// How long a CNI ADD waits for a ztunnel to connect: ztunnel reconnects to a restarted agent
/// within about a second (its backoff doubles from 20 ms), and the plugin gives the whole ADD 5 s.
const ZTUNNEL_WAIT: Duration = Duration::from_secs(3);
