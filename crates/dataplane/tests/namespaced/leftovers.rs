//! Finding and removing the state of the backend not in use (a backend switch on a live node).

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::nft::HostProbeConfig;
use dataplane::host::{self, ProbeSet};
use dataplane::inpod::InpodRules;
use dataplane::iptables::IptablesBackend;
use dataplane::leftovers::{self, IptablesLeftovers};
use dataplane::nft::NftablesBackend;
use dataplane::test_support::TestNetns;

fn cfg() -> InpodConfig {
    InpodConfig {
        ipv6: true,
        ..Default::default()
    }
}

fn all_iptables(ns: &TestNetns) -> String {
    [
        "iptables-legacy-save",
        "ip6tables-legacy-save",
        "iptables-nft-save",
        "ip6tables-nft-save",
    ]
    .iter()
    .map(|t| ns.exec(t, &[]))
    .collect()
}

#[test]
fn iptables_pod_rules_of_either_variant_are_found_and_removed() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let leftovers = IptablesLeftovers::find();
    for variant in ["legacy", "nft"] {
        let ns = TestNetns::new("left-ipt");
        let netns = ns.open();
        assert!(!leftovers.in_pod(&netns).unwrap(), "{variant}: fresh pod");
        let old = IptablesBackend::detect(Some(variant), true).unwrap();
        old.apply(&netns, &cfg()).unwrap();
        // Someone else's rule in the same table stays.
        ns.exec(
            "iptables-nft",
            &[
                "-t",
                "nat",
                "-A",
                "OUTPUT",
                "-d",
                "192.0.2.1",
                "-j",
                "RETURN",
            ],
        );
        assert!(leftovers.in_pod(&netns).unwrap(), "{variant}");
        assert!(leftovers.clear_pod(&netns).unwrap(), "{variant}");
        let rules = all_iptables(&ns);
        assert!(!rules.contains("ISTIO"), "{variant}: left behind\n{rules}");
        assert!(
            rules.contains("-d 192.0.2.1/32 -j RETURN"),
            "{variant}\n{rules}"
        );
        assert!(!leftovers.in_pod(&netns).unwrap());
        assert!(
            !leftovers.clear_pod(&netns).unwrap(),
            "{variant}: second clear"
        );
    }
}

/// After a switch of iptables variant, only the variant not in use counts as leftovers: the
/// rules of the one in use are the pod's redirection.
#[test]
fn other_than_holds_only_the_variant_not_in_use() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    use dataplane::iptables::detect::Variant;
    let ns = TestNetns::new("left-var");
    let netns = ns.open();
    IptablesBackend::detect(Some("legacy"), true)
        .unwrap()
        .apply(&netns, &cfg())
        .unwrap();
    let on_legacy = IptablesLeftovers::other_than(Variant::Legacy);
    let on_nft = IptablesLeftovers::other_than(Variant::Nft);
    assert_eq!(on_legacy.names(), "iptables-nft");
    assert_eq!(on_nft.names(), "iptables-legacy");
    assert!(!on_legacy.in_pod(&netns).unwrap());
    assert!(!on_legacy.clear_pod(&netns).unwrap());
    assert!(
        all_iptables(&ns).contains("ISTIO_OUTPUT"),
        "the rules in use stay"
    );
    assert!(on_nft.in_pod(&netns).unwrap());
    assert!(on_nft.clear_pod(&netns).unwrap());
    let rules = all_iptables(&ns);
    assert!(!rules.contains("ISTIO"), "{rules}");
}

#[test]
fn nft_pod_tables_are_found_and_removed() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let ns = TestNetns::new("left-nft");
    let netns = ns.open();
    assert!(!leftovers::nft_in_pod(&netns).unwrap());
    NftablesBackend::new().apply(&netns, &cfg()).unwrap();
    assert!(leftovers::nft_in_pod(&netns).unwrap());
    // The iptables gate sees no iptables state in a pod that only has our inet tables.
    assert!(!IptablesLeftovers::find().in_pod(&netns).unwrap());
    assert!(leftovers::clear_nft_pod(&netns).unwrap());
    let ruleset = ns.exec("nft", &["list", "ruleset"]);
    assert!(!ruleset.contains("istio"), "{ruleset}");
    assert!(!leftovers::clear_nft_pod(&netns).unwrap());
}

#[test]
fn host_state_of_either_backend_is_found_and_removed() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let ns = TestNetns::new("left-host");
    let hostns = ns.open();
    let leftovers = IptablesLeftovers::find();
    // Asked over netlink, so a fresh host runs no ipset tool.
    let ipset_exists = |name: &str| {
        dataplane::nft::with_socket(&hostns, |sock| {
            Ok(dataplane::nft::wire::ipset_exists(sock, name))
        })
        .unwrap()
    };
    assert_eq!(ipset_exists("istio-inpod-probes-v4"), Some(false));
    assert!(!leftovers.clear_host(&hostns).unwrap(), "fresh host");

    let old = IptablesBackend::detect(Some("nft"), true).unwrap();
    host::apply_rules(&hostns, &old, &cfg()).unwrap();
    ProbeSet { host: &hostns }
        .upsert("10.1.0.5".parse().unwrap(), "uid-a")
        .unwrap();
    assert_eq!(ipset_exists("istio-inpod-probes-v4"), Some(true));
    assert!(leftovers.clear_host(&hostns).unwrap());
    let rules = all_iptables(&ns);
    assert!(!rules.contains("ISTIO"), "{rules}");
    let sets = ns.exec("ipset", &["list", "-n"]);
    assert!(sets.trim().is_empty(), "sets left: {sets}");
    assert!(!leftovers.clear_host(&hostns).unwrap());

    assert!(!leftovers::clear_nft_host(&hostns).unwrap());
    dataplane::nft::host::apply_host_rules(
        &hostns,
        &HostProbeConfig {
            kubelet_uid: 0,
            ipv6: true,
            probe_snat_v4: cfg().probe_snat_v4,
            probe_snat_v6: cfg().probe_snat_v6,
        },
    )
    .unwrap();
    assert!(leftovers::clear_nft_host(&hostns).unwrap());
    let ruleset = ns.exec("nft", &["list", "ruleset"]);
    assert!(!ruleset.contains("istio"), "{ruleset}");
}
