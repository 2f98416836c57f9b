//! Sidecar-mode redirection inside a pod namespace, as the CNI plugin programs it in place of
//! `istio-init`: the rules through the same backends as ambient (one `iptables-restore` per
//! family under the pod's own xtables lock, or one nftables netlink batch), and for TPROXY mode
//! the policy routing that delivers marked packets locally (`fwmark 1337 lookup 133`, `local
//! default dev lo table 133`). Re-applying the same config changes nothing; a drifted state is
//! replaced, never duplicated.

use cni_core::redirect::iptables::{Family, Rule, restore_text};
use cni_core::redirect::nft::diff as nft_diff;
use cni_core::redirect::sidecar::iptables as sidecar_iptables;
use cni_core::redirect::sidecar::nft as sidecar_nft;
use cni_core::redirect::sidecar::{
    INBOUND_TPROXY_MARK, InterceptionMode, SidecarConfig, TPROXY_ROUTE_TABLE, families,
};

use crate::backend::{BackendError, BackendOptions, RuleBackend};
use crate::inpod::RuleState;
use crate::iptables::{IptablesBackend, IptablesError};
use crate::netns::Netns;
use crate::nft::{NftError, NftablesBackend, wire};
use crate::routes::{self, Policy, RouteError};

/// `ip rule add fwmark 1337 lookup 133`: the kernel gives a rule without a priority the one
/// below the first non-zero one, 32765 in a fresh namespace; we set it so re-adds are detected.
pub const TPROXY_POLICY: Policy = Policy {
    table: TPROXY_ROUTE_TABLE,
    mark: INBOUND_TPROXY_MARK,
    mask: 0xffff_ffff,
    priority: 32765,
};

#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error("unknown backend {0:?}: expected \"iptables\" or \"nftables\"")]
    UnknownBackend(String),
    #[error("iptables: {0}")]
    Iptables(#[from] IptablesError),
    #[error("nftables: {0}")]
    Nftables(#[from] NftError),
    #[error("cannot reopen the pod's network namespace: {0}")]
    Reopen(std::io::Error),
    #[error("TPROXY policy routing: {0}")]
    Routes(#[from] RouteError),
    #[error("{first}; removing the partial state also failed: {cleanup}")]
    RollbackFailed {
        first: Box<SidecarError>,
        cleanup: Box<SidecarError>,
    },
}

/// The backend's own errors, as sidecar errors always named them.
impl From<BackendError> for SidecarError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::Unknown(name) => SidecarError::UnknownBackend(name),
            BackendError::Iptables(e) => SidecarError::Iptables(e),
        }
    }
}

/// The rule backend sidecar redirection is programmed with.
pub enum SidecarBackend {
    Iptables(IptablesBackend),
    Nftables(NftablesBackend),
}

