//! The Istio we match, as conformance tests need it: where the module pinned in
//! `tools/istio/go.mod` is, and which of our configurations each of its ambient rule goldens
//! was produced with. Istio's files are read from the module at test time, never copied here;
//! what this file carries are facts learnt from Istio's tests (`cni/pkg/iptables` and
//! `cni/pkg/nftables`: `GetCommonInPodTestCases`, `GetCommonHostTestCases`,
//! `constructTestConfig`).
//!
//! Shared by cni-core's conformance test and dataplane's migration test (included there by
//! `#[path]`), so both read Istio's goldens the same way.

#![allow(
    dead_code,
    reason = "each test crate including this file uses a different part of it"
)]

use std::net::Ipv6Addr;
use std::path::{Path, PathBuf};

#[path = "../istio_module/mod.rs"]
pub mod istio_module;

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::consts::PROBE_SNAT_V6;
use cni_core::redirect::ambient::overrides::{
    self, BYPASS_INBOUND_CAPTURE, DNS_CAPTURE, REROUTE_VIRTUAL_INTERFACES,
};

/// The IPv6 probe address of Istio's test configuration (`constructTestConfig`); only the
/// iptables host test replaces it, with the production default.
pub const TEST_PROBE_V6: Ipv6Addr = Ipv6Addr::new(
    0xe9ac, 0x1e77, 0x90ca, 0x399f, 0x4d6d, 0xece2, 0x2f9b, 0x3164,
);

/// The kubelet UID Istio's nftables host test mocks.
pub const TEST_KUBELET_UID: u32 = 1000;

/// The two backends whose rules Istio keeps goldens of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Iptables,
    Nftables,
}

impl Backend {
    pub const ALL: [Backend; 2] = [Backend::Iptables, Backend::Nftables];

    /// The goldens' directory inside the module.
    pub fn golden_dir(self) -> &'static str {
        match self {
            Backend::Iptables => "cni/pkg/iptables/testdata",
            Backend::Nftables => "cni/pkg/nftables/testdata",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Backend::Iptables => "iptables",
            Backend::Nftables => "nftables",
        }
    }
}

/// What produced one of Istio's ambient goldens, in our terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Setup {
    /// In-pod rules (Istio's `CreateInpodRules`) for this effective pod configuration.
    Inpod(InpodConfig),
    /// Host probe rules (Istio's `CreateHostRulesForHealthChecks`).
    Host {
        ipv6: bool,
        probe_v6: Ipv6Addr,
        kubelet_uid: u32,
    },
}

/// One of Istio's in-pod test cases: name, global DNS capture (`RedirectDNS`, false unless the
/// case sets it) and the pod overrides, written as the annotations that produce them.
type InpodCase = (&'static str, bool, &'static [(&'static str, &'static str)]);

/// Istio's in-pod test cases.
const INPOD_CASES: [InpodCase; 6] = [
    ("default", true, &[]),
    ("ingress", false, &[(BYPASS_INBOUND_CAPTURE, "true")]),
    (
        "virtual_interfaces",
        false,
        &[(REROUTE_VIRTUAL_INTERFACES, "fake1s0f0,fake1s0f1")],
    ),
    (
        "ingress_and_virtual_interfaces",
        false,
        &[
            (BYPASS_INBOUND_CAPTURE, "true"),
            (REROUTE_VIRTUAL_INTERFACES, "fake1s0f0,fake1s0f1"),
        ],
    ),
    (
        "dns_pod_enabled_and_off_globally",
        false,
        &[(DNS_CAPTURE, "true")],
    ),
    (
        "dns_pod_disabled_and_on_globally",
        true,
        &[(DNS_CAPTURE, "false")],
    ),
];

/// Istio's host test case.
const HOST_CASE: &str = "hostprobe";

