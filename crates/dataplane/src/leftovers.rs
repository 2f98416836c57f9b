//! What the backend not in use left behind after a switch on a live node (iptables ↔ nftables,
//! or one iptables variant to the other, as when a node's OS moves from iptables-legacy to
//! iptables-nft): host `ISTIO_*` chains and the `istio-inpod-probes-*` ipsets, or the nftables
//! host table; in pods enrolled before the switch, the other backend's redirection. A pod whose
//! old rules survive keeps redirecting to ztunnel after it leaves the mesh, so the agent finds and
//! removes them (Istio instead keeps iptables until the next reboot).
//!
//! Finding is cheap, because it runs on every enrollment and removal: nftables tables are listed
//! over netlink, legacy iptables tables are read from the namespace's `/proc/.../net` files, and
//! the iptables tools only run when one of those shows something.

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::nft::{INPOD_TABLES, NAT_TABLE};
use cni_core::redirect::iptables::Family;

use crate::backend::RuleBackend;
use crate::host::{HostError, ProbeSet};
use crate::inpod::{InpodRules, RuleError, RuleState};
use crate::iptables::detect::{Binaries, parse_version};
use crate::iptables::{DEFAULT_LOCK_DIR, IptablesBackend};
use crate::netns::Netns;
use crate::nft::{NftError, wire, with_socket};

/// The tables each iptables variant keeps ambient's rules in.
const XTABLES: [&str; 3] = ["nat", "mangle", "raw"];

/// One iptables variant, driven only to find and remove `ISTIO_*` state.
struct Variant {
    backend: IptablesBackend,
    legacy: bool,
}

/// iptables state of a node now using nftables (every variant whose tools run here), or now
/// using the other iptables variant ([`IptablesLeftovers::other_than`]).
pub struct IptablesLeftovers {
    /// Found at first need (`--version` of each tool): most nodes never hold another
    /// variant's tables, and then no tool runs at all.
    variants: std::sync::OnceLock<Vec<Variant>>,
    /// Legacy variants (true) or nft ones (false) are not wanted.
    except: Option<bool>,
}

impl IptablesLeftovers {
    /// The usable variants other than the one the agent now drives.
    pub fn other_than(current: crate::iptables::detect::Variant) -> Self {
        IptablesLeftovers {
            variants: std::sync::OnceLock::new(),
            except: Some(current == crate::iptables::detect::Variant::Legacy),
        }
    }

    fn variants(&self) -> &[Variant] {
        self.variants.get_or_init(|| {
            let mut all = find_variants();
            if let Some(legacy) = self.except {
                all.retain(|v| v.legacy != legacy);
            }
            all
        })
    }

    /// The variants held, as logs name them: `iptables-legacy`, `iptables-nft`.
    pub fn names(&self) -> String {
        let names: Vec<String> = self
            .variants()
            .iter()
            .map(|v| v.backend.binaries().prefix.clone())
            .collect();
        names.join(", ")
    }

    /// Every usable variant, found when first needed.
    pub fn find() -> Self {
        IptablesLeftovers {
            variants: std::sync::OnceLock::new(),
            except: None,
        }
    }

    /// Variants that may hold state in `netns`, judged without running their tools (nor
    /// looking for them when the namespace holds no iptables table at all).
    fn candidates(&self, netns: &Netns) -> Result<Vec<&Variant>, NftError> {
        let (legacy_tables, nft_tables) = netns.run(|| -> Result<_, NftError> {
            // `thread-self`: the namespace this thread entered, not the main thread's.
            let legacy = ["ip_tables_names", "ip6_tables_names"].iter().any(|f| {
                std::fs::read_to_string(format!("/proc/thread-self/net/{f}"))
                    .is_ok_and(|names| names.lines().any(|t| XTABLES.contains(&t.trim())))
            });
            let nft = with_socket(netns, wire::xtables_table_names)?
                .iter()
                .any(|t| XTABLES.contains(&t.as_str()));
            Ok((legacy, nft))
        })??;
        if !legacy_tables && !nft_tables {
            return Ok(Vec::new());
        }
        Ok(self
            .variants()
            .iter()
            .filter(|v| if v.legacy { legacy_tables } else { nft_tables })
            .collect())
    }

