//! The installer's text against the pinned Istio's installer test vectors
//! (`cni/pkg/install/testdata`, read from the Go module cache):
//! - conflist editing (`cniconfig_test.go` `TestInsertCNIConfig`, `TestCreateCNIConfigFile`;
//!   `install_test.go` `TestCleanup`): each of Istio's inputs goes through our chaining, with the
//!   istio-cni entry Istio's test feeds (`istio-cni.conf`), and the result must equal Istio's
//!   golden as JSON. Istio re-marshals the whole document (keys sorted, 2-space indent); we splice
//!   the text so that every byte outside the edited `plugins` array is kept, so formatting and
//!   key order may differ from Istio's bytes while the document is the same. Invalid inputs
//!   (`invalid-arr`, `invalid-map`) must be refused, and cleanup must not rewrite them.
//! - the plugin's kubeconfig (`kubeconfig_test.go`): our text for the same server, CA and token
//!   must equal Istio's golden as YAML.
//!
//! The files we write whole, the standalone entry and the kubeconfig, must also match Istio's
//! bytes: we claim its layout for them.
//!
//! Every file of the directory is used here or listed as not applicable under `installer:` in
//! `tools/istio/conformance-allowlist.yaml`; differences are listed there too (a `- ` / `+ `
//! line per JSON path that differs), and a listed difference that no longer occurs fails.

mod istio_module;

use std::collections::{BTreeMap, BTreeSet};

use cni_core::conflist::{self, IstioEntry};
use cni_core::kubeconfig::{self, ServerTrust};
use istio_module::{Allowed, NOT_APPLICABLE};
use serde_json::Value;

const DIR: &str = "cni/pkg/install/testdata";

fn read(name: &str) -> String {
    istio_module::read(&format!("{DIR}/{name}"))
}

/// The entry Istio's tests chain (`istio-cni.conf`) as our installer's settings. A key our
/// installer does not write fails: the comparison would then be meaningless.
fn istio_entry() -> IstioEntry {
    let v: Value = serde_json::from_str(&read("istio-cni.conf")).expect("istio-cni.conf is JSON");
    let obj = v.as_object().expect("istio-cni.conf is an object");
    const WRITTEN: [&str; 13] = [
        "cniVersion",
        "name",
        "type",
        "ipam",
        "dns",
        "plugin_log_level",
        "cni_agent_run_dir",
        "ambient_enabled",
        "enablement_selectors",
        "exclude_namespaces",
        "pod_namespace",
        "native_nftables",
        "enable_ambient_detection_retry",
    ];
    for key in obj.keys() {
        assert!(
            WRITTEN.contains(&key.as_str()),
            "Istio's entry has `{key}`, which our installer does not write"
        );
    }
    let s = |k: &str| {
        obj[k]
            .as_str()
            .unwrap_or_else(|| panic!("{k} is not a string"))
            .to_string()
    };
    let b = |k: &str| {
        obj[k]
            .as_bool()
            .unwrap_or_else(|| panic!("{k} is not a bool"))
    };
    IstioEntry {
        plugin_log_level: s("plugin_log_level"),
        cni_agent_run_dir: s("cni_agent_run_dir"),
        ambient_enabled: b("ambient_enabled"),
        enablement_selectors: obj["enablement_selectors"].clone(),
        exclude_namespaces: match &obj["exclude_namespaces"] {
            Value::Null => None,
            other => Some(serde_json::from_value(other.clone()).expect("a list of strings")),
        },
        pod_namespace: s("pod_namespace"),
        native_nftables: b("native_nftables"),
        enable_ambient_detection_retry: b("enable_ambient_detection_retry"),
    }
}