impl SidecarBackend {
    /// `iptables` (variant detected in the calling thread's namespace, which must be the host's;
    /// `force` is `FORCE_IPTABLES_BINARY`) or `nftables`.
    pub fn new(name: &str, force: Option<&str>, ipv6: bool) -> Result<Self, SidecarError> {
        let opts = BackendOptions {
            force_iptables: force.map(str::to_string),
            ipv6,
        };
        Ok(match RuleBackend::new(name, &opts)? {
            RuleBackend::Iptables(b) => SidecarBackend::Iptables(b),
            RuleBackend::Nftables(b) => SidecarBackend::Nftables(b),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            SidecarBackend::Iptables(_) => "iptables",
            SidecarBackend::Nftables(_) => "nftables",
        }
    }

    /// Exactly what `apply` programs, as text (dry runs).
    pub fn render(&self, cfg: &SidecarConfig) -> String {
        render(self.name() == "nftables", cfg)
    }

    /// Programs routes (TPROXY only) then rules. Each backend changes the rules in one
    /// transaction (and undoes a half-programmed fresh pod itself); routes this call added are
    /// removed again when the rules fail, so an error leaves the pod as it was.
    pub fn apply(&self, netns: &Netns, cfg: &SidecarConfig) -> Result<(), SidecarError> {
        let tproxy = cfg.mode == InterceptionMode::Tproxy;
        let routes_fresh = tproxy
            && routes::read_policy(netns, cfg.ipv6, &TPROXY_POLICY)?
                .present
                .is_empty();
        let result = if tproxy {
            routes::apply_policy(netns, cfg.ipv6, &TPROXY_POLICY).map_err(SidecarError::from)
        } else {
            Ok(())
        }
        .and_then(|()| self.apply_rules(netns, cfg));
        match result {
            Err(first) if routes_fresh => match routes::remove_policy(netns, &TPROXY_POLICY) {
                Ok(()) => Err(first),
                Err(cleanup) => Err(SidecarError::RollbackFailed {
                    first: Box::new(first),
                    cleanup: Box::new(cleanup.into()),
                }),
            },
            other => other,
        }
    }

    fn apply_rules(&self, netns: &Netns, cfg: &SidecarConfig) -> Result<(), SidecarError> {
        match self {
            SidecarBackend::Iptables(b) => {
                b.converge_pod(&owner_matches(netns)?, rules_for(cfg))?;
            }
            SidecarBackend::Nftables(_) => {
                let desired = sidecar_nft::ruleset(cfg);
                crate::nft::with_socket(netns, move |sock| {
                    let actual = wire::read_tables(sock, &sidecar_nft::TABLES)?;
                    let mut batch = wire::Batch::default();
                    if actual.tables.is_empty() {
                        // A fresh pod (every ADD): only additions. Deleting nothing also spares
                        // the socket close (and so the plugin's exit) an RCU grace period.
                        for table in &desired.tables {
                            batch.add_table(&table.name);
                            batch.add_contents(table);
                        }
                    } else {
                        let (missing, unexpected) = nft_diff(&desired, &actual);
                        if missing.is_empty() && unexpected.is_empty() {
                            return Ok(());
                        }
                        batch.replace_tables(&desired);
                        for table in &actual.tables {
                            if desired.table(&table.name).is_none() {
                                batch.ensure_no_table(&table.name);
                            }
                        }
                    }
                    batch.commit(sock)
                })?;
            }
        }
        Ok(())
    }

    /// The rules compared with what `apply` programs (routes are checked by `apply` itself).
    pub fn verify(&self, netns: &Netns, cfg: &SidecarConfig) -> Result<RuleState, SidecarError> {
        match self {
            SidecarBackend::Iptables(b) => {
                Ok(b.verify_pod(&owner_matches(netns)?, rules_for(cfg))?)
            }
            SidecarBackend::Nftables(_) => {
                let actual = crate::nft::with_socket(netns, |sock| {
                    wire::read_tables(sock, &sidecar_nft::TABLES)
                })?;
                if actual.tables.is_empty() {
                    return Ok(RuleState::Absent);
                }
                let desired = sidecar_nft::ruleset(cfg);
                let (missing, unexpected) = nft_diff(&desired, &actual);
                if missing.is_empty() && unexpected.is_empty() {
                    Ok(RuleState::InSync)
                } else {
                    Ok(RuleState::Drifted(crate::inpod::Drift {
                        missing,
                        unexpected,
                    }))
                }
            }
        }
    }

    /// Removes our chains/tables (and the builtin-chain rules `cfg` adds) and the TPROXY routing.
    pub fn remove(&self, netns: &Netns, cfg: &SidecarConfig) -> Result<(), SidecarError> {
        match self {
            SidecarBackend::Iptables(b) => b.remove_pod(&owner_matches(netns)?, rules_for(cfg))?,
            SidecarBackend::Nftables(b) => {
                let mut batch = wire::Batch::default();
                for name in sidecar_nft::TABLES {
                    batch.ensure_no_table(name);
                }
                b.commit(netns, batch)?;
            }
        }
        routes::remove_policy(netns, &TPROXY_POLICY)?;
        Ok(())
    }
}

/// The sidecar rules match the proxy by UID and GID: in a user-namespaced pod the iptables tools
/// must run in the pod's user namespace (see [`Netns::for_owner_matches`]).
fn owner_matches(netns: &Netns) -> Result<Netns, SidecarError> {
    netns.for_owner_matches().map_err(SidecarError::Reopen)
}

/// What `apply` programs with the nftables (`nftables`) or iptables backend, as text; needs no
/// privileges and detects nothing, so dry runs work anywhere.
pub fn render(nftables: bool, cfg: &SidecarConfig) -> String {
    let mut out = if nftables {
        sidecar_nft::ruleset(cfg).render()
    } else {
        render_iptables(cfg)
    };
    if cfg.mode == InterceptionMode::Tproxy {
        let p = TPROXY_POLICY;
        out.push_str(&format!(
            "# ip rule add fwmark {} lookup {} pref {}\n# ip route add local 0.0.0.0/0 dev lo table {}\n",
            p.mark, p.table, p.priority, p.table
        ));
        if cfg.ipv6 {
            out.push_str(&format!(
                "# ip -6 rule add fwmark {} lookup {} pref {}\n# ip -6 route add local ::/0 dev lo table {}\n",
                p.mark, p.table, p.priority, p.table
            ));
        }
    }
    out
}

fn rules_for(cfg: &SidecarConfig) -> impl Fn(Family) -> Vec<Rule> + '_ {
    move |family| {
        if families(cfg).contains(&family) {
            sidecar_iptables::rules(cfg, family)
        } else {
            Vec::new()
        }
    }
}

