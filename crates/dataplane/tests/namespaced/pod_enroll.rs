//! Enrollment primitives: routes and rules together, for every backend, and the rollback that
//! keeps a failed enrollment from leaving half a pod behind.

use cni_core::redirect::ambient::InpodConfig;
use dataplane::inpod::{InpodRules, RuleError, RuleState};
use dataplane::netns::Netns;
use dataplane::test_support::TestNetns;
use dataplane::{BackendOptions, RuleBackend, pod};

#[test]
fn unknown_backend_is_refused() {
    dataplane::enter_test_group!();
    let Err(e) = RuleBackend::new("ebpf", &BackendOptions::default()) else {
        panic!("accepted")
    };
    assert!(e.to_string().contains("ebpf"));
}

#[test]
fn enroll_verify_unenroll_each_backend() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    for name in ["iptables", "nftables"] {
        let b = RuleBackend::new(
            name,
            &BackendOptions {
                ipv6: true,
                ..Default::default()
            },
        )
        .unwrap();
        let ns = TestNetns::new("pod");
        let netns = ns.open();
        let cfg = InpodConfig {
            ipv6: true,
            ..Default::default()
        };
        assert_eq!(
            pod::verify(&netns, &cfg, &b).unwrap(),
            RuleState::Absent,
            "{name}"
        );
        // A sandbox's enrollment, then the informer's of the same pod: both idempotent.
        pod::enroll_fresh(&netns, &cfg, &b).unwrap();
        assert_eq!(
            pod::verify(&netns, &cfg, &b).unwrap(),
            RuleState::InSync,
            "{name}"
        );
        pod::enroll_fresh(&netns, &cfg, &b).unwrap();
        pod::enroll(&netns, &cfg, &b).unwrap();
        assert_eq!(
            pod::verify(&netns, &cfg, &b).unwrap(),
            RuleState::InSync,
            "{name}"
        );

        // Drift after `ip <args>`, as the report names it; a re-enroll brings the pod back in sync.
        let drift_after = |args: &[&str]| -> String {
            ns.exec("ip", args);
            let RuleState::Drifted(d) = pod::verify(&netns, &cfg, &b).unwrap() else {
                panic!("{name}")
            };
            pod::enroll(&netns, &cfg, &b).unwrap();
            assert_eq!(
                pod::verify(&netns, &cfg, &b).unwrap(),
                RuleState::InSync,
                "{name}"
            );
            d.to_string()
        };

        // Losing the fwmark rule is drift, named in the report.
        let d = drift_after(&["rule", "del", "fwmark", "0x111/0xfff", "table", "100"]);
        assert!(
            d.contains("- ip rule fwmark 0x111/0xfff lookup 100 pref 32764"),
            "{name}: {d}"
        );

        // So is losing the IPv4 local route, with the IPv6 one (same table number) still there:
        // the route read asks for table 100 alone, per family.
        let d = drift_after(&[
            "route",
            "del",
            "local",
            "0.0.0.0/0",
            "dev",
            "lo",
            "table",
            "100",
        ]);
        assert!(
            d.contains("- ip route local 0.0.0.0/0 dev lo table 100"),
            "{name}: {d}"
        );
        assert!(!d.contains("::/0"), "{name}: {d}");

        pod::unenroll(&netns, &cfg, &b).unwrap();
        assert_eq!(
            pod::verify(&netns, &cfg, &b).unwrap(),
            RuleState::Absent,
            "{name}"
        );
        assert_eq!(ns.exec("ip", &["route", "show", "table", "100"]).trim(), "");
        assert!(!ns.exec("ip", &["rule"]).contains("0x111"));
    }
}

/// A backend whose apply always fails after nothing: proves the routes added first are undone.
struct Failing;

impl InpodRules for Failing {
    fn name(&self) -> &'static str {
        "failing"
    }
    fn render(&self, _: &InpodConfig) -> String {
        String::new()
    }
    fn apply(&self, _: &Netns, _: &InpodConfig) -> Result<(), RuleError> {
        Err(RuleError::Backend {
            backend: "failing",
            source: "refused".into(),
        })
    }
    fn verify(&self, _: &Netns, _: &InpodConfig) -> Result<RuleState, RuleError> {
        Ok(RuleState::Absent)
    }
    fn remove(&self, _: &Netns, _: &InpodConfig) -> Result<(), RuleError> {
        Ok(())
    }
}

#[test]
fn failed_enroll_of_a_fresh_pod_leaves_no_routes() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let ns = TestNetns::new("podfail");
    let netns = ns.open();
    let err = pod::enroll(&netns, &InpodConfig::default(), &Failing).unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
    assert_eq!(ns.exec("ip", &["route", "show", "table", "100"]).trim(), "");
    assert!(!ns.exec("ip", &["rule"]).contains("0x111"));
}

/// The one earlier writer a sandbox's namespace can have had is an agent that died serving the
/// same ADD: its routes go with a failed fresh enrollment (the sandbox is torn down anyway),
/// where [`pod::enroll`] keeps state it found.
#[test]
fn failed_fresh_enroll_takes_out_routes_it_found() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    for fresh in [true, false] {
        let ns = TestNetns::new("podfresh");
        let netns = ns.open();
        dataplane::routes::apply(&netns, false).unwrap();
        let err = match fresh {
            true => pod::enroll_fresh(&netns, &InpodConfig::default(), &Failing),
            false => pod::enroll(&netns, &InpodConfig::default(), &Failing),
        }
        .unwrap_err();
        assert!(err.to_string().contains("refused"), "{err}");
        let rules = ns.exec("ip", &["rule"]);
        assert_eq!(!rules.contains("0x111"), fresh, "fresh {fresh}: {rules}");
    }
}

#[test]
fn lo_without_ipv6_gets_no_ipv6_local_route() {
    dataplane::enter_test_group!();
    use dataplane::routes::{self, RoutePiece};
    dataplane::require_root!();
    let ns = TestNetns::new("noip6");
    let netns = ns.open();
    ns.exec("sysctl", &["-qw", "net.ipv6.conf.lo.disable_ipv6=1"]);
    routes::apply(&netns, true).unwrap();
    let state = routes::read(&netns, true).unwrap();
    assert!(
        !state.desired.contains(&RoutePiece::LocalRouteV6),
        "{:?}",
        state.desired
    );
    assert!(state.missing().is_empty(), "{:?}", state.missing());
    // With IPv6 back on `lo`, the same read asks for the IPv6 route too.
    ns.exec("sysctl", &["-qw", "net.ipv6.conf.lo.disable_ipv6=0"]);
    let state = routes::read(&netns, true).unwrap();
    assert_eq!(state.missing(), [RoutePiece::LocalRouteV6]);
}
