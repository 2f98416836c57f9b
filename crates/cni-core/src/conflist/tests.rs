//! Our own guarantees for conflist editing: byte preservation Istio does not give, libcni's
//! validity rules, refusals. Istio's installer vectors themselves (chaining into bridge.conf and
//! list.conflist, replacing an old entry, the standalone file, cleanup) are compared with the
//! pinned Istio's goldens by `tests/istio_conformance_install.rs`.

use super::*;
use serde_json::json;

const BRIDGE_CONF: &str = r#"{
  "cniVersion": "0.4.0",
  "name": "dbnet",
  "type": "bridge",
  "bridge": "cni0",
  "keyA": ["some more", "plugin specific", "configuration"],
  "ipam": {
    "type": "host-local",
    "subnet": "10.1.0.0/16",
    "gateway": "10.1.0.1"
  },
  "dns": {
    "nameservers": ["10.1.0.1"]
  }
}
"#;

const LIST_CONFLIST: &str = r#"{
  "cniVersion": "0.4.0",
  "name": "dbnet",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "args": {
        "labels": {
          "appVersion": "1.0"
        }
      },
      "ipam": {
        "type": "host-local",
        "subnet": "10.1.0.0/16",
        "gateway": "10.1.0.1"
      },
      "dns": {
        "nameservers": ["10.1.0.1"]
      }
    },
    {
      "type": "tuning",
      "sysctl": {
        "net.core.somaxconn": "500"
      }
    }
  ]
}
"#;

const LIST_WITH_ISTIO: &str = r#"{
  "cniVersion": "0.4.0",
  "name": "dbnet",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "args": {
        "labels": {
          "appVersion": "1.0"
        }
      },
      "ipam": {
        "type": "host-local",
        "subnet": "10.1.0.0/16",
        "gateway": "10.1.0.1"
      },
      "dns": {
        "nameservers": ["10.1.0.1"]
      }
    },
    {
      "type": "istio-cni",
      "plugin_log_level": "info",
      "kubernetes": {
        "kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig",
        "cni_bin_dir": "/opt/cni/bin",
        "exclude_namespaces": ["istio-system"]
      }
    },
    {
      "type": "tuning",
      "sysctl": {
        "net.core.somaxconn": "500"
      }
    }
  ]
}
"#;

fn entry() -> IstioEntry {
    IstioEntry {
        plugin_log_level: "debug".into(),
        cni_agent_run_dir: "/path/to/kubeconfig".into(),
        ambient_enabled: false,
        enablement_selectors: json!([]),
        exclude_namespaces: None,
        pod_namespace: "my-namespace".into(),
        native_nftables: false,
        enable_ambient_detection_retry: false,
    }
}

fn parse(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("output is not JSON ({e}):\n{s}"))
}

