//! A large cluster's API objects without its nodes, for the scale bench: namespaces, and pods
//! bound to nodes that do not exist (no kubelet ever runs them, the API server does not check a
//! pod's `nodeName`), created concurrently through the API as fast as the server takes them.
//! Creating what already exists is not an error, so a bench grows one cluster step by step.

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;

/// Requests in flight while filling: enough to keep the API server busy on two CPUs.
const IN_FLIGHT: usize = 48;

/// Attempts per object: a loaded test API server answers some creates with a timeout or 429.
const ATTEMPTS: usize = 5;

/// The `i`th namespace of the filled cluster.
pub fn namespace_name(i: usize) -> String {
    format!("scale-{i:05}")
}

/// Namespaces `from..to`, labelled and annotated as a team's namespace typically is; every
/// tenth in ambient mode, as a cluster adopting ambient namespace by namespace.
pub async fn namespaces(client: &kube::Client, from: usize, to: usize) -> Result<(), kube::Error> {
    let api = Api::<Namespace>::all(client.clone());
    for_each(from..to, |i| {
        let mut labels = json!({"team": format!("team-{}", i % 50), "env": "prod"});
        if i % 10 == 0 {
            labels["istio.io/dataplane-mode"] = json!("ambient");
        }
        let ns: Namespace = serde_json::from_value(json!({"metadata": {
            "name": namespace_name(i), "labels": labels,
            "annotations": {"owner": format!("team-{}@example.com", i % 50),
                            "description": "created by the scale bench"}
        }}))
        .expect("namespace object");
        let api = api.clone();
        async move { create(&api, &ns).await }
    })
    .await
}

/// Pods `from..to` of a Deployment-like shape, spread over the first `namespaces` namespaces
/// and bound to `nodes` nodes named `node_prefix-<k>`, none of which exist.
pub async fn pods_on_nodes(
    client: &kube::Client,
    from: usize,
    to: usize,
    namespaces: usize,
    node_prefix: &str,
    nodes: usize,
) -> Result<(), kube::Error> {
    for_each(from..to, |i| {
        let node = format!("{node_prefix}-{}", i % nodes);
        let ns = namespace_name(i % namespaces);
        let api = Api::<Pod>::namespaced(client.clone(), &ns);
        let pod = pod_object(&format!("p-{i:06}"), &node);
        async move { create(&api, &pod).await }
    })
    .await
}

/// Pods `from..to` bound to `node` (the agent's own), spread over `namespaces` (all in ambient
/// mode), Pending: what the agent caches of a node's pods before any sandbox is added.
pub async fn pods_on_node(
    client: &kube::Client,
    node: &str,
    from: usize,
    to: usize,
    namespaces: &[String],
) -> Result<(), kube::Error> {
    for_each(from..to, |i| {
        let api = Api::<Pod>::namespaced(client.clone(), &namespaces[i % namespaces.len()]);
        let pod = pod_object(&format!("own-{i:04}"), node);
        async move { create(&api, &pod).await }
    })
    .await
}

/// A pod as a Deployment's ReplicaSet makes one: labels, an owner, one container with ports,
/// env, resources and probes (about 1.5 KB of JSON, managedFields aside).
pub fn pod_object(name: &str, node: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {"app": "web", "pod-template-hash": "5d8f7c9b6d", "version": "v1"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-12-01T00:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                 "name": "web-5d8f7c9b6d", "uid": "6f1c1d4e-0000-4000-8000-000000000001",
                                 "controller": true, "blockOwnerDeletion": true}]
        },
        "spec": {
            "nodeName": node,
            "serviceAccountName": "default",
            "containers": [{
                "name": "web", "image": "registry.example.com/team/web:1.42.0",
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                "env": [{"name": "LOG_LEVEL", "value": "info"},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                              "limits": {"memory": "256Mi"}},
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5}
            }],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                             "effect": "NoExecute", "tolerationSeconds": 300}]
        }
    }))
    .expect("pod object")
}

async fn for_each<F, Fut>(range: std::ops::Range<usize>, make: F) -> Result<(), kube::Error>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), kube::Error>>,
{
    futures::stream::iter(range.map(make))
        .buffer_unordered(IN_FLIGHT)
        .try_collect()
        .await
}

/// Creates `obj`; one that exists already counts as created.
async fn create<K>(api: &Api<K>, obj: &K) -> Result<(), kube::Error>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut attempt = 1;
    loop {
        match api.create(&PostParams::default(), obj).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(()),
            Err(_) if attempt < ATTEMPTS => {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(200 * attempt as u64)).await;
            }
            Err(e) => return Err(e),
        }
    }
}
