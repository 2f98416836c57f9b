//! The iptables backend against real namespaces, for both variants: variant detection from what
//! a host namespace holds, apply, idempotence, drift repair in one transaction, config changes,
//! removal without residue.

use cni_core::redirect::InterfaceName;
use cni_core::redirect::ambient::InpodConfig;
use dataplane::inpod::{InpodRules, RuleState};
use dataplane::iptables::IptablesBackend;
use dataplane::iptables::detect::{Detection, Reason, Variant, detect};
use dataplane::test_support::{TestNetns, iptables_backends};

/// Detection as the agent runs it, in a namespace standing in for the host's (never this
/// process's own, whose tables other tests and the machine share).
fn detect_in(host: &TestNetns, force: Option<&str>) -> Detection {
    host.open()
        .run(|| detect(force, true))
        .unwrap()
        .unwrap_or_else(|e| panic!("detect in {}: {e}", host.name))
}

/// `ip(6)tables-<variant> <args>` inside `ns`.
fn ipt(ns: &TestNetns, variant: &str, v6: bool, args: &[&str]) {
    let tool = format!("{}tables-{variant}", if v6 { "ip6" } else { "ip" });
    ns.exec(&tool, args);
}

fn add_rules(ns: &TestNetns, variant: &str, v6: bool, n: usize) {
    for port in 0..n {
        let port = (1000 + port).to_string();
        ipt(
            ns,
            variant,
            v6,
            &["-A", "INPUT", "-p", "tcp", "--dport", &port, "-j", "ACCEPT"],
        );
    }
}

/// What some tool that once touched legacy leaves: tables with no rule in them.
fn touch_legacy(ns: &TestNetns) {
    for v6 in [false, true] {
        for table in ["nat", "filter", "mangle"] {
            ipt(ns, "legacy", v6, &["-t", table, "-N", "TOUCHED"]);
            ipt(ns, "legacy", v6, &["-t", table, "-X", "TOUCHED"]);
        }
    }
    let dump = ns.exec("iptables-legacy-save", &[]);
    // Istio's rule (three lines or more) would take legacy here.
    assert!(dump.lines().count() >= 3 && dump.contains("*nat"), "{dump}");
}

#[test]
fn empty_legacy_tables_never_win() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let host = TestNetns::new("ipt-det-empty");
    touch_legacy(&host);
    let d = detect_in(&host, None);
    assert_eq!(d.binaries.variant, Variant::Nft, "{d}");
    assert_eq!(d.reason, Reason::NoRules);

    // kube-proxy-like rules in nft next to the empty legacy tables.
    add_rules(&host, "nft", false, 3);
    let d = detect_in(&host, None);
    assert_eq!(d.binaries.prefix, "iptables-nft", "{d}");
    assert_eq!(d.reason, Reason::RuleLines { legacy: 0, nft: 3 });
}

#[test]
fn detection_touches_no_table_of_the_variant_it_does_not_choose() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let host = TestNetns::new("ipt-det-clean");
    let d = detect_in(&host, None);
    assert_eq!(d.binaries.variant, Variant::Nft, "{d}");
    for save in ["iptables-legacy-save", "ip6tables-legacy-save"] {
        assert_eq!(host.exec(save, &[]), "", "detection created legacy tables");
    }
    // So the next start (an agent restart) decides the same way.
    assert_eq!(detect_in(&host, None).reason, Reason::NoRules);
}

#[test]
fn legacy_rules_choose_legacy() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let host = TestNetns::new("ipt-det-legacy");
    add_rules(&host, "legacy", true, 2);
    let d = detect_in(&host, None);
    assert_eq!(d.binaries.prefix, "iptables-legacy", "{d}");
    assert_eq!(d.reason, Reason::RuleLines { legacy: 2, nft: 0 });
    // Fewer legacy rules than nft ones: nft.
    add_rules(&host, "nft", false, 3);
    assert_eq!(detect_in(&host, None).binaries.variant, Variant::Nft);
}

