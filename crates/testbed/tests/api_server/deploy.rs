//! The shipped deployment against a real kube-apiserver: every rendered manifest (and the chart
//! rendered with every platform profile) passes server-side dry-run apply, and the ambient RBAC is
//! both sufficient (the real agent runs a whole enrollment cycle with exactly that RBAC) and
//! minimal (every permission is one the agent or the plugin uses; taking it away gets a 403 on
//! that call).

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchParams};
use serde_json::{Value, json};
use testbed::kube::KubeTestEnv;
use testbed::manifests::{
    self, NAMESPACE, SERVICE_ACCOUNT, render_chart as render, try_render_chart as try_render,
};
use testbed::node::{Backend, Identity, TestNode};
use testbed::zds_peer::{PeerConfig, ZdsPeer};

#[path = "deploy/chart_values.rs"]
mod chart_values;
#[path = "deploy/fake_cluster.rs"]
mod fake_cluster;

const MANIFESTS: [&str; 2] = ["istio-cni.yaml", "istio-cni-ambient.yaml"];
const PLATFORMS: [&str; 7] = ["", "gke", "k3d", "k3s", "microk8s", "minikube", "openshift"];

/// OpenShift's Multus CRD, so the NetworkAttachmentDefinition the multus provider renders is
/// checked against a schema too (Multus defines `spec.config` as a string).
async fn install_multus_crd(client: &kube::Client) {
    let crd: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "network-attachment-definitions.k8s.cni.cncf.io"},
        "spec": {"group": "k8s.cni.cncf.io", "scope": "Namespaced",
                 "names": {"plural": "network-attachment-definitions", "singular": "network-attachment-definition",
                           "kind": "NetworkAttachmentDefinition", "shortNames": ["net-attach-def"]},
                 "versions": [{"name": "v1", "served": true, "storage": true,
                     "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                         "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                         "metadata": {"type": "object"},
                         "spec": {"type": "object", "properties": {"config": {"type": "string"}}}}}}}]}
    }))
    .unwrap();
    manifests::apply(client, &crd, false).await.unwrap();
    // The new kind is served once discovery lists it.
    for _ in 0..100 {
        let gvk = kube::api::GroupVersionKind::gvk(
            "k8s.cni.cncf.io",
            "v1",
            "NetworkAttachmentDefinition",
        );
        if kube::discovery::pinned_kind(client, &gvk).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("NetworkAttachmentDefinition CRD never served");
}

async fn dry_run_all(client: &kube::Client, what: &str, objs: &[DynamicObject]) -> usize {
    assert!(!objs.is_empty(), "{what}: nothing rendered");
    for obj in objs {
        manifests::apply(client, obj, true)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{what}: {} {:?} rejected by the API server: {e}",
                    manifests::kind(obj),
                    obj.metadata.name
                )
            });
    }
    objs.len()
}

