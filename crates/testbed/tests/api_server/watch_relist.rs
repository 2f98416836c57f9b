//! The agent's pod and namespace watches (`cni_agent::ambient::cluster::spawn_watches`) against a
//! real kube-apiserver, reached through the test API proxy so the watches can be cut:
//!
//! - a namespace and a pod of this node that are huge (hundreds of labels, annotations near the
//!   API server's 256 KiB limit: it refuses the 1 MiB a client might try) are cached with only
//!   the labels the enablement selectors read, and the pod with only the annotations the agent
//!   reads;
//! - a watch resumed at a resourceVersion the API server no longer has (410 Gone: the server was
//!   restarted while the watch was cut and the cluster changed meanwhile) lists again once, not
//!   in a loop, and the relist takes out the pods and namespaces deleted while it was cut.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::mpsc;

use cni_agent::ambient::cluster::{Cluster, ClusterEvent, spawn_watches};
use cni_agent::http::Readiness;
use cni_core::enroll::{CompiledSelectors, DATAPLANE_MODE_LABEL, Labels, default_selectors};
use cni_core::redirect::ambient::overrides::BYPASS_INBOUND_CAPTURE;
use testbed::api_proxy::ApiProxy;
use testbed::apiserver_metrics::Scrape;
use testbed::kube::KubeTestEnv;

const NODE: &str = "relist-node";
/// Generous: the machine is shared, and the watcher's backoff grows while the proxy refuses.
const WAIT: Duration = Duration::from_secs(90);

async fn create_namespace(admin: &kube::Client, ns: serde_json::Value) {
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &serde_json::from_value(ns).unwrap())
        .await
        .expect("create namespace");
}

async fn create_pod(admin: &kube::Client, namespace: &str, name: &str) {
    create_pod_with(admin, namespace, json!({"name": name})).await
}

async fn create_pod_with(admin: &kube::Client, namespace: &str, metadata: serde_json::Value) {
    let pod = json!({
        "metadata": metadata,
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "none"}]}
    });
    Api::<Pod>::namespaced(admin.clone(), namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(pod).unwrap(),
        )
        .await
        .expect("create pod");
}

/// Deletes a namespace for good: with no namespace controller in the test bed, its finalizer
/// is taken off as the controller would once the namespace is empty.
async fn delete_namespace(admin: &kube::Client, name: &str) {
    let api = Api::<Namespace>::all(admin.clone());
    api.delete(name, &DeleteParams::default())
        .await
        .expect("delete namespace");
    let mut ns = api.get(name).await.expect("terminating namespace");
    ns.spec.get_or_insert_default().finalizers = Some(Vec::new());
    api.replace_subresource("finalize", name, &PostParams::default(), &ns)
        .await
        .expect("finalize namespace");
}

/// LIST requests the API server has served for `resource` since it started.
async fn lists(admin: &kube::Client, resource: &str) -> f64 {
    Scrape::read(admin)
        .await
        .expect("API server /metrics")
        .sum("apiserver_request_total", |l| {
            l.get("verb") == Some(&"LIST") && l.get("resource") == Some(&resource)
        })
}

