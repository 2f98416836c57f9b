//! Istio's own mesh around our agent on the real node (`scripts/real-node mesh`): istiod built
//! from the pinned Istio, installed with Istio's `base` and `istiod` charts (profile ambient), our
//! chart in place of Istio's `cni` chart, and our ZDS test peer as ztunnel. istiod decides from
//! our annotation alone which pods ztunnel captures; its own view (`/debug/ambientz`) must list
//! as HBONE exactly the pods our agent enrolled.
//!
//! The node and istiod are started once for this file's tests (a shared fixture on one runtime,
//! torn down when the test process exits); the tests take turns on it, each in namespaces of its
//! own, and leave the node as they found it (peer, istiod). The fault tests start nodes of their
//! own.
//!
//! With `ZTUNNEL_BIN` (a ztunnel built without its `testing` feature) the tests at the end run
//! the real ztunnel from Istio's `ztunnel` chart on a second shared node; without it they print
//! `SKIPPED`.
//!
//! Needs root, the node binaries, istiod's (`tools/istio/build.sh`, cached) and the images.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{LazyLock, Mutex, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Pod, Service};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use testbed::istio_mesh::{DATAPLANE_MODE, Mesh, SYSTEM_NAMESPACE, sample};
use testbed::real_node::{
    NodeEnv, PEER, REDIRECTION, RealNode, annotation, busybox_pod, create, get, label_namespace,
    processes_under, running, wait_redirection, wait_running, witness, witness_pod,
};

/// One runtime for the whole file: the shared mesh's client and forwarder live on it.
static RT: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
});
/// The tests change shared state (the peer, istiod): one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shared mesh (node + istiod + our chart + the peer), brought up by the first test that
/// needs it. A failed start fails every test with its message instead of starting again.
fn mesh() -> &'static Mesh {
    static MESH: OnceLock<Result<Mesh, String>> = OnceLock::new();
    shared(&MESH, false)
}

fn shared(cell: &'static OnceLock<Result<Mesh, String>>, ztunnel: bool) -> &'static Mesh {
    cell.get_or_init(|| {
        std::panic::catch_unwind(|| {
            let started = Instant::now();
            let mesh = RT.block_on(Mesh::up(ztunnel));
            eprintln!(
                "shared mesh (ztunnel: {}) up in {:.1}s",
                if ztunnel { "Istio's" } else { "our peer" },
                started.elapsed().as_secs_f64()
            );
            mesh
        })
        .map_err(|e| {
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        })
    })
    .as_ref()
    .unwrap_or_else(|e| panic!("the shared mesh did not come up: {e}"))
}

type Key = (String, String);

fn key(ns: &str, name: &str) -> Key {
    (ns.to_string(), name.to_string())
}

/// Waits until istiod's HBONE workloads among `pods` are exactly `want`; returns how long that
/// took.
async fn wait_istiod_hbone(mesh: &Mesh, pods: &[Key], want: &[Key]) -> Duration {
    let want: BTreeSet<Key> = want.iter().cloned().collect();
    let started = Instant::now();
    let mut last = None;
    let deadline = started + Duration::from_secs(60);
    loop {
        let got = mesh.istiod_hbone(pods).await;
        if got.as_ref() == Some(&want) {
            return started.elapsed();
        }
        last = got.or(last);
        assert!(
            Instant::now() < deadline,
            "istiod's HBONE workloads among {pods:?}: {last:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn agent_pod(node: &RealNode) -> Pod {
    let pods = Api::<Pod>::namespaced(node.client(), SYSTEM_NAMESPACE)
        .list(&ListParams::default().labels("k8s-app=istio-cni-node"))
        .await
        .unwrap();
    pods.items
        .into_iter()
        .find(|p| p.metadata.deletion_timestamp.is_none())
        .expect("the agent's pod")
}

fn restarts(p: &Pod) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| c.restart_count).sum())
        .unwrap_or_default()
}

/// Delete events the agent processed (`nodeagent_reconcile_events_total{type="delete"}`).
async fn deletes_processed(mesh: &Mesh) -> f64 {
    sample(
        &mesh.agent_metrics().await,
        "nodeagent_reconcile_events_total",
        &["type=\"delete\""],
    )
    .unwrap_or(0.0)
}

