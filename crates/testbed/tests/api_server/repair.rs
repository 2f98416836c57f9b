//! The repair controller against a real kube-apiserver, authenticated as a service account bound
//! to exactly the rules of `deploy/rbac/repair-clusterrole.yaml`: broken sidecar pods on this node
//! are labelled or deleted, with Warning Events and `istio_cni_repair_pods_repaired_total`; pods on
//! other nodes, healthy pods and pods without the sidecar annotation are left alone.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cni_agent::ambient::hints::NetnsHints;
use cni_agent::cli::Cli;
use cni_agent::metrics::Metrics;
use cni_agent::repair::inplace::InPlaceRepair;
use cni_agent::repair::netns::PodNetnsFinder;
use cni_agent::repair::{RepairConfig, RepairController};
use dataplane::netns::Netns;
use dataplane::test_support::TestNetns;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::{Value, json};
use testbed::kube::KubeTestEnv;

const NS: &str = "apps";
const NODE: &str = "node-a";
const OTHER_NODE: &str = "node-b";
const LABEL_KEY: &str = "cni.istio.io/uninitialized";

/// The rules the chart grants for `action` (`None`: the base rules only).
fn repair_rules(action: Option<&str>) -> Vec<PolicyRule> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/rbac/repair-clusterrole.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let roles: HashMap<String, ClusterRole> = serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let role = ClusterRole::deserialize(doc).unwrap();
            (role.metadata.name.clone().unwrap(), role)
        })
        .collect();
    let mut rules = roles["istio-cni-repair-role"].rules.clone().unwrap();
    if let Some(action) = action {
        let extra = format!("istio-cni-repair-role-{action}");
        rules.extend(roles[&extra].rules.clone().unwrap());
    }
    rules
}

