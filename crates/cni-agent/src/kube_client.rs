//! The agent's Kubernetes client, built as Istio's node agent builds its own: a `User-Agent` of
//! `install-cni/<version>` (what API server audit logs and priority-and-fairness rules key on) and
//! a client-side limit of 80 requests per second with bursts of 160 (Istio's `QPS`/`Burst`, fixed
//! in its code). A node restart makes every agent list and patch at once; without a limit a large
//! cluster's API server sees the whole fleet's burst at full speed. Its connections are probed
//! by TCP keepalive ([`DEAD_PEER`]) so that a watch whose connection died silently is restarted.

use std::time::Duration;

use http::header::{HeaderValue, USER_AGENT};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;

/// `<binary>/<version>`, as Istio's `IstioUserAgent` forms it.
pub const AGENT_USER_AGENT: &str = concat!("install-cni/", env!("CARGO_PKG_VERSION"));

/// Client-side request budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// Sustained requests per second.
    pub qps: u32,
    /// Requests allowed at once before the rate applies.
    pub burst: u32,
}

/// Istio's node agent values.
pub const ISTIO_RATE_LIMIT: RateLimit = RateLimit {
    qps: 80,
    burst: 160,
};

/// Requests waiting for their response headers at once. The client speaks HTTP/1.1, one request
/// per connection at a time, and keeps idle connections for 90 s: 100 CNI ADDs at once opened 100
/// TLS connections to the API server (a handshake each, on both sides) and kept their buffers
/// for 90 s. A watch holds its slot only until its headers arrive, not while it streams.
pub const MAX_IN_FLIGHT: usize = 8;

/// When the kernel gives up on a connection to the API server: a keepalive probe after `idle`
/// with nothing received, then one every `interval`, and the connection reset once probes (or
/// sent data) went unanswered for `user_timeout` (`TCP_USER_TIMEOUT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadPeer {
    pub idle: Duration,
    pub interval: Duration,
    pub user_timeout: Duration,
}

/// A watch must hear again within one drift period (30 s by default). A `nft flush ruleset` on
/// the node takes kube-proxy's NAT from under the agent's connections to the `kubernetes`
/// Service address: the API server's answers then reach no socket, the node's kernel resets the
/// server's end, and the agent's end stayed ESTABLISHED and silent until kube's watch idle
/// timeout of 295 s (issue #39, RELIABILITY.md). A probe after 10 s idle finds such a connection
/// at once when the server answers it with a reset (as here, NAT back or not); when probes vanish
/// (a remote Service address with no NAT) the connection is reset at 25 s. The watcher then
/// watches again from its last resourceVersion, with no LIST. Probes are kernel segments answered
/// by the server's kernel, not requests: the API server's request load stays as it was (issue
/// #42). Istio's agent (client-go over HTTP/2) pings after 30 s without a frame, gives up 15 s
/// later.
pub const DEAD_PEER: DeadPeer = DeadPeer {
    idle: Duration::from_secs(10),
    interval: Duration::from_secs(5),
    user_timeout: Duration::from_secs(25),
};

/// The TCP connector under the client's TLS: `config`'s connect timeout and `dead`'s probes.
fn connector(config: &kube::Config, dead: DeadPeer) -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(config.connect_timeout);
    http.set_keepalive(Some(dead.idle));
    http.set_keepalive_interval(Some(dead.interval));
    http.set_tcp_user_timeout(Some(dead.user_timeout));
    http
}

