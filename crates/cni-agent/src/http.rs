//! Health (`:8000` `/healthz`, `/readyz`) and metrics (`:15014` `/metrics`) endpoints.
//!
//! Readiness is the conjunction of named conditions (installer, watches, ZDS server, ...), and
//! `/readyz` names the ones that are false, each with its reason when it has one: unlike Istio's,
//! it is never green while a part the node depends on is down.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// The named conditions that must all hold for the agent to be ready.
#[derive(Default)]
pub struct Readiness {
    /// Each condition: `Ok` when it holds, else why not, when known.
    conditions: Mutex<BTreeMap<&'static str, Result<(), Option<String>>>>,
    /// Settings the agent cannot honour, named under the status whatever it is.
    unhonoured: Mutex<Vec<String>>,
}

/// One condition of [`Readiness`]; starts not ready.
#[derive(Clone)]
pub struct ReadyFlag {
    name: &'static str,
    readiness: Arc<Readiness>,
}

impl ReadyFlag {
    pub fn set(&self, ready: bool) {
        self.update(if ready { Ok(()) } else { Err(None) });
    }

    /// Not ready because of `reason`, which `/readyz` shows after the condition's name.
    pub fn fail(&self, reason: String) {
        self.update(Err(Some(reason)));
    }

    fn update(&self, state: Result<(), Option<String>>) {
        self.readiness
            .conditions
            .lock()
            .unwrap()
            .insert(self.name, state);
    }
}

impl Readiness {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Adds a condition, initially false.
    pub fn condition(self: &Arc<Self>, name: &'static str) -> ReadyFlag {
        self.conditions.lock().unwrap().insert(name, Err(None));
        ReadyFlag {
            name,
            readiness: self.clone(),
        }
    }

    /// Names `setting` (with what the agent does instead) in every `/readyz` body.
    pub fn unhonoured(&self, setting: String) {
        self.unhonoured.lock().unwrap().push(setting);
    }

    /// Names of the conditions that are false; empty when ready.
    pub fn not_ready(&self) -> Vec<&'static str> {
        let conditions = self.conditions.lock().unwrap();
        conditions
            .iter()
            .filter(|(_, state)| state.is_err())
            .map(|(name, _)| *name)
            .collect()
    }

    /// The false conditions as `/readyz` names them: `name` or `name (reason)`.
    fn not_ready_described(&self) -> Vec<String> {
        let conditions = self.conditions.lock().unwrap();
        conditions
            .iter()
            .filter_map(|(name, state)| match state {
                Ok(()) => None,
                Err(None) => Some(name.to_string()),
                Err(Some(reason)) => Some(format!("{name} ({reason})")),
            })
            .collect()
    }
}

async fn readyz(State(readiness): State<Arc<Readiness>>) -> impl IntoResponse {
    let waiting = readiness.not_ready_described();
    let (status, mut body) = if waiting.is_empty() {
        (StatusCode::OK, "ok\n".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", waiting.join(", ")),
        )
    };
    for setting in readiness.unhonoured.lock().unwrap().iter() {
        body.push_str(&format!("not honoured: {setting}\n"));
    }
    (status, body)
}

/// `/healthz` (always 200 while the process serves) and `/readyz`.
pub fn health_router(readiness: Arc<Readiness>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(readiness)
}

async fn metrics(State(registry): State<Arc<Registry>>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// `/metrics` in the OpenMetrics text format.
pub fn metrics_router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(registry)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get_text(router: Router, path: &str) -> (u16, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut resp = String::new();
        stream.read_to_string(&mut resp).await.unwrap();
        let code = resp[9..12].parse().unwrap();
        let body = resp
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (code, body)
    }

    #[tokio::test]
    async fn readyz_names_what_is_not_ready() {
        let readiness = Readiness::new();
        let install = readiness.condition("installer");
        let zds = readiness.condition("zds");
        let (code, body) = get_text(health_router(readiness.clone()), "/readyz").await;
        assert_eq!((code, body.as_str()), (503, "not ready: installer, zds\n"));

        install.set(true);
        let (code, body) = get_text(health_router(readiness.clone()), "/readyz").await;
        assert_eq!((code, body.as_str()), (503, "not ready: zds\n"));

        install.fail("writing kubeconfig: write /run/k: No space left on device".into());
        let (code, body) = get_text(health_router(readiness.clone()), "/readyz").await;
        assert_eq!(
            (code, body.as_str()),
            (
                503,
                "not ready: installer (writing kubeconfig: write /run/k: No space left on device), zds\n"
            )
        );
        install.set(true);

        zds.set(true);
        assert_eq!(
            get_text(health_router(readiness.clone()), "/readyz")
                .await
                .0,
            200
        );
        zds.set(false);
        assert_eq!(
            get_text(health_router(readiness.clone()), "/readyz")
                .await
                .0,
            503
        );
        assert_eq!(get_text(health_router(readiness), "/healthz").await.0, 200);
    }

    #[tokio::test]
    async fn readyz_names_unhonoured_settings_ready_or_not() {
        let readiness = Readiness::new();
        let install = readiness.condition("installer");
        readiness.unhonoured("DRY_RUN_FILE_PATH=/x: applied".into());
        let (code, body) = get_text(health_router(readiness.clone()), "/readyz").await;
        assert_eq!(
            (code, body.as_str()),
            (
                503,
                "not ready: installer\nnot honoured: DRY_RUN_FILE_PATH=/x: applied\n"
            )
        );
        install.set(true);
        let (code, body) = get_text(health_router(readiness), "/readyz").await;
        assert_eq!(
            (code, body.as_str()),
            (200, "ok\nnot honoured: DRY_RUN_FILE_PATH=/x: applied\n")
        );
    }

    #[tokio::test]
    async fn metrics_are_served() {
        let mut registry = Registry::default();
        let m = crate::metrics::Metrics::new(&mut registry);
        m.ztunnel_connected.set(1);
        let (code, body) = get_text(metrics_router(Arc::new(registry)), "/metrics").await;
        assert_eq!(code, 200);
        assert!(body.lines().any(|l| l == "ztunnel_connected 1"), "{body}");
    }
}
