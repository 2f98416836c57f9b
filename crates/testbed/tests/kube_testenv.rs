//! Proves the test environment: a real kube-apiserver + etcd answer the calls the agent makes
//! (node-scoped pod watch, `pods/status` merge patch) and enforce RBAC.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use testbed::kube::KubeTestEnv;

fn pod(name: &str, node: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeName": node, "containers": [{"name": "app", "image": "busybox"}]}
    }))
    .unwrap()
}

#[tokio::test]
async fn node_scoped_watch_sees_status_patch() {
    let env = KubeTestEnv::start().await;
    let client = env.client();
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "smoke"}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let pods = Api::<Pod>::namespaced(client.clone(), "smoke");
    pods.create(&PostParams::default(), &pod("here", "node-a"))
        .await
        .unwrap();
    pods.create(&PostParams::default(), &pod("elsewhere", "node-b"))
        .await
        .unwrap();

    let cfg = watcher::Config::default().fields("spec.nodeName=node-a");
    let mut stream = watcher(Api::<Pod>::all(client.clone()), cfg)
        .applied_objects()
        .boxed();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.metadata.name.as_deref(), Some("here"));

    let patch = serde_json::json!({"metadata": {"annotations": {"ambient.istio.io/redirection": "enabled"}}});
    pods.patch_status("here", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    pods.patch_status("elsewhere", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();

    let next = tokio::time::timeout(Duration::from_secs(10), stream.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        next.metadata.name.as_deref(),
        Some("here"),
        "the watch is node-scoped"
    );
    let annotations = next.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations
            .get("ambient.istio.io/redirection")
            .map(String::as_str),
        Some("enabled")
    );
}

#[tokio::test]
async fn service_account_without_rbac_is_forbidden() {
    let env = KubeTestEnv::start().await;
    let (client, _token) = env
        .service_account_client("istio-system", "istio-cni")
        .await;
    let err = Api::<Pod>::all(client)
        .list(&Default::default())
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(status) => assert_eq!(status.code, 403, "{status:?}"),
        other => panic!("expected 403 Forbidden, got {other:?}"),
    }
}