#[test]
fn kubelet_hint_decides_in_each_variant_and_family() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    // (variant holding kubelet's chain, IPv6, chain); the other variant gets more rules.
    let cases = [
        ("legacy", false, "KUBE-IPTABLES-HINT"),
        ("legacy", true, "KUBE-KUBELET-CANARY"),
        ("nft", false, "KUBE-KUBELET-CANARY"),
        ("nft", true, "KUBE-IPTABLES-HINT"),
    ];
    for (variant, v6, chain) in cases {
        let host = TestNetns::new("ipt-det-hint");
        ipt(&host, variant, v6, &["-t", "mangle", "-N", chain]);
        let other = if variant == "legacy" { "nft" } else { "legacy" };
        add_rules(&host, other, false, 5);
        let d = detect_in(&host, None);
        assert_eq!(
            d.binaries.prefix,
            format!("iptables-{variant}"),
            "{variant} {v6} {chain}: {d}"
        );
        let want = if variant == "legacy" {
            Variant::Legacy
        } else {
            Variant::Nft
        };
        assert!(
            matches!(d.reason, Reason::KubeletChain { variant: v, v6: f, chain: c }
                if v == want && f == v6 && c == chain),
            "{variant} {v6} {chain}: {d}"
        );
    }
}

#[test]
fn forced_variant_wins_over_the_evidence() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let host = TestNetns::new("ipt-det-force");
    add_rules(&host, "legacy", false, 2);
    let d = detect_in(&host, Some("nft"));
    assert_eq!(
        (d.binaries.variant, d.reason),
        (Variant::Nft, Reason::Forced)
    );
    let d = detect_in(&host, Some("legacy"));
    assert_eq!(d.binaries.variant, Variant::Legacy);
    assert!(matches!(
        host.open().run(|| detect(Some("both"), true)).unwrap(),
        Err(dataplane::iptables::detect::DetectError::BadForce(v)) if v == "both"
    ));
}

#[test]
fn pods_get_rules_only_in_the_nodes_variant() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    for (node_variant, other) in [("legacy", "nft"), ("nft", "legacy")] {
        let host = TestNetns::new("ipt-det-node");
        ipt(
            &host,
            node_variant,
            false,
            &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
        );
        add_rules(&host, other, false, 4);
        let b = host
            .open()
            .run(|| IptablesBackend::detect(None, true))
            .unwrap()
            .unwrap();
        assert!(b.choice().contains("KUBE-IPTABLES-HINT"), "{}", b.choice());
        let pod = TestNetns::new("ipt-det-pod");
        let cfg = InpodConfig {
            ipv6: true,
            ..Default::default()
        };
        b.apply(&pod.open(), &cfg).unwrap();
        for v6 in [false, true] {
            let ip = if v6 { "ip6" } else { "ip" };
            let mine = pod.exec(&format!("{ip}tables-{node_variant}-save"), &[]);
            assert!(mine.contains("-j ISTIO_OUTPUT"), "{node_variant}: {mine}");
            let theirs = pod.exec(&format!("{ip}tables-{other}-save"), &[]);
            assert!(!theirs.contains("ISTIO"), "rules in {other}: {theirs}");
        }
    }
}

fn save(ns: &TestNetns, b: &IptablesBackend, v6: bool) -> String {
    ns.exec(&b.binaries().tool(v6, "-save"), &[])
}

fn istio_lines(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.contains("ISTIO")).collect()
}

#[test]
fn apply_verify_idempotent_and_remove() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    for (variant, b) in iptables_backends() {
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
    dataplane::enter_test_group!();
    dataplane::require_root!();
    for (variant, b) in iptables_backends() {
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
    dataplane::enter_test_group!();
    dataplane::require_root!();
    for (variant, b) in iptables_backends() {
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
    dataplane::enter_test_group!();
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

/// Our lines per table: legacy lists tables in the order they were created, which differs
/// between namespaces.
fn istio_by_table(text: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out = std::collections::BTreeMap::<String, Vec<String>>::new();
    let mut table = String::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.to_string();
        } else if line.contains("ISTIO") {
            out.entry(table.clone()).or_default().push(line.to_string());
        }
    }
    out
}

/// Holds an exclusive flock on `path` (created if missing) until dropped.
fn hold_lock(path: &std::path::Path) -> nix::fcntl::Flock<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap();
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).unwrap()
}