#[tokio::test]
async fn every_rendered_manifest_passes_server_side_dry_run() {
    dataplane::enter_test_group!();
    let kube = KubeTestEnv::start().await;
    let client = kube.client();
    manifests::ensure_namespace(&client, NAMESPACE).await;
    install_multus_crd(&client).await;

    let mut checked = 0;
    for file in MANIFESTS {
        let objs = manifests::shipped(file);
        let kinds: BTreeSet<&str> = objs.iter().map(manifests::kind).collect();
        for want in [
            "ServiceAccount",
            "ConfigMap",
            "ClusterRole",
            "ClusterRoleBinding",
            "DaemonSet",
        ] {
            assert!(kinds.contains(want), "{file} lacks a {want}: {kinds:?}");
        }
        checked += dry_run_all(&client, file, &objs).await;
    }

    // The chart beyond the two shipped renders: every platform, ambient on and off, and the
    // optional objects and settings switched on.
    let extras = [
        "networkPolicy.enabled=true",
        "resourceQuotas.enabled=true",
        "seccompProfile.type=RuntimeDefault",
        "global.nativeNftables=true",
        "istioOwnedCNIConfig=true",
        "env.EXTRA_SETTING=1",
        "repair.labelPods=true",
        "repair.repairPods=false",
    ];
    for platform in PLATFORMS {
        for ambient in ["false", "true"] {
            let mut args = vec![
                "--set".to_string(),
                format!("global.platform={platform}"),
                "--set".to_string(),
                format!("ambient.enabled={ambient}"),
            ];
            if ambient == "true" {
                args.extend([
                    "--set".into(),
                    "ambient.shareHostNetworkNamespace=true".into(),
                ]);
            }
            for e in extras {
                args.extend(["--set".into(), e.into()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let objs = render(&args);
            checked += dry_run_all(&client, &format!("{args:?}"), &objs).await;
        }
    }
    // Every profile and compatibility version, Istio's legacy `cni.` prefix, and AppArmor as
    // the securityContext field (for Kubernetes >= 1.30, as the test API server is).
    let mut value_sets: Vec<Vec<String>> = ["ambient", "demo", "preview", "remote", "stable"]
        .iter()
        .map(|p| vec![format!("profile={p}")])
        .collect();
    for minor in 25..=30 {
        value_sets.push(vec![
            "profile=ambient".into(),
            format!("compatibilityVersion=1.{minor}"),
        ]);
    }
    value_sets.push(
        [
            "cni.ambient.enabled=true",
            "cni.chained=false",
            "cni.repair.enabled=false",
            "cni.resourceQuotas.enabled=true",
            "cni.cniConfFileName=10-calico.conflist",
        ]
        .map(String::from)
        .to_vec(),
    );
    value_sets.push(vec!["useAppArmorAnnotation=false".into()]);
    for values in value_sets {
        let mut args = vec!["--kube-version", "1.34.0"];
        for v in &values {
            args.extend(["--set", v.as_str()]);
        }
        let objs = render(&args);
        checked += dry_run_all(&client, &format!("{values:?}"), &objs).await;
    }
    eprintln!("{checked} objects passed server-side dry-run");
}

#[test]
fn platform_profiles_set_their_paths_and_beat_user_values_as_in_istio() {
    dataplane::enter_test_group!();
    let ds = |args: &[&str]| -> Value {
        let obj = render(args)
            .into_iter()
            .find(|o| manifests::kind(o) == "DaemonSet")
            .expect("a DaemonSet");
        serde_json::to_value(obj).unwrap()
    };
    let host_path = |ds: &Value, volume: &str| -> String {
        ds["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == volume)
            .map(|v| v["hostPath"]["path"].as_str().unwrap().to_string())
            .unwrap_or_default()
    };
    let d = ds(&["--set", "global.platform=k3s"]);
    assert_eq!(
        host_path(&d, "cni-net-dir"),
        "/var/lib/rancher/k3s/agent/etc/cni/net.d"
    );
    assert_eq!(
        host_path(&d, "cni-bin-dir"),
        "/var/lib/rancher/k3s/data/cni"
    );
    let d = ds(&[
        "--set",
        "global.platform=gke",
        "--set",
        "cniBinDir=/custom/bin",
    ]);
    assert_eq!(host_path(&d, "cni-bin-dir"), "/home/kubernetes/bin");
    let d = ds(&[
        "--set",
        "global.platform=minikube",
        "--set",
        "ambient.enabled=true",
    ]);
    assert_eq!(host_path(&d, "cni-netns-dir"), "/var/run/docker/netns");

    // The profile beats the user, as in Istio's chart (openshift sets chained=false; the user's
    // chained=true loses), while a value no profile sets is the user's (DNS capture off).
    let cm = render(&[
        "--set",
        "global.platform=openshift",
        "--set",
        "chained=true",
        "--set",
        "ambient.dnsCapture=false",
    ])
    .into_iter()
    .find(|o| manifests::kind(o) == "ConfigMap")
    .unwrap();
    assert_eq!(cm.data["data"]["CHAINED_CNI_PLUGIN"], "false");
    assert_eq!(cm.data["data"]["AMBIENT_DNS_CAPTURE"], "false");
    assert_eq!(cm.data["data"]["CNI_CONF_NAME"], "istio-cni.conf");

    let err = try_render(&["--set", "global.platform=plan9"]).unwrap_err();
    assert!(err.contains("unknown global.platform \"plan9\""), "{err}");
}

/// One permission: (API group, resource, verb), as RBAC evaluates a request.
type Permission = (String, String, String);

/// The rules of the shipped agent ClusterRoles (not the repair controller's), one permission each.
fn shipped_permissions() -> BTreeSet<Permission> {
    let mut out = BTreeSet::new();
    for obj in manifests::shipped("istio-cni-ambient.yaml") {
        let name = obj.metadata.name.as_deref().unwrap_or("");
        if manifests::kind(&obj) != "ClusterRole"
            || !["istio-cni", "istio-cni-ambient"].contains(&name)
        {
            continue;
        }
        for rule in obj.data["rules"].as_array().unwrap() {
            let list = |k: &str| -> Vec<String> {
                rule[k]
                    .as_array()
                    .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
                    .unwrap_or_default()
            };
            for g in list("apiGroups") {
                for r in list("resources") {
                    for v in list("verbs") {
                        out.insert((g.clone(), r.clone(), v.clone()));
                    }
                }
            }
        }
    }
    out
}

/// The same rule set without one permission, as a ClusterRole (resourceNames kept).
fn role_without(name: &str, drop: Option<&Permission>) -> Value {
    let mut rules = Vec::new();
    for (g, r, v) in shipped_permissions() {
        if Some(&(g.clone(), r.clone(), v.clone())) == drop {
            continue;
        }
        let mut rule = json!({"apiGroups": [g], "resources": [r], "verbs": [v]});
        if r == "daemonsets" {
            rule["resourceNames"] = json!(["istio-cni-node"]);
        }
        rules.push(rule);
    }
    json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
           "metadata": {"name": name}, "rules": rules})
}

const NODE: &str = "node-a";
const POD_NS: &str = "probe";
const POD: &str = "app";

/// The call behind each permission, made the way the agent (or the plugin) makes it. Ok(()) when
/// the API server let it through.
async fn call(client: &kube::Client, p: &Permission) -> Result<(), kube::Error> {
    let pods_here = || Api::<Pod>::all(client.clone());
    let on_node = format!("spec.nodeName={NODE}");
    match (p.0.as_str(), p.1.as_str(), p.2.as_str()) {
        // Plugin ADD and the agent's fallback when the watch has not seen the pod yet.
        ("", "pods", "get") => Api::<Pod>::namespaced(client.clone(), POD_NS)
            .get(POD)
            .await
            .map(drop),
        ("", "namespaces", "get") => Api::<Namespace>::all(client.clone())
            .get_metadata(POD_NS)
            .await
            .map(drop),
        // The node-scoped pod watch (list, then watch).
        ("", "pods", "list") => pods_here()
            .list(&ListParams::default().fields(&on_node))
            .await
            .map(drop),
        ("", "pods", "watch") => {
            let wp = WatchParams::default().fields(&on_node).timeout(1);
            let mut stream = pods_here().watch(&wp, "0").await?.boxed();
            match stream.next().await {
                Some(Err(e)) => Err(e),
                _ => Ok(()),
            }
        }
        // The namespace label watch (metadata only).
        ("", "namespaces", "list") => Api::<Namespace>::all(client.clone())
            .list_metadata(&ListParams::default())
            .await
            .map(drop),
        ("", "namespaces", "watch") => {
            let wp = WatchParams::default().timeout(1);
            let mut stream = Api::<Namespace>::all(client.clone())
                .watch_metadata(&wp, "0")
                .await?
                .boxed();
            match stream.next().await {
                Some(Err(e)) => Err(e),
                _ => Ok(()),
            }
        }
        // The redirection annotation.
        ("", "pods/status", "patch") => {
            let patch =
                json!({"metadata": {"annotations": {"ambient.istio.io/redirection": "enabled"}}});
            Api::<Pod>::namespaced(client.clone(), POD_NS)
                .patch_status(POD, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(drop)
        }
        // Shutdown: upgrade or uninstall?
        ("apps", "daemonsets", "get") => Api::<DaemonSet>::namespaced(client.clone(), NAMESPACE)
            .get("istio-cni-node")
            .await
            .map(drop),
        ("", "nodes", "get") => Api::<Node>::all(client.clone()).get(NODE).await.map(drop),
        other => panic!(
            "ClusterRole grants {other:?}, which neither the agent nor the plugin uses: remove it \
             from deploy/charts/istio-cni/templates/clusterrole.yaml (or add the call here)"
        ),
    }
}

fn is_forbidden(r: &Result<(), kube::Error>) -> bool {
    matches!(r, Err(kube::Error::Api(s)) if s.code == 403)
}

#[tokio::test]
async fn ambient_rbac_is_minimal_each_permission_backs_a_call() {
    dataplane::enter_test_group!();
    let kube = KubeTestEnv::start().await;
    let admin = kube.client();
    manifests::install_shipped_rbac(&kube).await;
    // Objects for the calls to find (so a success is a 200, not a 404).
    for obj in manifests::shipped("istio-cni-ambient.yaml") {
        if manifests::kind(&obj) == "DaemonSet" {
            manifests::apply(&admin, &obj, false).await.unwrap();
        }
    }
    manifests::ensure_namespace(&admin, POD_NS).await;
    let node: Node = serde_json::from_value(json!({"metadata": {"name": NODE}})).unwrap();
    Api::<Node>::all(admin.clone())
        .create(&PostParams::default(), &node)
        .await
        .unwrap();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": POD},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "i"}]}
    }))
    .unwrap();
    Api::<Pod>::namespaced(admin.clone(), POD_NS)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();

    let perms = shipped_permissions();
    assert!(perms.len() >= 9, "shipped rules: {perms:?}");
    let (full, _) = kube
        .service_account_client(NAMESPACE, SERVICE_ACCOUNT)
        .await;
    for p in &perms {
        // Also fails (in `call`) for a granted permission no call needs.
        call(&full, p)
            .await
            .unwrap_or_else(|e| panic!("{p:?} with the shipped RBAC: {e}"));
    }

    let roles = Api::<DynamicObject>::all_with(
        admin.clone(),
        &kube::api::ApiResource::erase::<k8s_openapi::api::rbac::v1::ClusterRole>(&()),
    );
    let bindings = Api::<DynamicObject>::all_with(
        admin.clone(),
        &kube::api::ApiResource::erase::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>(&()),
    );
    for (i, p) in perms.iter().enumerate() {
        let name = format!("without-{i}");
        let role: DynamicObject = serde_json::from_value(role_without(&name, Some(p))).unwrap();
        roles.create(&PostParams::default(), &role).await.unwrap();
        let binding: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
        }))
        .unwrap();
        bindings
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
        let (reduced, _) = kube.service_account_client(NAMESPACE, &name).await;
        // RBAC changes reach the authorizer through its informer: wait for the grant to show.
        let others: Vec<&Permission> = perms.iter().filter(|o| *o != p).collect();
        let probe = others[0];
        let mut ready = false;
        for _ in 0..100 {
            if call(&reduced, probe).await.is_ok() {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(ready, "{name}: binding never took effect");
        let r = call(&reduced, p).await;
        assert!(
            is_forbidden(&r),
            "{p:?} still allowed without its rule: {r:?}"
        );
    }
}

