//! The repair controller (istio-cni.md §8): finds sidecar pods on this node that started before
//! the CNI plugin was installed (their `istio-validation` init container keeps exiting 126, no
//! traffic redirection) and deletes, labels or repairs them.

pub mod actions;
pub mod config;
pub mod controller;
pub mod events;
pub mod filter;
pub mod inplace;
pub mod netns;

pub use config::{RepairAction, RepairArgs, RepairConfig};
pub use controller::RepairController;

/// What the agent needs to run the controller.
pub struct RepairSetup {
    pub cfg: RepairConfig,
    pub client: kube::Client,
    /// Host access for `REPAIR_REPAIR_PODS`; `None` for the other actions.
    pub in_place: Option<inplace::InPlaceRepair>,
}