/// Every golden file name (`<case>[_ipv6].golden`) a backend's directory is expected to hold:
/// each case once per IPv6 setting, as Istio's tests run them.
pub fn expected_goldens() -> Vec<String> {
    let mut out = Vec::new();
    for name in INPOD_CASES.iter().map(|c| c.0).chain([HOST_CASE]) {
        out.push(format!("{name}.golden"));
        out.push(format!("{name}_ipv6.golden"));
    }
    out
}

/// The setup that produced golden `file` of `backend`'s directory, or `None` when no case of
/// ours maps to it (a golden added after a pin bump).
pub fn setup(backend: Backend, file: &str) -> Option<Setup> {
    let stem = file.strip_suffix(".golden")?;
    let (name, ipv6) = match stem.strip_suffix("_ipv6") {
        Some(name) => (name, true),
        None => (stem, false),
    };
    if name == HOST_CASE {
        return Some(Setup::Host {
            ipv6,
            probe_v6: match backend {
                Backend::Iptables => PROBE_SNAT_V6,
                Backend::Nftables => TEST_PROBE_V6,
            },
            kubelet_uid: TEST_KUBELET_UID,
        });
    }
    let (_, redirect_dns, annotations) = INPOD_CASES.iter().find(|c| c.0 == name)?;
    let global = InpodConfig {
        ipv6,
        redirect_dns: *redirect_dns,
        probe_snat_v6: TEST_PROBE_V6,
        ..InpodConfig::default()
    };
    // Through the annotation path, as the agent computes a pod's configuration.
    let (cfg, ignored) = overrides::inpod_config(&global, annotations.iter().copied())
        .expect("Istio's test overrides are valid annotations");
    assert!(ignored.is_empty(), "{name}: ignored {ignored:?}");
    Some(Setup::Inpod(cfg))
}

/// The pinned module's directory (located by the one locator the conformance tests share).
pub fn module_dir() -> PathBuf {
    istio_module::dir().to_path_buf()
}

/// The files of one backend's golden directory, by name, sorted. Panics when the directory is
/// missing (the module's layout changed).
pub fn golden_files(module: &Path, backend: Backend) -> Vec<(String, PathBuf)> {
    let dir = module.join(backend.golden_dir());
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "Istio's {} goldens are not at {}: {e}",
            backend.label(),
            dir.display()
        )
    });
    let mut files: Vec<(String, PathBuf)> = entries
        .map(|e| e.expect("read golden directory").path())
        .filter(|p| p.is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    files.sort();
    files
}

/// The commands Istio's iptables dependency stub records before the restore input: the two
/// state reads of `VerifyIptablesState`. They are not rules.
pub const IPTABLES_GOLDEN_HEADER: [&str; 2] = ["iptables-save", "ip6tables-save"];

/// An iptables golden as `iptables-restore` input per family, IPv4 first. The header lines are
/// checked and dropped; the IPv6 tables follow the IPv4 ones, so a table name that does not sort
/// after the previous one starts the next family (each family's tables are in name order).
pub fn iptables_golden_families(text: &str) -> Result<Vec<String>, String> {
    let mut lines = text.lines();
    for want in IPTABLES_GOLDEN_HEADER {
        match lines.next() {
            Some(l) if l == want => {}
            other => {
                return Err(format!(
                    "expected the recorded command {want:?}, got {other:?}"
                ));
            }
        }
    }
    let mut families: Vec<String> = Vec::new();
    let mut last_table: Option<&str> = None;
    for line in lines {
        if let Some(table) = line.strip_prefix('*') {
            let table = table.trim();
            if families.is_empty() || last_table.is_some_and(|prev| table <= prev) {
                families.push(String::new());
            }
            last_table = Some(table);
        }
        let Some(current) = families.last_mut() else {
            return Err(format!("{line:?} before the first table"));
        };
        current.push_str(line);
        current.push('\n');
    }
    if families.is_empty() || families.len() > 2 {
        return Err(format!("{} address families", families.len()));
    }
    Ok(families)
}
