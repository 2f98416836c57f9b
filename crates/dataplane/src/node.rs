//! This node's rule backend, the one owner of it: the backend chosen by name (through
//! [`RuleBackend::new`], the iptables variant detected in the host's namespace), the pods' rules,
//! the host side (probe SNAT rules and the set of enrolled pod IPs) in the host network namespace,
//! the AWS branch-ENI probe routes, and the variant Istio's agent must find after a rollback. The
//! agent decides when to call it and what to report; the `install-cni dataplane host` command and
//! the tests build the same thing.
//!
//! The other backend's state (nftables or the other iptables variant, for an iptables node),
//! left by an agent that ran with it before a switch, is removed from the host at startup and
//! from each pod whenever the pod is enrolled, repaired or removed; at a sandbox's own ADD it is
//! not looked for ([`NodeDataplane::enroll_sandbox`]), and a verify finds it.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::nft::HostProbeConfig;
use cni_core::redirect::iptables::Family;

use crate::backend::{BackendOptions, RuleBackend};
use crate::brancheni::{self, BranchEni};
use crate::inpod::{Drift, InpodRules, RuleState};
use crate::iptables::IptablesBackend;
use crate::leftovers::Previous;
use crate::netns::Netns;
use crate::nft::generations::Generations;
use crate::nft::host::ProbeSets;
use crate::nft::{KeptSocket, NftablesBackend};

pub type NodeError = Box<dyn std::error::Error + Send + Sync>;

/// Istio from 1.31.1 (istio/istio#61024, #61759 on release-1.31) keeps the iptables variant its
/// agent detected in these files of its run dir (`legacy` or `nft`) and at its next start drives
/// that variant without detecting again.
pub const ISTIO_VARIANT_FILES: [&str; 2] = [
    "detected-iptables-backend-v4",
    "detected-iptables-backend-v6",
];

/// What [`NodeDataplane::new`] builds the node's dataplane from.
pub struct NodeOptions<'a> {
    /// `iptables` or `nftables`.
    pub backend: &'a str,
    /// `FORCE_IPTABLES_BINARY`: `legacy` or `nft` (iptables only).
    pub force_iptables: Option<&'a str>,
    /// Pods' iptables commands under their own xtables lock (iptables only).
    pub scoped_xtables_locking: bool,
    /// Node-wide rule settings (the host side does not vary per pod).
    pub cfg: InpodConfig,
    /// Where kubelet is looked for (its UID, for the nftables host rule) and the host's
    /// `tcp_early_demux` read.
    pub proc_dir: &'a Path,
    /// `AMBIENT_ENABLE_AWS_BRANCH_ENI_PROBE`, which acts only where `tcp_early_demux` is 0.
    pub aws_branch_eni: bool,
}

enum Backend {
    Iptables(IptablesBackend),
    Nftables {
        host: HostProbeConfig,
        /// The host's nfnetlink socket, kept for the probe set changes of every add.
        sock: KeptSocket,
        rules: NftablesBackend,
    },
}

pub struct NodeDataplane {
    backend: Backend,
    /// What an agent on another backend may have left on this node.
    previous: Previous,
    /// The host's network namespace (host-side rules and sets live there).
    host: Netns,
    cfg: InpodConfig,
    /// AWS branch-ENI probe rules added per pod IP (`None`: not a Security Groups for Pods node,
    /// or disabled), remembered so removal and shutdown delete exactly those.
    branch_eni: Option<Mutex<HashMap<IpAddr, BranchEni>>>,
}

