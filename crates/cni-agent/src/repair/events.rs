//! Kubernetes Events about broken pods, as Istio's repair controller writes them: core/v1 Events
//! (the API group Istio's chart grants `create`/`patch` on), type Warning, component `cni-repair`.
//! An Event is a courtesy to whoever runs `kubectl describe pod`; failing to write one is logged
//! and never fails the repair itself.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};

/// `source.component` and `reportingComponent` of our Events.
pub const COMPONENT: &str = "cni-repair";
pub const REASON_DELETE: &str = "DeleteBrokenPod";
pub const REASON_LABEL: &str = "LabelBrokenPod";

#[derive(Clone)]
pub struct EventRecorder {
    client: kube::Client,
    /// The node we run on (`source.host`, `reportingInstance`).
    host: String,
}

impl EventRecorder {
    pub fn new(client: kube::Client, host: impl Into<String>) -> Self {
        EventRecorder {
            client,
            host: host.into(),
        }
    }

    /// Writes a Warning Event about `pod`.
    pub async fn warn(&self, pod: &Pod, reason: &str, message: &str) {
        let meta = &pod.metadata;
        let namespace = meta.namespace.clone().unwrap_or_else(|| "default".into());
        let name = meta.name.clone().unwrap_or_default();
        let now = Timestamp::now();
        // The same naming scheme as client-go's recorder: unique per pod and instant.
        let event_name = format!("{name}.{:x}", now.as_nanosecond());
        let event = Event {
            metadata: ObjectMeta {
                name: Some(event_name),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(name.clone()),
                namespace: Some(namespace.clone()),
                uid: meta.uid.clone(),
                resource_version: meta.resource_version.clone(),
                ..Default::default()
            },
            reason: Some(reason.into()),
            message: Some(message.into()),
            type_: Some("Warning".into()),
            source: Some(EventSource {
                component: Some(COMPONENT.into()),
                host: Some(self.host.clone()).filter(|h| !h.is_empty()),
            }),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            count: Some(1),
            reporting_component: Some(COMPONENT.into()),
            reporting_instance: Some(self.host.clone()).filter(|h| !h.is_empty()),
            event_time: None::<MicroTime>,
            ..Default::default()
        };
        let api = Api::<Event>::namespaced(self.client.clone(), &namespace);
        if let Err(e) = api.create(&PostParams::default(), &event).await {
            tracing::warn!(pod = %format!("{namespace}/{name}"), reason, error = %e, "cannot write event");
        }
    }
}
