//! Sidecar mode from a Pod object through detection to rules: the nftables rendering against our
//! goldens (`tests/golden/sidecar/nft`), and detection and annotation checks. The iptables
//! rendering is checked against Istio's own goldens, read from the pinned module, by
//! `istio_conformance_sidecar.rs`; the goldens here are the reference, never regenerated from
//! our output.

use std::path::PathBuf;

use cni_core::redirect::sidecar::{self, Detection, SidecarConfig, SidecarError};
use serde_json::{Value, json};

fn golden(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/sidecar")
        .join(format!("{name}.golden"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An injected pod as the injector leaves it: status annotation, istio-proxy with `proxy sidecar`.
fn pod(annotations: Value, env: Value, security: Value) -> Value {
    let mut ann = json!({"sidecar.istio.io/status": "{\"containers\":[\"istio-proxy\"]}"});
    ann.as_object_mut()
        .unwrap()
        .extend(annotations.as_object().unwrap().clone());
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "default", "annotations": ann},
        "spec": {
            "initContainers": [{"name": "istio-validation"}],
            "containers": [
                {"name": "app"},
                {"name": "istio-proxy", "args": ["proxy", "sidecar", "--domain", "x"],
                 "env": env, "securityContext": security},
            ]
        }
    })
}

fn config(p: &Value) -> SidecarConfig {
    match sidecar::detect(p, false).unwrap() {
        Detection::Sidecar(cfg) => *cfg,
        Detection::Skip(why) => panic!("skipped: {why}"),
    }
}

/// Our nftables golden for the pod (derived from Istio's `tools/istio-nftables` goldens; the model
/// spells `{ 53, 15008 }` as two comparisons, host prefixes without `/32`, and resolves
/// `insert … index` into final order). The same pods' iptables rules are Istio's plugin goldens.
fn check(name: &str, p: Value) {
    check_config(name, config(&p));
}

fn check_config(name: &str, cfg: SidecarConfig) {
    let nft = sidecar::nft::ruleset(&cfg).render();
    assert_eq!(nft, golden(&format!("nft/{name}")), "nft/{name}");
}

#[test]
fn basic() {
    check("basic", pod(json!({}), json!([]), json!({})));
}

#[test]
fn include_exclude_ip() {
    check(
        "include-exclude-ip",
        pod(
            json!({
                "traffic.sidecar.istio.io/includeOutboundIPRanges": "127.0.0.0/8",
                "traffic.sidecar.istio.io/excludeOutboundIPRanges": "10.0.0.0/8",
            }),
            json!([]),
            json!({}),
        ),
    );
}

#[test]
fn include_exclude_ports() {
    check(
        "include-exclude-ports",
        pod(
            json!({
                "traffic.sidecar.istio.io/includeInboundPorts": "1111,2222",
                "traffic.sidecar.istio.io/excludeOutboundPorts": "5555,6666",
            }),
            json!([]),
            json!({}),
        ),
    );
}

#[test]
fn tproxy() {
    check(
        "tproxy",
        pod(
            json!({"sidecar.istio.io/interceptionMode": "TPROXY"}),
            json!([]),
            json!({}),
        ),
    );
}

#[test]
fn dns() {
    check(
        "dns",
        pod(
            json!({}),
            json!([{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}]),
            json!({}),
        ),
    );
}

#[test]
fn invalid_drop() {
    check(
        "invalid-drop",
        pod(
            json!({}),
            json!([{"name": "INVALID_DROP", "value": "true"}]),
            json!({}),
        ),
    );
}

#[test]
fn custom_uid() {
    check(
        "custom-uid",
        pod(
            json!({}),
            json!([]),
            json!({"runAsUser": 1000670000u32, "runAsGroup": 1000670001u32}),
        ),
    );
}

#[test]
fn custom_uid_zero() {
    check(
        "custom-uid-zero",
        pod(
            json!({}),
            json!([]),
            json!({"runAsUser": 0, "runAsGroup": 0}),
        ),
    );
}

#[test]
fn custom_uid_tproxy() {
    check(
        "custom-uid-tproxy",
        pod(
            json!({"sidecar.istio.io/interceptionMode": "TPROXY"}),
            json!([]),
            json!({"runAsUser": 1000670000u32, "runAsGroup": 1000670001u32}),
        ),
    );
}