#[test]
fn standalone_entry_with_exclusions_and_selectors() {
    let mut e = entry();
    e.exclude_namespaces = Some(vec!["kube-system".into(), "istio-system".into()]);
    e.enablement_selectors = json!([{"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}, "namespaceSelector": {}}]);
    let v = parse(&e.standalone_file());
    assert_eq!(
        v["exclude_namespaces"],
        json!(["kube-system", "istio-system"])
    );
    assert_eq!(
        v["enablement_selectors"][0]["podSelector"]["matchLabels"]["istio.io/dataplane-mode"],
        "ambient"
    );
}

#[test]
fn insert_rejects_documents_without_a_plugin_list() {
    assert!(matches!(
        insert_entry(b"{}", &entry()),
        Err(ConfError::NoPluginList)
    ));
    assert!(matches!(
        insert_entry(b"[]", &entry()),
        Err(ConfError::NotAnObject)
    ));
    assert!(matches!(
        insert_entry(br#"{"name":"x","plugins":{}}"#, &entry()),
        Err(ConfError::NoPluginList)
    ));
    let err = insert_entry(br#"{"name":"x","plugins":[1]}"#, &entry()).unwrap_err();
    assert!(err.to_string().contains("plugin 0"), "{err}");
    let err = insert_entry(b"{\"name\": \"x\", \"plugins\": [", &entry()).unwrap_err();
    assert!(matches!(err, ConfError::Json(_)), "{err}");
}

#[test]
fn wrapped_conf_keeps_its_bytes_apart_from_cni_version_and_indentation() {
    let conf = r#"{"type":"bridge","cniVersion":"0.4.0","mtu":1.50,"big":123456789012345678901234567890,"z":"<&>","a":1}"#;
    let out = insert_entry(conf.as_bytes(), &entry()).unwrap();
    assert!(
        out.contains(
            r#"{"type":"bridge","mtu":1.50,"big":123456789012345678901234567890,"z":"<&>","a":1}"#
        ),
        "{out}"
    );
    // cniVersion first, in the middle, last, and the only member.
    for (conf, left) in [
        (r#"{"cniVersion":"1","type":"b"}"#, r#"{"type":"b"}"#),
        (
            r#"{ "a": 1, "cniVersion" : "1" , "type":"b"}"#,
            r#"{ "a": 1 , "type":"b"}"#,
        ),
        (r#"{"type":"b", "cniVersion":"1"}"#, r#"{"type":"b"}"#),
        (
            r#"{"type":"b","cniVersion":"1","cniVersion":"2"}"#,
            r#"{"type":"b"}"#,
        ),
    ] {
        let out = insert_entry(conf.as_bytes(), &entry()).unwrap();
        assert!(out.contains(left), "{conf} -> {out}");
    }
}

#[test]
fn old_istio_entry_is_replaced() {
    let out = insert_entry(LIST_WITH_ISTIO.as_bytes(), &entry()).unwrap();
    let from_clean = insert_entry(LIST_CONFLIST.as_bytes(), &entry()).unwrap();
    assert_eq!(parse(&out), parse(&from_clean));
    // And byte-identical too: the old entry's separator went with it.
    assert_eq!(out, from_clean);
}

#[test]
fn everything_outside_the_plugins_array_is_preserved() {
    let doc = "{\n\t\"name\": \"calico\",\n\t\"zeta\": 18446744073709551616000,\n\t\"ratio\": 0.10,\n\t\"html\": \"<a&b>\",\n\t\"cniVersion\": \"0.3.1\",\n\t\"plugins\": [\n\t\t{\"type\": \"calico\", \"etcd_port\": 123456789012345678901}\n\t],\n\t\"trailing\": {\"k\": [1, 2]}\n}  \n";
    let out = insert_entry(doc.as_bytes(), &entry()).unwrap();
    let array_start = doc.find("[\n").unwrap();
    let element_end = doc.find("}\n\t]").unwrap() + 1;
    assert_eq!(&out[..element_end], &doc[..element_end]);
    assert!(
        out.ends_with("\n\t],\n\t\"trailing\": {\"k\": [1, 2]}\n}  \n"),
        "{out}"
    );
    assert!(
        out[array_start..].contains("\n\t\t{\n\t\t  \"name\": \"istio-cni\""),
        "{out}"
    );
    // Removing it again restores the original bytes exactly.
    assert_eq!(remove_entry(out.as_bytes()).unwrap().unwrap(), doc);
}

#[test]
fn compact_documents_stay_compact() {
    let doc = r#"{"name":"n","plugins":[{"type":"a"}, {"type":"b"}]}"#;
    let out = insert_entry(doc.as_bytes(), &entry()).unwrap();
    assert!(!out.contains('\n'), "{out}");
    assert!(
        out.starts_with(
            r#"{"name":"n","plugins":[{"type":"a"}, {"type":"b"}, {"name":"istio-cni","#
        )
    );
    assert_eq!(remove_entry(out.as_bytes()).unwrap().unwrap(), doc);
}

#[test]
fn empty_plugin_array_gets_an_indented_entry() {
    let doc = "{\n  \"name\": \"n\",\n  \"plugins\": []\n}\n";
    let out = insert_entry(doc.as_bytes(), &entry()).unwrap();
    assert!(out.starts_with(
        "{\n  \"name\": \"n\",\n  \"plugins\": [\n    {\n      \"name\": \"istio-cni\""
    ));
    assert!(out.ends_with("\n    }\n  ]\n}\n"), "{out}");
    assert_eq!(parse(&out)["plugins"], json!([entry().chained_value()]));
}

#[test]
fn remove_takes_out_the_first_istio_entry_wherever_it_is() {
    for (doc, want) in [
        (r#"{"plugins":[{"type":"istio-cni"}]}"#, r#"{"plugins":[]}"#),
        (
            r#"{"plugins":[{"type":"istio-cni"}, {"type":"a"}]}"#,
            r#"{"plugins":[{"type":"a"}]}"#,
        ),
        (
            r#"{"plugins":[{"type":"a"} , {"type":"istio-cni"}]}"#,
            r#"{"plugins":[{"type":"a"}]}"#,
        ),
        (
            r#"{"plugins":[{"type":"a"},{"type":"istio-cni","n":1},{"type":"istio-cni","n":2}]}"#,
            r#"{"plugins":[{"type":"a"},{"type":"istio-cni","n":2}]}"#,
        ),
    ] {
        assert_eq!(
            remove_entry(doc.as_bytes()).unwrap().as_deref(),
            Some(want),
            "{doc}"
        );
    }
    assert_eq!(remove_entry(LIST_CONFLIST.as_bytes()).unwrap(), None);
    assert_eq!(remove_entry(BRIDGE_CONF.as_bytes()).unwrap(), None);
    assert!(remove_entry(b"not json").is_err());
}

#[test]
fn list_validity_follows_libcni() {
    let ok = parse_list(LIST_CONFLIST.as_bytes()).unwrap();
    assert_eq!(ok.name, "dbnet");
    assert_eq!(ok.inline_plugins, 2);
    assert!(!ok.load_only_inlined);

    let no_name = br#"{"cniVersion":"0.3.1","plugins":[{"type":"calico"}]}"#;
    assert!(matches!(parse_list(no_name), Err(ConfError::NoName)));
    let bad_version = br#"{"name":"k","cniVersion":3,"plugins":[{"type":"calico"}]}"#;
    let err = parse_list(bad_version).unwrap_err();
    assert!(err.to_string().contains("cniVersion"), "{err}");
    let typo = br#"{"name":"k","cniVersion":"0.3.1","pugins":[{"type":"calico"}]}"#;
    assert_eq!(parse_list(typo).unwrap().inline_plugins, 0);
    let empty_type = br#"{"name":"k","plugins":[{"type":"calico"},{"type":""}]}"#;
    let err = parse_list(empty_type).unwrap_err();
    assert_eq!(err.to_string(), "plugin 1: missing 'type'");
    assert!(matches!(
        parse_list(br#"{"name":"k","plugins":[]}"#),
        Err(ConfError::EmptyPlugins)
    ));
    assert!(matches!(parse_list(b"[]"), Err(ConfError::NotAnObject)));
    assert!(matches!(parse_list(b"{not json"), Err(ConfError::Json(_))));
    assert!(matches!(
        parse_list(br#"{"name":"k","loadOnlyInlinedPlugins":true}"#),
        Err(ConfError::InlinedWithoutPlugins)
    ));
    let stringly = br#"{"name":"k","disableCheck":"TRUE","plugins":[{"type":"a"}]}"#;
    assert!(parse_list(stringly).is_ok());
    let bad_bool = br#"{"name":"k","disableCheck":"yes","plugins":[{"type":"a"}]}"#;
    assert!(parse_list(bad_bool).is_err());
    let bad_ipam = br#"{"name":"k","plugins":[{"type":"a","ipam":"host-local"}]}"#;
    assert!(parse_list(bad_ipam).is_err());
}

#[test]
fn single_validity_follows_libcni() {
    parse_single(BRIDGE_CONF.as_bytes()).unwrap();
    parse_single(br#"{"type":"bridge"}"#).unwrap();
    assert!(matches!(
        parse_single(br#"{"name":"x"}"#),
        Err(ConfError::MissingType)
    ));
    assert!(matches!(parse_single(b""), Err(ConfError::Json(_))));
    assert!(matches!(
        parse_single(br#"{"type":5}"#),
        Err(ConfError::FieldType { .. })
    ));
}

#[test]
fn contents_report_types_and_our_entry() {
    let out = insert_entry(LIST_CONFLIST.as_bytes(), &entry()).unwrap();
    let c = list_contents(out.as_bytes()).unwrap();
    assert_eq!(c.types, ["bridge", "tuning", "istio-cni"]);
    assert_eq!(c.istio_entry, Some(entry().chained_value()));
    assert!(list_contents(br#"{"plugins":[{"type":1}]}"#).is_err());
    assert_eq!(
        single_type(entry().standalone_file().as_bytes())
            .unwrap()
            .as_deref(),
        Some("istio-cni")
    );
}

#[test]
fn plugins_range_is_the_array_edits_touch() {
    let range = plugins_range(LIST_CONFLIST.as_bytes()).unwrap().unwrap();
    let array = &LIST_CONFLIST[range.clone()];
    assert!(array.starts_with('[') && array.ends_with(']'), "{array}");
    let edited = insert_entry(LIST_CONFLIST.as_bytes(), &entry()).unwrap();
    let tail = LIST_CONFLIST.len() - range.end;
    assert_eq!(&edited[..range.start], &LIST_CONFLIST[..range.start]);
    assert_eq!(&edited[edited.len() - tail..], &LIST_CONFLIST[range.end..]);

    // A repeated key: the runtime reads the last one, and so do the edits.
    let twice = r#"{"name":"n","plugins":[{"type":"a"}],"plugins":[{"type":"b"}]}"#;
    let range = plugins_range(twice.as_bytes()).unwrap().unwrap();
    assert_eq!(&twice[range], r#"[{"type":"b"}]"#);
    assert_eq!(
        plugins_range(br#"{"name":"n","plugins":{}}"#).unwrap(),
        None
    );
    assert_eq!(plugins_range(BRIDGE_CONF.as_bytes()).unwrap(), None);
    assert!(plugins_range(b"[1]").is_err());
}

/// `conflist_edit` fuzzer finding: the edit kept the broken plugin and wrote a list the runtime
/// rejects. Invalid documents are refused instead.
#[test]
fn invalid_documents_are_refused_not_edited() {
    let found = include_bytes!("fuzz/plugin_without_type.conflist");
    assert!(matches!(
        insert_entry(found, &entry()),
        Err(ConfError::Plugin { index: 0, .. })
    ));
    assert!(matches!(
        insert_entry(br#"{"name":"n","type":"","cniVersion":1}"#, &entry()),
        Err(ConfError::Plugin { index: 0, .. })
    ));
    assert!(matches!(
        insert_entry(br#"{"name":"n","disableCheck":7,"plugins":[]}"#, &entry()),
        Err(ConfError::FieldType {
            key: "disableCheck",
            ..
        })
    ));
}
