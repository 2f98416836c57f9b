//! Whether a stopping agent is being upgraded (leave the plugin and host state in place, so new
//! ambient pods fail closed until the new agent is up) or uninstalled (clean up everything).
//!
//! Istio's chart grants the agent one call for this: `get` on its own DaemonSet, by name (no list,
//! no watch), and Istio's agent makes it once, at shutdown. So do we, and decide:
//!
//! 1. The GET answers: the DaemonSet `istio-cni-node` exists, is not being deleted and its node
//!    affinity still selects this node → upgrade or reboot; otherwise → uninstall (Istio's rule).
//! 2. 403: the token is good but the grant is gone, removed by hand or by an uninstall → uninstall
//!    (Istio's rule).
//! 3. 401: the token itself is refused. Two causes: the service account was deleted (an
//!    uninstall), or this agent's pod was force-deleted (`--grace-period=0 --force`: the object,
//!    and the token bound to it, vanish at once, and the DaemonSet makes a new pod). Istio reads
//!    every 401 as an uninstall, which after a force delete unchains the plugin while pods keep
//!    being created (they start unredirected until the next agent chains it again). The agent's
//!    node-scoped pod watch, established before the token was refused, still tells the two apart:
//!    its own pod gone outright → force-deleted → upgrade; its own pod deleted gracefully (an
//!    uninstall's garbage collection) or unknown → uninstall. The watch and the kubelet learn of a
//!    force delete at about the same moment, so a pod still seen running is looked at again for
//!    [`OWN_POD_SETTLE`] (the kubelet gives a force-deleted pod at least 2 s).
//! 4. Any other error (API server unreachable, 5xx): retried, then Istio's rule: keep in
//!    Istio-owned config mode, uninstall otherwise.
//!
//! A force delete during an uninstall (a stuck pod after `helm uninstall`) keeps the plugin: the
//! pod was already stopping when it was force-deleted, so its first shutdown had decided.

use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

/// The DaemonSet name is fixed: the plugin's own-pod check relies on it too.
pub const DAEMONSET: &str = "istio-cni-node";

/// How long a refused token waits for the pod watch to see this agent's pod deleted.
pub const OWN_POD_SETTLE: Duration = Duration::from_millis(1500);

/// This agent's pod as the pod watch last saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnPod {
    /// No pod name (`POD_NAME` unset), or the watch has not listed yet.
    Unknown,
    /// Present and not being deleted.
    Running,
    /// Being deleted gracefully: a rollout, a drain, an uninstall's garbage collection.
    Deleting,
    /// Gone from the API server while this agent still runs: force-deleted.
    Removed,
}

impl OwnPod {
    /// `cached`: the pod watch's copy of this agent's pod, `Some(None)` when the watch has listed
    /// and it is not there.
    pub fn from_watch(named: bool, listed: bool, cached: Option<bool>) -> OwnPod {
        match (named && listed, cached) {
            (false, _) => OwnPod::Unknown,
            (true, None) => OwnPod::Removed,
            (true, Some(true)) => OwnPod::Deleting,
            (true, Some(false)) => OwnPod::Running,
        }
    }
}

/// What the shutdown GET of our DaemonSet came back with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// The API server answered: upgrade (`true`) or uninstall.
    Decided(bool),
    /// 401: the token is refused.
    Unauthorized,
    /// 403: the grant is gone.
    Forbidden,
    /// Anything else, after the retries.
    Failed,
}

/// The numbered rule of the module doc.
fn verdict(answer: Answer, own: OwnPod, owned_config: bool) -> bool {
    match answer {
        Answer::Decided(upgrade) => upgrade,
        Answer::Forbidden => false,
        Answer::Unauthorized => own == OwnPod::Removed,
        Answer::Failed => owned_config,
    }
}

/// True when the shutdown looks like an upgrade or reboot. `owned_config`: in Istio-owned config
/// mode the default on persistent API errors is "upgrade" (keep things), otherwise "uninstall".
/// `own_pod` reads this agent's pod from the pod watch (rule 3).
pub async fn is_upgrade(
    client: &kube::Client,
    namespace: &str,
    node: &str,
    owned_config: bool,
    own_pod: impl Fn() -> OwnPod,
) -> bool {
    let attempts = if owned_config { 3 } else { 1 };
    let mut answer = Answer::Failed;
    for attempt in 0..attempts {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        answer = match decide(client, namespace, node).await {
            Ok(upgrade) => Answer::Decided(upgrade),
            Err(kube::Error::Api(s)) if s.code == 401 => Answer::Unauthorized,
            Err(kube::Error::Api(s)) if s.code == 403 => Answer::Forbidden,
            Err(e) => {
                tracing::warn!(error = %e, attempt, "cannot ask the API server whether this is an upgrade");
                Answer::Failed
            }
        };
        if answer != Answer::Failed {
            break;
        }
    }
    let mut own = own_pod();
    if answer == Answer::Unauthorized && own == OwnPod::Running {
        let settle = tokio::time::Instant::now() + OWN_POD_SETTLE;
        while own == OwnPod::Running && tokio::time::Instant::now() < settle {
            tokio::time::sleep(Duration::from_millis(50)).await;
            own = own_pod();
        }
    }
    let upgrade = verdict(answer, own, owned_config);
    tracing::info!(
        ?answer,
        ?own,
        owned_config,
        upgrade,
        "upgrade or uninstall decided from a GET of DaemonSet {DAEMONSET}"
    );
    upgrade
}

