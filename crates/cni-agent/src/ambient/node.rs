//! The node's dataplane as the agent uses it: the chosen backend for in-pod rules, and the host
//! side (probe SNAT rule and the set of enrolled pod IPs) in the host network namespace.
//!
//! The other backend's state (nftables or the other iptables variant, for an iptables node),
//! left by an agent that ran with it before a switch, is removed from the host at startup and
//! from each pod whenever the pod is enrolled, repaired or removed.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::nft::HostProbeConfig;
use cni_core::redirect::iptables::Family;
use dataplane::brancheni::{self, BranchEni};
use dataplane::inpod::{Drift, InpodRules, RuleState};
use dataplane::iptables::IptablesBackend;
use dataplane::leftovers::{self, IptablesLeftovers};
use dataplane::netns::Netns;
use dataplane::nft::generations::Generations;
use dataplane::nft::host::ProbeSets;
use dataplane::nft::{KeptSocket, NftablesBackend};

use super::mesh::{BoxError, PodRules, ProbeSet};
use crate::hostfs::{FileMode, HostDir};

enum Backend {
    Iptables {
        backend: IptablesBackend,
        /// What an agent on the other iptables variant may have left on this node.
        other_variant: IptablesLeftovers,
    },
    Nftables {
        host: HostProbeConfig,
        /// What an iptables agent may have left on this node.
        previous: IptablesLeftovers,
        /// The host's nfnetlink socket, kept for the probe set changes of every add.
        sock: KeptSocket,
        rules: NftablesBackend,
    },
}

pub struct NodeDataplane {
    backend: Backend,
    /// The host's network namespace (host-side rules and sets live there).
    host: Netns,
    /// Node-wide rule settings (the host side does not vary per pod).
    cfg: InpodConfig,
    /// AWS branch-ENI probe rules added per pod IP (`None`: not a Security Groups for Pods node,
    /// or disabled), remembered so removal and shutdown delete exactly those.
    branch_eni: Option<Mutex<HashMap<IpAddr, BranchEni>>>,
}

impl NodeDataplane {
    /// `nftables` true selects native nftables; otherwise iptables with the variant detected from
    /// the host (or forced), pods under their own xtables lock when `scoped_xtables_locking`. The
    /// kubelet UID for the nftables host rule is found under `proc_dir`.
    /// `aws_branch_eni`: `AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE`, which acts only where the host's
    /// `tcp_early_demux` (read under `proc_dir`) is 0.
    pub fn new(
        nftables: bool,
        force_iptables: Option<&str>,
        scoped_xtables_locking: bool,
        host: Netns,
        cfg: InpodConfig,
        proc_dir: &Path,
        aws_branch_eni: bool,
    ) -> Result<Self, BoxError> {
        let branch_eni =
            (aws_branch_eni && brancheni::early_demux_disabled(&host, proc_dir)).then(|| {
                tracing::info!("net.ipv4.tcp_early_demux=0: AWS branch-ENI probe routing on");
                Mutex::new(HashMap::new())
            });
        let backend = if nftables {
            let kubelet_uid = dataplane::nft::host::kubelet_uid(proc_dir)?;
            Backend::Nftables {
                host: HostProbeConfig {
                    kubelet_uid,
                    ipv6: cfg.ipv6,
                    probe_snat_v4: cfg.probe_snat_v4,
                    probe_snat_v6: cfg.probe_snat_v6,
                },
                previous: IptablesLeftovers::find(),
                sock: KeptSocket::new(&host)?,
                rules: NftablesBackend::new(),
            }
        } else {
            // Detection runs in the host namespace: the pods use the variant the host uses.
            let detected = host.run(|| IptablesBackend::detect(force_iptables, cfg.ipv6))??;
            tracing::info!(iptables = %detected.choice(), "iptables variant chosen");
            Backend::Iptables {
                other_variant: IptablesLeftovers::other_than(detected.binaries().variant),
                backend: detected.with_scoped_locking(scoped_xtables_locking),
            }
        };
        Ok(NodeDataplane {
            backend,
            host,
            cfg,
            branch_eni,
        })
    }

    /// Pods found in sync are remembered by nftables generation in `journal` (opened for
    /// reading and appending), so a later check of an unchanged pod, by this agent or the next,
    /// skips reading its tables back. Only the nftables backend can tell that nothing changed.
    pub fn remembering_generations(mut self, journal: std::fs::File) -> Self {
        if let Backend::Nftables { rules, .. } = &mut self.backend {
            let generations = Arc::new(Generations::journaled(journal));
            tracing::info!(
                namespaces = generations.len(),
                "nftables generations of pods found in sync"
            );
            *rules = NftablesBackend::remembering(generations);
        }
        self
    }

