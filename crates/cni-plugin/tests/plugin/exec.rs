//! The built `istio-cni` binary, exec'd the way a runtime execs it (env + stdin), against real
//! in-test peers: an agent on a unix socket, an API server on 127.0.0.1, a log sink.

use crate::support;

use std::path::Path;

use cni_core::cmdadd::{CmdAddRequest, IpConfig};
use serde_json::{Value, json};
use support::{Output, POD_ARGS, PREV, Recorded, Server, plugin_conf, run_plugin};

const NETNS: &str = "/var/run/netns/cni-istio-test-absent";
fn conf(run_dir: &Path, ambient: bool, prev: Option<&str>) -> String {
    let mut c = plugin_conf(run_dir, ambient);
    if let Some(p) = prev {
        c["prevResult"] = serde_json::from_str(p).unwrap();
    }
    // The prevResult is spliced in as text so the byte-for-byte pass-through is really tested.
    let text = c.to_string();
    match prev {
        Some(p) => {
            let v: Value = serde_json::from_str(p).unwrap();
            text.replace(&v.to_string(), p)
        }
        None => text,
    }
}

fn add(args: &str, stdin: &str) -> Output {
    run_plugin(
        &[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "abc123"),
            ("CNI_NETNS", NETNS),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            ("CNI_ARGS", args),
        ],
        stdin,
    )
}

fn error_of(out: &Output) -> Value {
    assert_eq!(
        out.code, 1,
        "expected failure; stdout={} stderr={}",
        out.stdout, out.stderr
    );
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not error JSON ({e}): {}", out.stdout))
}

fn ok(out: &Output) -> &str {
    assert_eq!(
        out.code, 0,
        "expected success; stdout={} stderr={}",
        out.stdout, out.stderr
    );
    &out.stdout
}

fn expected_request() -> CmdAddRequest {
    CmdAddRequest {
        netns: NETNS.into(),
        pod_name: "web-0".into(),
        pod_namespace: "default".into(),
        ips: vec![IpConfig {
            interface: Some(0),
            address: "10.244.1.5/24".parse().unwrap(),
            gateway: Some("10.244.1.1".parse().unwrap()),
        }],
        pod_uid: "uid-1".into(),
        container_id: "abc123".into(),
    }
}

fn agent(dir: &Path, status: u16, body: &'static str) -> Server {
    Server::unix(&dir.join("pluginevent.sock"), move |_| {
        (status, body.as_bytes().to_vec())
    })
}

/// An API server that serves one pod and its namespace.
fn api_server(pod_labels: Value, ns_labels: Value) -> Server {
    Server::tcp(move |r: &Recorded| {
        match r.path.as_str() {
        "/api/v1/namespaces/default/pods/web-0" => (
            200,
            json!({"kind": "Pod", "metadata": {"name": "web-0", "namespace": "default", "labels": pod_labels}, "spec": {}})
                .to_string()
                .into_bytes(),
        ),
        "/api/v1/namespaces/default" => (
            200,
            json!({"kind": "Namespace", "metadata": {"name": "default", "labels": ns_labels}})
                .to_string()
                .into_bytes(),
        ),
        _ => (404, b"{\"kind\":\"Status\",\"code\":404}".to_vec()),
    }
    })
}

fn write_kubeconfig(dir: &Path, port: u16) {
    let text = format!(
        "apiVersion: v1\nclusters:\n- cluster:\n    insecure-skip-tls-verify: true\n    server: http://127.0.0.1:{port}\n  name: local\n\
         contexts:\n- context:\n    cluster: local\n    user: istio-cni\n  name: istio-cni-context\n\
         current-context: istio-cni-context\nkind: Config\nusers:\n- name: istio-cni\n  user:\n    token: sa-token\n"
    );
    std::fs::write(dir.join("istio-cni-kubeconfig"), text).unwrap();
}

// ---- protocol surface -------------------------------------------------------------------------

#[test]
fn version_prints_supported_versions() {
    dataplane::enter_test_group!();
    let out = run_plugin(&[("CNI_COMMAND", "VERSION")], "");
    assert_eq!(
        ok(&out),
        "{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"0.1.0\",\"0.2.0\",\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\"]}\n"
    );
}

#[test]
fn no_command_prints_about_to_stderr() {
    dataplane::enter_test_group!();
    let out = run_plugin(&[], "");
    assert_eq!(ok(&out), "");
    assert!(
        out.stderr.starts_with("CNI plugin istio-cni "),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("CNI protocol versions supported: 0.1.0, 0.2.0"),
        "{}",
        out.stderr
    );
}

