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
    dataplane::enter_test_group!();
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
    dataplane::enter_test_group!();
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

/// The API server's port stays held by the test bed while the server restarts (issue #35): a
/// process binding it over and over meanwhile never gets it, and the server comes back on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_servers_port_cannot_be_taken_while_it_restarts() {
    dataplane::enter_test_group!();
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut env = KubeTestEnv::start().await;
    let port = env.port();
    let stop = Arc::new(AtomicBool::new(false));
    let taker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut tries = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for addr in ["127.0.0.1", "0.0.0.0"] {
                    if std::net::TcpListener::bind((addr, port)).is_ok() {
                        return Err(format!("took {addr}:{port} after {tries} tries"));
                    }
                }
                tries += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(tries)
        })
    };
    env.restart_apiserver().await;
    stop.store(true, Ordering::Relaxed);
    let tries = taker.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
    assert!(tries > 0, "the taker never tried");
    assert_eq!(env.port(), port);
    Api::<Namespace>::all(env.client())
        .list(&Default::default())
        .await
        .expect("the restarted API server answers on its port");
}