    /// Istio from 1.31.1 (istio/istio#61024, #61759 on release-1.31) keeps the iptables variant
    /// its agent detected in `<run_dir>/detected-iptables-backend-v4` and `-v6` (`legacy` or
    /// `nft`) and at its next start drives that variant without detecting again. On a rollback to
    /// Istio's agent the files must name the variant the pods' rules are in: a stale one (an
    /// Istio agent's, from before ours ran) would have Istio's agent miss our rules in every pod
    /// and write its own beside them in the other variant. Written at every start with the
    /// iptables backend; the nftables backend leaves them alone (Istio reads them only for
    /// iptables, and a rollback from nftables goes through our iptables backend first).
    pub fn record_iptables_variant(&self, run_dir: &Path) -> std::io::Result<()> {
        let Backend::Iptables { backend, .. } = &self.backend else {
            return Ok(());
        };
        let variant = backend.binaries().variant.to_string();
        for_variant_files(run_dir, |dir, name| {
            dir.write_atomic(name, variant.as_bytes(), FileMode::Exactly(0o644))
        })
    }

    /// Uninstall: the files [`record_iptables_variant`](Self::record_iptables_variant) wrote go
    /// with the rules they named (an upgrade keeps both). With the nftables backend they are not
    /// ours, and stay.
    pub fn forget_iptables_variant(&self, run_dir: &Path) -> std::io::Result<()> {
        if !matches!(self.backend, Backend::Iptables { .. }) {
            return Ok(());
        }
        for_variant_files(run_dir, |dir, name| dir.remove(name).map(drop))
    }

    fn rules(&self) -> &dyn InpodRules {
        match &self.backend {
            Backend::Iptables { backend, .. } => backend,
            Backend::Nftables { rules, .. } => rules,
        }
    }

    /// The backends not in use, as logs name them.
    fn previous_name(&self) -> String {
        match &self.backend {
            Backend::Iptables { other_variant, .. } => {
                format!("nftables, {}", other_variant.names())
            }
            Backend::Nftables { .. } => "iptables".into(),
        }
    }

    /// Whether the pod still holds rules of a backend not in use.
    pub fn leftovers_in_pod(&self, netns: &Netns) -> Result<bool, BoxError> {
        Ok(match &self.backend {
            Backend::Iptables { other_variant, .. } => {
                leftovers::nft_in_pod(netns)? || other_variant.in_pod(netns)?
            }
            Backend::Nftables { previous, .. } => previous.in_pod(netns)?,
        })
    }

    /// Removes the rules of the backends not in use from the pod.
    fn clear_pod_leftovers(&self, netns: &Netns) -> Result<(), BoxError> {
        let cleared = match &self.backend {
            Backend::Iptables { other_variant, .. } => {
                // Both run: either may hold rules, whatever the other found.
                let nft = leftovers::clear_nft_pod(netns)?;
                other_variant.clear_pod(netns)? || nft
            }
            Backend::Nftables { previous, .. } => previous.clear_pod(netns)?,
        };
        if cleared {
            tracing::info!(
                previous = self.previous_name(),
                "removed the previous backend's in-pod rules"
            );
        }
        Ok(())
    }

    /// Removes the host rules and probe sets of the backend not in use.
    fn clear_host_leftovers(&self) -> Result<(), BoxError> {
        let cleared = match &self.backend {
            Backend::Iptables { other_variant, .. } => {
                let nft = leftovers::clear_nft_host(&self.host)?;
                other_variant.clear_host_chains(&self.host)? || nft
            }
            Backend::Nftables { previous, .. } => previous.clear_host(&self.host)?,
        };
        if cleared {
            tracing::info!(
                previous = self.previous_name(),
                "removed the previous backend's host rules and probe sets"
            );
        }
        Ok(())
    }

    /// Adds the branch-ENI probe rules for `ip` when it is a branch-ENI pod.
    fn route_branch_eni(&self, ip: IpAddr) -> Result<(), BoxError> {
        let Some(known) = &self.branch_eni else {
            return Ok(());
        };
        let eni = match brancheni::detect(&self.host, ip) {
            Ok(Some(eni)) => eni,
            Ok(None) => return Ok(()),
            // As Istio: a detection failure means plain veth routing, not a failed pod.
            Err(e) => {
                tracing::warn!(%ip, error = %e, "cannot tell whether the pod is behind a branch ENI");
                return Ok(());
            }
        };
        brancheni::add_rules(&self.host, ip, &eni)?;
        tracing::info!(%ip, veth = %eni.veth, table = eni.table, "branch-ENI probe rules added");
        known.lock().unwrap().insert(ip, eni);
        Ok(())
    }