#[test]
fn missing_env_is_code_4_on_stdout() {
    dataplane::enter_test_group!();
    let out = run_plugin(&[("CNI_COMMAND", "ADD")], "{}");
    assert_eq!(
        out.stdout,
        "{\n    \"code\": 4,\n    \"msg\": \"required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME,CNI_PATH] missing\"\n}"
    );
    assert_eq!(out.code, 1);
    // Logs go to stderr only, as JSON lines.
    let line: Value = serde_json::from_str(out.stderr.lines().next().unwrap()).unwrap();
    assert_eq!(line["level"], "error");
}

#[test]
fn bad_stdin_codes() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(error_of(&add("", "not json"))["code"], 6);
    assert_eq!(error_of(&add("", r#"{"cniVersion":"1.0.0"}"#))["code"], 7);
    let e = error_of(&add("", r#"{"cniVersion":"0.5.0","name":"n"}"#));
    assert_eq!(
        (e["code"].as_u64(), e["msg"].as_str()),
        (Some(1), Some("incompatible CNI versions"))
    );
    // A config key of the wrong type is a decoding error, not a silent default.
    let bad = conf(dir.path(), false, None)
        .replace("\"ambient_enabled\":false", "\"ambient_enabled\":\"no\"");
    assert_eq!(error_of(&add("", &bad))["code"], 6);
}

#[test]
fn check_del_gc_status_and_unknown_commands() {
    dataplane::enter_test_group!();
    let env = |cmd: &'static str| {
        vec![
            ("CNI_COMMAND", cmd),
            ("CNI_CONTAINERID", "abc123"),
            ("CNI_NETNS", NETNS),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
        ]
    };
    let with_version = |v: &str| format!(r#"{{"cniVersion":"{v}","name":"n","type":"istio-cni"}}"#);
    assert_eq!(ok(&run_plugin(&env("CHECK"), &with_version("0.4.0"))), "");
    assert_eq!(
        error_of(&run_plugin(&env("CHECK"), &with_version("0.3.1")))["msg"],
        "config version does not allow CHECK"
    );
    assert_eq!(ok(&run_plugin(&env("DEL"), &with_version("0.3.1"))), "");
    assert_eq!(ok(&run_plugin(&env("GC"), &with_version("1.1.0"))), "");
    assert_eq!(ok(&run_plugin(&env("STATUS"), &with_version("1.1.0"))), "");
    assert_eq!(
        error_of(&run_plugin(&env("STATUS"), &with_version("1.0.0")))["code"],
        1
    );
    let e = error_of(&run_plugin(&env("FROB"), &with_version("1.0.0")));
    assert_eq!(
        (e["code"].as_u64(), e["msg"].as_str()),
        (Some(4), Some("unknown CNI_COMMAND: FROB"))
    );
    // DEL without a netns is fine (the sandbox may be gone already).
    let mut del = env("DEL");
    del.retain(|(k, _)| *k != "CNI_NETNS");
    assert_eq!(ok(&run_plugin(&del, &with_version("1.0.0"))), "");
}

#[test]
fn own_netns_is_refused_unless_overridden() {
    dataplane::enter_test_group!();
    let me = format!("/proc/{}/ns/net", std::process::id());
    let env = |over: &'static str| {
        vec![
            ("CNI_COMMAND", "ADD".to_owned()),
            ("CNI_CONTAINERID", "abc123".to_owned()),
            ("CNI_NETNS", me.clone()),
            ("CNI_IFNAME", "eth0".to_owned()),
            ("CNI_PATH", "/opt/cni/bin".to_owned()),
            ("CNI_NETNS_OVERRIDE", over.to_owned()),
        ]
    };
    let stdin = r#"{"cniVersion":"1.0.0","name":"n","type":"istio-cni"}"#;
    let e1 = env("");
    let e1: Vec<(&str, &str)> = e1.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let e = error_of(&run_plugin(&e1, stdin));
    assert_eq!(e["code"], 8);
    let e2 = env("true");
    let e2: Vec<(&str, &str)> = e2.iter().map(|(k, v)| (*k, v.as_str())).collect();
    ok(&run_plugin(&e2, stdin));
}

// ---- pass-through cases: nothing contacted ----------------------------------------------------

#[test]
fn non_k8s_sandbox_passes_prev_result_through_byte_for_byte() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), 500, "must not be called");
    let out = add("", &conf(dir.path(), true, Some(PREV)));
    assert_eq!(ok(&out), PREV);
    assert!(a.requests().is_empty());
}