/// A client for `config` with our User-Agent, `limit` and [`DEAD_PEER`]'s probes. The limit is a
/// window of `burst` requests per `burst / qps` seconds: the same average and the same largest
/// burst as client-go's token bucket.
///
/// The stack is kube's own (`ClientBuilder::try_from`) but for the TCP connector, which kube
/// does not let a caller configure, and these differences: no proxy (`proxy-url` is refused, as
/// kube without its proxy features refuses it), no write timeout layer (`TCP_USER_TIMEOUT` bounds
/// a write the server does not acknowledge), no request tracing spans, and no retry layer: kube's
/// retries 429, 503 and 504 up to 15 times with a backoff growing to minutes, so after a burst of
/// those a watch, an annotation or a CNI ADD's pod lookup slept for minutes after the API server
/// had recovered, holding the reconciler's queue (the churn harness saw deletes unprocessed for
/// over a minute). Every caller retries on its own terms instead: the watches with their
/// backoff, the reconciler per pod, the runtime its ADD.
pub fn build(mut config: kube::Config, limit: RateLimit) -> Result<kube::Client, kube::Error> {
    if let Some(proxy_url) = config.proxy_url.take() {
        return Err(kube::Error::ProxyProtocolUnsupported {
            proxy_url: Box::new(proxy_url),
        });
    }
    config
        .headers
        .push((USER_AGENT, HeaderValue::from_static(AGENT_USER_AGENT)));
    let https = config.rustls_https_connector_with_connector(connector(&config, DEAD_PEER))?;
    let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build::<_, kube::client::Body>(https);
    let window = Duration::from_secs_f64(f64::from(limit.burst) / f64::from(limit.qps.max(1)));
    let service = tower::ServiceBuilder::new()
        .layer(tower::limit::ConcurrencyLimitLayer::new(MAX_IN_FLIGHT))
        .layer(tower::limit::RateLimitLayer::new(
            u64::from(limit.burst.max(1)),
            window,
        ))
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(http);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// The in-cluster (or `KUBECONFIG`) client the agent uses.
pub async fn from_environment() -> anyhow::Result<kube::Client> {
    let config = kube::Config::infer().await?;
    Ok(build(config, ISTIO_RATE_LIMIT)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A loopback HTTP server that records each request head and when it arrived.
    async fn recorder() -> (String, Arc<Mutex<Vec<(Instant, String)>>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let log = log.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    loop {
                        let Ok(n) = s.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).to_string();
                            buf.drain(..end + 4);
                            log.lock().unwrap().push((Instant::now(), head));
                            let _ = s
                                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                .await;
                        }
                    }
                });
            }
        });
        (url, seen)
    }

    async fn get(client: &kube::Client) {
        let req = http::Request::get("/healthz").body(Vec::new()).unwrap();
        assert_eq!(client.request_text(req).await.unwrap(), "ok");
    }

    /// The kernel holds the probe settings of each connection the client opens: a silent peer
    /// is found by the connection itself, whichever request (a watch, a GET) is on it.
    #[tokio::test]
    async fn connections_probe_a_silent_api_server() {
        use nix::sys::socket::{getsockopt, sockopt};
        use tower::ServiceExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let config = kube::Config::new(url.parse().unwrap());
        let dead = DeadPeer {
            idle: Duration::from_secs(7),
            interval: Duration::from_secs(3),
            user_timeout: Duration::from_millis(11_500),
        };
        let io = connector(&config, dead)
            .oneshot(url.parse().unwrap())
            .await
            .unwrap();
        let tcp = io.inner();
        assert!(getsockopt(tcp, sockopt::KeepAlive).unwrap());
        assert_eq!(getsockopt(tcp, sockopt::TcpKeepIdle).unwrap(), 7);
        assert_eq!(getsockopt(tcp, sockopt::TcpKeepInterval).unwrap(), 3);
        assert_eq!(getsockopt(tcp, sockopt::TcpUserTimeout).unwrap(), 11_500);
    }

    #[test]
    fn a_proxy_url_is_refused() {
        let mut config = kube::Config::new("https://10.96.0.1".parse().unwrap());
        config.proxy_url = Some("http://proxy:3128".parse().unwrap());
        match build(config, ISTIO_RATE_LIMIT) {
            Err(kube::Error::ProxyProtocolUnsupported { proxy_url }) => {
                assert_eq!(proxy_url.to_string(), "http://proxy:3128/")
            }
            other => panic!("want the proxy refused, got {:?}", other.map(|_| ())),
        }
    }

    #[tokio::test]
    async fn requests_carry_the_install_cni_user_agent() {
        let (url, seen) = recorder().await;
        let client = build(kube::Config::new(url.parse().unwrap()), ISTIO_RATE_LIMIT).unwrap();
        get(&client).await;
        let heads = seen.lock().unwrap();
        let ua = heads[0]
            .1
            .lines()
            .find_map(|l| l.strip_prefix("user-agent: "))
            .unwrap_or_else(|| panic!("no user-agent in {:?}", heads[0].1));
        assert_eq!(ua, format!("install-cni/{}", env!("CARGO_PKG_VERSION")));
    }

    #[tokio::test]
    async fn a_429_is_returned_at_once_not_retried_by_the_client() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let count = Arc::new(Mutex::new(0));
        let seen = count.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                *seen.lock().unwrap() += 1;
                let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"TooManyRequests","code":429}"#;
                let resp = format!(
                    "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        let client = build(kube::Config::new(url.parse().unwrap()), ISTIO_RATE_LIMIT).unwrap();
        let pods = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client, "default");
        let got = tokio::time::timeout(Duration::from_secs(3), pods.get("p")).await;
        match got {
            Ok(Err(kube::Error::Api(e))) => assert_eq!(e.code, 429),
            other => panic!("want the 429 at once, got {other:?}"),
        }
        assert_eq!(*count.lock().unwrap(), 1);
    }

    #[tokio::test]
    async fn requests_beyond_the_burst_wait_for_the_rate() {
        let (url, seen) = recorder().await;
        // 3 at once, then 10 per second: the 4th request waits for the 300 ms window.
        let limit = RateLimit { qps: 10, burst: 3 };
        let client = build(kube::Config::new(url.parse().unwrap()), limit).unwrap();
        // The window opens when the first request asks, which is after `start`: measured from
        // here (not from the first request's arrival, which a loaded machine delays), the 4th
        // request cannot arrive before the window ends, however slow the rest is.
        let start = std::time::Instant::now();
        for _ in 0..4 {
            get(&client).await;
        }
        let heads = seen.lock().unwrap();
        assert_eq!(heads.len(), 4);
        let fourth = heads[3].0.duration_since(start);
        assert!(fourth >= Duration::from_millis(300), "{fourth:?}");
    }
}