/// A client for service account `istio-system/istio-cni` holding exactly `rules`.
async fn repair_client(env: &KubeTestEnv, rules: Vec<PolicyRule>) -> kube::Client {
    let admin = env.client();
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "istio-cni-repair-role"}, "rules": rules
    }))
    .unwrap();
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "istio-cni-repair-rolebinding"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "istio-cni-repair-role"},
        "subjects": [{"kind": "ServiceAccount", "name": "istio-cni", "namespace": "istio-system"}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let (client, _) = env
        .service_account_client("istio-system", "istio-cni")
        .await;
    // The authorizer learns new bindings from its own watch: wait until the list is allowed.
    let pods = Api::<Pod>::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(20);
    while pods.list(&ListParams::default().limit(1)).await.is_err() {
        assert!(Instant::now() < deadline, "RBAC binding never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    client
}

async fn create_namespace(env: &KubeTestEnv) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap();
    Api::<Namespace>::all(env.client())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
}

/// A sidecar-injected pod (or not: `annotated`) on `node`, with the validation init container.
async fn create_pod(pods: &Api<Pod>, name: &str, node: &str, annotated: bool, labels: Value) {
    let annotations = if annotated {
        json!({"sidecar.istio.io/status": "{\"initContainers\":[\"istio-validation\"]}"})
    } else {
        json!({})
    };
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "nodeName": node,
            "initContainers": [{"name": "istio-validation", "image": "proxyv2"}],
            "containers": [{"name": "app", "image": "busybox"}]
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
}

/// Writes the init container status a kubelet would report: crash-looping after exiting 126
/// (`broken`), or completed.
async fn set_validation_status(pods: &Api<Pod>, name: &str, broken: bool) {
    let (state, last) = if broken {
        (
            json!({"waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting failed container"}}),
            json!({"terminated": {"exitCode": 126, "reason": "Error", "message": "iptables rules not applied"}}),
        )
    } else {
        (
            json!({"terminated": {"exitCode": 0, "reason": "Completed"}}),
            json!({}),
        )
    };
    let patch = json!({"status": {"initContainerStatuses": [{
        "name": "istio-validation", "image": "proxyv2", "imageID": "", "ready": !broken,
        "restartCount": if broken { 3 } else { 0 }, "state": state, "lastState": last
    }]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

async fn start_controller(
    env_vars: &[(&str, &str)],
    client: kube::Client,
) -> (Registry, tokio::task::JoinHandle<()>) {
    start_controller_with(env_vars, client, None).await
}

async fn start_controller_with(
    env_vars: &[(&str, &str)],
    client: kube::Client,
    in_place: Option<InPlaceRepair>,
) -> (Registry, tokio::task::JoinHandle<()>) {
    let env: HashMap<&str, &str> = env_vars.iter().copied().collect();
    let cli: Cli = cni_agent::config::parse_from(["install-cni"], &env).unwrap();
    let cfg = RepairConfig::from_args(&cli.repair, cli.ambient.node_name.as_deref())
        .unwrap()
        .expect("an action is selected");
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let mut controller = RepairController::new(cfg, client, metrics.pods_repaired.clone());
    if let Some(r) = in_place {
        controller = controller.with_in_place(r);
    }
    let task = tokio::spawn(controller.run(None, std::future::pending()));
    (registry, task)
}

/// `istio_cni_repair_pods_repaired_total{type,result}`, 0 when absent.
fn repaired(registry: &Registry, kind: &str, result: &str) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let prefix =
        format!("istio_cni_repair_pods_repaired_total{{type=\"{kind}\",result=\"{result}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.parse().unwrap())
        .unwrap_or(0)
}

async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn label(pod: &Pod) -> Option<String> {
    pod.metadata.labels.as_ref()?.get(LABEL_KEY).cloned()
}

/// Our Events in the namespace, as `(pod, reason, message)`, checking the fields Istio sets.
async fn repair_events(admin: &kube::Client) -> Vec<(String, String, String)> {
    let events = Api::<Event>::namespaced(admin.clone(), NS)
        .list(&ListParams::default())
        .await
        .unwrap();
    events
        .items
        .into_iter()
        .map(|e| {
            assert_eq!(e.type_.as_deref(), Some("Warning"));
            let source = e.source.clone().unwrap_or_default();
            assert_eq!(source.component.as_deref(), Some("cni-repair"));
            assert_eq!(source.host.as_deref(), Some(NODE));
            assert_eq!(e.involved_object.kind.as_deref(), Some("Pod"));
            assert!(e.involved_object.uid.is_some());
            (
                e.involved_object.name.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default(),
            )
        })
        .collect()
}

#[tokio::test]
async fn label_mode_labels_broken_pods_of_this_node_only() {
    dataplane::enter_test_group!();
    let env = KubeTestEnv::start().await;
    let admin = env.client();
    create_namespace(&env).await;
    let pods = Api::<Pod>::namespaced(admin.clone(), NS);
    create_pod(&pods, "broken", NODE, true, json!({})).await;
    create_pod(&pods, "healthy", NODE, true, json!({})).await;
    create_pod(&pods, "elsewhere", OTHER_NODE, true, json!({})).await;
    create_pod(
        &pods,
        "prelabelled",
        NODE,
        true,
        json!({LABEL_KEY: "already"}),
    )
    .await;
    create_pod(&pods, "unannotated", NODE, false, json!({})).await;
    for (name, broken) in [
        ("broken", true),
        ("healthy", false),
        ("elsewhere", true),
        ("prelabelled", true),
        ("unannotated", true),
    ] {
        set_validation_status(&pods, name, broken).await;
    }

    let client = repair_client(&env, repair_rules(Some("label-pods"))).await;
    let (registry, _task) = start_controller(
        &[
            ("REPAIR_LABEL_PODS", "true"),
            ("REPAIR_NODE_NAME", ""),
            ("NODE_NAME", NODE),
        ],
        client,
    )
    .await;

    eventually("the broken pod to be labelled", || async {
        label(&pods.get("broken").await.unwrap()).as_deref() == Some("true")
    })
    .await;

    // A pod that breaks later is caught by the watch, not only by the initial list.
    create_pod(&pods, "late", NODE, true, json!({})).await;
    set_validation_status(&pods, "late", false).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(label(&pods.get("late").await.unwrap()), None);
    set_validation_status(&pods, "late", true).await;
    eventually("the pod that broke later to be labelled", || async {
        label(&pods.get("late").await.unwrap()).as_deref() == Some("true")
    })
    .await;
    eventually("both Events", || async {
        repair_events(&admin).await.len() >= 2
    })
    .await;

    for name in ["healthy", "elsewhere", "unannotated"] {
        assert_eq!(label(&pods.get(name).await.unwrap()), None, "{name}");
    }
    assert_eq!(
        label(&pods.get("prelabelled").await.unwrap()).as_deref(),
        Some("already"),
        "an existing label is left as it is"
    );

    let mut events = repair_events(&admin).await;
    events.sort();
    let labeled = "pod detected as broken, labeled".to_string();
    assert_eq!(
        events,
        vec![
            ("broken".into(), "LabelBrokenPod".into(), labeled.clone()),
            ("late".into(), "LabelBrokenPod".into(), labeled),
        ]
    );
    assert_eq!(repaired(&registry, "label", "success"), 2);
    assert!(repaired(&registry, "label", "skip") >= 1, "prelabelled pod");
    assert_eq!(repaired(&registry, "label", "fail"), 0);
}

#[tokio::test]
async fn delete_mode_deletes_broken_pods_of_this_node_only() {
    dataplane::enter_test_group!();
    let env = KubeTestEnv::start().await;
    let admin = env.client();
    create_namespace(&env).await;
    let pods = Api::<Pod>::namespaced(admin.clone(), NS);
    create_pod(&pods, "broken", NODE, true, json!({})).await;
    create_pod(&pods, "healthy", NODE, true, json!({})).await;
    create_pod(&pods, "elsewhere", OTHER_NODE, true, json!({})).await;
    for (name, broken) in [("broken", true), ("healthy", false), ("elsewhere", true)] {
        set_validation_status(&pods, name, broken).await;
    }

    let client = repair_client(&env, repair_rules(Some("delete-pods"))).await;
    let (registry, _task) = start_controller(
        &[("REPAIR_DELETE_PODS", "true"), ("REPAIR_NODE_NAME", NODE)],
        client,
    )
    .await;

    // A bound pod is deleted gracefully: without a kubelet it stays, marked for deletion.
    eventually("the broken pod to be deleted", || async {
        pods.get_opt("broken")
            .await
            .unwrap()
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
    })
    .await;
    eventually("the Event", || async {
        !repair_events(&admin).await.is_empty()
    })
    .await;
    // Later status changes of the terminating pod must not delete it again.
    set_validation_status(&pods, "broken", true).await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    for name in ["healthy", "elsewhere"] {
        let pod = pods.get(name).await.unwrap();
        assert!(pod.metadata.deletion_timestamp.is_none(), "{name}");
    }
    assert_eq!(
        repair_events(&admin).await,
        vec![(
            "broken".into(),
            "DeleteBrokenPod".into(),
            "pod detected as broken, deleted".into()
        )]
    );
    assert_eq!(repaired(&registry, "delete", "success"), 1);
    assert_eq!(repaired(&registry, "delete", "fail"), 0);
}

#[tokio::test]
async fn without_the_action_rule_labelling_fails_five_times_then_stops() {
    dataplane::enter_test_group!();
    let env = KubeTestEnv::start().await;
    let admin = env.client();
    create_namespace(&env).await;
    let pods = Api::<Pod>::namespaced(admin.clone(), NS);
    create_pod(&pods, "broken", NODE, true, json!({})).await;
    set_validation_status(&pods, "broken", true).await;

    // Base rules only: pods/status patch is what labelling needs, and it is missing.
    let client = repair_client(&env, repair_rules(None)).await;
    let (registry, _task) = start_controller(
        &[("REPAIR_LABEL_PODS", "true"), ("NODE_NAME", NODE)],
        client,
    )
    .await;

    eventually("five failed attempts", || async {
        repaired(&registry, "label", "fail") >= 5
    })
    .await;
    // Backoff totals 1.5 s; well past it, nothing more is tried until the pod changes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(repaired(&registry, "label", "fail"), 5);
    assert_eq!(repaired(&registry, "label", "success"), 0);
    assert_eq!(label(&pods.get("broken").await.unwrap()), None);
    let events = repair_events(&admin).await;
    assert_eq!(events.len(), 5);
    for (pod, reason, message) in events {
        assert_eq!(
            (pod.as_str(), reason.as_str()),
            ("broken", "LabelBrokenPod")
        );
        assert!(
            message.starts_with("pod detected as broken, but failed to label: ")
                && message.contains("forbidden"),
            "{message}"
        );
    }
}

/// A sidecar pod whose sandbox is `netns` (holding `ip`), crash-looping on validation, with the
/// netns path recorded as the agent records `CNI_NETNS` at ADD.
async fn running_sidecar_pod(
    pods: &Api<Pod>,
    name: &str,
    node: &str,
    netns: &TestNetns,
    ip: &str,
    hints: &NetnsHints,
) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"sidecar.istio.io/status": "{}"}},
        "spec": {
            "nodeName": node,
            "initContainers": [{"name": "istio-validation", "image": "proxyv2"}],
            "containers": [
                {"name": "app", "image": "busybox"},
                {"name": "istio-proxy", "image": "proxyv2", "args": ["proxy", "sidecar"]}
            ]
        }
    }))
    .unwrap();
    let created = pods.create(&PostParams::default(), &pod).await.unwrap();
    netns.exec(
        "ip",
        &[
            "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
        ],
    );
    netns.exec("ip", &["addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
    hints.record(
        created.metadata.uid.as_deref().unwrap(),
        &netns.path().display().to_string(),
    );
    let patch = json!({"status": {"podIP": ip, "podIPs": [{"ip": ip}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    set_validation_status(pods, name, true).await;
}

/// The iptables variant is forced so the test reads rules back with the matching `-save`.
fn in_place(run_dir: &std::path::Path, backend: &'static str) -> InPlaceRepair {
    InPlaceRepair {
        finder: PodNetnsFinder {
            hints: NetnsHints::new(run_dir),
            host_prefix: "/".into(),
            proc_dir: "/proc".into(),
            host: Netns::current().unwrap().id(),
            // Not the machine's /var/run/netns: other tests' namespaces are not ours to open.
            netns_dir: run_dir.join("pinned-netns"),
        },
        backend,
        force_iptables_binary: Some("nft".into()),
        host: None,
    }
}

#[tokio::test]
async fn repair_mode_programs_sidecar_rules_in_running_pods() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let env = KubeTestEnv::start().await;
    let admin = env.client();
    create_namespace(&env).await;
    let pods = Api::<Pod>::namespaced(admin.clone(), NS);
    let run = tempfile::tempdir().unwrap();
    let hints = NetnsHints::new(run.path());
    // One node per backend, each with its own controller: each repairs only its node's pod.
    let (ipt_ns, nft_ns) = (TestNetns::new("repair-ipt"), TestNetns::new("repair-nft"));
    running_sidecar_pod(&pods, "on-a", NODE, &ipt_ns, "10.251.9.7", &hints).await;
    running_sidecar_pod(&pods, "on-c", "node-c", &nft_ns, "10.251.9.8", &hints).await;

    // In-place repair needs no API rules beyond the base ones.
    let client = repair_client(&env, repair_rules(None)).await;
    let (ipt_metrics, _a) = start_controller_with(
        &[("REPAIR_REPAIR_PODS", "true"), ("NODE_NAME", NODE)],
        client.clone(),
        Some(in_place(run.path(), "iptables")),
    )
    .await;
    let (nft_metrics, _c) = start_controller_with(
        &[("REPAIR_REPAIR_PODS", "true"), ("NODE_NAME", "node-c")],
        client,
        Some(in_place(run.path(), "nftables")),
    )
    .await;

    eventually("both pods repaired", || async {
        repaired(&ipt_metrics, "repair", "success") == 1
            && repaired(&nft_metrics, "repair", "success") == 1
    })
    .await;
    let nat = ipt_ns.exec("iptables-nft-save", &["-t", "nat"]);
    for line in [
        "-A PREROUTING -p tcp -j ISTIO_INBOUND",
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
        "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006",
    ] {
        assert!(
            nat.lines().any(|l| l == line),
            "missing {line:?} in:\n{nat}"
        );
    }
    let ruleset = nft_ns.exec("nft", &["list", "ruleset"]);
    assert!(
        ruleset.contains("table inet istio-proxy-nat") && ruleset.contains("15001"),
        "{ruleset}"
    );
    for save in ["iptables-nft-save", "iptables-legacy-save"] {
        assert!(
            !nft_ns.exec(save, &[]).contains("ISTIO"),
            "the nftables node must not get iptables rules"
        );
    }

    // Later changes of a repaired pod do not re-apply anything (the UID is remembered).
    set_validation_status(&pods, "on-a", true).await;
    let patch = json!({"metadata": {"annotations": {"touched": "1"}}});
    pods.patch_status("on-a", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(repaired(&ipt_metrics, "repair", "success"), 1);
    assert_eq!(repaired(&ipt_metrics, "repair", "fail"), 0);
    assert_eq!(repaired(&nft_metrics, "repair", "fail"), 0);
    // In-place repair leaves no Events, as in Istio.
    assert!(repair_events(&admin).await.is_empty());
}