#[test]
fn no_prev_result_prints_an_empty_result_of_the_config_version() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        ok(&add("", &conf(dir.path(), false, None))),
        "{\n    \"cniVersion\": \"1.0.0\"\n}"
    );
    let old = conf(dir.path(), false, None).replace("\"1.0.0\"", "\"0.3.1\"");
    assert_eq!(
        ok(&add("", &old)),
        "{\n    \"cniVersion\": \"0.3.1\",\n    \"dns\": {}\n}"
    );
}

#[test]
fn own_agent_pod_passes_without_agent_or_kubeconfig() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=istio-system;K8S_POD_NAME=istio-cni-node-x7k2p";
    assert_eq!(ok(&add(args, &conf(dir.path(), true, Some(PREV)))), PREV);
    // Same name in another namespace is an ordinary pod: no agent, no kubeconfig → fails closed.
    let args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=istio-cni-node-x7k2p";
    error_of(&add(args, &conf(dir.path(), true, Some(PREV))));
}

#[test]
fn excluded_namespace_passes_without_contacting_the_agent() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), 500, "must not be called");
    let args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-1";
    assert_eq!(ok(&add(args, &conf(dir.path(), true, Some(PREV)))), PREV);
    assert!(a.requests().is_empty());
}

#[test]
fn ambient_disabled_passes_without_contacting_the_agent() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), 500, "must not be called");
    // With ambient off the plugin reads the pod only to decide on sidecar redirection.
    let api = api_server(json!({"app": "web"}), json!({}));
    write_kubeconfig(dir.path(), api.port);
    assert_eq!(
        ok(&add(POD_ARGS, &conf(dir.path(), false, Some(PREV)))),
        PREV
    );
    assert!(a.requests().is_empty());
    // The lookup identifies itself as Istio's clients do: `<binary>/<version>`.
    let ua = format!("istio-cni/{}", env!("CARGO_PKG_VERSION"));
    let reqs = api.requests();
    assert!(!reqs.is_empty());
    assert!(
        reqs.iter()
            .all(|r| r.header("user-agent") == Some(ua.as_str()))
    );
}

#[test]
fn unknown_cni_args_without_ignore_unknown_fail() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let e = error_of(&add(
        "K8S_POD_NAME=a;FOO=bar",
        &conf(dir.path(), true, Some(PREV)),
    ));
    assert_eq!(e["code"], 999);
    assert_eq!(e["msg"], r#"ARGS: unknown args ["FOO=bar"]"#);
}

// ---- the agent decides ------------------------------------------------------------------------

#[test]
fn agent_decisions_pass_and_the_request_is_our_v1_body() {
    dataplane::enter_test_group!();
    for body in [
        r#"{"decision":"enrolled"}"#,
        r#"{"decision":"not-ambient","reason":"no selector matches"}"#,
        r#"{"decision":"sidecar","pod":{"kind":"Pod"}}"#,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let a = agent(dir.path(), 200, body);
        assert_eq!(
            ok(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV)))),
            PREV,
            "{body}"
        );
        let reqs = a.requests();
        assert_eq!(reqs.len(), 1);
        assert_eq!(
            (reqs[0].method.as_str(), reqs[0].path.as_str()),
            ("POST", "/v1/cmdadd")
        );
        assert_eq!(reqs[0].header("Content-Type"), Some("application/json"));
        assert_eq!(reqs[0].body, expected_request().to_v1_json());
    }
}

#[test]
fn no_prev_result_sends_null_ips() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), 200, r#"{"decision":"enrolled"}"#);
    ok(&add(POD_ARGS, &conf(dir.path(), true, None)));
    let body: Value = serde_json::from_slice(&a.requests()[0].body).unwrap();
    assert_eq!(body["IPs"], Value::Null);
}

#[test]
fn agent_error_status_fails_with_its_body() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let _a = agent(dir.path(), 500, "ztunnel did not ack pod default/web-0\n");
    let e = error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    assert_eq!(e["code"], 999);
    assert_eq!(
        e["msg"],
        "istio-cni agent refused pod default/web-0 (status code 500): ztunnel did not ack pod default/web-0"
    );
}

#[test]
fn unreadable_decision_fails() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let _a = agent(dir.path(), 200, "OK");
    let e = error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    assert!(
        e["msg"].as_str().unwrap().contains("unreadable decision"),
        "{e}"
    );
}

