//! The iptables backend against real namespaces, for both variants: apply, idempotence, drift
//! repair in one transaction, config changes, removal without residue.

use cni_core::redirect::{InpodConfig, InterfaceName};
use dataplane::inpod::{InpodRules, RuleState};
use dataplane::iptables::IptablesBackend;
use dataplane::test_support::TestNetns;

fn backends() -> Vec<(&'static str, IptablesBackend)> {
    ["nft", "legacy"]
        .into_iter()
        .map(|v| (v, IptablesBackend::detect(Some(v), true).expect("detect")))
        .collect()
}

fn save(ns: &TestNetns, b: &IptablesBackend, v6: bool) -> String {
    ns.exec(&b.binaries().tool(v6, "-save"), &[])
}

fn istio_lines(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.contains("ISTIO")).collect()
}

#[test]
fn apply_verify_idempotent_and_remove() {
    dataplane::require_root!();
    for (variant, b) in backends() {
        let ns = TestNetns::new("ipt-apply");
        let netns = ns.open();
        let cfg = InpodConfig {
            ipv6: true,
            ..Default::default()
        };
        assert_eq!(
            b.verify(&netns, &cfg).unwrap(),
            RuleState::Absent,
            "{variant}"
        );

        b.apply(&netns, &cfg).unwrap();
        assert_eq!(
            b.verify(&netns, &cfg).unwrap(),
            RuleState::InSync,
            "{variant}"
        );
        let first = save(&ns, &b, false);
        assert!(first.contains("-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001"), "{variant}: {first}");
        assert!(save(&ns, &b, true).contains("! -d ::1/128"), "{variant}");

        // Same state again: nothing duplicated.
        b.apply(&netns, &cfg).unwrap();
        assert_eq!(
            istio_lines(&save(&ns, &b, false)),
            istio_lines(&first),
            "{variant}"
        );

        b.remove(&netns, &cfg).unwrap();
        assert_eq!(
            istio_lines(&save(&ns, &b, false)),
            Vec::<&str>::new(),
            "{variant}"
        );
        assert_eq!(
            istio_lines(&save(&ns, &b, true)),
            Vec::<&str>::new(),
            "{variant}"
        );
        assert_eq!(
            b.verify(&netns, &cfg).unwrap(),
            RuleState::Absent,
            "{variant}"
        );
        // Removing twice is fine.
        b.remove(&netns, &cfg).unwrap();
    }
}

#[test]
fn drift_is_reported_and_replaced_without_touching_foreign_rules() {
    dataplane::require_root!();
    for (variant, b) in backends() {
        let ns = TestNetns::new("ipt-drift");
        let netns = ns.open();
        let cfg = InpodConfig::default();
        b.apply(&netns, &cfg).unwrap();
        let ipt = b.binaries().tool(false, "");
        // Someone else's rule, a tampered chain and a leftover chain of an older version.
        ns.exec(
            &ipt,
            &[
                "-t", "nat", "-A", "OUTPUT", "-p", "udp", "--dport", "9", "-j", "ACCEPT",
            ],
        );
        ns.exec(
            &ipt,
            &[
                "-t",
                "nat",
                "-D",
                "ISTIO_OUTPUT",
                "-p",
                "tcp",
                "-m",
                "mark",
                "--mark",
                "0x111/0xfff",
                "-j",
                "ACCEPT",
            ],
        );
        ns.exec(
            &ipt,
            &[
                "-t",
                "nat",
                "-A",
                "ISTIO_OUTPUT",
                "-p",
                "tcp",
                "--dport",
                "1",
                "-j",
                "RETURN",
            ],
        );
        ns.exec(&ipt, &["-t", "mangle", "-N", "ISTIO_OLD"]);
        ns.exec(&ipt, &["-t", "mangle", "-A", "FORWARD", "-j", "ISTIO_OLD"]);

        let RuleState::Drifted(drift) = b.verify(&netns, &cfg).unwrap() else {
            panic!("{variant}: not drifted")
        };
        let text = drift.to_string();
        assert!(
            text.contains("- -t nat -A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT"),
            "{variant}: {text}"
        );
        assert!(
            text.contains("+ -t nat -A ISTIO_OUTPUT -p tcp -m tcp --dport 1 -j RETURN"),
            "{variant}: {text}"
        );
        assert!(
            text.contains("+ -t mangle -N ISTIO_OLD")
                && text.contains("+ -t mangle -A FORWARD -j ISTIO_OLD"),
            "{variant}: {text}"
        );

        b.apply(&netns, &cfg).unwrap();
        assert_eq!(
            b.verify(&netns, &cfg).unwrap(),
            RuleState::InSync,
            "{variant}"
        );
        let after = save(&ns, &b, false);
        assert!(
            !after.contains("ISTIO_OLD") && !after.contains("--dport 1 "),
            "{variant}: {after}"
        );
        assert!(
            after.contains("--dport 9 -j ACCEPT"),
            "{variant}: foreign rule lost: {after}"
        );
    }
}

#[test]
fn config_change_converges_to_the_new_rule_set() {
    dataplane::require_root!();
    for (variant, b) in backends() {
        let ns = TestNetns::new("ipt-change");
        let netns = ns.open();
        let on = InpodConfig {
            ipv6: true,
            ..Default::default()
        };
        b.apply(&netns, &on).unwrap();
        let off = InpodConfig {
            redirect_dns: false,
            ingress_mode: true,
            reroute_virtual_interfaces: vec![InterfaceName::new("vm0").unwrap()],
            ipv6: false,
            ..Default::default()
        };
        assert!(
            matches!(b.verify(&netns, &off).unwrap(), RuleState::Drifted(_)),
            "{variant}"
        );
        b.apply(&netns, &off).unwrap();
        assert_eq!(
            b.verify(&netns, &off).unwrap(),
            RuleState::InSync,
            "{variant}"
        );
        let v4 = save(&ns, &b, false);
        assert!(
            !v4.contains("*raw") || !v4.contains("ISTIO_PRERT -p udp"),
            "{variant}: {v4}"
        );
        assert!(
            v4.contains("-i vm0 -p tcp -j REDIRECT --to-ports 15001"),
            "{variant}: {v4}"
        );
        assert_eq!(
            istio_lines(&save(&ns, &b, true)),
            Vec::<&str>::new(),
            "{variant}: v6 rules must go with ipv6=false"
        );
    }
}

#[test]
fn render_is_the_restore_input() {
    let b = IptablesBackend::new(
        dataplane::iptables::detect::Binaries {
            prefix: "iptables".into(),
            variant: dataplane::iptables::detect::Variant::Nft,
            version: (1, 8, 9),
        },
        None,
    );
    let text = b.render(&InpodConfig::default());
    assert!(text.starts_with("* mangle\n-N ISTIO_PRERT\n") && text.ends_with("COMMIT\n"));
}
