//! `deploy/node/`: the chart rendered with the real node's values file and the ztunnel-peer
//! DaemonSet. They must name the images `scripts/node-images` builds, never pull, run the agent
//! with the nftables backend on the host network, share the ZDS socket dir between agent and
//! peer, and pass the API server's server-side dry-run.

use kube::api::DynamicObject;
use serde_json::Value;
use testbed::kube::KubeTestEnv;
use testbed::manifests::{self, NAMESPACE};

const VALUES: &str = "deploy/node/values-real-node.yaml";
const PEER: &str = "deploy/node/ztunnel-peer.yaml";
/// The refs scripts/node-images tags its archives with.
const AGENT_IMAGE: &str = "localhost/istio-cni-rs/install-cni:dev";
const PEER_IMAGE: &str = "localhost/istio-cni-rs/ztunnel-peer:dev";

fn find<'a>(objs: &'a [DynamicObject], kind: &str, name: &str) -> &'a Value {
    let obj = objs
        .iter()
        .find(|o| manifests::kind(o) == kind && o.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"));
    &obj.data
}

/// The hostPath behind the volume that `container` mounts at `mount_path`.
fn host_path(pod_spec: &Value, container: &Value, mount_path: &str) -> String {
    let mounts = container["volumeMounts"].as_array().unwrap();
    let mount = mounts
        .iter()
        .find(|m| m["mountPath"] == mount_path)
        .unwrap_or_else(|| panic!("nothing mounted at {mount_path}"));
    let volumes = pod_spec["volumes"].as_array().unwrap();
    let volume = volumes.iter().find(|v| v["name"] == mount["name"]).unwrap();
    volume["hostPath"]["path"].as_str().unwrap().to_string()
}

fn env<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

#[tokio::test]
async fn real_node_values_and_ztunnel_peer() {
    dataplane::enter_test_group!();
    let values = manifests::repo_file(VALUES);
    let chart = manifests::render_chart(&["-f", values.to_str().unwrap()]);
    let peer_text = std::fs::read_to_string(manifests::repo_file(PEER)).unwrap();
    let peer = manifests::documents(&peer_text);

    let agent = &find(&chart, "DaemonSet", "istio-cni-node")["spec"]["template"]["spec"];
    let install_cni = &agent["containers"][0];
    assert_eq!(install_cni["image"], AGENT_IMAGE);
    assert_eq!(install_cni["imagePullPolicy"], "Never");
    assert_eq!(agent["hostNetwork"], true);
    let config = &find(&chart, "ConfigMap", "istio-cni-config")["data"];
    assert_eq!(config["AMBIENT_ENABLED"], "true");
    assert_eq!(config["NATIVE_NFTABLES"], "true");
    // The agent serves ZDS at its default path, in the dir the peer mounts too.
    assert!(config.get("ZTUNNEL_UDS_ADDRESS").is_none());
    let zds_dir = std::path::Path::new(cni_agent::zds::DEFAULT_SOCKET)
        .parent()
        .unwrap()
        .to_str()
        .unwrap();
    let agent_dir = host_path(agent, install_cni, zds_dir);

    assert_eq!(peer.len(), 1);
    let ds = find(&peer, "DaemonSet", "ztunnel");
    assert_eq!(peer[0].metadata.namespace.as_deref(), Some(NAMESPACE));
    let spec = &ds["spec"]["template"]["spec"];
    let proxy = &spec["containers"][0];
    assert_eq!(proxy["image"], PEER_IMAGE);
    assert_eq!(proxy["imagePullPolicy"], "Never");
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(
        env(proxy, "INPOD_UDS"),
        Some(cni_agent::zds::DEFAULT_SOCKET)
    );
    assert_eq!(host_path(spec, proxy, zds_dir), agent_dir);
    // Root (the agent's peer check) with setns and SO_MARK.
    assert_eq!(proxy["securityContext"]["runAsUser"], 0);
    let caps = &proxy["securityContext"]["capabilities"]["add"];
    for cap in ["SYS_ADMIN", "NET_ADMIN"] {
        assert!(
            caps.as_array().unwrap().iter().any(|c| c == cap),
            "{cap} missing: {caps}"
        );
    }

    let kube = KubeTestEnv::start().await;
    let client = kube.client();
    manifests::ensure_namespace(&client, NAMESPACE).await;
    for obj in chart.iter().chain(&peer) {
        manifests::apply(&client, obj, true)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{} {:?} rejected: {e}",
                    manifests::kind(obj),
                    obj.metadata.name
                )
            });
    }
}

/// The agent image of a render.
fn agent_image(chart: &[DynamicObject]) -> String {
    find(chart, "DaemonSet", "istio-cni-node")["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .expect("the agent's image")
        .to_string()
}

/// The real-node suites install our chart with Istio's `ambient` profile on top of the values
/// file (`testbed::migrate::values_args`), and that profile sets the `distroless` variant: the
/// values file clears it, so the agent's image is still the one scripts/node-images tags.
#[test]
fn ambient_profile_on_the_real_node_keeps_the_node_image() {
    dataplane::enter_test_group!();
    let args = testbed::migrate::values_args(false);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_eq!(agent_image(&manifests::render_chart(&args)), AGENT_IMAGE);
    // Without the values file's `variant: ""`, the profile's variant names another tag.
    let hub_and_tag = [
        "--set",
        "global.hub=localhost/istio-cni-rs",
        "--set",
        "global.tag=dev",
    ];
    let profile = ["--set", "profile=ambient"];
    assert_eq!(
        agent_image(&manifests::render_chart(
            &[&hub_and_tag[..], &profile].concat()
        )),
        format!("{AGENT_IMAGE}-distroless")
    );
    // Istio's chart from the pin, with the same values as the migration suites give it, names
    // Istio's image as scripts/node-images tags it.
    let out = std::process::Command::new(manifests::helm())
        .args(["template", "istio-cni", &testbed::migrate::istio_chart()])
        .args(testbed::migrate::values_args(true))
        .output()
        .expect("run helm");
    assert!(
        out.status.success(),
        "helm template of Istio's chart: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let istio = manifests::documents(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(agent_image(&istio), testbed::migrate::ISTIO_IMAGE);
}
