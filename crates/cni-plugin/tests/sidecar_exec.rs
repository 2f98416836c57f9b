//! Sidecar mode through the built `istio-cni` binary: the in-test agent (or the API server, when
//! the agent is down or ambient is off) hands over an injected Pod, and the plugin must leave the
//! redirect rules in a real network namespace, or fail the ADD naming the pod and annotation.

#[expect(
    dead_code,
    reason = "the shared peers module also serves exec.rs, which uses all of it"
)]
mod support;

use std::path::Path;
use std::process::Command;

use dataplane::test_support::TestNetns;
use serde_json::{Value, json};
use support::{Output, POD_ARGS, PREV, Recorded, Server, plugin_conf, run_plugin};

fn conf(run_dir: &Path, ambient: bool, nftables: bool) -> String {
    let mut c = plugin_conf(run_dir, ambient);
    c["native_nftables"] = json!(nftables);
    c["prevResult"] = serde_json::from_str(PREV).unwrap();
    c.to_string()
}

/// An injected pod, as the agent or the API server returns it.
fn sidecar_pod(annotations: Value) -> Value {
    let mut ann = json!({"sidecar.istio.io/status": "{\"containers\":[\"istio-proxy\"]}"});
    ann.as_object_mut()
        .unwrap()
        .extend(annotations.as_object().unwrap().clone());
    json!({
        "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "default", "annotations": ann},
        "spec": {
            "initContainers": [{"name": "istio-validation"}],
            "containers": [{"name": "app"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}]
        }
    })
}

fn add(netns: &str, stdin: &str) -> Output {
    run_plugin(
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "abc123"),
            ("CNI_NETNS", netns),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            ("CNI_ARGS", POD_ARGS),
            // Runtimes pass their own environment through; the iptables tools live in sbin.
            (
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            ),
        ],
        stdin,
    )
}

fn agent_says_sidecar(dir: &Path, pod: Value) -> Server {
    let body = json!({"decision": "sidecar", "pod": pod}).to_string();
    Server::unix(&dir.join("pluginevent.sock"), move |_| {
        (200, body.clone().into_bytes())
    })
}

fn api_serving(pod: Value) -> Server {
    Server::tcp(move |r: &Recorded| match r.path.as_str() {
        "/api/v1/namespaces/default/pods/web-0" => (200, pod.to_string().into_bytes()),
        "/api/v1/namespaces/default" => (
            200,
            json!({"kind": "Namespace", "metadata": {"name": "default", "labels": {}}})
                .to_string()
                .into_bytes(),
        ),
        _ => (404, b"{}".to_vec()),
    })
}

fn write_kubeconfig(dir: &Path, port: u16) {
    let text = format!(
        "apiVersion: v1\nclusters:\n- cluster:\n    server: http://127.0.0.1:{port}\n  name: local\n\
         contexts:\n- context:\n    cluster: local\n    user: u\n  name: c\ncurrent-context: c\nkind: Config\n\
         users:\n- name: u\n  user:\n    token: t\n"
    );
    std::fs::write(dir.join("istio-cni-kubeconfig"), text).unwrap();
}