#[test]
fn istiod_lists_as_hbone_exactly_the_pods_our_agent_enrolled() {
    dataplane::require_root!();
    let _one = one_at_a_time();
    let mesh = mesh();
    RT.block_on(async {
        let node = &mesh.node;
        node.namespace("amb", true).await;
        node.namespace("plain", false).await;
        let mut optout = witness_pod("optout", "sleep 3600");
        optout["metadata"]["labels"] = json!({DATAPLANE_MODE: "none"});
        create(node, "amb", witness_pod("a1", "sleep 3600")).await;
        let a2 = create(node, "amb", witness_pod("a2", "sleep 3600")).await;
        create(node, "amb", optout).await;
        create(node, "plain", witness_pod("p1", "sleep 3600")).await;
        let all = [
            key("amb", "a1"),
            key("amb", "a2"),
            key("amb", "optout"),
            key("plain", "p1"),
        ];
        for (ns, name) in &all {
            wait_running(node, ns, name).await;
        }
        // Our agent's decisions, and what each pod saw of them from its first instruction on.
        for (ns, name, enrolled) in [
            ("amb", "a1", true),
            ("amb", "a2", true),
            ("amb", "optout", false),
            ("plain", "p1", false),
        ] {
            let p = get(node, ns, name).await.unwrap();
            let want = enrolled.then_some("enabled");
            assert_eq!(annotation(&p, REDIRECTION).as_deref(), want, "{ns}/{name}");
            let seen = witness(node, ns, name);
            assert_eq!(seen == "REDIRECTED", enrolled, "{ns}/{name}: {seen}");
        }
        // istiod's: HBONE for exactly those two.
        let took = wait_istiod_hbone(mesh, &all, &all[..2]).await;
        eprintln!("istiod lists a1, a2 as HBONE ({took:?} after they ran)");
        let w = mesh.istiod_workloads().await.unwrap();
        for (ns, name) in &all {
            let ip: std::net::IpAddr = get(node, ns, name)
                .await
                .unwrap()
                .status
                .unwrap()
                .pod_ip
                .unwrap()
                .parse()
                .unwrap();
            let wl = w.get(&key(ns, name));
            assert_eq!(
                wl.map(|w| w.addresses.clone()),
                Some(vec![ip]),
                "istiod's {ns}/{name}: {w:#?}"
            );
        }
        mesh.assert_istiod_agrees_with_the_agent().await;

        // Out of the mesh by namespace label: our annotation goes, istiod follows; and back.
        label_namespace(node, "amb", false).await;
        for name in ["a1", "a2"] {
            wait_redirection(node, "amb", name, None).await;
        }
        let took = wait_istiod_hbone(mesh, &all, &[]).await;
        eprintln!("namespace out of the mesh: istiod followed our annotation in {took:?}");
        label_namespace(node, "amb", true).await;
        for name in ["a1", "a2"] {
            wait_redirection(node, "amb", name, Some("enabled")).await;
        }
        let took = wait_istiod_hbone(mesh, &all, &all[..2]).await;
        eprintln!("namespace back in the mesh: istiod followed our annotation in {took:?}");
        mesh.assert_istiod_agrees_with_the_agent().await;

        // One pod delete through kubelet (terminal phase, then the object goes): one ZDS Del.
        let before = deletes_processed(mesh).await;
        let logged = mesh.peer_log().len();
        Api::<Pod>::namespaced(node.client(), "amb")
            .delete("a2", &DeleteParams::default())
            .await
            .unwrap();
        node.eventually(
            "a2 deleted and processed",
            Duration::from_secs(60),
            || async {
                let gone = get(node, "amb", "a2").await.is_none();
                (gone && deletes_processed(mesh).await > before).then_some(())
            },
        )
        .await;
        // Whatever the delete event was going to send has gone out by now.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let log = mesh.peer_log();
        let since = &log[logged.min(log.len())..];
        let dels = since.iter().filter(|e| **e == format!("del {a2}")).count();
        assert_eq!(dels, 1, "ZDS Dels for one pod delete: {since:?}");
        wait_istiod_hbone(mesh, &all, &all[..1]).await;
        mesh.assert_istiod_agrees_with_the_agent().await;
    });
}

/// Puts the peer DaemonSet back when dropped (also when the test fails half-way).
struct PeerBack<'a>(&'a RealNode);