/// What a case does with Istio's files.
enum Op {
    /// Chain the entry into `input` (with `ambient_enabled` set for Istio's istio-owned cases,
    /// whose owned file is the primary plus the entry).
    Insert { input: &'static str, ambient: bool },
    /// The standalone file (Istio's standalone `TestCreateCNIConfigFile` cases).
    Standalone,
    /// Remove our entry again (Istio's `TestCleanup`, chained).
    Remove { input: &'static str },
    /// The plugin kubeconfig for this server.
    Kubeconfig { host: &'static str, skip_tls: bool },
}

struct Case {
    name: &'static str,
    op: Op,
    /// Istio's expected file, or `None` when Istio expects the input to be refused.
    golden: Option<&'static str>,
}

/// Istio's `k8sServiceHost` / `k8sServicePort` / `saToken` (`kubeconfig_test.go`).
const SERVICE_PORT: u16 = 443;
const SA_TOKEN: &str = "service_account_token_string";

/// Istio's other `TestInsertCNIConfig` case, an array as the *new* entry, cannot arise: our entry
/// is a typed struct.
fn cases() -> Vec<Case> {
    let insert = |input, ambient| Op::Insert { input, ambient };
    vec![
        Case {
            name: "insert/bridge.conf",
            op: insert("bridge.conf", false),
            golden: Some("bridge.conf.golden"),
        },
        Case {
            name: "insert/list.conflist",
            op: insert("list.conflist", false),
            golden: Some("list.conflist.golden"),
        },
        Case {
            name: "insert/list-with-istio.conflist",
            op: insert("list-with-istio.conflist", false),
            golden: Some("list-with-istio.conflist.golden"),
        },
        Case {
            name: "insert/invalid-map.conflist",
            op: insert("invalid-map.conflist", false),
            golden: None,
        },
        Case {
            name: "insert/invalid-arr.conflist",
            op: insert("invalid-arr.conflist", false),
            golden: None,
        },
        Case {
            name: "istio-owned/bridge.conf",
            op: insert("bridge.conf", true),
            golden: Some("istio-owned-bridge.conflist.golden"),
        },
        Case {
            name: "istio-owned/list.conflist",
            op: insert("list.conflist", true),
            golden: Some("istio-owned.conflist.golden"),
        },
        Case {
            name: "standalone",
            op: Op::Standalone,
            golden: Some("istio-cni.conf"),
        },
        Case {
            name: "cleanup/list-with-istio.conflist",
            op: Op::Remove {
                input: "list-with-istio.conflist",
            },
            golden: Some("list-no-istio.conflist"),
        },
        Case {
            name: "kubeconfig/tls",
            op: Op::Kubeconfig {
                host: "10.96.0.1",
                skip_tls: false,
            },
            golden: Some("kubeconfig-tls"),
        },
        Case {
            name: "kubeconfig/skip-tls",
            op: Op::Kubeconfig {
                host: "10.96.0.1",
                skip_tls: true,
            },
            golden: Some("kubeconfig-skip-tls"),
        },
        Case {
            name: "kubeconfig/newhost",
            op: Op::Kubeconfig {
                host: "50.76.2.1",
                skip_tls: false,
            },
            golden: Some("kubeconfig-newhost"),
        },
    ]
}

impl Case {
    /// Istio's files this case reads.
    fn files(&self) -> Vec<&'static str> {
        let mut files: Vec<&'static str> = self.golden.into_iter().collect();
        match self.op {
            Op::Insert { input, .. } => files.extend([input, "istio-cni.conf"]),
            Op::Standalone => files.push("istio-cni.conf"),
            Op::Remove { input } => files.push(input),
            Op::Kubeconfig { skip_tls, .. } => {
                if !skip_tls {
                    files.push("kube-ca.crt");
                }
            }
        }
        files
    }

    /// Our output (`Ok(None)`: we refused the input or left it as it was).
    fn ours(&self) -> Result<Option<String>, String> {
        match self.op {
            Op::Insert { input, ambient } => {
                let mut entry = istio_entry();
                entry.ambient_enabled = ambient;
                let before = read(input);
                match conflist::insert_entry(before.as_bytes(), &entry) {
                    Ok(text) => {
                        conflist::parse_list(text.as_bytes())
                            .map_err(|e| format!("we wrote a list the runtime refuses: {e}"))?;
                        Ok(Some(text))
                    }
                    Err(_) => {
                        // Refused: cleanup must not rewrite it either.
                        match conflist::remove_entry(before.as_bytes()) {
                            Ok(Some(edit)) => Err(format!(
                                "refused to chain, but cleanup rewrites it:\n{edit}"
                            )),
                            _ => Ok(None),
                        }
                    }
                }
            }
            Op::Standalone => Ok(Some(istio_entry().standalone_file())),
            Op::Remove { input } => conflist::remove_entry(read(input).as_bytes())
                .map_err(|e| format!("cleanup failed: {e}")),
            Op::Kubeconfig { host, skip_tls } => {
                let ca = istio_module::dir().join(DIR).join("kube-ca.crt");
                let ca = std::fs::read(&ca).unwrap_or_else(|e| panic!("{}: {e}", ca.display()));
                let trust = if skip_tls {
                    ServerTrust::SkipVerify
                } else {
                    ServerTrust::CaData(&ca)
                };
                let server = kubeconfig::server_url("https", host, SERVICE_PORT);
                Ok(Some(kubeconfig::render(&server, trust, SA_TOKEN)))
            }
        }
    }

    fn parse(&self, text: &str) -> Result<Value, String> {
        match self.op {
            Op::Kubeconfig { .. } => serde_yaml::from_str(text).map_err(|e| e.to_string()),
            _ => serde_json::from_str(text).map_err(|e| e.to_string()),
        }
    }
}

/// `- path: istio` / `+ path: ours` for every leaf that differs, in path order.
fn json_diff(istio: &Value, ours: &Value) -> String {
    fn walk(path: &str, a: Option<&Value>, b: Option<&Value>, out: &mut String) {
        match (a, b) {
            (Some(Value::Object(x)), Some(Value::Object(y))) => {
                let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    walk(&format!("{path}.{k}"), x.get(k), y.get(k), out);
                }
            }
            (Some(Value::Array(x)), Some(Value::Array(y))) => {
                for i in 0..x.len().max(y.len()) {
                    walk(&format!("{path}[{i}]"), x.get(i), y.get(i), out);
                }
            }
            (a, b) if a == b => {}
            (a, b) => {
                if let Some(a) = a {
                    out.push_str(&format!("- {path}: {a}\n"));
                }
                if let Some(b) = b {
                    out.push_str(&format!("+ {path}: {b}\n"));
                }
            }
        }
    }
    let mut out = String::new();
    walk("$", Some(istio), Some(ours), &mut out);
    out
}

fn allowlist() -> BTreeMap<String, Allowed> {
    istio_module::allowlist("installer")
        .into_iter()
        .map(|a| (a.case.clone(), a))
        .collect()
}

#[test]
fn every_istio_installer_test_file_is_used_or_not_applicable() {
    let mut used: BTreeSet<&str> = BTreeSet::new();
    for case in cases() {
        used.extend(case.files());
    }
    let allowed = allowlist();
    let not_applicable: BTreeSet<&str> = allowed
        .values()
        .filter(|a| a.difference == NOT_APPLICABLE)
        .map(|a| a.case.as_str())
        .collect();
    let on_disk = istio_module::files(DIR);
    let mut problems = Vec::new();
    for f in &on_disk {
        if !used.contains(f.as_str()) && !not_applicable.contains(f.as_str()) {
            problems.push(format!(
                "{DIR}/{f}: new Istio test file; use it in a case here, or list it under \
                 installer: as not applicable, with why"
            ));
        }
    }
    for f in used.iter().chain(&not_applicable) {
        if !on_disk.iter().any(|d| d == f) {
            problems.push(format!("{DIR}/{f}: no longer in the pinned Istio"));
        }
        if used.contains(f) && not_applicable.contains(f) {
            problems.push(format!("{f}: used here, but listed as not applicable"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn installer_text_matches_istio_for_every_case() {
    let allowed = allowlist();
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for case in cases() {
        assert!(seen.insert(case.name), "{} listed twice", case.name);
        let diff = match (case.ours(), case.golden) {
            (Err(e), _) => {
                problems.push(format!("{}: {e}", case.name));
                continue;
            }
            (Ok(None), None) => String::new(),
            (Ok(Some(text)), None) => format!("+ accepted what Istio refuses:\n{text}"),
            (Ok(None), Some(golden)) => format!("- refused what Istio writes as {golden}\n"),
            (Ok(Some(text)), Some(golden)) => {
                let istio = case
                    .parse(&read(golden))
                    .unwrap_or_else(|e| panic!("{golden}: {e}"));
                let diff = match case.parse(&text) {
                    Ok(ours) => json_diff(&istio, &ours),
                    Err(e) => format!("+ unparsable: {e}\n{text}"),
                };
                // Files we write whole (not by splicing) follow Istio's layout byte for byte.
                let whole = matches!(case.op, Op::Standalone | Op::Kubeconfig { .. });
                if diff.is_empty() && whole && text != read(golden) {
                    format!("~ same document, other bytes than {golden}:\n{text}")
                } else {
                    diff
                }
            }
        };
        match allowed.get(case.name) {
            Some(a) if a.difference == NOT_APPLICABLE => problems.push(format!(
                "{}: a case here, but listed as not applicable",
                case.name
            )),
            Some(_) if diff.is_empty() => problems.push(format!(
                "{}: stale allowlist entry, ours now matches Istio",
                case.name
            )),
            Some(a) if a.difference.trim_end() != diff.trim_end() => problems.push(format!(
                "{}: differs other than listed.\nlisted:\n{}\nnow:\n{diff}",
                case.name, a.difference
            )),
            Some(_) => {}
            None if !diff.is_empty() => problems.push(format!(
                "{}: differs from Istio (- Istio, + ours); fix it, or list the deliberate \
                 difference under installer:\n{diff}",
                case.name
            )),
            None => {}
        }
    }
    for a in allowed.values() {
        let file = a.difference == NOT_APPLICABLE;
        if !file && !seen.contains(a.case.as_str()) {
            problems.push(format!("{}: allowlisted, but no such case", a.case));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// The JSON diff names each differing leaf once per side, so a listed difference is exact.
#[test]
fn json_diff_names_each_leaf() {
    let a = serde_json::json!({"a": 1, "l": [1, {"x": true}], "gone": null});
    let b = serde_json::json!({"a": 2, "l": [1, {"x": true}, 3], "new": "n"});
    assert_eq!(
        json_diff(&a, &b),
        "- $.a: 1\n+ $.a: 2\n- $.gone: null\n+ $.l[2]: 3\n+ $.new: \"n\"\n"
    );
    assert_eq!(json_diff(&a, &a), "");
}