// ---- an Istio agent (404 on /v1/cmdadd) -------------------------------------------------------

fn istio_agent(dir: &Path, cmdadd_status: u16) -> Server {
    Server::unix(&dir.join("pluginevent.sock"), move |r| {
        match r.path.as_str() {
            "/cmdadd" => (
                cmdadd_status,
                if cmdadd_status == 200 {
                    vec![]
                } else {
                    b"pod not found\n".to_vec()
                },
            ),
            _ => (404, b"404 page not found\n".to_vec()),
        }
    })
}

#[test]
fn istio_agent_gets_istios_exact_body_for_an_ambient_pod() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let api = api_server(json!({}), json!({"istio.io/dataplane-mode": "ambient"}));
    write_kubeconfig(dir.path(), api.port);
    let a = istio_agent(dir.path(), 200);
    assert_eq!(
        ok(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV)))),
        PREV
    );
    let reqs = a.requests();
    assert_eq!(
        reqs.iter().map(|r| r.path.as_str()).collect::<Vec<_>>(),
        ["/v1/cmdadd", "/cmdadd"]
    );
    assert_eq!(
        String::from_utf8(reqs[1].body.clone()).unwrap(),
        r#"{"Netns":"/var/run/netns/cni-istio-test-absent","PodName":"web-0","PodNamespace":"default","IPs":[{"Interface":0,"Address":{"IP":"10.244.1.5","Mask":"////AA=="},"Gateway":"10.244.1.1"}]}"#
    );
    // The API server saw our token on both lookups.
    let api_reqs = api.requests();
    assert_eq!(api_reqs.len(), 2);
    assert!(
        api_reqs
            .iter()
            .all(|r| r.header("Authorization") == Some("Bearer sa-token"))
    );
}

#[test]
fn istio_agent_not_ambient_pod_is_not_sent() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let api = api_server(
        json!({"istio.io/dataplane-mode": "none"}),
        json!({"istio.io/dataplane-mode": "ambient"}),
    );
    write_kubeconfig(dir.path(), api.port);
    let a = istio_agent(dir.path(), 200);
    ok(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    assert_eq!(a.requests().len(), 1, "only the /v1/cmdadd probe");
}

#[test]
fn istio_agent_failure_uses_istios_message() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let api = api_server(json!({"istio.io/dataplane-mode": "ambient"}), json!({}));
    write_kubeconfig(dir.path(), api.port);
    let _a = istio_agent(dir.path(), 500);
    let e = error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    assert_eq!(
        e["msg"],
        "istio-cni cmdAdd failed to contact node Istio CNI agent: unable to push CNI event (status code 500): pod not found"
    );
}

#[test]
fn istio_agent_with_failing_api_fails_closed() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let api = Server::tcp(|_| (503, b"etcd unavailable".to_vec()));
    write_kubeconfig(dir.path(), api.port);
    let a = istio_agent(dir.path(), 200);
    let e = error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    assert!(
        e["msg"]
            .as_str()
            .unwrap()
            .contains("cannot tell whether pod default/web-0 is ambient"),
        "{e}"
    );
    assert!(
        e["msg"].as_str().unwrap().contains("etcd unavailable"),
        "{e}"
    );
    assert_eq!(a.requests().len(), 1, "never enrolled blindly");
    assert_eq!(api.requests().len(), 3, "retried");
}

// ---- the agent is down ------------------------------------------------------------------------

#[test]
fn agent_down_non_ambient_pod_starts() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let api = api_server(json!({"app": "web"}), json!({}));
    write_kubeconfig(dir.path(), api.port);
    assert_eq!(
        ok(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV)))),
        PREV
    );
    assert_eq!(api.requests().len(), 2);
}

#[test]
fn agent_down_ambient_pod_is_refused() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let api = api_server(json!({}), json!({"istio.io/dataplane-mode": "ambient"}));
    write_kubeconfig(dir.path(), api.port);
    let e = error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    let msg = e["msg"].as_str().unwrap();
    assert!(
        msg.starts_with(
            "agent unreachable: refusing to start ambient pod default/web-0 unredirected"
        ),
        "{msg}"
    );
}

#[test]
fn stale_socket_counts_as_agent_down() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    // A socket file nobody listens on: connect is refused.
    drop(std::os::unix::net::UnixListener::bind(dir.path().join("pluginevent.sock")).unwrap());
    let api = api_server(json!({"app": "web"}), json!({}));
    write_kubeconfig(dir.path(), api.port);
    ok(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    assert_eq!(api.requests().len(), 2);
}

