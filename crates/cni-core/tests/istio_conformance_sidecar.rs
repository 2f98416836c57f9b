//! Sidecar rules against the pinned Istio's own goldens, read from the Go module cache:
//! - `tools/istio-iptables/pkg/capture/testdata/*.golden`, one per case of `TestIptables`
//!   (`capture/run_test.go`: each case is a change to a base config);
//! - `cni/pkg/plugin/testdata/*.txt.golden`, from `TestIPTablesRuleGeneration`
//!   (`plugin/plugin_dryrun_test.go`: each case is a pod's annotations, proxy env and IDs).
//!
//! Each case the CNI plugin can produce is rebuilt here as what the plugin sees (a Pod object,
//! the pod's address family, the plugin's environment) and goes through our detection and
//! renderer, as in production. A capture case that only `istio-iptables`' own flags can produce
//! (several proxy UIDs, DNS capture of resolv.conf servers only, ...) is listed as not applicable
//! in `tools/istio/conformance-allowlist.yaml` (`sidecar_rules:`) with the reason.
//!
//! Normalisation, and only this: lines that are exactly `iptables-save` or `ip6tables-save` are
//! dropped. They are the state reads Istio's dependency stub records around the restore (its own
//! plugin test drops them too); the rest is the `iptables-restore` input, v4 then v6, compared
//! line for line with ours.
//!
//! A difference is either fixed or listed in the allowlist, spelled as the exact line diff
//! (`- ` Istio only, `+ ` ours only), so any further drift in a listed case still fails. Every
//! golden must be mapped here or listed as not applicable (a new golden after a pin bump fails),
//! and a listed difference that no longer occurs fails as stale.

mod istio_module;

use std::collections::{BTreeMap, BTreeSet};

use cni_core::redirect::sidecar::{self, Detection, SidecarEnv};
use istio_module::{Allowed, NOT_APPLICABLE, OnlyIn};
use serde_json::{Value, json};

const CAPTURE_DIR: &str = "tools/istio-iptables/pkg/capture/testdata";
const PLUGIN_DIR: &str = "cni/pkg/plugin/testdata";

/// One Istio test case, as the CNI plugin would meet it.
struct Case {
    /// `capture/<case>` or `plugin/<case>`: Istio's test-case name.
    name: &'static str,
    /// Path of the golden inside the module.
    golden: String,
    annotations: Value,
    /// `istio-proxy` container env.
    proxy_env: Value,
    /// `istio-proxy` securityContext.
    security: Value,
    /// The pod has an IPv6 address (Istio's `EnableIPv6`, derived from the pod's address).
    ipv6: bool,
    /// The plugin process environment (Istio's `FillConfigFromEnvironment` reads it there).
    plugin_env: &'static [(&'static str, &'static str)],
}

fn capture(name: &'static str) -> Case {
    let stem = name.strip_prefix("capture/").expect("capture case");
    Case {
        name,
        golden: format!("{CAPTURE_DIR}/{stem}.golden"),
        // `constructTestConfig` leaves inbound ports, outbound port exclusions and outbound
        // ranges empty, where the plugin's defaults are `*`, `15020` and `*`: the annotations
        // set them to empty, which the plugin accepts.
        annotations: json!({
            "traffic.sidecar.istio.io/includeInboundPorts": "",
            "traffic.sidecar.istio.io/excludeOutboundPorts": "",
            "traffic.sidecar.istio.io/includeOutboundIPRanges": "",
        }),
        proxy_env: json!([]),
        security: json!({}),
        ipv6: false,
        plugin_env: &[],
    }
}

fn plugin(name: &'static str, golden: &str) -> Case {
    Case {
        name,
        golden: format!("{PLUGIN_DIR}/{golden}.txt.golden"),
        annotations: json!({}),
        proxy_env: json!([]),
        security: json!({}),
        ipv6: false,
        plugin_env: &[],
    }
}

impl Case {
    fn ann(mut self, key: &str, value: &str) -> Self {
        self.annotations[key] = json!(value);
        self
    }

    fn env(mut self, name: &str, value: &str) -> Self {
        self.proxy_env
            .as_array_mut()
            .unwrap()
            .push(json!({"name": name, "value": value}));
        self
    }