impl NodeDataplane {
    /// The node's dataplane on `opts.backend`; an unknown name is an error naming it.
    pub fn new(host: Netns, opts: NodeOptions<'_>) -> Result<Self, NodeError> {
        let NodeOptions {
            backend,
            force_iptables,
            scoped_xtables_locking,
            cfg,
            proc_dir,
            aws_branch_eni,
        } = opts;
        let branch_eni =
            (aws_branch_eni && brancheni::early_demux_disabled(&host, proc_dir)).then(|| {
                tracing::info!("net.ipv4.tcp_early_demux=0: AWS branch-ENI probe routing on");
                Mutex::new(HashMap::new())
            });
        let backend_opts = BackendOptions {
            force_iptables: force_iptables.map(str::to_string),
            ipv6: cfg.ipv6,
        };
        // Detection runs in the host namespace: the pods use the variant the host uses.
        let chosen = host.run(|| RuleBackend::new(backend, &backend_opts))??;
        let previous = Previous::of(&chosen);
        let backend = match chosen {
            RuleBackend::Iptables(detected) => {
                tracing::info!(iptables = %detected.choice(), "iptables variant chosen");
                Backend::Iptables(detected.with_scoped_locking(scoped_xtables_locking))
            }
            RuleBackend::Nftables(rules) => Backend::Nftables {
                host: HostProbeConfig {
                    kubelet_uid: crate::nft::host::kubelet_uid(proc_dir)?,
                    ipv6: cfg.ipv6,
                    probe_snat_v4: cfg.probe_snat_v4,
                    probe_snat_v6: cfg.probe_snat_v6,
                },
                sock: KeptSocket::new(&host)?,
                rules,
            },
        };
        Ok(NodeDataplane {
            backend,
            previous,
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

    /// What [`ISTIO_VARIANT_FILES`] must say on this node: the variant the pods' rules are in
    /// (a stale one, an Istio agent's from before ours ran, would have Istio's agent after a
    /// rollback miss our rules in every pod and write its own beside them in the other variant).
    /// `None` with nftables: Istio reads the files only for iptables, a rollback from nftables
    /// goes through our iptables backend first, and the files are not ours.
    pub fn istio_variant(&self) -> Option<String> {
        match &self.backend {
            Backend::Iptables(b) => Some(b.binaries().variant.to_string()),
            Backend::Nftables { .. } => None,
        }
    }

    /// `iptables` or `nftables`, as logs and reports name it.
    pub fn backend(&self) -> &'static str {
        self.rules().name()
    }

    fn rules(&self) -> &dyn InpodRules {
        match &self.backend {
            Backend::Iptables(b) => b,
            Backend::Nftables { rules, .. } => rules,
        }
    }

    /// The backend in use first, then the previous backend's rules go: both redirect the same
    /// way, so the pod is redirected throughout a switch (removing first left a window with no
    /// rules at all, in which connections the pod opened went direct).
    pub fn enroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), NodeError> {
        // One thread in the pod for both steps (nested runs happen in place).
        netns.run(|| {
            crate::pod::enroll(netns, cfg, self.rules())?;
            self.clear_pod_leftovers(netns)
        })?
    }

    /// [`enroll`](Self::enroll) of a namespace the runtime has just made for a sandbox (its CNI
    /// ADD), without looking for the previous backend's rules or reading its own first
    /// ([`crate::pod::enroll_fresh`]): the caller knows none can be there but in a case
    /// [`verify`](Self::verify) and [`unenroll`](Self::unenroll) cover.
    pub fn enroll_sandbox(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), NodeError> {
        Ok(crate::pod::enroll_fresh(netns, cfg, self.rules())?)
    }

    pub fn unenroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), NodeError> {
        netns.run(|| {
            let ours = crate::pod::unenroll(netns, cfg, self.rules());
            let previous = self.clear_pod_leftovers(netns);
            ours?;
            previous
        })?
    }

    pub fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, NodeError> {
        netns.run(|| {
            let state = crate::pod::verify(netns, cfg, self.rules())?;
            if !self.previous.in_pod(netns)? {
                return Ok(state);
            }
            // Still redirected by the previous backend: drift, so a repair replaces it.
            let mut drift = match state {
                RuleState::Drifted(d) => d,
                _ => Drift::default(),
            };
            drift.unexpected.push(format!(
                "(rules of the previous backend, {})",
                self.previous.names()
            ));
            Ok(RuleState::Drifted(drift))
        })?
    }

    /// Whether the pod still holds rules of a backend not in use.
    pub fn leftovers(&self, netns: &Netns) -> Result<bool, NodeError> {
        Ok(netns.run(|| self.previous.in_pod(netns))??)
    }

