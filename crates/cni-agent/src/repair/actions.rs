//! What is done to a pod found broken: delete it, label it, or repair it in place. Each action
//! counts its outcome in `istio_cni_repair_pods_repaired_total{type,result}`; delete and label
//! also leave an Event on the pod, as Istio's do.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::config::{RepairAction, RepairConfig};
use super::events::{EventRecorder, REASON_DELETE, REASON_LABEL};
use crate::metrics::RepairLabels;

#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    #[error("deleting the pod: {0}")]
    Delete(#[source] kube::Error),
    #[error("labelling the pod: {0}")]
    Label(#[source] kube::Error),
    #[error("repairing in place: {0}")]
    Repair(#[from] super::inplace::InPlaceError),
    /// A controller built without the host access in-place repair needs.
    #[error("in-place repair (REPAIR_REPAIR_PODS) is not set up in this controller")]
    RepairUnavailable,
}

/// Outcome label values.
const SUCCESS: &str = "success";
const FAIL: &str = "fail";
const SKIP: &str = "skip";

pub struct Actions {
    pub cfg: std::sync::Arc<RepairConfig>,
    pub client: kube::Client,
    pub events: EventRecorder,
    pub metrics: Family<RepairLabels, Counter>,
    pub in_place: Option<super::inplace::InPlaceRepair>,
}

fn namespace_and_name(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

impl Actions {
    /// Exports the configured action's `success` and `fail` counts at 0 from the start, so a
    /// dashboard has a series to show before the first repair (and `increase()` sees a first
    /// repair made after the first scrape).
    pub fn export_counts(&self) {
        for result in [SUCCESS, FAIL] {
            let _ = self.metrics.get_or_create(&RepairLabels {
                r#type: self.cfg.action.metric_type().into(),
                result: result.into(),
            });
        }
    }

    fn count(&self, action: RepairAction, result: &str) {
        self.metrics
            .get_or_create(&RepairLabels {
                r#type: action.metric_type().into(),
                result: result.into(),
            })
            .inc();
    }

    /// Deletes `pod` only if it is still the object we judged: a recreated pod of the same name
    /// (other UID) or a changed one (other resourceVersion) is left alone, and the next event for
    /// it is judged afresh.
    pub async fn delete(&self, pod: &Pod) -> Result<(), ActionError> {
        let (ns, name) = namespace_and_name(pod);
        tracing::info!(pod = %format!("{ns}/{name}"), "pod detected as broken, deleting");
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: pod.metadata.resource_version.clone(),
            }),
            ..DeleteParams::default()
        };
        match Api::<Pod>::namespaced(self.client.clone(), &ns)
            .delete(&name, &params)
            .await
        {
            Ok(_) => {
                self.events
                    .warn(pod, REASON_DELETE, "pod detected as broken, deleted")
                    .await;
                self.count(RepairAction::Delete, SUCCESS);
                Ok(())
            }
            Err(e) => {
                let message = format!("pod detected as broken, but failed to delete: {e}");
                self.events.warn(pod, REASON_DELETE, &message).await;
                self.count(RepairAction::Delete, FAIL);
                Err(ActionError::Delete(e))
            }
        }
    }

    /// Labels `pod` through `pods/status`, which can change metadata and is a narrower grant than
    /// `pods` patch.
    pub async fn label(&self, pod: &Pod) -> Result<(), ActionError> {
        let (ns, name) = namespace_and_name(pod);
        let key = &self.cfg.label_key;
        if pod
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(key))
        {
            tracing::debug!(pod = %format!("{ns}/{name}"), key, "broken pod already labelled");
            self.count(RepairAction::Label, SKIP);
            return Ok(());
        }
        tracing::info!(pod = %format!("{ns}/{name}"), key, value = %self.cfg.label_value, "pod detected as broken, labelling");
        let patch =
            serde_json::json!({"metadata": {"labels": {key.as_str(): self.cfg.label_value}}});
        match Api::<Pod>::namespaced(self.client.clone(), &ns)
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                self.events
                    .warn(pod, REASON_LABEL, "pod detected as broken, labeled")
                    .await;
                self.count(RepairAction::Label, SUCCESS);
                Ok(())
            }
            Err(e) => {
                tracing::error!(pod = %format!("{ns}/{name}"), error = %e, "cannot label broken pod");
                let message = format!("pod detected as broken, but failed to label: {e}");
                self.events.warn(pod, REASON_LABEL, &message).await;
                self.count(RepairAction::Label, FAIL);
                Err(ActionError::Label(e))
            }
        }
    }

    /// Programs the sidecar redirection inside the running pod (no Event, as in Istio).
    pub async fn repair(&self, pod: &Pod) -> Result<(), ActionError> {
        let (ns, name) = namespace_and_name(pod);
        let result = match &self.in_place {
            Some(r) => r.repair(pod).await.map_err(ActionError::from),
            None => Err(ActionError::RepairUnavailable),
        };
        match &result {
            Ok(()) => {
                tracing::info!(pod = %format!("{ns}/{name}"), "broken pod repaired in place");
                self.count(RepairAction::Repair, SUCCESS);
            }
            Err(e) => {
                tracing::error!(pod = %format!("{ns}/{name}"), error = %e, "pod detected as broken, but repair failed");
                self.count(RepairAction::Repair, FAIL);
            }
        }
        result
    }
}
