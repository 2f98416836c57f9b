//! The one place a configured backend name (`iptables` or `nftables`) becomes a rule backend:
//! the agent's node dataplane, the plugin's and repair's sidecar rules, the `install-cni
//! dataplane` command, the benches and the tests all choose through [`RuleBackend::new`], so a
//! name means the same backend (and the same iptables variant detection) everywhere.

use crate::inpod::{InpodRules, RuleError, RuleState};
use crate::iptables::{IptablesBackend, IptablesError};
use crate::netns::Netns;
use crate::nft::NftablesBackend;
use cni_core::redirect::ambient::InpodConfig;

/// Settings a backend needs at construction.
#[derive(Clone, Debug, Default)]
pub struct BackendOptions {
    /// `FORCE_IPTABLES_BINARY`: `legacy` or `nft` (iptables backend only).
    pub force_iptables: Option<String>,
    /// IPv6 rules will be programmed, so the IPv6 tools must work too.
    pub ipv6: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("unknown backend {0:?}: expected \"iptables\" or \"nftables\"")]
    Unknown(String),
    #[error(transparent)]
    Iptables(#[from] IptablesError),
}

/// The rule backend chosen by name.
pub enum RuleBackend {
    /// With the variant (legacy or nft) the host uses, detected or forced.
    Iptables(IptablesBackend),
    Nftables(NftablesBackend),
}

impl RuleBackend {
    /// The backend called `name`. Detection (iptables variant) runs in the calling thread's
    /// namespace, which must be the host's: the pods use the variant the host uses.
    pub fn new(name: &str, opts: &BackendOptions) -> Result<Self, BackendError> {
        match name {
            "iptables" => Ok(RuleBackend::Iptables(IptablesBackend::detect(
                opts.force_iptables.as_deref(),
                opts.ipv6,
            )?)),
            "nftables" => Ok(RuleBackend::Nftables(NftablesBackend::new())),
            other => Err(BackendError::Unknown(other.to_string())),
        }
    }

    fn rules(&self) -> &dyn InpodRules {
        match self {
            RuleBackend::Iptables(b) => b,
            RuleBackend::Nftables(b) => b,
        }
    }
}

/// In-pod rules through the chosen backend.
impl InpodRules for RuleBackend {
    fn name(&self) -> &'static str {
        self.rules().name()
    }

    fn render(&self, cfg: &InpodConfig) -> String {
        self.rules().render(cfg)
    }

    fn apply(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), RuleError> {
        self.rules().apply(netns, cfg)
    }

    fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, RuleError> {
        self.rules().verify(netns, cfg)
    }

    fn remove(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), RuleError> {
        self.rules().remove(netns, cfg)
    }
}