#[test]
fn agent_down_and_no_kubeconfig_fails_closed() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let e = error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    let msg = e["msg"].as_str().unwrap();
    assert!(
        msg.contains("ambient membership of pod default/web-0 unknown"),
        "{msg}"
    );
    assert!(msg.contains("istio-cni-kubeconfig"), "{msg}");
}

#[test]
fn agent_down_and_pod_missing_fails_closed() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let api = Server::tcp(|_| (404, br#"{"kind":"Status","reason":"NotFound"}"#.to_vec()));
    write_kubeconfig(dir.path(), api.port);
    let e = error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    assert!(e["msg"].as_str().unwrap().contains("returned 404"), "{e}");
}

#[test]
fn hung_agent_times_out_after_5s_then_falls_back() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let _a = agent(dir.path(), 0, "");
    let api = api_server(json!({"app": "web"}), json!({}));
    write_kubeconfig(dir.path(), api.port);
    let start = std::time::Instant::now();
    ok(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    let took = start.elapsed();
    assert!(
        took >= std::time::Duration::from_secs(5) && took < std::time::Duration::from_secs(7),
        "{took:?}"
    );
}

// ---- log forwarding ---------------------------------------------------------------------------

#[test]
fn logs_are_forwarded_to_the_agent_log_socket() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let sink = Server::unix(&dir.path().join("log.sock"), |_| (200, vec![]));
    let _a = agent(dir.path(), 200, r#"{"decision":"enrolled"}"#);
    let out = add(POD_ARGS, &conf(dir.path(), true, Some(PREV)));
    ok(&out);
    let reqs = sink.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(
        (reqs[0].method.as_str(), reqs[0].path.as_str()),
        ("POST", "/log")
    );
    let records: Vec<String> = serde_json::from_slice(&reqs[0].body).unwrap();
    assert!(!records.is_empty());
    for r in &records {
        let v: Value = serde_json::from_str(r).unwrap();
        assert!(v["time"].as_str().unwrap().ends_with('Z'));
        assert!(v["level"].is_string() && v["msg"].is_string());
        assert_eq!(v["pod"], "default/web-0");
    }
    assert!(
        records
            .iter()
            .any(|r| r.contains("pod enrolled in the ambient mesh"))
    );
    // The same records went to stderr; stdout only has the result.
    assert!(out.stderr.contains("pod enrolled in the ambient mesh"));
    assert_eq!(out.stdout, PREV);
    // Delivered, so nothing is kept on the node.
    assert!(!dir.path().join("istio-cni.log").exists());
}

#[test]
fn logs_the_agent_cannot_take_go_to_the_node_local_file() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("istio-cni.log");
    // The agent refuses the pod and its log server is down: the operator must still see why.
    let _a = agent(dir.path(), 500, "rules failed");
    error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    let text = std::fs::read_to_string(&file).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        lines[0]["msg"]
            .as_str()
            .unwrap()
            .contains("log socket unavailable")
    );
    assert!(lines[0]["reason"].as_str().unwrap().contains("log.sock"));
    assert!(
        lines.iter().any(|v| v["level"] == "error"
            && v["pod"] == "default/web-0"
            && v["error"].as_str().unwrap().contains("rules failed")),
        "{text}"
    );
    // Istio's file keeps info and above, whatever the plugin's level.
    assert!(lines.iter().all(|v| v["level"] != "debug"), "{text}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // A log socket that refuses the records: appended, not overwritten.
    let _sink = Server::unix(&dir.path().join("log.sock"), |_| (500, vec![]));
    error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    let text = std::fs::read_to_string(&file).unwrap();
    assert_eq!(text.matches("rules failed").count(), 2, "{text}");
    assert!(text.contains("answered 500"), "{text}");
}

#[test]
fn a_symlinked_log_file_is_not_followed() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "keep\n").unwrap();
    std::os::unix::fs::symlink(&victim, dir.path().join("istio-cni.log")).unwrap();
    let _a = agent(dir.path(), 500, "rules failed");
    let out = add(POD_ARGS, &conf(dir.path(), true, Some(PREV)));
    error_of(&out);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep\n");
    assert!(out.stderr.contains("not writing to it"), "{}", out.stderr);
}

// ---- the API server over HTTPS ----------------------------------------------------------------

/// A CA and a server certificate for 127.0.0.1 signed by it: (ca pem, server chain pem, key pem).
fn mint_certs() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

