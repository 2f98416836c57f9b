//! Whether a stopping agent is being upgraded (leave the plugin and host state in place, so new
//! ambient pods fail closed until the new agent is up) or uninstalled (clean up everything).
//! Istio's rule: the DaemonSet `istio-cni-node` still exists, is not being deleted, and still
//! selects this node → upgrade or reboot.

use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

/// The DaemonSet name is fixed: the plugin's own-pod check relies on it too.
pub const DAEMONSET: &str = "istio-cni-node";

/// True when the shutdown looks like an upgrade or reboot. `owned_config`: in Istio-owned config
/// mode the default on persistent API errors is "upgrade" (keep things), otherwise "uninstall".
pub async fn is_upgrade(
    client: &kube::Client,
    namespace: &str,
    node: &str,
    owned_config: bool,
) -> bool {
    let attempts = if owned_config { 3 } else { 1 };
    for attempt in 0..attempts {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        match decide(client, namespace, node).await {
            Ok(upgrade) => return upgrade,
            Err(e) => tracing::warn!(error = %e, attempt, "cannot tell upgrade from uninstall"),
        }
    }
    owned_config
}

async fn decide(client: &kube::Client, namespace: &str, node: &str) -> Result<bool, kube::Error> {
    let ds = match Api::<DaemonSet>::namespaced(client.clone(), namespace)
        .get_opt(DAEMONSET)
        .await
    {
        Ok(Some(ds)) => ds,
        Ok(None) => return Ok(false),
        // RBAC already revoked by the uninstall.
        Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => return Ok(false),
        Err(e) => return Err(e),
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
    use super::requirement_holds;

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