impl Drop for PeerBack<'_> {
    fn drop(&mut self) {
        let path = format!("{}/../../{PEER}", env!("CARGO_MANIFEST_DIR"));
        let _ = self.0.try_script(&["kubectl", "apply", "-f", &path]);
    }
}

#[test]
fn a_pod_whose_enrollment_failed_closed_is_not_in_the_mesh_until_ztunnel_is_back() {
    dataplane::require_root!();
    let _one = one_at_a_time();
    let mesh = mesh();
    RT.block_on(async {
        let node = &mesh.node;
        // No ZDS peer: ambient ADDs fail closed (the pod never starts).
        let back = PeerBack(node);
        node.kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "delete",
            "daemonset",
            "ztunnel",
            "--wait=true",
        ]);
        node.eventually(
            "the agent sees no ztunnel",
            Duration::from_secs(60),
            || async {
                let m = mesh.agent_metrics().await;
                (sample(&m, "ztunnel_connected", &[]) == Some(0.0)).then_some(())
            },
        )
        .await;
        node.namespace("closed", true).await;
        create(node, "closed", witness_pod("late", "sleep 3600")).await;
        let events = Api::<Event>::namespaced(node.client(), "closed");
        let failed = node
            .eventually(
                "late's sandbox creation failed",
                Duration::from_secs(60),
                || async {
                    let lp = ListParams::default()
                        .fields("involvedObject.name=late,reason=FailedCreatePodSandBox");
                    let e = events.list(&lp).await.unwrap().items;
                    e.first().and_then(|e| e.message.clone())
                },
            )
            .await;
        eprintln!("late's ADD failed closed: {failed}");
        let late = get(node, "closed", "late").await.unwrap();
        assert!(!running(&late), "started without ztunnel");
        assert_ne!(annotation(&late, REDIRECTION).as_deref(), Some("enabled"));
        let k = [key("closed", "late")];
        assert!(
            mesh.istiod_hbone(&k).await.unwrap().is_empty(),
            "istiod lists a pod that never started as HBONE"
        );
        mesh.assert_istiod_agrees_with_the_agent().await;

        // The peer back: kubelet's next try enrolls it, istiod follows.
        drop(back);
        node.rollout("ztunnel").await;
        wait_running(node, "closed", "late").await;
        wait_redirection(node, "closed", "late", Some("enabled")).await;
        assert_eq!(witness(node, "closed", "late"), "REDIRECTED");
        wait_istiod_hbone(mesh, &k, &k).await;
        mesh.assert_istiod_agrees_with_the_agent().await;
    });
}

/// Scales istiod back up when dropped.
struct IstiodBack<'a>(&'a RealNode);

impl Drop for IstiodBack<'_> {
    fn drop(&mut self) {
        let _ = self.0.try_script(&[
            "kubectl",
            "-n",
            SYSTEM_NAMESPACE,
            "scale",
            "deployment/istiod",
            "--replicas=1",
        ]);
    }
}

/// Ambient enrollment does not depend on istiod: with istiod gone the agent neither fails nor
/// lets an ambient pod start unredirected, and istiod, back, lists the pod as HBONE.
#[test]
fn istiod_down_neither_fails_the_agent_nor_starts_pods_unredirected() {
    dataplane::require_root!();
    let _one = one_at_a_time();
    let mesh = mesh();
    RT.block_on(async {
        let node = &mesh.node;
        let agent = agent_pod(node).await;
        let back = IstiodBack(node);
        node.kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "scale",
            "deployment/istiod",
            "--replicas=0",
        ]);
        node.eventually("istiod gone", Duration::from_secs(60), || async {
            let pods = Api::<Pod>::namespaced(node.client(), SYSTEM_NAMESPACE)
                .list(&ListParams::default().labels("app=istiod"))
                .await
                .unwrap();
            pods.items.is_empty().then_some(())
        })
        .await;
        assert!(mesh.ambientz().await.is_none(), "istiod still answers");

        node.namespace("nod", true).await;
        let uid = create(node, "nod", witness_pod("while-down", "sleep 3600")).await;
        wait_running(node, "nod", "while-down").await;
        wait_redirection(node, "nod", "while-down", Some("enabled")).await;
        assert_eq!(witness(node, "nod", "while-down"), "REDIRECTED");
        let peer = node.peer_status().unwrap();
        assert!(peer["workloads"].get(&uid).is_some(), "{peer:#}");
        let now = agent_pod(node).await;
        assert_eq!(
            now.metadata.uid, agent.metadata.uid,
            "the agent's pod was replaced"
        );
        assert_eq!(restarts(&now), restarts(&agent), "the agent restarted");
        assert!(running(&now), "the agent is not ready");

        drop(back);
        node.kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "rollout",
            "status",
            "deployment/istiod",
            "--timeout=120s",
        ]);
        let k = [key("nod", "while-down")];
        wait_istiod_hbone(mesh, &k, &k).await;
        mesh.assert_istiod_agrees_with_the_agent().await;
    });
}