/// Every bad value fails with the annotation's name in the message.
#[test]
fn bad_values_name_the_annotation() {
    let cases = [
        ("sidecar.istio.io/interceptionMode", "NAT"),
        (
            "traffic.sidecar.istio.io/includeOutboundIPRanges",
            "10.0.0.0/33",
        ),
        (
            "traffic.sidecar.istio.io/includeOutboundIPRanges",
            "10.0.0.1",
        ),
        ("traffic.sidecar.istio.io/excludeOutboundIPRanges", "*"),
        (
            "traffic.sidecar.istio.io/excludeOutboundIPRanges",
            "10.0.0.0/8,nope",
        ),
        ("traffic.sidecar.istio.io/includeInboundPorts", "80,http"),
        ("traffic.sidecar.istio.io/includeInboundPorts", "65536"),
        ("traffic.sidecar.istio.io/excludeInboundPorts", "0"),
        ("traffic.sidecar.istio.io/includeOutboundPorts", "-1"),
        ("traffic.sidecar.istio.io/excludeOutboundPorts", "22 23"),
        (
            "traffic.sidecar.istio.io/excludeInterfaces",
            "eth0 -j ACCEPT",
        ),
        (
            "traffic.sidecar.istio.io/excludeInterfaces",
            "averyveryverylongname",
        ),
        ("istio.io/reroute-virtual-interfaces", "-j"),
        ("traffic.sidecar.istio.io/kubevirtInterfaces", "net1;rm"),
    ];
    for (key, value) in cases {
        let p = pod(json!({ key: value }), json!([]), json!({}));
        let err = sidecar::detect(&p, false).expect_err(&format!("{key}={value:?} accepted"));
        match &err {
            SidecarError::BadAnnotation { annotation, .. } => assert_eq!(*annotation, key),
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains(key), "{err}");
    }
}

#[test]
fn good_values_are_parsed() {
    let p = pod(
        json!({
            "traffic.sidecar.istio.io/excludeInboundPorts": "22, 15021,8080",
            "traffic.sidecar.istio.io/includeOutboundIPRanges": "10.0.0.0/8,fd00::/8",
            "traffic.sidecar.istio.io/excludeInterfaces": "eth1,net2",
            "traffic.sidecar.istio.io/kubevirtInterfaces": "old0",
            "istio.io/reroute-virtual-interfaces": "new0",
        }),
        json!([{"name": "ISTIO_DUAL_STACK", "value": "1"}, {"name": "INVALID_DROP", "value": "maybe"}]),
        json!({"runAsUser": 1001}),
    );
    let cfg = config(&p);
    // Istio appends its own listener ports and drops repeats, keeping the first position.
    assert_eq!(cfg.exclude_inbound_ports, [22, 15021, 8080, 15020, 15090]);
    assert_eq!(
        cfg.reroute_virtual_interfaces
            .iter()
            .map(|i| i.as_str())
            .collect::<Vec<_>>(),
        ["new0"]
    );
    assert_eq!(cfg.exclude_interfaces.len(), 2);
    assert_eq!((cfg.proxy_uid, cfg.proxy_gid), (1001, 1337));
    assert!(cfg.dual_stack);
    assert!(!cfg.drop_invalid, "unparsable env keeps the default");
    // The IPv6 range only appears in the IPv6 rules.
    let v4 = sidecar::iptables::rules(&cfg, cni_core::redirect::iptables::Family::V4);
    assert!(v4.iter().all(|r| !r.args.contains("fd00::/8")));
    let v6 = sidecar::iptables::rules(&cfg, cni_core::redirect::iptables::Family::V6);
    assert!(v6.iter().any(|r| r.args == "-d fd00::/8 -j ISTIO_REDIRECT"));
    assert!(v6.iter().any(|r| r.args == "-o lo -s ::6/128 -j RETURN"));
}

fn skipped(p: &Value) -> String {
    match sidecar::detect(p, false).unwrap() {
        Detection::Skip(why) => why,
        Detection::Sidecar(_) => panic!("detected as sidecar: {p}"),
    }
}

