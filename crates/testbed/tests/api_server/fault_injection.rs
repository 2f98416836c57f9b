//! The churn harness's API faults, proven against a real kube-apiserver: the proxy passes a
//! kube client's requests through with the server's own certificate, answers every request with
//! the injected status during a burst (resetting open connections), and recovers; a restarted
//! API server keeps its data and port.

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use testbed::api_proxy::ApiProxy;
use testbed::kube::KubeTestEnv;

fn namespace(name: &str) -> Namespace {
    serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_proxy_passes_fails_on_demand_and_recovers() {
    dataplane::enter_test_group!();
    let mut env = KubeTestEnv::start().await;
    let proxy = ApiProxy::start(&env).await;
    let namespaces = Api::<Namespace>::all(env.admin_client_via(proxy.port()).await);

    namespaces
        .create(&PostParams::default(), &namespace("through-proxy"))
        .await
        .expect("a request through the proxy");
    assert_eq!(proxy.rejected(), 0);

    // kube's client retries 429 and 503 itself (with backoff), so those are seen as retries.
    for status in [500, 502] {
        proxy.set_failing(Some(status));
        // The reset may meet a pooled connection first; the next request gets the status.
        let mut got = Vec::new();
        for _ in 0..3 {
            let r = tokio::time::timeout(Duration::from_secs(10), namespaces.get("through-proxy"))
                .await
                .expect("an answer within 10 s");
            match r {
                Err(kube::Error::Api(e)) => {
                    assert_eq!(e.code, status, "{e:?}");
                    break;
                }
                other => got.push(format!("{other:?}")),
            }
        }
        assert!(got.len() < 3, "want an API error {status}, got {got:#?}");
    }

    assert!(proxy.rejected() >= 2, "{}", proxy.rejected());
    proxy.set_failing(Some(429));
    let before = proxy.rejected();
    let retried =
        tokio::time::timeout(Duration::from_secs(3), namespaces.get("through-proxy")).await;
    assert!(
        retried.is_err(),
        "a 429 burst is retried, not answered: {retried:?}"
    );
    assert!(
        proxy.rejected() > before + 1,
        "no retries through the burst"
    );

    proxy.set_failing(None);
    namespaces.get("through-proxy").await.expect("recovered");

    // A restart keeps etcd's data and the port: the same client reconnects.
    env.restart_apiserver().await;
    namespaces
        .get("through-proxy")
        .await
        .expect("the object survives an API server restart");
}