    fn ipv6(mut self) -> Self {
        self.ipv6 = true;
        self
    }

    fn plugin_env(mut self, env: &'static [(&'static str, &'static str)]) -> Self {
        self.plugin_env = env;
        self
    }

    fn ids(mut self, uid: u64, gid: Option<u64>) -> Self {
        self.security = json!({"runAsUser": uid});
        if let Some(gid) = gid {
            self.security["runAsGroup"] = json!(gid);
        }
        self
    }

    /// The injected pod of Istio's plugin test (`buildFakeDryRunPod`), with this case's
    /// annotations, proxy env and IDs; the status annotation makes it a sidecar pod.
    fn pod(&self) -> Value {
        let mut annotations = json!({"sidecar.istio.io/status": "true"});
        for (k, v) in self.annotations.as_object().unwrap() {
            annotations[k] = v.clone();
        }
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "test", "namespace": "testNS", "annotations": annotations},
            "spec": {"containers": [
                {"name": "test"},
                {"name": "istio-proxy", "env": self.proxy_env, "securityContext": self.security},
                {"name": "istio-validate"},
            ]}
        })
    }

    /// Our `iptables-restore` input for this pod, v4 then v6, as lines.
    fn ours(&self) -> Result<Vec<String>, String> {
        let env: BTreeMap<&str, &str> = self.plugin_env.iter().copied().collect();
        let host = SidecarEnv {
            fallback: &|k| env.get(k).map(|v| v.to_string()),
            group_id: &group_id,
        };
        let cfg = match sidecar::detect_with(&self.pod(), self.ipv6, &host) {
            Ok(Detection::Sidecar(cfg)) => cfg,
            Ok(Detection::Skip(why)) => return Err(format!("skipped: {why}")),
            Err(e) => return Err(format!("rejected: {e}")),
        };
        Ok(sidecar::iptables::restore(&cfg)
            .into_iter()
            .flat_map(|(_, text)| text.lines().map(str::to_string).collect::<Vec<_>>())
            .collect())
    }
}

/// The node's group database for the owner-group cases: Istio's goldens name groups `java` and
/// `ftp`, which iptables resolves when it loads the rule; the plugin resolves them first.
fn group_id(name: &str) -> Option<u32> {
    match name {
        "java" => Some(1001),
        "ftp" => Some(21),
        _ => None,
    }
}