#[test]
fn detection_skips() {
    let base = || pod(json!({}), json!([]), json!({}));

    let mut p = base();
    p["spec"]["initContainers"] = json!([{"name": "istio-init"}]);
    assert!(skipped(&p).contains("istio-init"));

    let mut p = base();
    p["spec"]["containers"][1]["env"] = json!([{"name": "DISABLE_ENVOY", "value": "true"}]);
    assert!(skipped(&p).contains("DISABLE_ENVOY"));

    let mut p = base();
    p["spec"]["containers"][1]["args"] = json!(["proxy", "router"]);
    assert!(skipped(&p).contains("router"));

    let mut p = base();
    p["spec"]["containers"] = json!([{"name": "app"}]);
    assert!(skipped(&p).contains("istio-proxy"));

    let mut p = base();
    p["metadata"]["annotations"] = json!({});
    assert!(skipped(&p).contains("status"));

    let mut p = base();
    p["metadata"]["annotations"]["sidecar.istio.io/inject"] = json!("false");
    assert!(skipped(&p).contains("disabled"));

    // The label wins over the annotation, even when it does not parse (then neither applies).
    let mut p = base();
    p["metadata"]["annotations"]["sidecar.istio.io/inject"] = json!("false");
    p["metadata"]["labels"] = json!({"sidecar.istio.io/inject": "yes-please"});
    assert!(matches!(
        sidecar::detect(&p, false),
        Ok(Detection::Sidecar(_))
    ));

    let mut p = base();
    p["metadata"]["annotations"]["sidecar.istio.io/inject"] = json!("true");
    p["metadata"]["labels"] = json!({"sidecar.istio.io/inject": "F"});
    assert!(skipped(&p).contains("disabled"));

    // A native sidecar (istio-proxy as an init container) is a sidecar pod.
    let mut p = base();
    let proxy = p["spec"]["containers"][1].clone();
    p["spec"]["containers"] = json!([{"name": "app"}]);
    p["spec"]["initContainers"] = json!([proxy]);
    assert!(matches!(
        sidecar::detect(&p, false),
        Ok(Detection::Sidecar(_))
    ));

    assert!(sidecar::detect(&json!("pod"), false).is_err());
}

/// Istio's env-only outbound settings: `ISTIO_OUTBOUND_OWNER_GROUPS` (only these groups'
/// traffic is captured: one rule of `! --gid-owner` matches), `_EXCLUDE` (with the default `*`:
/// a RETURN per group), both placed after the proxy's own owner rules as `istio-iptables` does;
/// group names resolve on the node. The istio-proxy env wins over the plugin's environment.
#[test]
fn outbound_owner_groups_from_proxy_env_or_plugin_env() {
    let groups = |name: &str| match name {
        "java" => Some(1001),
        "ftp" => Some(21),
        _ => None,
    };
    let detect = |p: &Value, process: &[(&str, &str)]| {
        let process: std::collections::HashMap<String, String> = process
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let host = sidecar::SidecarEnv {
            fallback: &|k| process.get(k).cloned(),
            group_id: &groups,
        };
        match sidecar::detect_with(p, false, &host) {
            Ok(Detection::Sidecar(cfg)) => Ok(*cfg),
            Ok(Detection::Skip(why)) => panic!("skipped: {why}"),
            Err(e) => Err(e),
        }
    };
    let env = |k: &str, v: &str| json!([{"name": k, "value": v}]);
    check_config(
        "owner-groups",
        detect(
            &pod(
                json!({}),
                env("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202"),
                json!({}),
            ),
            &[],
        )
        .unwrap(),
    );
    check_config(
        "owner-groups-exclude",
        detect(
            &pod(json!({}), json!([]), json!({})),
            &[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "888,ftp")],
        )
        .unwrap(),
    );
    // The pod's own setting wins over the plugin's environment.
    let cfg = detect(
        &pod(
            json!({}),
            env("ISTIO_OUTBOUND_OWNER_GROUPS", "*"),
            json!({}),
        ),
        &[("ISTIO_OUTBOUND_OWNER_GROUPS", "java")],
    )
    .unwrap();
    assert_eq!(cfg, config(&pod(json!({}), json!([]), json!({}))));

    let err = detect(
        &pod(
            json!({}),
            env("ISTIO_OUTBOUND_OWNER_GROUPS", "nosuchgroup"),
            json!({}),
        ),
        &[],
    )
    .unwrap_err();
    assert!(
        matches!(
            &err,
            SidecarError::BadEnv {
                name: "ISTIO_OUTBOUND_OWNER_GROUPS",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("nosuchgroup"), "{err}");
    let many: Vec<String> = (0..65).map(|g| g.to_string()).collect();
    let err = detect(
        &pod(
            json!({}),
            env("ISTIO_OUTBOUND_OWNER_GROUPS", &many.join(",")),
            json!({}),
        ),
        &[],
    )
    .unwrap_err();
    assert!(err.to_string().contains("at most 64"), "{err}");
}

/// `ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR` replaces 127.0.0.1/32 in every loopback match, as in
/// Istio's `host-ipv4-loopback-cidr` golden; only IPv4 loopback prefixes of /8../32 are valid.
#[test]
fn ipv4_loopback_cidr() {
    let env = |v: &str| json!([{"name": "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "value": v}]);
    check(
        "loopback-cidr",
        pod(json!({}), env("127.0.0.1/8"), json!({})),
    );
    for bad in ["10.0.0.0/8", "127.0.0.1/7", "::1/128", "loopback"] {
        let err = sidecar::detect(&pod(json!({}), env(bad), json!({})), false).unwrap_err();
        assert!(
            matches!(
                &err,
                SidecarError::BadEnv {
                    name: "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR",
                    ..
                }
            ),
            "{bad}: {err}"
        );
    }
}
