//! Whether a stopping agent is being upgraded (leave the plugin and host state in place, so new
//! ambient pods fail closed until the new agent is up) or uninstalled (clean up everything).
//! Istio's rule: the DaemonSet `istio-cni-node` still exists, is not being deleted, and still
//! selects this node → upgrade or reboot.
//!
//! The shutdown-time GET cannot always answer. A force-deleted agent pod (`--grace-period=0
//! --force`) loses its object, and its bound token with it, before the agent stops: every call
//! then gets 401, which Istio reads as an uninstall, unchaining the plugin while pods keep being
//! created (they start unredirected until the next agent re-chains it). So a metadata-only watch
//! of the DaemonSet runs for the agent's life, and when the GET fails its last view decides. An
//! uninstall deletes the DaemonSet before the agent's pod is stopped, so the watch has seen the
//! deletion by then; only with no view at all does Istio's fallback apply.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent, watcher};

/// The DaemonSet name is fixed: the plugin's own-pod check relies on it too.
pub const DAEMONSET: &str = "istio-cni-node";

/// What the DaemonSet watch last saw of our DaemonSet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// No complete view: not listed yet, or the watch is failing.
    Unknown,
    /// It exists and is not being deleted.
    Present,
    /// Deleted, being deleted, or absent from the last list.
    Gone,
}

/// The DaemonSet watch's latest view, shared with the shutdown path.
#[derive(Clone, Debug)]
pub struct DaemonSetView(Arc<Mutex<Seen>>);

impl DaemonSetView {
    pub fn get(&self) -> Seen {
        *self.0.lock().unwrap()
    }

    fn set(&self, seen: Seen) {
        *self.0.lock().unwrap() = seen;
    }
}

/// Starts the metadata-only watch of our DaemonSet in `namespace`.
pub fn watch_daemonset(client: kube::Client, namespace: &str) -> DaemonSetView {
    let view = DaemonSetView(Arc::new(Mutex::new(Seen::Unknown)));
    let api = Api::<PartialObjectMeta<DaemonSet>>::namespaced(client, namespace);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={DAEMONSET}"));
    let shared = view.clone();
    tokio::spawn(async move {
        let mut stream = watcher(api, cfg).default_backoff().boxed();
        let mut listed = false;
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Init) => listed = false,
                Ok(WatchEvent::InitApply(ds)) | Ok(WatchEvent::Apply(ds)) => {
                    listed = true;
                    shared.set(if ds.metadata.deletion_timestamp.is_some() {
                        Seen::Gone
                    } else {
                        Seen::Present
                    });
                }
                Ok(WatchEvent::Delete(_)) => shared.set(Seen::Gone),
                Ok(WatchEvent::InitDone) if !listed => shared.set(Seen::Gone),
                Ok(WatchEvent::InitDone) => {}
                Err(e) => {
                    // A view we can no longer refresh may be stale: let the GET's rule decide.
                    tracing::debug!(error = %e, "DaemonSet watch error, retrying with backoff");
                    shared.set(Seen::Unknown);
                }
            }
        }
    });
    view
}

/// True when the shutdown looks like an upgrade or reboot. `owned_config`: in Istio-owned config
/// mode the default on persistent API errors is "upgrade" (keep things), otherwise "uninstall".
pub async fn is_upgrade(
    client: &kube::Client,
    namespace: &str,
    node: &str,
    owned_config: bool,
    view: &DaemonSetView,
) -> bool {
    let attempts = if owned_config { 3 } else { 1 };
    let mut denied = false;
    for attempt in 0..attempts {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        match decide(client, namespace, node).await {
            Ok(upgrade) => return upgrade,
            Err(e) => {
                denied = matches!(&e, kube::Error::Api(s) if s.code == 401 || s.code == 403);
                tracing::warn!(error = %e, attempt, "cannot ask the API server whether this is an upgrade");
            }
        }
    }
    let seen = view.get();
    let upgrade = fallback(seen, denied, owned_config);
    tracing::info!(
        ?seen,
        denied,
        upgrade,
        "upgrade or uninstall decided by the DaemonSet watch's last view"
    );
    upgrade
}

/// The verdict when the API server could not be asked: the watch's view when it has one, else
/// Istio's rule (credentials refused: the uninstall revoked them; other errors: `owned_config`).
fn fallback(seen: Seen, denied: bool, owned_config: bool) -> bool {
    match seen {
        Seen::Present => true,
        Seen::Gone => false,
        Seen::Unknown => !denied && owned_config,
    }
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
    use super::{Seen, fallback, requirement_holds};

    #[test]
    fn an_unanswerable_shutdown_follows_the_watch_then_istio() {
        // Force-deleted agent pod: its token is refused, the DaemonSet is still there.
        assert!(fallback(Seen::Present, true, false));
        // Uninstall: the watch saw the DaemonSet go, whatever the error and the config mode.
        assert!(!fallback(Seen::Gone, true, true));
        assert!(!fallback(Seen::Gone, false, true));
        // No view: Istio's rule.
        assert!(!fallback(Seen::Unknown, true, true));
        assert!(!fallback(Seen::Unknown, false, false));
        assert!(fallback(Seen::Unknown, false, true));
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