/// Every case the CNI plugin can produce, mapped from Istio's test tables.
fn cases() -> Vec<Case> {
    const GROUPS: &[(&str, &str)] = &[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")];
    const GROUPS_EXCLUDE: &[(&str, &str)] = &[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "888,ftp")];
    const LOOPBACK: &[(&str, &str)] = &[("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "127.0.0.1/8")];
    const IN: &str = "traffic.sidecar.istio.io/includeInboundPorts";
    const EX_IN: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
    const IN_OUT: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
    const EX_OUT: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
    const IN_IP: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
    const EX_IP: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
    const EX_IF: &str = "traffic.sidecar.istio.io/excludeInterfaces";
    const REROUTE: &str = "istio.io/reroute-virtual-interfaces";
    const MODE: &str = "sidecar.istio.io/interceptionMode";
    vec![
        capture("capture/empty"),
        capture("capture/ipv6-empty-inbound-ports").ipv6(),
        capture("capture/ipv6-inbound-ports")
            .ann(IN, "4000,5000")
            .ipv6(),
        capture("capture/ipv6-virt-interfaces")
            .ann(IN, "4000,5000")
            .ann(REROUTE, "eth0,eth1")
            .ipv6(),
        // Istio's case excludes "6000,7000,": the plugin refuses the empty item, and with an
        // inbound include list the exclusions render nothing either way.
        capture("capture/ipv6-ipnets")
            .ann(IN, "4000,5000")
            .ann(EX_IN, "6000,7000")
            .ann(REROUTE, "eth0,eth1")
            .ann(EX_IP, "2001:db8::/32")
            .ann(IN_IP, "2001:db8::/32")
            .ipv6(),
        capture("capture/ipv6-outbound-ports")
            .ann(IN_OUT, "32000,31000")
            .ipv6(),
        capture("capture/kube-virt-interfaces")
            .ann(REROUTE, "eth1,eth2")
            .ann(IN_IP, "*"),
        capture("capture/ipnets").ann(IN_IP, "10.0.0.0/8"),
        capture("capture/ipnets-with-kube-virt-interfaces")
            .ann(REROUTE, "eth1,eth2")
            .ann(IN_IP, "10.0.0.0/8"),
        capture("capture/inbound-ports-include").ann(IN, "32000,31000"),
        capture("capture/inbound-ports-tproxy")
            .ann(IN, "32000,31000")
            .ann(MODE, "TPROXY"),
        capture("capture/outbound-owner-groups").plugin_env(GROUPS),
        capture("capture/outbound-owner-groups-exclude").plugin_env(GROUPS_EXCLUDE),
        // These two set REDIRECT_DNS with neither CAPTURE_ALL_DNS nor DNS servers, which
        // istio-iptables turns into no DNS capture; the plugin's equivalent is DNS capture off.
        capture("capture/ipv6-dns-outbound-owner-groups")
            .plugin_env(GROUPS)
            .ipv6(),
        capture("capture/ipv6-dns-outbound-owner-groups-exclude")
            .plugin_env(GROUPS_EXCLUDE)
            .ipv6(),
        capture("capture/outbound-ports-include").ann(IN_OUT, "32000,31000"),
        capture("capture/basic-exclude-nic").ann(EX_IF, "not-istio-nic"),
        capture("capture/drop-invalid").env("INVALID_DROP", "true"),
        capture("capture/host-ipv4-loopback-cidr").plugin_env(LOOPBACK),
        plugin("plugin/basic", "basic"),
        plugin("plugin/include-exclude-ip", "include-exclude-ip")
            .ann(IN_IP, "127.0.0.0/8")
            .ann(EX_IP, "10.0.0.0/8"),
        plugin("plugin/include-exclude-ports", "include-exclude-ports")
            .ann(IN, "1111,2222")
            .ann(EX_IN, "3333,4444")
            .ann(EX_OUT, "5555,6666"),
        plugin("plugin/tproxy", "tproxy").ann(MODE, "TPROXY"),
        plugin("plugin/DNS", "dns").env("ISTIO_META_DNS_CAPTURE", "true"),
        plugin("plugin/invalid-drop", "invalid-drop").env("INVALID_DROP", "true"),
        plugin("plugin/custom-uid", "custom-uid").ids(1000670000, Some(1000670001)),
        // runAsUser 0 means "unset": Istio's test expects the basic golden.
        plugin("plugin/custom-uid-zero", "basic").ids(0, None),
        plugin("plugin/custom-uid-tproxy", "custom-uid-tproxy")
            .ann(MODE, "TPROXY")
            .ids(1000670000, Some(1000670001)),
    ]
}

/// The golden's rule lines: the trace minus the stub's `*-save` state reads.
fn golden_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| *l != "iptables-save" && *l != "ip6tables-save")
        .map(str::to_string)
        .collect()
}

/// Line diff of `istio` → `ours`: `- ` lines only Istio has, `+ ` lines only we have, in order;
/// empty when equal.
fn diff(istio: &[String], ours: &[String]) -> String {
    istio_module::line_diff(istio, ours)
        .into_iter()
        .map(|(side, line)| match side {
            OnlyIn::Istio => format!("- {line}\n"),
            OnlyIn::Ours => format!("+ {line}\n"),
        })
        .collect()
}

fn allowlist() -> BTreeMap<String, Allowed> {
    istio_module::allowlist("sidecar_rules")
        .into_iter()
        .map(|a| (a.case.clone(), a))
        .collect()
}

/// The golden behind a case name (`capture/x` → the capture golden `x`, `plugin/x` → the plugin
/// golden `x`), for not-applicable entries, which have no mapping.
fn golden_of(case: &str) -> Option<String> {
    if let Some(stem) = case.strip_prefix("capture/") {
        Some(format!("{CAPTURE_DIR}/{stem}.golden"))
    } else {
        case.strip_prefix("plugin/")
            .map(|stem| format!("{PLUGIN_DIR}/{stem}.txt.golden"))
    }
}