/// Every pod watch/patch/lookup of a whole enrollment cycle, done by the real agent (and plugin)
/// with a ServiceAccount token bound to exactly the shipped ClusterRoles, then a shutdown that
/// must read the DaemonSet and the Node to recognise an upgrade.
#[tokio::test]
async fn ambient_rbac_is_sufficient_for_an_enrollment_cycle() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let mut node = TestNode::start_as(Backend::Iptables, Identity::ShippedRbac).await;
    let peer = ZdsPeer::start(PeerConfig::new(node.path("zt/ztunnel.sock")));
    peer.wait_for("snapshot", Duration::from_secs(10), |s| s.snapshot_received)
        .await
        .unwrap();

    node.create_namespace("mesh", &[("istio.io/dataplane-mode", "ambient")])
        .await;
    let (pod, result) = node.create_pod("mesh", "app-1", &[]).await;
    result.unwrap_or_else(|e| panic!("ambient ADD failed: {e}\n{}", node.agent_log()));
    node.wait_redirection(&pod, Some("enabled")).await;
    assert!(peer.status().workloads.contains_key(&pod.uid));

    // Namespace label removed → the namespace watch drives the pod out, annotation removed.
    node.label_namespace("mesh", "istio.io/dataplane-mode", None)
        .await;
    node.wait_redirection(&pod, None).await;
    peer.wait_for("pod removed", Duration::from_secs(15), |s| {
        !s.workloads.contains_key(&pod.uid)
    })
    .await
    .unwrap();

    // Re-enrolled through the watch alone (no CNI ADD): the informer path.
    node.label_pod(&pod, "istio.io/dataplane-mode", Some("ambient"))
        .await;
    node.wait_redirection(&pod, Some("enabled")).await;
    node.delete_pod(&pod).await;
    peer.wait_for("pod deleted", Duration::from_secs(15), |s| {
        !s.workloads.contains_key(&pod.uid)
    })
    .await
    .unwrap();

    // The shipped DaemonSet, pinned to this node by affinity: shutdown must GET both to decide
    // this is an upgrade and leave the plugin chained (a 403 on either would mean uninstall).
    let admin = node.kube.client();
    let mut ds = manifests::shipped("istio-cni-ambient.yaml")
        .into_iter()
        .find(|o| manifests::kind(o) == "DaemonSet")
        .unwrap();
    ds.data["spec"]["template"]["spec"]["affinity"] = json!({"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "istio-cni-rs/test-node", "operator": "In", "values": ["yes"]}]}]}}});
    manifests::apply(&admin, &ds, false).await.unwrap();
    let k8s_node: Node = serde_json::from_value(json!({"metadata": {
        "name": node.node_name, "labels": {"istio-cni-rs/test-node": "yes"}}}))
    .unwrap();
    Api::<Node>::all(admin.clone())
        .create(&PostParams::default(), &k8s_node)
        .await
        .unwrap();
    let status = node.stop_agent();
    assert!(
        status.success(),
        "agent exit {status}\n{}",
        node.agent_log()
    );
    let log = node.agent_log();
    assert!(
        node.conflist().contains("istio-cni"),
        "shutdown did not recognise the upgrade (plugin unchained):\n{log}"
    );
    let full_log = std::fs::read_to_string(node.path("agent.log")).unwrap_or_default();
    for bad in ["forbidden", "Forbidden"] {
        assert!(!full_log.contains(bad), "agent hit {bad}:\n{log}");
    }
}

/// The container's environment as the kubelet would build it from the rendered DaemonSet:
/// `envFrom` the ConfigMap, then `env` (literal values, and the downward-API fields filled in).
fn container_env(
    objs: &[DynamicObject],
) -> (
    Vec<String>,
    std::collections::HashMap<String, String>,
    Value,
) {
    let cm = objs
        .iter()
        .find(|o| manifests::kind(o) == "ConfigMap")
        .unwrap();
    let ds = objs
        .iter()
        .find(|o| manifests::kind(o) == "DaemonSet")
        .unwrap();
    let container = ds.data["spec"]["template"]["spec"]["containers"][0].clone();
    assert_eq!(container["name"], "install-cni");
    assert_eq!(
        container["envFrom"][0]["configMapRef"]["name"],
        cm.metadata.name.as_deref().unwrap()
    );
    let mut env: std::collections::HashMap<String, String> = cm.data["data"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    for e in container["env"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap().to_string();
        let value = match (
            &e["value"],
            e["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        ) {
            (Value::String(v), _) => v.clone(),
            (_, Some("spec.nodeName")) => "node-a".into(),
            (_, Some("metadata.name")) => "istio-cni-node-x1".into(),
            (_, Some("metadata.namespace")) => NAMESPACE.into(),
            other => panic!("env {name}: unexpected source {other:?}"),
        };
        env.insert(name, value);
    }
    let mut argv = vec!["install-cni".to_string()];
    argv.extend(
        container["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string()),
    );
    assert_eq!(container["command"], json!(["install-cni"]));
    (argv, env, ds.data["spec"]["template"]["spec"].clone())
}

#[test]
fn the_agent_accepts_the_shipped_configuration_and_mounts() {
    dataplane::enter_test_group!();
    use cni_agent::ambient::config::AmbientConfig;
    use cni_agent::cli::Cli;
    use cni_agent::config::parse_from;
    use cni_agent::install::config::InstallConfig;
    use cni_agent::repair::RepairConfig;

    let objs = manifests::shipped("istio-cni-ambient.yaml");
    let (argv, env, pod) = container_env(&objs);
    let cli: Cli = parse_from(&argv, &env).unwrap_or_else(|e| panic!("{argv:?} {env:?}: {e}"));
    let install = InstallConfig::from_args(&cli.install, &cli.log).unwrap();
    let selectors: Vec<cni_core::enroll::EnablementSelector> =
        serde_json::from_value(install.entry.enablement_selectors.clone()).unwrap();
    assert_eq!(selectors.len(), 2, "Istio's two default selectors");
    let exclude = install.entry.exclude_namespaces.clone().unwrap_or_default();
    assert_eq!(exclude, ["kube-system"]);
    let ambient = AmbientConfig::from_args(&cli.ambient, &selectors, exclude).unwrap();
    assert!(install.entry.ambient_enabled && ambient.inpod.redirect_dns && ambient.inpod.ipv6);
    assert!(ambient.reconcile_on_startup && ambient.switch_to_host_ns);
    assert_eq!(ambient.node_name, "node-a");
    let repair = RepairConfig::from_args(&cli.repair, Some("node-a")).unwrap();
    assert!(
        repair.is_some(),
        "chart default repairPods=true selects an action"
    );

    // Every path and port the agent uses is one the pod spec provides.
    let container = &pod["containers"][0];
    let mounts: Vec<(String, String)> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["mountPath"].as_str().unwrap().to_string(),
                m["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let host_path = |volume: &str| -> String {
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == volume)
            .and_then(|v| v["hostPath"]["path"].as_str())
            .unwrap_or_else(|| panic!("no hostPath volume {volume}"))
            .to_string()
    };
    let mounted = |path: &std::path::Path| -> (String, String) {
        let (mount, volume) = mounts
            .iter()
            .filter(|(m, _)| path.starts_with(m))
            .max_by_key(|(m, _)| m.len())
            .unwrap_or_else(|| panic!("{} is not on any volume: {mounts:?}", path.display()));
        (mount.clone(), host_path(volume))
    };
    assert_eq!(
        mounted(&install.conf_dir),
        ("/host/etc/cni/net.d".into(), "/etc/cni/net.d".into())
    );
    for bin in &install.bin_dirs {
        assert_eq!(mounted(bin).1, "/opt/cni/bin");
    }
    // The run dir is the same path inside and out: the plugin config names it for the host.
    assert_eq!(
        mounted(&install.run_dir),
        (
            install.run_dir.display().to_string(),
            install.run_dir.display().to_string()
        )
    );
    let zds_dir = ambient.zds_socket.parent().unwrap();
    assert_eq!(
        mounted(zds_dir),
        (zds_dir.display().to_string(), zds_dir.display().to_string())
    );
    assert_eq!(
        mounted(&ambient.proc_dir),
        ("/host/proc".into(), "/proc".into())
    );
    assert_eq!(
        mounted(&ambient.host_prefix.join("var/run/netns/x")).1,
        "/var/run/netns"
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"],
        json!({"path": "/readyz", "port": ambient.health_port})
    );
    assert_eq!(
        container["ports"][0]["containerPort"],
        json!(ambient.monitoring_port.unwrap())
    );
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT);
}

/// The chart's repair ClusterRole is the rule set the repair controller's own tests bind
/// (deploy/rbac/repair-clusterrole.yaml): the base rules plus the selected action's.
#[test]
fn chart_repair_role_matches_deploy_rbac() {
    dataplane::enter_test_group!();
    let rules_of = |objs: &[DynamicObject], names: &[&str]| -> BTreeSet<String> {
        objs.iter()
            .filter(|o| manifests::kind(o) == "ClusterRole")
            .filter(|o| names.contains(&o.metadata.name.as_deref().unwrap_or("")))
            .flat_map(|o| o.data["rules"].as_array().unwrap().clone())
            .map(|r| r.to_string())
            .collect()
    };
    let file = std::fs::read_to_string(manifests::repo_file("deploy/rbac/repair-clusterrole.yaml"))
        .unwrap();
    let reference = manifests::documents(&file);
    let base = "istio-cni-repair-role";
    for (values, extra) in [
        (vec![], None),
        (
            vec!["repair.repairPods=false", "repair.deletePods=true"],
            Some("istio-cni-repair-role-delete-pods"),
        ),
        (
            vec!["repair.repairPods=false", "repair.labelPods=true"],
            Some("istio-cni-repair-role-label-pods"),
        ),
    ] {
        let mut args = Vec::new();
        for v in &values {
            args.extend(["--set", v]);
        }
        let rendered = render(&args);
        let want_names: Vec<&str> = [Some(base), extra].into_iter().flatten().collect();
        assert_eq!(
            rules_of(&rendered, &[base]),
            rules_of(&reference, &want_names),
            "{values:?}"
        );
    }
}
