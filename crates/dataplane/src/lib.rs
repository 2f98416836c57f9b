//! Privileged side effects of istio-cni-rs: the only crate that enters network namespaces, speaks
//! netlink, runs iptables and touches address sets.

pub mod brancheni;
pub mod heap;
pub mod host;
pub mod inpod;
pub mod iptables;
pub mod leftovers;
pub mod logfile;
pub mod netlink;
pub mod netns;
pub mod nft;
pub mod pod;
pub mod routes;
pub mod sidecar;
pub mod test_support;

use inpod::InpodRules;

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
    Iptables(#[from] iptables::IptablesError),
}

/// The in-pod rule backend called `name` (`iptables` or `nftables`). Detection (iptables variant)
/// runs in the calling thread's namespace, which must be the host's.
pub fn backend(name: &str, opts: &BackendOptions) -> Result<Box<dyn InpodRules>, BackendError> {
    match name {
        "iptables" => Ok(Box::new(iptables::IptablesBackend::detect(
            opts.force_iptables.as_deref(),
            opts.ipv6,
        )?)),
        "nftables" => Ok(Box::new(nft::NftablesBackend::new())),
        other => Err(BackendError::Unknown(other.to_string())),
    }
}
