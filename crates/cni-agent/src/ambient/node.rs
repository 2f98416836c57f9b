//! The node's dataplane ([`dataplane::node::NodeDataplane`], the owner of this node's rule
//! backend) as the agent's seams see it, and the files Istio's agent reads of it in the agent's
//! run dir. What to program and when is the agent's; how is the dataplane's.

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cni_core::redirect::ambient::InpodConfig;
use dataplane::inpod::RuleState;
use dataplane::netns::Netns;
use dataplane::node::{ISTIO_VARIANT_FILES, NodeDataplane};

use super::mesh::{BoxError, PodRules, ProbeSet};
use crate::hostfs::{FileMode, HostDir};

impl PodRules for NodeDataplane {
    fn backend(&self) -> &'static str {
        NodeDataplane::backend(self)
    }

    fn enroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError> {
        NodeDataplane::enroll(self, netns, cfg)
    }

    fn enroll_sandbox(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError> {
        NodeDataplane::enroll_sandbox(self, netns, cfg)
    }

    fn unenroll(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), BoxError> {
        NodeDataplane::unenroll(self, netns, cfg)
    }

    fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, BoxError> {
        NodeDataplane::verify(self, netns, cfg)
    }

    fn leftovers(&self, netns: &Netns) -> Result<bool, BoxError> {
        NodeDataplane::leftovers(self, netns)
    }
}

/// Each probe set change also adds or removes the pod's branch-ENI probe rules.
impl ProbeSet for NodeDataplane {
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        NodeDataplane::upsert(self, ip, uid)
    }

    fn remove(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        NodeDataplane::remove(self, ip, uid)
    }

    fn upsert_many(&self, entries: &[(IpAddr, String)]) -> Result<(), BoxError> {
        NodeDataplane::upsert_many(self, entries)
    }

    fn repair_rules(&self) -> Result<Option<RuleState>, BoxError> {
        NodeDataplane::repair_rules(self)
    }

    fn list(&self) -> Result<Vec<(IpAddr, String)>, BoxError> {
        NodeDataplane::list(self)
    }

    fn missing(&self, want: &[(IpAddr, String)]) -> Result<Vec<(IpAddr, String)>, BoxError> {
        NodeDataplane::missing(self, want)
    }

    fn prune(&self, keep: &HashSet<IpAddr>) -> Result<(), BoxError> {
        NodeDataplane::prune(self, keep)
    }
}

/// Shares one node dataplane as both seams of [`super::mesh::Mesh`].
pub fn seams(node: Arc<NodeDataplane>) -> (Arc<dyn PodRules>, Arc<dyn ProbeSet>) {
    (node.clone(), node)
}

/// Writes [`ISTIO_VARIANT_FILES`] in `run_dir` with the variant the node's pods' rules are in, so
/// Istio's agent after a rollback drives that one ([`NodeDataplane::istio_variant`]). Written at
/// every start with the iptables backend; the nftables backend leaves them alone.
pub fn record_iptables_variant(node: &NodeDataplane, run_dir: &Path) -> std::io::Result<()> {
    let Some(variant) = node.istio_variant() else {
        return Ok(());
    };
    for_variant_files(run_dir, |dir, name| {
        dir.write_atomic(name, variant.as_bytes(), FileMode::Exactly(0o644))
    })
}

/// Uninstall: the files [`record_iptables_variant`] wrote go with the rules they named (an
/// upgrade keeps both). With the nftables backend they are not ours, and stay.
pub fn forget_iptables_variant(node: &NodeDataplane, run_dir: &Path) -> std::io::Result<()> {
    if node.istio_variant().is_none() {
        return Ok(());
    }
    for_variant_files(run_dir, |dir, name| dir.remove(name).map(drop))
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
    let dir =
        HostDir::open(run_dir).map_err(|e| named(run_dir.join(ISTIO_VARIANT_FILES[0]), &e))?;
    for name in ISTIO_VARIANT_FILES {
        op(&dir, name).map_err(|e| named(run_dir.join(name), &e))?;
    }
    Ok(())
}