/// kube-proxy and CoreDNS on the node: a pod finds a Service by its cluster DNS name and reaches
/// it through its ClusterIP, and the `kubernetes` Service by name.
#[test]
fn services_and_cluster_dns_work_as_on_any_cluster() {
    dataplane::require_root!();
    let _one = one_at_a_time();
    let mesh = mesh();
    RT.block_on(async {
        let node = &mesh.node;
        node.namespace("svc", false).await;
        let mut server = busybox_pod(
            "web",
            &[
                "sh",
                "-c",
                "mkdir /www; echo hello > /www/index.html; exec httpd -f -p 8080 -h /www",
            ],
        );
        server["metadata"]["labels"] = json!({"app": "web"});
        create(node, "svc", server).await;
        create(node, "svc", busybox_pod("client", &["sleep", "3600"])).await;
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
        }))
        .unwrap();
        let svc = Api::<Service>::namespaced(node.client(), "svc")
            .create(&PostParams::default(), &svc)
            .await
            .unwrap();
        let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();
        wait_running(node, "svc", "web").await;
        wait_running(node, "svc", "client").await;
        let exec = |script: &str| {
            node.try_script(&[
                "kubectl", "-n", "svc", "exec", "client", "--", "sh", "-c", script,
            ])
        };
        // (busybox's nslookup speaks DNS itself; its nc and wget would go through glibc's NSS,
        // which busybox-static cannot load, so they are given addresses.)
        let lookup = node
            .eventually("web resolves", Duration::from_secs(30), || async {
                let out = exec("nslookup web.svc.svc.cluster.local");
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                text.contains(&cluster_ip).then_some(text)
            })
            .await;
        assert!(
            lookup.contains("10.96.0.10"),
            "not the cluster DNS: {lookup}"
        );
        let api = exec("nslookup kubernetes.default.svc.cluster.local");
        assert!(
            String::from_utf8_lossy(&api.stdout).contains("10.96.0.1"),
            "{api:?}"
        );
        let response = node
            .eventually(
                "web answers on its ClusterIP",
                Duration::from_secs(30),
                || async {
                    let out = exec(&format!(
                        "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {cluster_ip} 80"
                    ));
                    let text = String::from_utf8_lossy(&out.stdout).into_owned();
                    text.ends_with("\r\n\r\nhello\n").then_some(text)
                },
            )
            .await;
        assert!(response.starts_with("HTTP/1."), "{response:?}");
    });
}