/// The restore input per family, IPv6 marked as such.
fn render_iptables(cfg: &SidecarConfig) -> String {
    let mut out = String::new();
    for family in families(cfg) {
        if family == Family::V6 {
            out.push_str("# ip6tables-restore --noflush\n");
        }
        out.push_str(&restore_text(&sidecar_iptables::rules(cfg, family)));
    }
    out
}

#[cfg(test)]
mod tests {
    use cni_core::redirect::InterfaceName;

    use super::*;
    use crate::test_support::TestNetns;

    fn tproxy_cfg() -> SidecarConfig {
        SidecarConfig {
            mode: InterceptionMode::Tproxy,
            exclude_interfaces: vec![InterfaceName::new("eth9").unwrap()],
            redirect_dns: true,
            drop_invalid: true,
            ..SidecarConfig::default()
        }
    }

    fn tool(backend: &SidecarBackend, suffix: &str) -> String {
        match backend {
            SidecarBackend::Iptables(b) => b.binaries().tool(false, suffix),
            SidecarBackend::Nftables(_) => unreachable!("iptables tests only"),
        }
    }

    fn save(ns: &TestNetns, backend: &SidecarBackend) -> String {
        ns.exec(&tool(backend, "-save"), &[])
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| {
                // Packet counters change between reads; the rules are what matter.
                if l.starts_with(':') {
                    l.split(' ').take(2).collect::<Vec<_>>().join(" ")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn route_lines(ns: &TestNetns) -> (String, String) {
        (
            ns.exec("ip", &["rule", "show"]),
            ns.exec("ip", &["route", "show", "table", "133"]),
        )
    }

    #[test]
    fn iptables_apply_is_idempotent_repairs_drift_and_removes_everything() {
        crate::require_root!();
        let ns = TestNetns::new("sc-ipt");
        let netns = ns.open();
        let backend = SidecarBackend::new("iptables", None, false).unwrap();
        let cfg = tproxy_cfg();
        assert_eq!(backend.verify(&netns, &cfg).unwrap(), RuleState::Absent);
        backend.apply(&netns, &cfg).unwrap();
        let first = save(&ns, &backend);
        assert!(first.contains("-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --on-port 15006 --on-ip 0.0.0.0 --tproxy-mark 0x539/0xffffffff"), "{first}");
        assert!(
            first.contains("-A PREROUTING -p tcp -m mark --mark 0x539 -j CONNMARK --save-mark"),
            "{first}"
        );
        assert!(first.contains("-A OUTPUT -o eth9 -j RETURN"), "{first}");
        let (rules, routes) = route_lines(&ns);
        assert!(
            rules.contains("32765:\tfrom all fwmark 0x539 lookup 133"),
            "{rules}"
        );
        assert!(routes.contains("local default dev lo"), "{routes}");
        assert_eq!(backend.verify(&netns, &cfg).unwrap(), RuleState::InSync);

        backend.apply(&netns, &cfg).unwrap();
        assert_eq!(save(&ns, &backend), first, "re-apply changed the rules");
        assert_eq!(route_lines(&ns), (rules.clone(), routes));

        // Drift: a builtin-chain rule of ours gone, a chain rule changed. Repair must restore
        // exactly the first state: no duplicated CONNMARK/MARK rules in the builtin chains.
        ns.exec(
            &tool(&backend, ""),
            &[
                "-t",
                "mangle",
                "-D",
                "PREROUTING",
                "-p",
                "tcp",
                "-m",
                "mark",
                "--mark",
                "1337",
                "-j",
                "CONNMARK",
                "--save-mark",
            ],
        );
        ns.exec(
            &tool(&backend, ""),
            &["-t", "nat", "-A", "ISTIO_OUTPUT", "-j", "RETURN"],
        );
        assert!(matches!(
            backend.verify(&netns, &cfg).unwrap(),
            RuleState::Drifted(_)
        ));
        backend.apply(&netns, &cfg).unwrap();
        assert_eq!(
            save(&ns, &backend),
            first,
            "repair did not restore the exact state"
        );

        backend.remove(&netns, &cfg).unwrap();
        let after = save(&ns, &backend);
        assert!(
            !after.contains("ISTIO") && !after.contains("-A "),
            "{after}"
        );
        let (rules, routes) = route_lines(&ns);
        assert!(
            !rules.contains("lookup 133") && routes.trim().is_empty(),
            "{rules}{routes}"
        );
        assert_eq!(backend.verify(&netns, &cfg).unwrap(), RuleState::Absent);
    }

    #[test]
    fn nftables_apply_verify_remove() {
        crate::require_root!();
        let ns = TestNetns::new("sc-nft");
        let netns = ns.open();
        let backend = SidecarBackend::new("nftables", None, false).unwrap();
        let cfg = SidecarConfig {
            ipv6: true,
            ..tproxy_cfg()
        };
        backend.apply(&netns, &cfg).unwrap();
        let listed = ns.exec("nft", &["list", "ruleset"]);
        for want in [
            "table inet istio-proxy-nat",
            "table inet istio-proxy-mangle",
            "table inet istio-proxy-raw",
            "tproxy ip to :15006",
            "tproxy ip6 to :15006",
            "skgid 1337",
            "ct state established,related",
            "ct state invalid",
            "meta mark set 0x0000053a",
        ] {
            assert!(listed.contains(want), "{want:?} missing:\n{listed}");
        }
        assert_eq!(backend.verify(&netns, &cfg).unwrap(), RuleState::InSync);
        backend.apply(&netns, &cfg).unwrap();
        assert_eq!(ns.exec("nft", &["list", "ruleset"]), listed);
        let v6_rules = ns.exec("ip", &["-6", "rule", "show"]);
        assert!(v6_rules.contains("fwmark 0x539 lookup 133"), "{v6_rules}");

        ns.exec("nft", &["delete", "table", "inet", "istio-proxy-raw"]);
        assert!(matches!(
            backend.verify(&netns, &cfg).unwrap(),
            RuleState::Drifted(_)
        ));
        backend.apply(&netns, &cfg).unwrap();
        assert_eq!(backend.verify(&netns, &cfg).unwrap(), RuleState::InSync);

        backend.remove(&netns, &cfg).unwrap();
        assert_eq!(ns.exec("nft", &["list", "ruleset"]).trim(), "");
        assert_eq!(backend.verify(&netns, &cfg).unwrap(), RuleState::Absent);
    }

    #[test]
    fn render_shows_rules_and_tproxy_routing() {
        let cfg = tproxy_cfg();
        let b = SidecarBackend::Nftables(NftablesBackend::new());
        let text = b.render(&cfg);
        assert!(text.contains("add table inet istio-proxy-mangle"), "{text}");
        assert!(
            text.contains("# ip rule add fwmark 1337 lookup 133 pref 32765"),
            "{text}"
        );
        assert!(matches!(
            SidecarBackend::new("ebpf", None, false),
            Err(SidecarError::UnknownBackend(_))
        ));
    }
}