#[test]
fn every_istio_sidecar_golden_is_mapped_or_not_applicable() {
    let cases = cases();
    let allowed = allowlist();
    let mut problems = Vec::new();

    let mapped: BTreeSet<String> = cases.iter().map(|c| c.golden.clone()).collect();
    let mut not_applicable = BTreeSet::new();
    for a in allowed.values().filter(|a| a.difference == NOT_APPLICABLE) {
        match golden_of(&a.case) {
            Some(g) if mapped.contains(&g) => problems.push(format!(
                "{}: listed as not applicable, but this test maps it",
                a.case
            )),
            Some(g) => {
                not_applicable.insert(g);
            }
            None => problems.push(format!("{}: not a capture/ or plugin/ case name", a.case)),
        }
    }
    let mut on_disk = BTreeSet::new();
    for (dir, suffix) in [(CAPTURE_DIR, ".golden"), (PLUGIN_DIR, ".txt.golden")] {
        for f in istio_module::files(dir)
            .into_iter()
            .filter(|f| f.ends_with(suffix))
        {
            on_disk.insert(format!("{dir}/{f}"));
        }
    }
    for g in &on_disk {
        if !mapped.contains(g) && !not_applicable.contains(g) {
            problems.push(format!(
                "{g}: new Istio golden; map its case in this test, or list it under \
                 sidecar_rules: as not applicable, with why"
            ));
        }
    }
    for g in mapped.union(&not_applicable) {
        if !on_disk.contains(g) {
            problems.push(format!(
                "{g}: no longer in the pinned Istio; drop its case or entry"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn sidecar_rules_match_istio_for_every_case_the_plugin_can_produce() {
    let allowed = allowlist();
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for case in cases() {
        assert!(seen.insert(case.name), "{} mapped twice", case.name);
        let istio = golden_lines(&istio_module::read(&case.golden));
        assert!(!istio.is_empty(), "{}: empty golden", case.golden);
        let ours = match case.ours() {
            Ok(lines) => lines,
            Err(e) => {
                problems.push(format!("{}: {e}", case.name));
                continue;
            }
        };
        let d = diff(&istio, &ours);
        match allowed.get(case.name) {
            Some(a) if a.difference == NOT_APPLICABLE => problems.push(format!(
                "{}: mapped, but listed as not applicable",
                case.name
            )),
            Some(_) if d.is_empty() => problems.push(format!(
                "{}: stale allowlist entry, ours now matches {}",
                case.name, case.golden
            )),
            Some(a) if a.difference.trim_end() != d.trim_end() => problems.push(format!(
                "{}: differs from {} other than listed.\nlisted:\n{}\nnow:\n{d}",
                case.name, case.golden, a.difference
            )),
            Some(_) => {}
            None if !d.is_empty() => problems.push(format!(
                "{}: differs from {} (- Istio, + ours); fix it, or list the deliberate \
                 difference under sidecar_rules:\n{d}",
                case.name, case.golden
            )),
            None => {}
        }
    }
    for a in allowed.values() {
        if a.difference != NOT_APPLICABLE && !seen.contains(a.case.as_str()) {
            problems.push(format!("{}: allowlisted, but no such case", a.case));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// The diff the allowlist relies on reports exactly the lines that differ, in order.
#[test]
fn diff_names_the_lines_that_differ() {
    let l = |s: &str| s.lines().map(str::to_string).collect::<Vec<_>>();
    assert_eq!(diff(&l("a\nb\nc"), &l("a\nb\nc")), "");
    assert_eq!(diff(&l("a\nb\nc"), &l("a\nx\nc")), "+ x\n- b\n");
    assert_eq!(diff(&l("a\nb"), &l("b\na")), "+ b\n- b\n");
    assert_eq!(diff(&l("a"), &l("a\nz")), "+ z\n");
    assert_eq!(diff(&l("a\nz"), &l("a")), "- z\n");
    assert_eq!(
        golden_lines("iptables-save\nip6tables-save\n* nat\nCOMMIT\niptables-save"),
        ["* nat", "COMMIT"]
    );
}
