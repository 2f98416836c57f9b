//! The node's dataplane as the agent uses it: the chosen backend for in-pod rules, and the host
//! side (probe SNAT rule and the set of enrolled pod IPs) in the host network namespace.

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use cni_core::redirect::InpodConfig;
use cni_core::redirect::iptables::Family;
use cni_core::redirect::nft::HostProbeConfig;
use dataplane::inpod::{InpodRules, RuleState};
use dataplane::iptables::IptablesBackend;
use dataplane::netns::Netns;
use dataplane::nft::NftablesBackend;
use dataplane::nft::host::ProbeSets;

use super::mesh::{BoxError, PodRules, ProbeSet};

enum Backend {
    Iptables(IptablesBackend),
    Nftables { host: HostProbeConfig },
}

pub struct NodeDataplane {
    backend: Backend,
    /// The host's network namespace (host-side rules and sets live there).
    host: Netns,
    /// Node-wide rule settings (the host side does not vary per pod).
    cfg: InpodConfig,
}

impl NodeDataplane {
    /// `nftables` true selects native nftables; otherwise iptables with the variant detected from
    /// the host (or forced). The kubelet UID for the nftables host rule is found under `proc_dir`.
    pub fn new(
        nftables: bool,
        force_iptables: Option<&str>,
        host: Netns,
        cfg: InpodConfig,
        proc_dir: &Path,
    ) -> Result<Self, BoxError> {
        let backend = if nftables {
            let kubelet_uid = dataplane::nft::host::kubelet_uid(proc_dir)?;
            Backend::Nftables {
                host: HostProbeConfig {
                    kubelet_uid,
                    ipv6: cfg.ipv6,
                    probe_snat_v4: cfg.probe_snat_v4,
                    probe_snat_v6: cfg.probe_snat_v6,
                },
            }
        } else {
            // Detection runs in the host namespace: the pods use the variant the host uses.
            let detected = host.run(|| IptablesBackend::detect(force_iptables, cfg.ipv6))??;
            tracing::info!(iptables = %detected.choice(), "iptables variant chosen");
            Backend::Iptables(detected)
        };
        Ok(NodeDataplane { backend, host, cfg })
    }

    fn rules(&self) -> &dyn InpodRules {
        match &self.backend {
            Backend::Iptables(b) => b,
            Backend::Nftables { .. } => &NftablesBackend,
        }
    }

    fn families(&self) -> Vec<Family> {
        if self.cfg.ipv6 {
            vec![Family::V4, Family::V6]
        } else {
            vec![Family::V4]
        }
    }

    /// Host probe rules and an empty probe set (startup re-adds the enrolled pods' IPs).
    pub fn setup_host(&self) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables(b) => {
                dataplane::host::apply_rules(&self.host, b, &self.cfg)?;
                let sets = dataplane::host::ProbeSet { host: &self.host };
                for f in self.families() {
                    sets.flush(f)?;
                }
            }
            Backend::Nftables { host } => dataplane::nft::host::apply_host_rules(&self.host, host)?,
        }
        Ok(())
    }

    /// Removes the host rules and the probe sets (uninstall; an upgrade keeps them).
    pub fn teardown_host(&self) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables(b) => {
                dataplane::host::remove_rules(&self.host, b)?;
                let sets = dataplane::host::ProbeSet { host: &self.host };
                for f in self.families() {
                    sets.destroy(f)?;
                }
            }
            Backend::Nftables { .. } => dataplane::nft::host::destroy_host_table(&self.host)?,
        }
        Ok(())
    }
}

impl PodRules for NodeDataplane {
    fn backend(&self) -> &'static str {
        self.rules().name()
    }

    fn enroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError> {
        Ok(dataplane::pod::enroll(netns, cfg, self.rules())?)
    }

    fn unenroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError> {
        Ok(dataplane::pod::unenroll(netns, cfg, self.rules())?)
    }

    fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, BoxError> {
        Ok(dataplane::pod::verify(netns, cfg, self.rules())?)
    }
}

impl ProbeSet for NodeDataplane {
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables(_) => {
                if ip.is_ipv6() && !self.cfg.ipv6 {
                    return Ok(());
                }
                dataplane::host::ProbeSet { host: &self.host }.upsert(ip, uid)?;
            }
            Backend::Nftables { host } => {
                ProbeSets { ipv6: host.ipv6 }.upsert(&self.host, ip, uid)?;
            }
        }
        Ok(())
    }

    fn remove(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables(_) => {
                if ip.is_ipv6() && !self.cfg.ipv6 {
                    return Ok(());
                }
                let outcome = dataplane::host::ProbeSet { host: &self.host }.delete(ip, uid)?;
                if let dataplane::host::Deleted::OwnedByOther(other) = outcome {
                    tracing::warn!(%ip, uid, owner = %other, "probe set entry belongs to another pod; kept");
                }
            }
            Backend::Nftables { host } => {
                ProbeSets { ipv6: host.ipv6 }.remove(&self.host, ip, uid)?;
            }
        }
        Ok(())
    }

    fn upsert_many(&self, entries: &[(IpAddr, String)]) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Nftables { host } => {
                let refs: Vec<(IpAddr, &str)> = entries
                    .iter()
                    .map(|(ip, uid)| (*ip, uid.as_str()))
                    .collect();
                ProbeSets { ipv6: host.ipv6 }.upsert_many(&self.host, &refs)?;
                Ok(())
            }
            Backend::Iptables(_) => entries
                .iter()
                .try_for_each(|(ip, uid)| self.upsert(*ip, uid)),
        }
    }

    fn prune(&self, keep: &HashSet<IpAddr>) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables(_) => {
                let sets = dataplane::host::ProbeSet { host: &self.host };
                let keep: Vec<IpAddr> = keep.iter().copied().collect();
                for f in self.families() {
                    sets.prune(f, &keep)?;
                }
            }
            Backend::Nftables { host } => {
                ProbeSets { ipv6: host.ipv6 }.prune(&self.host, keep)?;
            }
        }
        Ok(())
    }
}

/// Shares one node dataplane as both seams of [`super::mesh::Mesh`].
pub fn seams(node: Arc<NodeDataplane>) -> (Arc<dyn PodRules>, Arc<dyn ProbeSet>) {
    (node.clone(), node)
}