fn tls_api_server(chain: &str, key: &str) -> Server {
    Server::tls(chain, key, |r: &Recorded| match r.path.as_str() {
        "/api/v1/namespaces/default/pods/web-0" => (
            200,
            json!({"metadata": {"name": "web-0", "labels": {"app": "web"}}})
                .to_string()
                .into_bytes(),
        ),
        "/api/v1/namespaces/default" => (
            200,
            json!({"metadata": {"name": "default"}})
                .to_string()
                .into_bytes(),
        ),
        _ => (404, vec![]),
    })
}

fn write_tls_kubeconfig(dir: &Path, port: u16, cluster: &str) {
    let text = format!(
        "apiVersion: v1\nclusters:\n- cluster:\n{cluster}    server: https://127.0.0.1:{port}\n  name: local\n\
         contexts:\n- context:\n    cluster: local\n    user: istio-cni\n  name: istio-cni-context\n\
         current-context: istio-cni-context\nkind: Config\nusers:\n- name: istio-cni\n  user:\n    token: sa-token\n"
    );
    std::fs::write(dir.join("istio-cni-kubeconfig"), text).unwrap();
}

fn ca_data(pem: &str) -> String {
    use base64::Engine as _;
    format!(
        "    certificate-authority-data: {}\n",
        base64::engine::general_purpose::STANDARD.encode(pem)
    )
}

#[test]
fn https_api_server_verified_with_the_kubeconfig_ca() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let (ca, chain, key) = mint_certs();
    let api = tls_api_server(&chain, &key);
    write_tls_kubeconfig(dir.path(), api.port, &ca_data(&ca));
    assert_eq!(
        ok(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV)))),
        PREV
    );
    let reqs = api.requests();
    assert_eq!(reqs.len(), 2);
    assert!(
        reqs.iter()
            .all(|r| r.header("Authorization") == Some("Bearer sa-token"))
    );
}

#[test]
fn https_api_server_with_a_foreign_ca_is_refused() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let (_, chain, key) = mint_certs();
    let (other_ca, _, _) = mint_certs();
    let api = tls_api_server(&chain, &key);
    write_tls_kubeconfig(dir.path(), api.port, &ca_data(&other_ca));
    let e = error_of(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    let msg = e["msg"].as_str().unwrap();
    assert!(
        msg.contains("UnknownIssuer") || msg.contains("certificate"),
        "{msg}"
    );
    assert!(
        api.requests().is_empty(),
        "no request may cross an unverified connection"
    );
}

#[test]
fn https_api_server_with_insecure_skip_tls_verify() {
    dataplane::enter_test_group!();
    let dir = tempfile::tempdir().unwrap();
    let (_, chain, key) = mint_certs();
    let api = tls_api_server(&chain, &key);
    write_tls_kubeconfig(dir.path(), api.port, "    insecure-skip-tls-verify: true\n");
    ok(&add(POD_ARGS, &conf(dir.path(), true, Some(PREV))));
    assert_eq!(api.requests().len(), 2);
}

// Hostile or broken callers: a huge or deeply nested network config on stdin is a CNI decoding
// error (code 6) after bounded work.

#[test]
fn huge_stdin_is_refused_without_reading_it_all() {
    dataplane::enter_test_group!();
    // 64 MiB of valid JSON: only the size can make it fail.
    let filler = "a".repeat(64 << 20);
    let stdin = format!(r#"{{"cniVersion":"1.0.0","name":"n","type":"istio-cni","x":"{filler}"}}"#);
    let e = error_of(&add(POD_ARGS, &stdin));
    assert_eq!(e["code"], 6, "{e}");
    assert!(
        e["msg"].as_str().unwrap().contains("larger than 4 MiB"),
        "{e}"
    );
}

#[test]
fn deeply_nested_stdin_is_a_decoding_error_not_a_stack_overflow() {
    dataplane::enter_test_group!();
    let depth = 10_000;
    for (open, close) in [("[", "]"), (r#"{"a":"#, "}")] {
        let stdin = format!(
            r#"{{"cniVersion":"1.0.0","name":"n","type":"istio-cni","x":{}{}}}"#,
            open.repeat(depth),
            close.repeat(depth)
        );
        let e = error_of(&add(POD_ARGS, &stdin));
        assert_eq!(e["code"], 6, "{e}");
        assert!(
            e["msg"].as_str().unwrap().contains("recursion limit"),
            "{e}"
        );
    }
}
