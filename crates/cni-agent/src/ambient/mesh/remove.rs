//! Removing a pod from the mesh.

use std::net::IpAddr;

use cni_core::reconcile::Redirection;

use super::{Mesh, MeshError, in_netns, name, ns_name};
use crate::ambient::cluster::CachedPod;

impl Mesh {
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
            .annotations
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