async fn decide(client: &kube::Client, namespace: &str, node: &str) -> Result<bool, kube::Error> {
    let ds = match Api::<DaemonSet>::namespaced(client.clone(), namespace)
        .get_opt(DAEMONSET)
        .await?
    {
        Some(ds) => ds,
        None => return Ok(false),
    };
    if ds.metadata.deletion_timestamp.is_some() {
        return Ok(false);
    }
    let required = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    let Some(required) = required else {
        return Ok(true);
    };
    let node = Api::<Node>::all(client.clone()).get(node).await?;
    let labels = node.metadata.labels.unwrap_or_default();
    // Node selector terms are ORed; expressions within a term are ANDed. Only label expressions
    // are evaluated (field expressions name metadata.name).
    let name = node.metadata.name.unwrap_or_default();
    Ok(required.node_selector_terms.iter().any(|term| {
        let exprs = term
            .match_expressions
            .iter()
            .flatten()
            .map(|e| (e, labels.get(&e.key).cloned()));
        let fields = term
            .match_fields
            .iter()
            .flatten()
            .map(|e| (e, (e.key == "metadata.name").then(|| name.clone())));
        exprs
            .chain(fields)
            .all(|(e, value)| requirement_holds(&e.operator, value.as_deref(), e.values.as_deref()))
    }))
}

fn requirement_holds(op: &str, value: Option<&str>, values: Option<&[String]>) -> bool {
    let values = values.unwrap_or_default();
    match op {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|x| x != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(|v| v.parse::<i64>().ok()),
                values.first().and_then(|b| b.parse::<i64>().ok()),
            ) else {
                return false;
            };
            if op == "Gt" { v > bound } else { v < bound }
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{Answer, OwnPod, requirement_holds, verdict};

    #[test]
    fn the_own_pod_as_the_watch_saw_it() {
        assert_eq!(OwnPod::from_watch(false, true, None), OwnPod::Unknown);
        assert_eq!(OwnPod::from_watch(true, false, None), OwnPod::Unknown);
        assert_eq!(OwnPod::from_watch(true, true, None), OwnPod::Removed);
        assert_eq!(OwnPod::from_watch(true, true, Some(true)), OwnPod::Deleting);
        assert_eq!(OwnPod::from_watch(true, true, Some(false)), OwnPod::Running);
    }

    #[test]
    fn an_answered_get_decides_whatever_the_pod_and_mode() {
        for own in [
            OwnPod::Unknown,
            OwnPod::Running,
            OwnPod::Deleting,
            OwnPod::Removed,
        ] {
            for owned in [false, true] {
                assert!(verdict(Answer::Decided(true), own, owned));
                assert!(!verdict(Answer::Decided(false), own, owned));
            }
        }
    }

    #[test]
    fn a_revoked_grant_is_an_uninstall() {
        // 403: the token still works, so the pod was not force-deleted.
        for own in [
            OwnPod::Unknown,
            OwnPod::Running,
            OwnPod::Deleting,
            OwnPod::Removed,
        ] {
            assert!(!verdict(Answer::Forbidden, own, true));
        }
    }

    #[test]
    fn a_refused_token_keeps_the_plugin_only_for_a_force_deleted_pod() {
        // Force-deleted: the DaemonSet makes a new pod, which must find the plugin chained.
        assert!(verdict(Answer::Unauthorized, OwnPod::Removed, false));
        // The service account deleted under a pod the uninstall is deleting gracefully.
        assert!(!verdict(Answer::Unauthorized, OwnPod::Deleting, true));
        // No way to tell: Istio's rule.
        assert!(!verdict(Answer::Unauthorized, OwnPod::Unknown, true));
        assert!(!verdict(Answer::Unauthorized, OwnPod::Running, true));
    }

    #[test]
    fn an_unreachable_api_server_follows_the_config_mode() {
        assert!(verdict(Answer::Failed, OwnPod::Running, true));
        assert!(!verdict(Answer::Failed, OwnPod::Running, false));
    }

    #[test]
    fn node_affinity_operators() {
        let vals = vec!["a".to_string(), "b".to_string()];
        assert!(requirement_holds("In", Some("a"), Some(&vals)));
        assert!(!requirement_holds("In", Some("c"), Some(&vals)));
        assert!(!requirement_holds("In", None, Some(&vals)));
        assert!(requirement_holds("NotIn", None, Some(&vals)));
        assert!(!requirement_holds("NotIn", Some("b"), Some(&vals)));
        assert!(requirement_holds("Exists", Some(""), None));
        assert!(requirement_holds("DoesNotExist", None, None));
        assert!(requirement_holds("Gt", Some("5"), Some(&["3".to_string()])));
        assert!(!requirement_holds(
            "Lt",
            Some("5"),
            Some(&["3".to_string()])
        ));
        assert!(!requirement_holds("Bogus", Some("5"), None));
    }
}