/// `scripts/real-node mesh up` in a fresh directory with extra environment; (success, stderr).
fn mesh_up(
    dir: &std::path::Path,
    images: &std::path::Path,
    env: &[(&str, &str)],
) -> (bool, String) {
    let out = std::process::Command::new(format!(
        "{}/../../scripts/real-node",
        env!("CARGO_MANIFEST_DIR")
    ))
    .args(["mesh", "up", "--images"])
    .arg(images)
    .env("REAL_NODE_DIR", dir)
    .envs(env.iter().copied())
    .env_remove("ZTUNNEL_BIN")
    .stdin(std::process::Stdio::null())
    .output()
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A failed image build is named and nothing starts; an istiod that cannot start is named with
/// its log, and the node `mesh up` started is stopped.
#[test]
fn mesh_up_names_what_failed_and_leaves_nothing_running() {
    dataplane::require_root!();
    let _one = one_at_a_time();
    let dir = tempfile::Builder::new()
        .prefix("real-node-mesh")
        .tempdir_in("/tmp")
        .unwrap();
    // The node's usual images; `mesh up` adds only what a given directory lacks (pilot).
    let images = tempfile::tempdir().unwrap();
    for tar in std::fs::read_dir(testbed::real_node::images_dir()).unwrap() {
        let tar = tar.unwrap().path();
        if tar.extension().is_some_and(|e| e == "tar") && !tar.ends_with("pilot.tar") {
            std::os::unix::fs::symlink(&tar, images.path().join(tar.file_name().unwrap())).unwrap();
        }
    }
    // The image tool as built with the workspace (no cargo run from inside a test).
    let tool = testbed::node::binary_dir().join("oci-archive");
    let tool = tool.to_str().unwrap();
    let env = |pilot: &'static str| {
        let mut env = vec![("PILOT_BIN", pilot)];
        if std::path::Path::new(tool).is_file() {
            env.push(("OCI_ARCHIVE", tool));
        }
        env
    };

    let (ok, err) = mesh_up(dir.path(), images.path(), &env("/nonexistent/pilot"));
    assert!(!ok);
    assert!(
        err.contains("/nonexistent/pilot is not an executable file")
            && err.contains("building the images failed"),
        "{err}"
    );
    let node_env = NodeEnv::read(dir.path(), 1);
    assert!(!node_env.path("REAL_NODE_HOLDER_PID_FILE").exists());
    assert!(processes_under(dir.path()).is_empty());

    // busybox as istiod: the container starts and exits at once ("applet not found").
    let (ok, err) = mesh_up(dir.path(), images.path(), &env("/bin/busybox"));
    let left = processes_under(dir.path());
    let _ = std::process::Command::new(format!(
        "{}/../../scripts/real-node",
        env!("CARGO_MANIFEST_DIR")
    ))
    .arg("down")
    .env("REAL_NODE_DIR", dir.path())
    .output();
    assert!(!ok, "{err}");
    assert!(
        err.contains("deployment/istiod does not start") && err.contains("applet not found"),
        "{err}"
    );
    assert!(err.contains("stopping the node"), "{err}");
    assert!(left.is_empty(), "left running: {left:#?}");
}

// --- the real ztunnel (ZTUNNEL_BIN) -------------------------------------------------------------

fn real_ztunnel(test: &str) -> Option<&'static Mesh> {
    if std::env::var_os("ZTUNNEL_BIN").is_none() {
        eprintln!("SKIPPED {test}: set ZTUNNEL_BIN to a ztunnel built without its testing feature");
        return None;
    }
    static MESH: OnceLock<Result<Mesh, String>> = OnceLock::new();
    let mesh = shared(&MESH, true);
    assert!(
        mesh.node.has_real_ztunnel(),
        "ZTUNNEL_BIN is set but the node's images have no ztunnel.tar"
    );
    Some(mesh)
}

/// The real ztunnel's metrics (`:15020` on its pod IP, from the node).
async fn ztunnel_metrics(mesh: &Mesh) -> String {
    let pods = Api::<Pod>::namespaced(mesh.node.client(), SYSTEM_NAMESPACE)
        .list(&ListParams::default().labels("app=ztunnel"))
        .await
        .unwrap();
    let Some(ip) = pods
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .find_map(|p| p.status.as_ref()?.pod_ip.clone())
    else {
        return String::new();
    };
    mesh.http_get(&ip, 15020, "/metrics", None)
        .await
        .map(|(_, b)| b)
        .unwrap_or_default()
}