/// Waits (up to [`WAIT`]) until `done` holds for the cache.
async fn until(cluster: &Cluster, what: &str, done: impl Fn(&Cluster) -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done(cluster) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {WAIT:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn labels_of(cluster: &Cluster, namespace: &str) -> Option<Labels> {
    cluster.read().unwrap().namespaces.get(namespace).cloned()
}

fn has_pod(cluster: &Cluster, namespace: &str, name: &str) -> bool {
    let key = (namespace.to_string(), name.to_string());
    cluster.read().unwrap().pods.contains_key(&key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_keep_only_what_the_agent_reads_and_relist_once_after_410_gone() {
    dataplane::enter_test_group!();
    let mut env = KubeTestEnv::start().await;
    let proxy = ApiProxy::start(&env).await;
    let admin = env.client();

    let ambient = json!({DATAPLANE_MODE_LABEL: "ambient"});
    for name in ["stays", "goes"] {
        create_namespace(
            &admin,
            json!({"metadata": {"name": name, "labels": ambient}}),
        )
        .await;
    }
    // 500 labels and 250 KiB of annotations (the API server refuses more than 256 KiB).
    let mut labels: BTreeMap<String, String> = (0..500)
        .map(|i| (format!("example.com/label-{i:03}"), format!("value-{i:03}")))
        .collect();
    labels.insert(DATAPLANE_MODE_LABEL.into(), "ambient".into());
    let annotations: BTreeMap<String, String> = (0..250)
        .map(|i| (format!("example.com/note-{i:03}"), "x".repeat(1000)))
        .collect();
    create_namespace(
        &admin,
        json!({"metadata": {"name": "huge", "labels": labels, "annotations": annotations}}),
    )
    .await;
    for (ns, pod) in [("stays", "p-stays"), ("goes", "p-goes")] {
        create_pod(&admin, ns, pod).await;
    }
    // The same on a pod of this node, with an annotation the agent reads among them.
    let mut pod_annotations = annotations.clone();
    pod_annotations.insert(BYPASS_INBOUND_CAPTURE.into(), "true".into());
    create_pod_with(
        &admin,
        "huge",
        json!({"name": "huge", "labels": labels, "annotations": pod_annotations}),
    )
    .await;

    let cluster = Arc::new(Cluster::default());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let selectors = CompiledSelectors::compile(&default_selectors()).unwrap();
    spawn_watches(
        env.admin_client_via(proxy.port()).await,
        NODE,
        &selectors,
        cluster.clone(),
        tx,
        Readiness::new().condition("watches"),
    );
    tokio::time::timeout(WAIT, async {
        while !matches!(rx.recv().await, Some(ClusterEvent::Synced) | None) {}
    })
    .await
    .expect("watches synced");

    // Huge input costs only what is kept: the one label the default selectors read.
    let only_mode: Labels = [(DATAPLANE_MODE_LABEL.to_string(), "ambient".to_string())].into();
    assert_eq!(labels_of(&cluster, "huge"), Some(only_mode.clone()));
    assert_eq!(labels_of(&cluster, "stays"), Some(only_mode.clone()));
    assert!(has_pod(&cluster, "goes", "p-goes"));
    let huge = cluster.read().unwrap().pods[&("huge".into(), "huge".into())].clone();
    assert_eq!(huge.metadata.labels, Some(only_mode));
    let read: BTreeMap<String, String> = [(BYPASS_INBOUND_CAPTURE.into(), "true".into())].into();
    assert_eq!(huge.metadata.annotations, Some(read));
    assert!(huge.metadata.uid.is_some());

    // The watches are cut (every request refused) while the cluster changes, and the API server
    // restarts: its watch cache starts after these changes, so the watches' resourceVersion is
    // gone from it (410).
    proxy.set_failing(Some(500));
    Api::<Pod>::namespaced(admin.clone(), "goes")
        .delete("p-goes", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete pod");
    delete_namespace(&admin, "goes").await;
    let none = json!({"metadata": {"labels": {DATAPLANE_MODE_LABEL: "none", "team": "a"}}});
    Api::<Namespace>::all(admin.clone())
        .patch("stays", &PatchParams::default(), &Patch::Merge(&none))
        .await
        .expect("relabel namespace");
    create_namespace(
        &admin,
        json!({"metadata": {"name": "new", "labels": ambient}}),
    )
    .await;
    env.restart_apiserver().await;
    // The server's own clients list at start-up; with the proxy still refusing, none are ours.
    let mut before = (0.0, 0.0);
    loop {
        let now = (
            lists(&admin, "namespaces").await,
            lists(&admin, "pods").await,
        );
        if now == before {
            break;
        }
        before = now;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let (ns_before, pods_before) = before;

    proxy.set_failing(None);
    until(&cluster, "namespaces relisted", |c| {
        labels_of(c, "new").is_some()
            && labels_of(c, "goes").is_none()
            && labels_of(c, "stays").and_then(|l| l.get(DATAPLANE_MODE_LABEL).cloned())
                == Some("none".into())
    })
    .await;
    until(&cluster, "pods relisted", |c| !has_pod(c, "goes", "p-goes")).await;
    assert!(has_pod(&cluster, "stays", "p-stays"));
    assert_eq!(
        labels_of(&cluster, "stays").map(|l| l.len()),
        Some(1),
        "only the selectors' label kept after the relist"
    );

    // Once, not in a loop: the watcher's backoff would have gone round several times by now.
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert_eq!(
        (
            lists(&admin, "namespaces").await - ns_before,
            lists(&admin, "pods").await - pods_before
        ),
        (1.0, 1.0),
        "LISTs of namespaces and pods after the watches resumed"
    );
}