    /// Whether a pod namespace holds `ISTIO_*` chains or jumps of any variant.
    pub fn in_pod(&self, netns: &Netns) -> Result<bool, RuleError> {
        for v in self.candidates(netns)? {
            if v.backend.verify_pod(netns, |_| Vec::new())? != RuleState::InSync {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Removes every variant's `ISTIO_*` chains and jumps from a pod namespace; returns whether
    /// there were any.
    pub fn clear_pod(&self, netns: &Netns) -> Result<bool, RuleError> {
        let mut found = false;
        for v in self.candidates(netns)? {
            if v.backend.verify_pod(netns, |_| Vec::new())? != RuleState::InSync {
                v.backend.remove(netns, &InpodConfig::default())?;
                found = true;
            }
        }
        Ok(found)
    }

    /// Removes the host's `ISTIO_*` chains (probe SNAT) of every variant held; returns whether
    /// there were any. The probe ipsets stay: the variant in use refers to the same sets.
    pub fn clear_host_chains(&self, host: &Netns) -> Result<bool, HostError> {
        let mut found = false;
        for v in self.candidates(host)? {
            let nothing = |_| Vec::new();
            if v.backend.verify_host(host, nothing, &|_| Ok(()))? != RuleState::InSync {
                v.backend.converge_host(host, nothing, &|_| Ok(()))?;
                found = true;
            }
        }
        Ok(found)
    }

    /// [`IptablesLeftovers::clear_host_chains`], then the probe ipsets they referred to (a node
    /// now on nftables); returns whether anything was there. No `ipset` tool means no sets of ours.
    pub fn clear_host(&self, host: &Netns) -> Result<bool, HostError> {
        let mut found = self.clear_host_chains(host)?;
        let sets = ProbeSet { host };
        for family in [Family::V4, Family::V6] {
            // Asked over netlink first: the tool runs only for a set that is there.
            let name = family.probe_set();
            if with_socket(host, |sock| Ok(wire::ipset_exists(sock, &name))).ok()
                == Some(Some(false))
            {
                continue;
            }
            match sets.list(family) {
                Ok(_) => {
                    sets.destroy(family)?;
                    found = true;
                }
                Err(HostError::Spawn(_)) => break,
                // `ipset save` of a set that does not exist fails: nothing to remove.
                Err(HostError::Ipset { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(found)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeftoverError {
    #[error(transparent)]
    Nftables(#[from] NftError),
    #[error(transparent)]
    Rules(#[from] RuleError),
    #[error(transparent)]
    Host(#[from] HostError),
}

/// Every backend a node may have used before the one it uses now: with iptables, nftables and
/// the other iptables variant; with nftables, iptables (either variant).
pub enum Previous {
    /// In use: iptables of a variant; here, the other variant's.
    NftablesAnd(IptablesLeftovers),
    /// In use: nftables.
    Iptables(IptablesLeftovers),
}

impl Previous {
    /// The backends `current` replaces.
    pub fn of(current: &RuleBackend) -> Self {
        match current {
            RuleBackend::Iptables(b) => {
                Previous::NftablesAnd(IptablesLeftovers::other_than(b.binaries().variant))
            }
            RuleBackend::Nftables(_) => Previous::Iptables(IptablesLeftovers::find()),
        }
    }

    /// As logs name them.
    pub fn names(&self) -> String {
        match self {
            Previous::NftablesAnd(other_variant) => {
                format!("nftables, {}", other_variant.names())
            }
            Previous::Iptables(_) => "iptables".into(),
        }
    }

    /// Whether the pod still holds rules of one of them.
    pub fn in_pod(&self, netns: &Netns) -> Result<bool, LeftoverError> {
        Ok(match self {
            Previous::NftablesAnd(other_variant) => {
                nft_in_pod(netns)? || other_variant.in_pod(netns)?
            }
            Previous::Iptables(previous) => previous.in_pod(netns)?,
        })
    }

    /// Removes their rules from the pod; returns whether there were any.
    pub fn clear_pod(&self, netns: &Netns) -> Result<bool, LeftoverError> {
        Ok(match self {
            Previous::NftablesAnd(other_variant) => {
                // Both run: either may hold rules, whatever the other found.
                let nft = clear_nft_pod(netns)?;
                other_variant.clear_pod(netns)? || nft
            }
            Previous::Iptables(previous) => previous.clear_pod(netns)?,
        })
    }

    /// Removes their host rules and probe sets; returns whether there were any. An iptables node
    /// keeps the other variant's probe ipsets: its own rules refer to the same sets.
    pub fn clear_host(&self, host: &Netns) -> Result<bool, LeftoverError> {
        Ok(match self {
            Previous::NftablesAnd(other_variant) => {
                let nft = clear_nft_host(host)?;
                other_variant.clear_host_chains(host)? || nft
            }
            Previous::Iptables(previous) => previous.clear_host(host)?,
        })
    }
}

/// The usable variants among `iptables-legacy` and `iptables-nft` (plain `iptables` when
/// neither exists). Only `--version` runs: probing a table would load legacy modules.
fn find_variants() -> Vec<Variant> {
    let mut variants = Vec::new();
    for prefix in ["iptables-legacy", "iptables-nft", "iptables"] {
        if prefix == "iptables" && !variants.is_empty() {
            break;
        }
        let Ok(out) = std::process::Command::new(prefix).arg("--version").output() else {
            continue;
        };
        if !out.status.success() {
            continue;
        }
        let (variant, version) = parse_version(&String::from_utf8_lossy(&out.stdout));
        let bins = Binaries {
            prefix: prefix.to_string(),
            variant,
            version,
        };
        let legacy = variant == crate::iptables::detect::Variant::Legacy;
        variants.push(Variant {
            backend: IptablesBackend::new(bins, Some(DEFAULT_LOCK_DIR.into())),
            legacy,
        });
    }
    variants
}

/// Whether a pod namespace holds the nftables backend's tables.
pub fn nft_in_pod(netns: &Netns) -> Result<bool, NftError> {
    with_socket(netns, |sock| wire::read_tables(sock, &INPOD_TABLES)).map(|r| !r.tables.is_empty())
}

/// Removes the nftables backend's tables from a pod namespace; returns whether there were any.
pub fn clear_nft_pod(netns: &Netns) -> Result<bool, NftError> {
    if !nft_in_pod(netns)? {
        return Ok(false);
    }
    let mut batch = wire::Batch::default();
    for name in INPOD_TABLES {
        batch.ensure_no_table(name);
    }
    with_socket(netns, move |sock| batch.commit(sock))?;
    Ok(true)
}

/// Removes the nftables host table (probe sets and SNAT chain); returns whether it was there.
pub fn clear_nft_host(host: &Netns) -> Result<bool, NftError> {
    let present = with_socket(host, |sock| wire::read_tables(sock, &[NAT_TABLE]))?;
    if present.tables.is_empty() {
        return Ok(false);
    }
    crate::nft::host::destroy_host_table(host)?;
    Ok(true)
}