/// `client` (pod in `ns`) asks `ip:8080` for its page: the response, or what nc printed.
fn fetch(node: &RealNode, ns: &str, client: &str, ip: &str) -> String {
    let out = node.try_script(&[
        "kubectl",
        "-n",
        ns,
        "exec",
        client,
        "--",
        "sh",
        "-c",
        &format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {ip} 8080"),
    ]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn served(response: &str) -> bool {
    response.starts_with("HTTP/1.") && response.ends_with("\r\n\r\nhello\n")
}

/// A busybox pod with service account `sa` (created when missing) running `command`.
async fn pod_as(node: &RealNode, ns: &str, name: &str, sa: &str, command: &[&str]) -> String {
    let sas = Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(node.client(), ns);
    if sas.get_opt(sa).await.unwrap().is_none() {
        let obj = serde_json::from_value(json!({"metadata": {"name": sa}})).unwrap();
        sas.create(&PostParams::default(), &obj).await.unwrap();
    }
    let mut p = busybox_pod(name, command);
    p["spec"]["serviceAccountName"] = json!(sa);
    create(node, ns, p).await
}

const HTTPD: &[&str] = &[
    "sh",
    "-c",
    "mkdir /www; echo hello > /www/index.html; exec httpd -f -p 8080 -h /www",
];

/// The real ztunnel from Istio's chart, with certificates from istiod's CA and workloads from
/// istiod: traffic between ambient pods is mTLS with both SPIFFE identities.
#[test]
fn real_ztunnel_mtls_with_identities_from_istiod() {
    let Some(mesh) = real_ztunnel("real_ztunnel_mtls_with_identities_from_istiod") else {
        return;
    };
    dataplane::require_root!();
    let _one = one_at_a_time();
    RT.block_on(async {
        let node = &mesh.node;
        node.namespace("zsrv", true).await;
        node.namespace("zcli", true).await;
        pod_as(node, "zsrv", "server", "web", HTTPD).await;
        pod_as(node, "zcli", "client", "allowed", &["sleep", "3600"]).await;
        let server = wait_running(node, "zsrv", "server").await;
        wait_running(node, "zcli", "client").await;
        let ip = server.status.unwrap().pod_ip.unwrap();
        let k = [key("zsrv", "server"), key("zcli", "client")];
        wait_istiod_hbone(mesh, &k, &k).await;
        let response = node
            .eventually("client reaches server", Duration::from_secs(90), || async {
                let r = fetch(node, "zcli", "client", &ip);
                served(&r).then_some(r)
            })
            .await;
        assert!(served(&response));
        let metrics = ztunnel_metrics(mesh).await;
        let mtls = sample(
            &metrics,
            "istio_tcp_connections_opened_total",
            &[
                "reporter=\"destination\"",
                "connection_security_policy=\"mutual_tls\"",
                "source_principal=\"spiffe://cluster.local/ns/zcli/sa/allowed\"",
                "destination_principal=\"spiffe://cluster.local/ns/zsrv/sa/web\"",
            ],
        );
        assert!(
            mtls >= Some(1.0),
            "no mTLS connection with both identities:\n{metrics}"
        );
    });
}

/// Applies `manifest` (YAML) as cluster admin.
fn apply(node: &RealNode, manifest: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.yaml");
    std::fs::write(&path, manifest).unwrap();
    node.kubectl(&["apply", "-f", path.to_str().unwrap()]);
}

/// Waits until `from` in `ns` is refused (`allowed` false) or served by `ip`.
async fn wait_served(node: &RealNode, ns: &str, from: &str, ip: &str, allowed: bool) {
    node.eventually(
        &format!("{ns}/{from} {}", if allowed { "served" } else { "refused" }),
        Duration::from_secs(60),
        || async { (served(&fetch(node, ns, from, ip)) == allowed).then_some(()) },
    )
    .await
}

/// An L4 AuthorizationPolicy DENY for one source service account holds for every ambient pod:
/// pods created during a `helm upgrade` of our chart, right after an agent kill and right after
/// a ztunnel restart; deleting the policy lets the denied client through again.
#[test]
fn real_ztunnel_enforces_an_l4_deny_for_every_ambient_pod() {
    let Some(mesh) = real_ztunnel("real_ztunnel_enforces_an_l4_deny_for_every_ambient_pod") else {
        return;
    };
    dataplane::require_root!();
    let _one = one_at_a_time();
    RT.block_on(async {
        let node = &mesh.node;
        node.namespace("dsrv", true).await;
        node.namespace("dcli", true).await;
        pod_as(node, "dcli", "allowed", "allowed", &["sleep", "3600"]).await;
        pod_as(node, "dcli", "denied", "denied", &["sleep", "3600"]).await;
        apply(
            node,
            r#"
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-denied, namespace: dsrv}
spec:
  action: DENY
  rules:
  - from:
    - source:
        principals: ["cluster.local/ns/dcli/sa/denied"]
"#,
        );
        let repo = format!("{}/../..", env!("CARGO_MANIFEST_DIR"));
        // Servers created in each situation; every one must refuse `denied` and serve `allowed`.
        let mut servers = Vec::new();
        pod_as(node, "dsrv", "steady", "web", HTTPD).await;
        servers.push("steady".to_string());
        // During a helm upgrade of our chart (the agent's pod is replaced meanwhile).
        let upgrade = async {
            let out = mesh
                .script_blocking(&[
                    "helm",
                    "upgrade",
                    "istio-cni",
                    &format!("{repo}/deploy/charts/istio-cni"),
                    "-n",
                    SYSTEM_NAMESPACE,
                    "--set",
                    "profile=ambient",
                    "-f",
                    &format!("{repo}/deploy/node/values-real-node.yaml"),
                    "--set-string",
                    "podAnnotations.rollout=upgrade",
                ])
                .await;
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            node.rollout("istio-cni-node").await;
        };
        let creating = async {
            for i in 0..3 {
                pod_as(node, "dsrv", &format!("upgrade-{i}"), "web", HTTPD).await;
                tokio::time::sleep(Duration::from_millis(700)).await;
            }
        };
        tokio::join!(upgrade, creating);
        servers.extend((0..3).map(|i| format!("upgrade-{i}")));
        // Right after an agent kill (SIGKILL of its process: kubelet restarts the container).
        let agent = agent_pod(node).await;
        let pids = node.pod_processes(
            &format!("pod{}/", agent.metadata.uid.as_deref().unwrap()),
            Some("install-cni"),
        );
        assert!(!pids.is_empty(), "no agent process");
        for pid in pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        pod_as(node, "dsrv", "after-kill", "web", HTTPD).await;
        servers.push("after-kill".into());
        // Right after a ztunnel restart.
        node.kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "delete",
            "pod",
            "-l",
            "app=ztunnel",
            "--wait=false",
        ]);
        pod_as(node, "dsrv", "after-ztunnel", "web", HTTPD).await;
        servers.push("after-ztunnel".into());
        node.rollout("ztunnel").await;

        let mut ips = BTreeMap::new();
        for s in &servers {
            let p = wait_running(node, "dsrv", s).await;
            wait_redirection(node, "dsrv", s, Some("enabled")).await;
            ips.insert(s.clone(), p.status.unwrap().pod_ip.unwrap());
        }
        wait_running(node, "dcli", "allowed").await;
        wait_running(node, "dcli", "denied").await;
        for (s, ip) in &ips {
            wait_served(node, "dcli", "allowed", ip, true).await;
            let r = fetch(node, "dcli", "denied", ip);
            assert!(!served(&r), "{s} served the denied client: {r:?}");
        }
        let metrics = ztunnel_metrics(mesh).await;
        assert!(
            metrics.contains("connection_security_policy=\"mutual_tls\""),
            "{metrics}"
        );
        // Policy gone: the denied client is served again.
        node.kubectl(&["-n", "dsrv", "delete", "authorizationpolicy", "deny-denied"]);
        for ip in ips.values() {
            wait_served(node, "dcli", "denied", ip, true).await;
        }
    });
}

