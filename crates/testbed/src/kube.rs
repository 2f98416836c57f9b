//! A real Kubernetes API for tests: etcd and kube-apiserver (built by `tools/k8s-testenv/build.sh`
//! from their Go modules) on loopback, with RBAC authorization and a static admin token. Both
//! processes are killed when the [`KubeTestEnv`] is dropped.
//!
//! There is no controller-manager, scheduler or kubelet: pods are created with `spec.nodeName` set
//! and stay `Pending` unless a test writes their status. The `ServiceAccount` admission plugin is
//! off because nothing would create the `default` service account of a namespace.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};

const ADMIN_TOKEN: &str = "istio-cni-rs-test-admin";

pub struct KubeTestEnv {
    /// etcd, then kube-apiserver.
    processes: Vec<Child>,
    /// The etcd client, etcd peer and API server ports, held while the processes live.
    _ports: [crate::ports::Held; 3],
    /// How kube-apiserver was started, for [`restart_apiserver`](Self::restart_apiserver).
    apiserver: Vec<std::ffi::OsString>,
    dir: tempfile::TempDir,
    /// `https://127.0.0.1:<port>`
    pub server: String,
    /// Made once: every new client opens its own TLS connection, which cost each API call of a
    /// test ~50 ms.
    admin: std::sync::OnceLock<kube::Client>,
}

/// Directory holding `etcd` and `kube-apiserver`: `$K8S_TESTENV_DIR`, or built (and cached) now.
fn binaries_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("K8S_TESTENV_DIR") {
        return dir.into();
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/k8s-testenv/build.sh");
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    let stdout = String::from_utf8(out.stdout).unwrap();
    PathBuf::from(
        stdout
            .lines()
            .last()
            .expect("build.sh prints the cache dir")
            .trim(),
    )
}

fn openssl(dir: &Path, args: &str) {
    let status = Command::new("openssl")
        .args(args.split(' '))
        .current_dir(dir)
        .stderr(Stdio::null())
        .status()
        .expect("openssl is needed to make the test API server's certificates");
    assert!(status.success(), "openssl {args} failed");
}

fn spawn(cmd: &mut Command, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    cmd.stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"))
}