/// Every iptables variant's view of the netns nat table, whichever the plugin picked.
fn nat_rules(ns: &TestNetns) -> String {
    ["iptables-legacy-save", "iptables-nft-save"]
        .iter()
        .map(|tool| {
            let out = Command::new("ip")
                .args(["netns", "exec", &ns.name, tool, "-t", "nat"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
        .collect()
}

fn assert_ok(out: &Output) {
    assert_eq!(
        out.code, 0,
        "ADD failed: stdout={} stderr={}",
        out.stdout, out.stderr
    );
    let printed: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(printed, serde_json::from_str::<Value>(PREV).unwrap());
}

#[test]
fn agent_sidecar_decision_programs_iptables_in_the_pod_netns() {
    dataplane::require_root!();
    let dir = tempfile::tempdir().unwrap();
    let ns = TestNetns::new("plug-sc");
    let _agent = agent_says_sidecar(dir.path(), sidecar_pod(json!({})));
    assert_ok(&add(
        ns.path().to_str().unwrap(),
        &conf(dir.path(), true, false),
    ));
    let nat = nat_rules(&ns);
    for want in [
        "-A PREROUTING -p tcp -j ISTIO_INBOUND",
        "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006",
        "-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN",
        "-A ISTIO_OUTPUT -j ISTIO_REDIRECT",
    ] {
        assert!(nat.contains(want), "{want:?} missing:\n{nat}");
    }
    // A retried ADD (the runtime retries sandboxes) leaves exactly the same rules.
    assert_ok(&add(
        ns.path().to_str().unwrap(),
        &conf(dir.path(), true, false),
    ));
    assert_eq!(nat_rules(&ns), nat);
}

#[test]
fn native_nftables_programs_nftables_and_tproxy_routing() {
    dataplane::require_root!();
    let dir = tempfile::tempdir().unwrap();
    let ns = TestNetns::new("plug-scn");
    let pod = sidecar_pod(json!({"sidecar.istio.io/interceptionMode": "TPROXY"}));
    let _agent = agent_says_sidecar(dir.path(), pod);
    assert_ok(&add(
        ns.path().to_str().unwrap(),
        &conf(dir.path(), true, true),
    ));
    let listed = ns.exec("nft", &["list", "ruleset"]);
    assert!(listed.contains("table inet istio-proxy-mangle"), "{listed}");
    assert!(listed.contains("tproxy ip to :15006"), "{listed}");
    let rules = ns.exec("ip", &["rule", "show"]);
    assert!(rules.contains("fwmark 0x539 lookup 133"), "{rules}");
    assert!(nat_rules(&ns).lines().all(|l| !l.contains("ISTIO")));
}

#[test]
fn bad_annotation_fails_the_add_naming_pod_and_annotation() {
    dataplane::require_root!();
    let dir = tempfile::tempdir().unwrap();
    let ns = TestNetns::new("plug-scb");
    let pod =
        sidecar_pod(json!({"traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.0.0.0/8,10.1"}));
    let _agent = agent_says_sidecar(dir.path(), pod);
    let out = add(ns.path().to_str().unwrap(), &conf(dir.path(), true, false));
    assert_eq!(out.code, 1, "{}", out.stdout);
    let e: Value = serde_json::from_str(&out.stdout).unwrap();
    let msg = e["msg"].as_str().unwrap();
    assert!(msg.contains("default/web-0"), "{msg}");
    assert!(
        msg.contains("traffic.sidecar.istio.io/excludeOutboundIPRanges"),
        "{msg}"
    );
    assert!(
        !nat_rules(&ns).contains("ISTIO"),
        "nothing may be programmed"
    );
}

#[test]
fn agent_down_falls_back_to_the_api_server_for_a_sidecar_pod() {
    dataplane::require_root!();
    let dir = tempfile::tempdir().unwrap();
    let ns = TestNetns::new("plug-scd");
    let api = api_serving(sidecar_pod(json!({
        "traffic.sidecar.istio.io/includeInboundPorts": "8080"
    })));
    write_kubeconfig(dir.path(), api.port);
    assert_ok(&add(
        ns.path().to_str().unwrap(),
        &conf(dir.path(), true, false),
    ));
    assert!(
        nat_rules(&ns).contains("-A ISTIO_INBOUND -p tcp -m tcp --dport 8080 -j ISTIO_IN_REDIRECT"),
        "{}",
        nat_rules(&ns)
    );
}

#[test]
fn ambient_disabled_reads_the_pod_and_programs_only_sidecar_pods() {
    dataplane::require_root!();
    let dir = tempfile::tempdir().unwrap();
    let ns = TestNetns::new("plug-sco");
    let api = api_serving(sidecar_pod(json!({})));
    write_kubeconfig(dir.path(), api.port);
    assert_ok(&add(
        ns.path().to_str().unwrap(),
        &conf(dir.path(), false, false),
    ));
    assert!(nat_rules(&ns).contains("ISTIO_OUTPUT"));
    assert_eq!(api.requests().len(), 1);

    // A pod without the injector's status annotation passes through untouched.
    let dir = tempfile::tempdir().unwrap();
    let plain = TestNetns::new("plug-scp");
    let mut pod = sidecar_pod(json!({}));
    pod["metadata"]["annotations"] = json!({});
    let api = api_serving(pod);
    write_kubeconfig(dir.path(), api.port);
    assert_ok(&add(
        plain.path().to_str().unwrap(),
        &conf(dir.path(), false, false),
    ));
    assert!(!nat_rules(&plain).contains("ISTIO"));
    assert_eq!(plain.exec("nft", &["list", "ruleset"]).trim(), "");
}