/// Whether `apply` in a fresh pod waits while someone holds `lock_of(pod)`: runs it in the
/// background, and releases the lock after `hold`.
fn apply_waits_for(
    b: &IptablesBackend,
    lock_of: impl Fn(&dataplane::netns::Netns) -> std::path::PathBuf,
) -> bool {
    let pod = TestNetns::new("ipt-lock");
    let netns = pod.open();
    let cfg = InpodConfig::default();
    let held = hold_lock(&lock_of(&netns));
    std::thread::scope(|s| {
        let worker = s.spawn(|| b.apply(&netns, &cfg));
        std::thread::sleep(std::time::Duration::from_millis(700));
        let waited = !worker.is_finished();
        drop(held);
        worker.join().unwrap().unwrap();
        assert_eq!(b.verify(&netns, &cfg).unwrap(), RuleState::InSync);
        waited
    })
}

fn legacy(version: (u32, u32, u32)) -> dataplane::iptables::detect::Binaries {
    dataplane::iptables::detect::Binaries {
        prefix: "iptables-legacy".into(),
        variant: Variant::Legacy,
        version,
    }
}

#[test]
fn legacy_pod_commands_take_the_pods_own_lock_by_env_and_by_bind_mount() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    // 1.8.6 and later get XTABLES_LOCKFILE; before, the file is bound over /run/xtables.lock in
    // the sandbox (the binary here is newer, but is not told the path, so it uses the global one).
    for version in [(1, 8, 9), (1, 8, 5)] {
        let dir = tempfile::tempdir().unwrap();
        let b = IptablesBackend::new(legacy(version), Some(dir.path().to_owned()));
        assert!(
            apply_waits_for(&b, |ns| b.pod_lock_file(ns).expect("pod lock")),
            "{version:?}: apply ignored the pod's lock"
        );
        // Another pod's lock does not hold this one up.
        let other = TestNetns::new("ipt-lock-other");
        let others = b.pod_lock_file(&other.open()).unwrap();
        assert!(!apply_waits_for(&b, |_| others.clone()), "{version:?}");
    }
}

#[test]
fn scoped_locking_off_leaves_pods_on_the_node_lock() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let dir = tempfile::tempdir().unwrap();
    let b = IptablesBackend::new(legacy((1, 8, 9)), Some(dir.path().to_owned()))
        .with_scoped_locking(false);
    let pod = TestNetns::new("ipt-nolock");
    assert_eq!(b.pod_lock_file(&pod.open()), None);
    b.apply(&pod.open(), &InpodConfig::default()).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // nft never locks.
    let nft = IptablesBackend::new(
        dataplane::iptables::detect::Binaries {
            prefix: "iptables-nft".into(),
            variant: Variant::Nft,
            version: (1, 8, 9),
        },
        Some(dir.path().to_owned()),
    );
    assert_eq!(nft.pod_lock_file(&pod.open()), None);
}

/// kube-proxy's part of a namespace: a service chain hooked into nat PREROUTING and OUTPUT,
/// rewritten whole by `iptables-restore --noflush` as each sync does.
const KUBE_SERVICES: &str = "*nat\n:KUBE-SERVICES - [0:0]\n\
    -A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m tcp --dport 443 -j RETURN\n\
    -A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m udp --dport 53 -j RETURN\n\
    -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 53 -j RETURN\nCOMMIT\n";

/// The writer's lasting rules as `-save` prints them: everything but its churn.
fn kube_lines(save: &str) -> Vec<&str> {
    save.lines()
        .filter(|l| l.contains("KUBE-") && !l.contains("10.244."))
        .collect()
}

