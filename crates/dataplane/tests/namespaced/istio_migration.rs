//! Taking a node over from Istio's agent of the pinned version (`tools/istio/go.mod`): for every
//! iptables golden of Istio's rule tests (read from the module at test time, as in cni-core's
//! conformance test), a fresh namespace gets exactly what Istio's agent programs for that
//! configuration — its policy routing and the golden as `iptables-restore --noflush` input —
//! and our agent's view of the same configuration must find it in sync and leave it as it is:
//! verify (the drift check), the other backends' leftover checks, and enroll (reconcile), with
//! the calls the agent makes. Both iptables variants. A rule of Istio's that we removed or
//! rewrote here would be a gap in redirection during a migration.
//!
//! Run (root): `cargo test -p dataplane --test namespaced istio_migration::`.

#[path = "../../../cni-core/tests/support/istio_pin.rs"]
mod istio_pin;

use cni_core::redirect::ambient::InpodConfig;
use dataplane::host;
use dataplane::inpod::{InpodRules, RuleState};
use dataplane::iptables::IptablesBackend;
use dataplane::iptables::detect::Variant;
use dataplane::leftovers::{self, IptablesLeftovers};
use dataplane::pod;
use dataplane::test_support::{TestNetns, iptables_backends};
use istio_pin::{Backend, Setup};