    /// Deletes the branch-ENI probe rules remembered for `ip` (best effort, as the pod may be
    /// gone and its veth with it).
    fn unroute_branch_eni(&self, ip: IpAddr) {
        let Some(known) = &self.branch_eni else {
            return;
        };
        let Some(eni) = known.lock().unwrap().remove(&ip) else {
            return;
        };
        if let Err(e) = brancheni::del_rules(&self.host, ip, &eni) {
            tracing::warn!(%ip, error = %e, "cannot remove branch-ENI probe rules");
        }
    }

    fn families(&self) -> Vec<Family> {
        if self.cfg.ipv6 {
            vec![Family::V4, Family::V6]
        } else {
            vec![Family::V4]
        }
    }

    /// Host probe rules and an empty probe set (startup re-adds the enrolled pods' IPs); then the
    /// other backend's host state goes (after: kubelet's probes stay SNATed throughout a switch).
    pub fn setup_host(&self) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables { backend: b, .. } => {
                dataplane::host::apply_rules(&self.host, b, &self.cfg)?;
                let sets = dataplane::host::ProbeSet { host: &self.host };
                for f in self.families() {
                    sets.flush(f)?;
                }
            }
            Backend::Nftables { host, .. } => {
                dataplane::nft::host::apply_host_rules(&self.host, host)?
            }
        }
        self.clear_host_leftovers()
    }

    /// Removes the host rules and the probe sets, of both backends (uninstall; an upgrade keeps
    /// them).
    pub fn teardown_host(&self) -> Result<(), BoxError> {
        let remembered: Vec<IpAddr> = self
            .branch_eni
            .as_ref()
            .map(|k| k.lock().unwrap().keys().copied().collect())
            .unwrap_or_default();
        for ip in remembered {
            self.unroute_branch_eni(ip);
        }
        self.clear_host_leftovers()?;
        match &self.backend {
            Backend::Iptables { backend: b, .. } => {
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

    /// The backend in use first, then the previous backend's rules go: both redirect the same
    /// way, so the pod is redirected throughout a switch (removing first left a window with no
    /// rules at all, in which connections the pod opened went direct).
    fn enroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError> {
        // One thread in the pod for both steps (nested runs happen in place).
        netns.run(|| {
            dataplane::pod::enroll(netns, cfg, self.rules())?;
            self.clear_pod_leftovers(netns)
        })?
    }

    fn unenroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError> {
        netns.run(|| {
            let ours = dataplane::pod::unenroll(netns, cfg, self.rules());
            let previous = self.clear_pod_leftovers(netns);
            ours?;
            previous
        })?
    }

    fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, BoxError> {
        netns.run(|| {
            let state = dataplane::pod::verify(netns, cfg, self.rules())?;
            if !self.leftovers_in_pod(netns)? {
                return Ok(state);
            }
            // Still redirected by the previous backend: drift, so a repair replaces it.
            let mut drift = match state {
                RuleState::Drifted(d) => d,
                _ => Drift::default(),
            };
            drift.unexpected.push(format!(
                "(rules of the previous backend, {})",
                self.previous_name()
            ));
            Ok(RuleState::Drifted(drift))
        })?
    }

    fn leftovers(&self, netns: &Netns) -> Result<bool, BoxError> {
        netns.run(|| self.leftovers_in_pod(netns))?
    }
}

impl NodeDataplane {
    fn set_upsert(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables { .. } => {
                if ip.is_ipv6() && !self.cfg.ipv6 {
                    return Ok(());
                }
                dataplane::host::ProbeSet { host: &self.host }.upsert(ip, uid)?;
            }
            Backend::Nftables { host, sock, .. } => {
                ProbeSets { ipv6: host.ipv6 }.upsert(sock, ip, uid)?;
            }
        }
        Ok(())
    }

    fn set_remove(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables { .. } => {
                if ip.is_ipv6() && !self.cfg.ipv6 {
                    return Ok(());
                }
                let outcome = dataplane::host::ProbeSet { host: &self.host }.delete(ip, uid)?;
                if let dataplane::host::Deleted::OwnedByOther(other) = outcome {
                    tracing::warn!(%ip, uid, owner = %other, "probe set entry belongs to another pod; kept");
                }
            }
            Backend::Nftables { host, sock, .. } => {
                ProbeSets { ipv6: host.ipv6 }.remove(sock, ip, uid)?;
            }
        }
        Ok(())
    }

    fn set_upsert_many(&self, entries: &[(IpAddr, String)]) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Nftables { host, sock, .. } => {
                let refs: Vec<(IpAddr, &str)> = entries
                    .iter()
                    .map(|(ip, uid)| (*ip, uid.as_str()))
                    .collect();
                ProbeSets { ipv6: host.ipv6 }.upsert_many(sock, &refs)?;
                Ok(())
            }
            Backend::Iptables { .. } => entries
                .iter()
                .try_for_each(|(ip, uid)| self.set_upsert(*ip, uid)),
        }
    }

    /// Addresses the probe sets hold (IPv6 only with IPv6 on), which are the ones probed.
    fn probed(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() || self.cfg.ipv6
    }
}