    /// Removes the rules of the backends not in use from the pod.
    fn clear_pod_leftovers(&self, netns: &Netns) -> Result<(), NodeError> {
        if self.previous.clear_pod(netns)? {
            tracing::info!(
                previous = self.previous.names(),
                "removed the previous backend's in-pod rules"
            );
        }
        Ok(())
    }

    /// Removes the host rules and probe sets of the backend not in use.
    fn clear_host_leftovers(&self) -> Result<(), NodeError> {
        if self.previous.clear_host(&self.host)? {
            tracing::info!(
                previous = self.previous.names(),
                "removed the previous backend's host rules and probe sets"
            );
        }
        Ok(())
    }

    /// Adds the branch-ENI probe rules for `ip` when it is a branch-ENI pod.
    fn route_branch_eni(&self, ip: IpAddr) -> Result<(), NodeError> {
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
    pub fn setup_host(&self) -> Result<(), NodeError> {
        self.apply_host_rules()?;
        if let Backend::Iptables(_) = &self.backend {
            let sets = crate::host::ProbeSet { host: &self.host };
            for f in self.families() {
                sets.flush(f)?;
            }
        }
        self.clear_host_leftovers()
    }

    /// Removes the host rules and the probe sets, of both backends (uninstall; an upgrade keeps
    /// them).
    pub fn teardown_host(&self) -> Result<(), NodeError> {
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
            Backend::Iptables(b) => {
                crate::host::remove_rules(&self.host, b)?;
                let sets = crate::host::ProbeSet { host: &self.host };
                for f in self.families() {
                    sets.destroy(f)?;
                }
            }
            Backend::Nftables { .. } => crate::nft::host::destroy_host_table(&self.host)?,
        }
        Ok(())
    }

    /// The host's probe SNAT rules, and the probe sets they refer to where missing (entries of
    /// sets that exist are kept).
    pub fn apply_host_rules(&self) -> Result<(), NodeError> {
        match &self.backend {
            Backend::Iptables(b) => crate::host::apply_rules(&self.host, b, &self.cfg)?,
            Backend::Nftables { host, .. } => crate::nft::host::apply_host_rules(&self.host, host)?,
        }
        Ok(())
    }

    pub fn verify_host_rules(&self) -> Result<RuleState, NodeError> {
        Ok(match &self.backend {
            Backend::Iptables(b) => crate::host::verify_rules(&self.host, b, &self.cfg)?,
            Backend::Nftables { host, .. } => {
                crate::nft::host::verify_host_rules(&self.host, host)?
            }
        })
    }

    /// Removes the host's probe SNAT rules only; the probe sets stay.
    pub fn remove_host_rules(&self) -> Result<(), NodeError> {
        match &self.backend {
            Backend::Iptables(b) => crate::host::remove_rules(&self.host, b)?,
            Backend::Nftables { .. } => crate::nft::host::remove_host_rules(&self.host)?,
        }
        Ok(())
    }

    /// Exactly what [`apply_host_rules`](Self::apply_host_rules) programs, as text (dry runs).
    pub fn render_host_rules(&self) -> String {
        use cni_core::redirect::ambient::iptables::{families, host_probe_rules};
        match &self.backend {
            Backend::Iptables(_) => families(&self.cfg)
                .into_iter()
                .map(|f| {
                    cni_core::redirect::iptables::restore_text(&host_probe_rules(&self.cfg, f))
                })
                .collect(),
            Backend::Nftables { host, .. } => {
                cni_core::redirect::ambient::nft::host_ruleset(host).render()
            }
        }
    }

    fn set_upsert(&self, ip: IpAddr, uid: &str) -> Result<(), NodeError> {
        match &self.backend {
            Backend::Iptables(_) => {
                if ip.is_ipv6() && !self.cfg.ipv6 {
                    return Ok(());
                }
                crate::host::ProbeSet { host: &self.host }.upsert(ip, uid)?;
            }
            Backend::Nftables { host, sock, .. } => {
                ProbeSets { ipv6: host.ipv6 }.upsert(sock, ip, uid)?;
            }
        }
        Ok(())
    }

