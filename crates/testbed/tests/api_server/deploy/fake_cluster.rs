//! Just enough of a Kubernetes API for `helm template --validate` to take the cluster's version
//! from it: `/version` reports the given `gitVersion` (which `--kube-version` cannot carry:
//! helm drops a `-gke.N` suffix), discovery lists the kinds the chart renders, and every object
//! lookup is a 404 (nothing installed yet). Plain HTTP on loopback, one thread.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use serde_json::{Value, json};

/// (API group, resource, kind, namespaced) of every kind the chart can render.
const RESOURCES: &[(&str, &str, &str, bool)] = &[
    ("", "configmaps", "ConfigMap", true),
    ("", "serviceaccounts", "ServiceAccount", true),
    ("", "resourcequotas", "ResourceQuota", true),
    ("apps", "daemonsets", "DaemonSet", true),
    (
        "rbac.authorization.k8s.io",
        "clusterroles",
        "ClusterRole",
        false,
    ),
    (
        "rbac.authorization.k8s.io",
        "clusterrolebindings",
        "ClusterRoleBinding",
        false,
    ),
    (
        "networking.k8s.io",
        "networkpolicies",
        "NetworkPolicy",
        true,
    ),
    (
        "k8s.cni.cncf.io",
        "network-attachment-definitions",
        "NetworkAttachmentDefinition",
        true,
    ),
];

pub struct FakeCluster {
    kubeconfig: tempfile::NamedTempFile,
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeCluster {
    pub fn start(git_version: &str) -> FakeCluster {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let version = git_version.to_string();
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(conn) = conn {
                        serve(conn, &version);
                    }
                }
            })
        };
        let mut kubeconfig = tempfile::NamedTempFile::new().unwrap();
        write!(
            kubeconfig,
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             clusters: [{{name: fake, cluster: {{server: 'http://{addr}'}}}}]\n\
             contexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\n\
             users: [{{name: fake, user: {{}}}}]\n"
        )
        .unwrap();
        FakeCluster {
            kubeconfig,
            addr,
            stop,
            thread: Some(thread),
        }
    }

    pub fn kubeconfig(&self) -> &str {
        self.kubeconfig.path().to_str().unwrap()
    }
}

impl Drop for FakeCluster {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One request per connection (`Connection: close`): read the request line and headers, answer.
fn serve(conn: TcpStream, git_version: &str) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut request = String::new();
    if reader.read_line(&mut request).is_err() {
        return;
    }
    loop {
        let mut header = String::new();
        match reader.read_line(&mut header) {
            Ok(0) | Err(_) => break,
            Ok(_) if header == "\r\n" => break,
            Ok(_) => {}
        }
    }
    let target = request.split_whitespace().nth(1).unwrap_or("/");
    let path = target.split('?').next().unwrap_or(target);
    let (status, body) = match answer(path, git_version) {
        Some(body) => ("200 OK", body),
        None => (
            "404 Not Found",
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                   "reason": "NotFound", "code": 404}),
        ),
    };
    let body = body.to_string();
    let mut conn = conn;
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
}

fn answer(path: &str, git_version: &str) -> Option<Value> {
    let groups: std::collections::BTreeSet<&str> = RESOURCES
        .iter()
        .map(|r| r.0)
        .filter(|g| !g.is_empty())
        .collect();
    let resources = |group: &str| -> Value {
        let list: Vec<Value> = RESOURCES
            .iter()
            .filter(|r| r.0 == group)
            .map(|(_, name, kind, namespaced)| {
                json!({"name": name, "singularName": "", "namespaced": namespaced,
                       "kind": kind, "verbs": ["get", "list", "create", "patch"]})
            })
            .collect();
        let gv = if group.is_empty() {
            "v1".to_string()
        } else {
            format!("{group}/v1")
        };
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
               "resources": list})
    };
    match path {
        "/version" => {
            let minor = git_version.split('.').nth(1).unwrap_or("0");
            Some(
                json!({"major": "1", "minor": minor, "gitVersion": git_version,
                        "platform": "linux/amd64"}),
            )
        }
        "/api" => Some(json!({"kind": "APIVersions", "versions": ["v1"]})),
        "/apis" => {
            let list: Vec<Value> = groups
                .iter()
                .map(|g| {
                    let v = json!({"groupVersion": format!("{g}/v1"), "version": "v1"});
                    json!({"name": g, "versions": [v], "preferredVersion": v})
                })
                .collect();
            Some(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": list}))
        }
        "/api/v1" => Some(resources("")),
        _ => {
            let group = path.strip_prefix("/apis/")?.strip_suffix("/v1")?;
            groups.contains(group).then(|| resources(group))
        }
    }
}
