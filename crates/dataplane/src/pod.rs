//! Enrollment primitives the agent calls for one pod namespace: policy routing and the rule
//! backend together, in Istio's order (routes, then rules), never leaving half of it behind on
//! a fresh pod.

use cni_core::redirect::ambient::InpodConfig;

use crate::inpod::{Drift, InpodRules, RuleError, RuleState};
use crate::netns::{Netns, NetnsError};
use crate::routes::{self, RouteError};

#[derive(Debug, thiserror::Error)]
pub enum PodError {
    #[error("policy routing: {0}")]
    Routes(#[from] RouteError),
    #[error("{0}")]
    Rules(#[from] RuleError),
    #[error("{first}; cleanup also failed: {cleanup}")]
    RollbackFailed {
        first: Box<PodError>,
        cleanup: Box<PodError>,
    },
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Many(Vec<PodError>),
    #[error(transparent)]
    Netns(#[from] NetnsError),
}

/// Runs the steps of one operation on a single thread inside the pod's namespace (each step's
/// own [`Netns::run`] then runs in place rather than starting a thread of its own).
fn in_pod<T: Send>(
    netns: &Netns,
    steps: impl FnOnce() -> Result<T, PodError> + Send,
) -> Result<T, PodError> {
    netns.run(steps)?
}

/// Programs routes and rules. If the pod had none of our state before and any step fails, what
/// was added is removed again, so the error leaves the pod as it was.
pub fn enroll(netns: &Netns, cfg: &InpodConfig, backend: &dyn InpodRules) -> Result<(), PodError> {
    in_pod(netns, || {
        let had_routes = !routes::read(netns, cfg.ipv6)?.present.is_empty();
        let had_rules = backend.verify(netns, cfg)? != RuleState::Absent;
        apply_or_undo(netns, cfg, backend, !had_routes && !had_rules)
    })
}

/// [`enroll`] of a namespace the runtime has just made for a sandbox, without reading what it
/// holds first (two dumps and a socket): a fresh namespace holds none of our state, so a failed
/// step is always undone. The one earlier writer such a namespace can have had is an agent that
/// died while serving the same ADD, which the runtime then fails too.
pub fn enroll_fresh(
    netns: &Netns,
    cfg: &InpodConfig,
    backend: &dyn InpodRules,
) -> Result<(), PodError> {
    in_pod(netns, || apply_or_undo(netns, cfg, backend, true))
}

/// Routes, then rules; on failure everything is removed again when `undo`.
fn apply_or_undo(
    netns: &Netns,
    cfg: &InpodConfig,
    backend: &dyn InpodRules,
    undo: bool,
) -> Result<(), PodError> {
    let result = routes::apply(netns, cfg.ipv6)
        .map_err(PodError::from)
        .and_then(|()| backend.apply(netns, cfg).map_err(PodError::from));
    match result {
        Err(first) if undo => match unenroll(netns, cfg, backend) {
            Ok(()) => Err(first),
            Err(cleanup) => Err(PodError::RollbackFailed {
                first: Box::new(first),
                cleanup: Box::new(cleanup),
            }),
        },
        other => other,
    }
}

/// Routes and rules compared with what [`enroll`] programs, as one verdict.
pub fn verify(
    netns: &Netns,
    cfg: &InpodConfig,
    backend: &dyn InpodRules,
) -> Result<RuleState, PodError> {
    in_pod(netns, || {
        let rules = backend.verify(netns, cfg)?;
        let routes = routes::read(netns, cfg.ipv6)?;
        let (missing, unexpected) = (routes.missing(), routes.unexpected());
        Ok(match rules {
            RuleState::InSync if missing.is_empty() && unexpected.is_empty() => RuleState::InSync,
            RuleState::Absent if routes.present.is_empty() => RuleState::Absent,
            other => {
                let mut drift = match other {
                    RuleState::Drifted(d) => d,
                    RuleState::Absent => Drift {
                        missing: vec![format!("(all {} rules)", backend.name())],
                        ..Default::default()
                    },
                    RuleState::InSync => Drift::default(),
                };
                drift.missing.extend(missing.iter().map(|p| p.to_string()));
                drift
                    .unexpected
                    .extend(unexpected.iter().map(|p| p.to_string()));
                RuleState::Drifted(drift)
            }
        })
    })
}

/// Removes rules, then routes (Istio's order). Both are attempted; failures are joined.
pub fn unenroll(
    netns: &Netns,
    cfg: &InpodConfig,
    backend: &dyn InpodRules,
) -> Result<(), PodError> {
    in_pod(netns, || {
        let mut errs = Vec::new();
        if let Err(e) = backend.remove(netns, cfg) {
            errs.push(PodError::from(e));
        }
        if let Err(e) = routes::remove(netns) {
            errs.push(PodError::from(e));
        }
        match errs.len() {
            0 => Ok(()),
            1 => Err(errs.remove(0)),
            _ => Err(PodError::Many(errs)),
        }
    })
}