/// Runs an iptables command in `ns` the way kube-proxy does: `-w`, and again after a failure (a
/// concurrent legacy commit makes the kernel answer EAGAIN; kube-proxy's next sync retries).
fn writer_cmd(ns: &str, tool: &str, args: &[&str], stdin: Option<&str>) {
    use std::io::Write as _;
    for attempt in 1..=20 {
        let mut cmd = std::process::Command::new("ip");
        cmd.args(["netns", "exec", ns, tool, "-w"]).args(args);
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let mut pipe = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            pipe.write_all(text.as_bytes()).unwrap();
        }
        drop(pipe);
        let out = child.wait_with_output().unwrap();
        if out.status.success() {
            return;
        }
        assert!(
            attempt < 20,
            "{tool} {args:?} keeps failing: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn reapplying_under_concurrent_iptables_writers_stays_exact() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    const CHURN: usize = 120;
    let dns_on = InpodConfig::default();
    let dns_off = InpodConfig {
        redirect_dns: false,
        ..Default::default()
    };
    for (variant, b) in iptables_backends() {
        // Golden: each rule set as it reads in a namespace nobody else writes to.
        let quiet = TestNetns::new("ipt-quiet");
        let golden = |cfg: &InpodConfig| {
            b.apply(&quiet.open(), cfg).unwrap();
            let lines = istio_by_table(&save(&quiet, &b, false));
            b.remove(&quiet.open(), cfg).unwrap();
            lines
        };
        let (gold_on, gold_off) = (golden(&dns_on), golden(&dns_off));
        assert_ne!(gold_on, gold_off);

        let ns = TestNetns::new("ipt-churn");
        let netns = ns.open();
        let ipt = b.binaries().tool(false, "");
        let restore = b.binaries().tool(false, "-restore");
        writer_cmd(&ns.name, &restore, &["--noflush"], Some(KUBE_SERVICES));
        for hook in ["PREROUTING", "OUTPUT"] {
            writer_cmd(
                &ns.name,
                &ipt,
                &["-t", "nat", "-I", hook, "1", "-j", "KUBE-SERVICES"],
                None,
            );
        }
        writer_cmd(&ns.name, &ipt, &["-t", "filter", "-N", "KUBE-FW"], None);
        let kube_before: Vec<String> = kube_lines(&save(&ns, &b, false))
            .into_iter()
            .map(String::from)
            .collect();
        assert_eq!(kube_before.len(), 7, "{kube_before:?}");

        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..CHURN {
                    let ip = format!("10.244.{}.{}/32", i / 200, i % 200 + 1);
                    let rule = ["-d", ip.as_str(), "-p", "tcp", "-j", "RETURN"];
                    let with = |op: &str, chain: &str, table: &str| {
                        let mut a = vec!["-t", table, op, chain];
                        a.extend_from_slice(&rule);
                        writer_cmd(&ns.name, &ipt, &a, None);
                    };
                    with("-I", "KUBE-SERVICES", "nat");
                    with("-A", "KUBE-FW", "filter");
                    writer_cmd(&ns.name, &restore, &["--noflush"], Some(KUBE_SERVICES));
                    with("-D", "KUBE-FW", "filter");
                }
                done.store(true, std::sync::atomic::Ordering::SeqCst);
            });
            let check = |want: &std::collections::BTreeMap<String, Vec<String>>, step: &str| {
                let text = save(&ns, &b, false);
                let ours = istio_by_table(&text);
                assert_eq!(
                    &ours, want,
                    "{variant} {step}: our rules are not exact:\n{text}"
                );
                assert_eq!(
                    kube_lines(&text),
                    kube_before,
                    "{variant} {step}: the other writer's rules changed:\n{text}"
                );
            };
            let mut rounds = 0;
            while rounds < 8 || !done.load(std::sync::atomic::Ordering::SeqCst) {
                rounds += 1;
                b.apply(&netns, &dns_on).unwrap();
                check(&gold_on, "apply");
                b.apply(&netns, &dns_on).unwrap();
                check(&gold_on, "re-apply");
                assert_eq!(b.verify(&netns, &dns_on).unwrap(), RuleState::InSync);
                b.apply(&netns, &dns_off).unwrap();
                check(&gold_off, "config change");
                b.remove(&netns, &dns_off).unwrap();
                check(&Default::default(), "remove");
                assert!(rounds < 500, "{variant}: the writer never finished");
            }
            eprintln!("{variant}: {rounds} rounds against {CHURN} writer iterations");
        });
        let after = save(&ns, &b, false);
        assert!(
            !after.contains("10.244."),
            "{variant}: churn left rules:\n{after}"
        );
    }
}