/// Each probe set change also adds or removes the pod's branch-ENI probe rules.
impl ProbeSet for NodeDataplane {
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        self.set_upsert(ip, uid)?;
        if self.probed(ip) {
            self.route_branch_eni(ip)?;
        }
        Ok(())
    }

    fn remove(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        self.set_remove(ip, uid)?;
        self.unroute_branch_eni(ip);
        Ok(())
    }

    fn upsert_many(&self, entries: &[(IpAddr, String)]) -> Result<(), BoxError> {
        self.set_upsert_many(entries)?;
        entries
            .iter()
            .filter(|(ip, _)| self.probed(*ip))
            .try_for_each(|(ip, _)| self.route_branch_eni(*ip))
    }

    fn repair_rules(&self) -> Result<Option<RuleState>, BoxError> {
        let state = match &self.backend {
            Backend::Iptables { backend: b, .. } => {
                dataplane::host::verify_rules(&self.host, b, &self.cfg)?
            }
            Backend::Nftables { host, .. } => {
                dataplane::nft::host::verify_host_rules(&self.host, host)?
            }
        };
        if state == RuleState::InSync {
            return Ok(None);
        }
        // Both keep the entries of sets that still exist, and create the ones that do not.
        match &self.backend {
            Backend::Iptables { backend: b, .. } => {
                dataplane::host::apply_rules(&self.host, b, &self.cfg)?
            }
            Backend::Nftables { host, .. } => {
                dataplane::nft::host::apply_host_rules(&self.host, host)?
            }
        }
        Ok(Some(state))
    }

    fn list(&self) -> Result<Vec<(IpAddr, String)>, BoxError> {
        Ok(match &self.backend {
            Backend::Iptables { .. } => {
                let sets = dataplane::host::ProbeSet { host: &self.host };
                let mut entries = Vec::new();
                for f in self.families() {
                    entries.extend(sets.list(f)?);
                }
                entries
            }
            Backend::Nftables { host, sock, .. } => ProbeSets { ipv6: host.ipv6 }
                .list(sock)?
                .into_iter()
                .map(|e| (e.ip, e.pod_uid))
                .collect(),
        })
    }

    fn missing(&self, want: &[(IpAddr, String)]) -> Result<Vec<(IpAddr, String)>, BoxError> {
        let present: HashSet<(IpAddr, String)> = self.list()?.into_iter().collect();
        Ok(want
            .iter()
            .map(|(ip, uid)| (ip.to_canonical(), uid.clone()))
            .filter(|(ip, uid)| self.probed(*ip) && !present.contains(&(*ip, uid.clone())))
            .collect())
    }

    fn prune(&self, keep: &HashSet<IpAddr>) -> Result<(), BoxError> {
        match &self.backend {
            Backend::Iptables { .. } => {
                let sets = dataplane::host::ProbeSet { host: &self.host };
                let keep: Vec<IpAddr> = keep.iter().copied().collect();
                for f in self.families() {
                    sets.prune(f, &keep)?;
                }
            }
            Backend::Nftables { host, sock, .. } => {
                ProbeSets { ipv6: host.ipv6 }.prune(sock, keep)?;
            }
        }
        Ok(())
    }
}

/// Shares one node dataplane as both seams of [`super::mesh::Mesh`].
pub fn seams(node: Arc<NodeDataplane>) -> (Arc<dyn PodRules>, Arc<dyn ProbeSet>) {
    (node.clone(), node)
}

/// `op` on each of Istio's detected-iptables-backend files in `run_dir` (symlink-safe: through the
/// directory's fd); an error names the file.
fn for_variant_files(
    run_dir: &Path,
    mut op: impl FnMut(&HostDir, &str) -> Result<(), crate::hostfs::HostFsError>,
) -> std::io::Result<()> {
    let named = |path: PathBuf, e: &dyn std::fmt::Display| {
        std::io::Error::other(format!("{}: {e}", path.display()))
    };
    let first = run_dir.join("detected-iptables-backend-v4");
    let dir = HostDir::open(run_dir).map_err(|e| named(first, &e))?;
    for family in ["v4", "v6"] {
        let name = format!("detected-iptables-backend-{family}");
        op(&dir, &name).map_err(|e| named(run_dir.join(&name), &e))?;
    }
    Ok(())
}
