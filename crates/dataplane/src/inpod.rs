//! The seam between the agent and a rule backend for ambient in-pod redirection. Each backend
//! (iptables via `iptables-restore`, nftables over netlink) implements [`InpodRules`] from the same
//! [`InpodConfig`]; the agent never needs to know which one it holds.

use cni_core::redirect::ambient::InpodConfig;

use crate::netns::{Netns, NetnsError};

/// What `verify` found in a pod's namespace, compared with what `apply` would program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RuleState {
    /// Exactly the desired rules are present.
    InSync,
    /// None of our rules are present.
    Absent,
    /// Some are missing, changed or foreign; `apply` replaces them.
    Drifted(Drift),
}

/// A readable difference, one rule (in the backend's own syntax) per line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Drift {
    pub missing: Vec<String>,
    pub unexpected: Vec<String>,
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for line in &self.missing {
            writeln!(f, "- {line}")?;
        }
        for line in &self.unexpected {
            writeln!(f, "+ {line}")?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RuleError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("{backend} backend: {source}")]
    Backend {
        backend: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Programs, checks and removes the in-pod redirection rules of one backend.
pub trait InpodRules: Send + Sync {
    /// `iptables` or `nftables`, as on the command line and in logs.
    fn name(&self) -> &'static str;
    /// The exact rules `apply` programs, as text (dry runs, goldens, explain output).
    fn render(&self, cfg: &InpodConfig) -> String;
    /// Programs the rules in one transaction. Idempotent: the same state twice changes nothing,
    /// a drifted state is replaced, never duplicated.
    fn apply(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), RuleError>;
    /// Compares the namespace's rules with the desired ones.
    fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, RuleError>;
    /// Removes every rule, chain and table this backend owns in the namespace.
    fn remove(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), RuleError>;
}