/// PeerAuthentication STRICT in the server's namespace: plaintext from a non-mesh pod is
/// refused, the mesh client is still served.
#[test]
fn real_ztunnel_strict_peer_authentication_refuses_plaintext() {
    let Some(mesh) = real_ztunnel("real_ztunnel_strict_peer_authentication_refuses_plaintext")
    else {
        return;
    };
    dataplane::require_root!();
    let _one = one_at_a_time();
    RT.block_on(async {
        let node = &mesh.node;
        node.namespace("ssrv", true).await;
        node.namespace("scli", true).await;
        node.namespace("soutside", false).await;
        pod_as(node, "ssrv", "server", "web", HTTPD).await;
        pod_as(node, "scli", "meshed", "meshed", &["sleep", "3600"]).await;
        pod_as(node, "soutside", "plain", "plain", &["sleep", "3600"]).await;
        let server = wait_running(node, "ssrv", "server").await;
        wait_running(node, "scli", "meshed").await;
        wait_running(node, "soutside", "plain").await;
        let ip = server.status.unwrap().pod_ip.unwrap();
        wait_served(node, "scli", "meshed", &ip, true).await;
        wait_served(node, "soutside", "plain", &ip, true).await;
        apply(
            node,
            r#"
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: ssrv}
spec:
  mtls: {mode: STRICT}
"#,
        );
        wait_served(node, "soutside", "plain", &ip, false).await;
        assert!(served(&fetch(node, "scli", "meshed", &ip)));
        node.kubectl(&["-n", "ssrv", "delete", "peerauthentication", "strict"]);
        wait_served(node, "soutside", "plain", &ip, true).await;
    });
}