    fn set_remove(&self, ip: IpAddr, uid: &str) -> Result<(), NodeError> {
        match &self.backend {
            Backend::Iptables(_) => {
                if ip.is_ipv6() && !self.cfg.ipv6 {
                    return Ok(());
                }
                let outcome = crate::host::ProbeSet { host: &self.host }.delete(ip, uid)?;
                if let crate::host::Deleted::OwnedByOther(other) = outcome {
                    tracing::warn!(%ip, uid, owner = %other, "probe set entry belongs to another pod; kept");
                }
            }
            Backend::Nftables { host, sock, .. } => {
                ProbeSets { ipv6: host.ipv6 }.remove(sock, ip, uid)?;
            }
        }
        Ok(())
    }

    fn set_upsert_many(&self, entries: &[(IpAddr, String)]) -> Result<(), NodeError> {
        match &self.backend {
            Backend::Nftables { host, sock, .. } => {
                let refs: Vec<(IpAddr, &str)> = entries
                    .iter()
                    .map(|(ip, uid)| (*ip, uid.as_str()))
                    .collect();
                ProbeSets { ipv6: host.ipv6 }.upsert_many(sock, &refs)?;
                Ok(())
            }
            Backend::Iptables(_) => entries
                .iter()
                .try_for_each(|(ip, uid)| self.set_upsert(*ip, uid)),
        }
    }

    /// Addresses the probe sets hold (IPv6 only with IPv6 on), which are the ones probed.
    fn probed(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() || self.cfg.ipv6
    }

    /// Adds or replaces the probe set entry for `ip`, tagged with the pod UID, and the pod's
    /// branch-ENI probe rules.
    pub fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), NodeError> {
        self.set_upsert(ip, uid)?;
        if self.probed(ip) {
            self.route_branch_eni(ip)?;
        }
        Ok(())
    }

    /// Deletes the entry for `ip` only if it carries `uid`, and the pod's branch-ENI probe rules.
    pub fn remove(&self, ip: IpAddr, uid: &str) -> Result<(), NodeError> {
        self.set_remove(ip, uid)?;
        self.unroute_branch_eni(ip);
        Ok(())
    }

    /// Many upserts at once; one transaction with nftables.
    pub fn upsert_many(&self, entries: &[(IpAddr, String)]) -> Result<(), NodeError> {
        self.set_upsert_many(entries)?;
        entries
            .iter()
            .filter(|(ip, _)| self.probed(*ip))
            .try_for_each(|(ip, _)| self.route_branch_eni(*ip))
    }

    /// Checks the host's probe SNAT rules and the sets, and re-applies them where they drifted.
    /// Returns what was found then (`None`: in sync).
    pub fn repair_rules(&self) -> Result<Option<RuleState>, NodeError> {
        let state = self.verify_host_rules()?;
        if state == RuleState::InSync {
            return Ok(None);
        }
        // Both keep the entries of sets that still exist, and create the ones that do not.
        self.apply_host_rules()?;
        Ok(Some(state))
    }

    /// Every probe set entry: its address and the pod UID it is tagged with.
    pub fn list(&self) -> Result<Vec<(IpAddr, String)>, NodeError> {
        Ok(match &self.backend {
            Backend::Iptables(_) => {
                let sets = crate::host::ProbeSet { host: &self.host };
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

    /// The entries of `want` the sets lack (or hold for another pod), leaving out addresses the
    /// sets never hold.
    pub fn missing(&self, want: &[(IpAddr, String)]) -> Result<Vec<(IpAddr, String)>, NodeError> {
        let present: HashSet<(IpAddr, String)> = self.list()?.into_iter().collect();
        Ok(want
            .iter()
            .map(|(ip, uid)| (ip.to_canonical(), uid.clone()))
            .filter(|(ip, uid)| self.probed(*ip) && !present.contains(&(*ip, uid.clone())))
            .collect())
    }

    /// Deletes every probe set entry whose IP is not in `keep`.
    pub fn prune(&self, keep: &HashSet<IpAddr>) -> Result<(), NodeError> {
        match &self.backend {
            Backend::Iptables(_) => {
                let sets = crate::host::ProbeSet { host: &self.host };
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