/// Istio's golden as restore input per family.
fn families(name: &str, golden: &str) -> Vec<String> {
    istio_pin::iptables_golden_families(golden).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// `ip(6)tables-<variant>-restore --noflush` of each family's text, as Istio's agent applies it.
fn restore(ns: &TestNetns, variant: &str, families: &[String]) {
    for (text, ip) in families.iter().zip(["ip", "ip6"]) {
        ns.exec_stdin(
            &format!("{ip}tables-{variant}-restore"),
            &["--noflush"],
            text,
        );
    }
}

/// The policy routing Istio's agent adds before the rules: `local` default routes in table
/// 100 and the fwmark rule at priority 32764 (IPv6 too when enabled; Go's netlink gives the
/// route protocol `boot` and the rule none, as `ip` does).
fn istio_routes(ns: &TestNetns, ipv6: bool) {
    let families: &[(&str, &str)] = if ipv6 {
        &[("-4", "0.0.0.0/0"), ("-6", "::/0")]
    } else {
        &[("-4", "0.0.0.0/0")]
    };
    for (f, any) in families {
        ns.exec(
            "ip",
            &[
                f, "route", "replace", "local", any, "dev", "lo", "table", "100", "scope", "host",
            ],
        );
        ns.exec(
            "ip",
            &[
                f,
                "rule",
                "add",
                "fwmark",
                "0x111/0xfff",
                "table",
                "100",
                "priority",
                "32764",
            ],
        );
    }
}

/// Everything a take-over could change, as the tools print it: both variants' rules of both
/// families (their comment lines carry a time), the policy rules and routes, the ipsets.
fn snapshot(ns: &TestNetns) -> String {
    let mut out = String::new();
    for tool in [
        "iptables-nft-save",
        "ip6tables-nft-save",
        "iptables-legacy-save",
        "ip6tables-legacy-save",
    ] {
        out += &format!("## {tool}\n");
        for line in ns.exec(tool, &[]).lines().filter(|l| !l.starts_with('#')) {
            out += line;
            out.push('\n');
        }
    }
    for f in ["-4", "-6"] {
        out += &ns.exec("ip", &["-d", f, "rule", "show"]);
        // Every table: `show table 100` fails while the table does not exist.
        out += &ns.exec("ip", &["-d", f, "route", "show", "table", "all"]);
    }
    out += &ns.exec("ipset", &["save"]);
    out
}

fn variant_of(name: &str) -> Variant {
    if name == "legacy" {
        Variant::Legacy
    } else {
        Variant::Nft
    }
}

/// A pod Istio's agent enrolled, taken over by ours.
fn take_over_pod(case: &str, golden: &str, cfg: &InpodConfig, variant: &str, b: &IptablesBackend) {
    let ns = TestNetns::new("istio-pod");
    let netns = ns.open();
    istio_routes(&ns, cfg.ipv6);
    restore(&ns, variant, &families(case, golden));
    let before = snapshot(&ns);

    // The drift check: our rules and routes, and no other backend's.
    assert_eq!(
        b.verify(&netns, cfg).unwrap(),
        RuleState::InSync,
        "{case} ({variant}): rules Istio programs look drifted to us"
    );
    assert_eq!(
        pod::verify(&netns, cfg, b).unwrap(),
        RuleState::InSync,
        "{case} ({variant})"
    );
    let other = IptablesLeftovers::other_than(variant_of(variant));
    assert!(
        !leftovers::nft_in_pod(&netns).unwrap() && !other.in_pod(&netns).unwrap(),
        "{case} ({variant}): Istio's rules taken for another backend's leftovers"
    );

    // Reconcile, as the agent enrolls: the other backends' leftovers first, then ours, twice.
    for _ in 0..2 {
        assert!(
            !leftovers::clear_nft_pod(&netns).unwrap(),
            "{case} ({variant})"
        );
        assert!(!other.clear_pod(&netns).unwrap(), "{case} ({variant})");
        pod::enroll(&netns, cfg, b).unwrap();
    }
    assert_eq!(
        snapshot(&ns),
        before,
        "{case} ({variant}): enroll changed what Istio programmed"
    );
    assert_eq!(pod::verify(&netns, cfg, b).unwrap(), RuleState::InSync);
}

/// A node whose host rules Istio's agent programmed, set up by ours.
fn take_over_host(case: &str, golden: &str, cfg: &InpodConfig, variant: &str, b: &IptablesBackend) {
    let ns = TestNetns::new("istio-host");
    let hostns = ns.open();
    // Istio's probe sets: hash:ip with comments, per family.
    let families = families(case, golden);
    for (family, set) in ["inet", "inet6"]
        .iter()
        .zip(["istio-inpod-probes-v4", "istio-inpod-probes-v6"])
        .take(families.len())
    {
        ns.exec(
            "ipset",
            &["create", set, "hash:ip", "family", family, "comment"],
        );
    }
    restore(&ns, variant, &families);
    let before = snapshot(&ns);

    assert_eq!(
        host::verify_rules(&hostns, b, cfg).unwrap(),
        RuleState::InSync,
        "{case} ({variant}): host rules Istio programs look drifted to us"
    );
    // Startup, as the agent sets up the host: the other backends' state, then ours.
    let other = IptablesLeftovers::other_than(variant_of(variant));
    assert!(
        !leftovers::clear_nft_host(&hostns).unwrap(),
        "{case} ({variant})"
    );
    assert!(
        !other.clear_host_chains(&hostns).unwrap(),
        "{case} ({variant})"
    );
    host::apply_rules(&hostns, b, cfg).unwrap();
    assert_eq!(
        snapshot(&ns),
        before,
        "{case} ({variant}): host setup changed what Istio programmed"
    );
}

#[test]
fn rules_istio_programs_are_in_sync_and_kept() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let module = istio_pin::module_dir();
    let backends = iptables_backends();
    let mut taken_over = 0;
    for (name, path) in istio_pin::golden_files(&module, Backend::Iptables) {
        let case = format!("iptables/{name}");
        let setup = istio_pin::setup(Backend::Iptables, &name)
            .unwrap_or_else(|| panic!("no case maps to golden {case}"));
        let golden =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for (variant, b) in &backends {
            match &setup {
                Setup::Inpod(cfg) => take_over_pod(&case, &golden, cfg, variant, b),
                Setup::Host { ipv6, probe_v6, .. } => {
                    let cfg = InpodConfig {
                        ipv6: *ipv6,
                        probe_snat_v6: *probe_v6,
                        ..InpodConfig::default()
                    };
                    take_over_host(&case, &golden, &cfg, variant, b)
                }
            }
        }
        taken_over += 1;
    }
    assert_eq!(taken_over, istio_pin::expected_goldens().len());
}