impl KubeTestEnv {
    /// Starts etcd and kube-apiserver and waits until the API server reports ready.
    ///
    /// Their ports stay held by the test bed for the environment's life and are shared with them
    /// alone ([`crate::ports::held`]): no other process on the machine can take one before they
    /// bind it, nor the API server's while it restarts.
    pub async fn start() -> Self {
        let bin = binaries_dir();
        let dir = tempfile::Builder::new()
            .prefix("kube-testenv")
            .tempdir()
            .unwrap();
        let d = dir.path().to_path_buf();
        let d = d.as_path();
        let (client, peer, api) = (
            crate::ports::held(),
            crate::ports::held(),
            crate::ports::held(),
        );
        let (client_port, peer_port, port) = (client.port(), peer.port(), api.port());
        let mut env = KubeTestEnv {
            processes: Vec::new(),
            _ports: [client, peer, api],
            apiserver: Vec::new(),
            dir,
            server: String::new(),
            admin: std::sync::OnceLock::new(),
        };

        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        env.processes.push(spawn(
            Command::new(bin.join("etcd"))
                .arg(format!("--data-dir={}", d.join("etcd").display()))
                .arg(format!("--listen-client-urls={etcd_url}"))
                .arg(format!("--advertise-client-urls={etcd_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=default={peer_url}"))
                .arg("--unsafe-no-fsync")
                .arg("--socket-reuse-port"),
            &d.join("etcd.log"),
        ));

        // A throwaway CA signs the serving certificate (rustls refuses a CA certificate used as a
        // server's own); the serving key also signs service-account tokens.
        let (key, cert) = (d.join("apiserver.key"), d.join("apiserver.crt"));
        std::fs::write(
            d.join("san.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        openssl(
            d,
            "req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=test-ca -keyout ca.key -out ca.crt",
        );
        openssl(
            d,
            "req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout apiserver.key -out apiserver.csr",
        );
        openssl(
            d,
            "x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext -out apiserver.crt",
        );
        std::fs::write(
            d.join("tokens.csv"),
            format!("{ADMIN_TOKEN},admin,admin-uid,\"system:masters\"\n"),
        )
        .unwrap();

        env.server = format!("https://127.0.0.1:{port}");
        let flags = [
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            "--permit-port-sharing".into(),
            format!("--tls-cert-file={}", cert.display()),
            format!("--tls-private-key-file={}", key.display()),
            "--authorization-mode=RBAC".into(),
            format!("--token-auth-file={}", d.join("tokens.csv").display()),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", key.display()),
            format!("--service-account-signing-key-file={}", key.display()),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            "--disable-admission-plugins=ServiceAccount".into(),
            "--allow-privileged=true".into(),
            "--enable-priority-and-fairness=false".into(),
        ];
        env.apiserver = std::iter::once(bin.join("kube-apiserver").into_os_string())
            .chain(flags.into_iter().map(Into::into))
            .collect();
        let apiserver = env.spawn_apiserver();
        env.processes.push(apiserver);
        if let Err(e) = env.wait_ready().await {
            panic!("{e}");
        }
        env
    }

    fn spawn_apiserver(&self) -> Child {
        let log = self.dir.path().join("kube-apiserver.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        Command::new(&self.apiserver[0])
            .args(&self.apiserver[1..])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start kube-apiserver: {e}"))
    }

    /// Kills kube-apiserver (SIGKILL) and starts it again on the same port and etcd; returns once
    /// it is ready. Clients see their connections reset and then refused meanwhile.
    pub async fn restart_apiserver(&mut self) {
        let old = &mut self.processes[1];
        let _ = old.kill();
        let _ = old.wait();
        self.processes[1] = self.spawn_apiserver();
        if let Err(e) = self.wait_ready().await {
            panic!("kube-apiserver restart: {e}");
        }
    }

    /// The API server's serving certificate and key (PEM files): a test proxy in front of the
    /// server presents them, so clients trusting [`ca_pem`](Self::ca_pem) accept the proxy.
    pub fn serving_cert(&self) -> (PathBuf, PathBuf) {
        let d = self.dir.path();
        (d.join("apiserver.crt"), d.join("apiserver.key"))
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(90);
        let client = self.client();
        loop {
            for (i, p) in self.processes.iter_mut().enumerate() {
                if let Ok(Some(status)) = p.try_wait() {
                    let log = if i == 0 {
                        "etcd.log"
                    } else {
                        "kube-apiserver.log"
                    };
                    let text =
                        std::fs::read_to_string(self.dir.path().join(log)).unwrap_or_default();
                    let tail: String = text.lines().rev().take(30).collect::<Vec<_>>().join("\n");
                    return Err(format!(
                        "{log} process exited with {status}; last lines (newest first):\n{tail}"
                    ));
                }
            }
            let req = http::Request::get("/readyz").body(Vec::new()).unwrap();
            if let Ok(body) = client.request_text(req).await
                && body.trim() == "ok"
            {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "kube-apiserver not ready after 90s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// PEM of the CA that signed the API server's serving certificate.
    pub fn ca_pem(&self) -> Vec<u8> {
        std::fs::read(self.dir.path().join("ca.crt")).expect("ca.crt")
    }

    fn config(&self, token: &str) -> kube::Config {
        let mut cfg = kube::Config::new(self.server.parse().unwrap());
        cfg.root_cert = Some(vec![pem_to_der(&self.ca_pem())]);
        cfg.auth_info.token = Some(token.to_string().into());
        cfg.default_namespace = "default".into();
        cfg
    }

    /// A kubeconfig file (JSON, which is YAML) for `token`, for processes under test.
    pub fn write_kubeconfig(&self, path: &Path, token: &str) {
        self.write_kubeconfig_for(path, token, &self.server);
    }

    /// The same for another endpoint serving this API (a proxy in front of it).
    pub fn write_kubeconfig_for(&self, path: &Path, token: &str, server: &str) {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(self.ca_pem());
        let cfg = serde_json::json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority-data": ca}}],
            "users": [{"name": "test", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            "current-context": "test"
        });
        std::fs::write(path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    }

    /// An admin client that reaches this API through another endpoint on 127.0.0.1 (a proxy in
    /// front of it).
    pub async fn admin_client_via(&self, port: u16) -> kube::Client {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        self.write_kubeconfig_for(
            &path,
            self.admin_token(),
            &format!("https://127.0.0.1:{port}"),
        );
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        kube::Client::try_from(cfg).unwrap()
    }

    /// The static admin token (group `system:masters`).
    pub fn admin_token(&self) -> &'static str {
        ADMIN_TOKEN
    }

    /// The API server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.server
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("server port")
    }

    /// A client with cluster-admin rights (group `system:masters`).
    pub fn client(&self) -> kube::Client {
        self.admin
            .get_or_init(|| kube::Client::try_from(self.config(ADMIN_TOKEN)).expect("admin client"))
            .clone()
    }

    /// Creates (if needed) the namespace and service account, and returns a client authenticated
    /// as that service account through a TokenRequest: its rights are exactly what RBAC grants it.
    pub async fn service_account_client(
        &self,
        namespace: &str,
        name: &str,
    ) -> (kube::Client, String) {
        let admin = self.client();
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(namespace.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let _ = Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &ns)
            .await;
        let sa = ServiceAccount {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let sas = Api::<ServiceAccount>::namespaced(admin.clone(), namespace);
        let _ = sas.create(&PostParams::default(), &sa).await;
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        let token = sas
            .create_token_request(name, &PostParams::default(), &req)
            .await
            .expect("token request")
            .status
            .expect("token status")
            .token;
        let client = kube::Client::try_from(self.config(&token)).expect("service account client");
        (client, token)
    }
}

pub(crate) fn pem_to_der(pem: &[u8]) -> Vec<u8> {
    use base64::Engine;
    let text = std::str::from_utf8(pem).expect("PEM is text");
    let body: String = text
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(body)
        .expect("PEM base64")
}

impl Drop for KubeTestEnv {
    fn drop(&mut self) {
        for p in self.processes.iter_mut().rev() {
            let _ = p.kill();
            let _ = p.wait();
        }
    }
}
