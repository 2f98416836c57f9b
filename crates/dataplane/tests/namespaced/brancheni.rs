//! AWS branch-ENI probe routing against a namespace set up the way aws-vpc-cni sets up a node
//! with Security Groups for Pods: an `iif <veth> lookup <table>` rule and, in that table, the
//! host route to the pod through the veth.

use std::net::IpAddr;
use std::path::Path;

use dataplane::brancheni::{self, BranchEni};
use dataplane::test_support::TestNetns;

/// A host namespace with one branch-ENI pod (veth `vlan5a`, table 105, iif rule priority 10)
/// and one plain pod (veth `eni7b`, host route in main).
fn sgp_host() -> (TestNetns, TestNetns) {
    let host = TestNetns::new("eni-host");
    let pod = TestNetns::new("eni-pod");
    let h = |args: &[&str]| host.exec("ip", args);
    h(&[
        "link", "add", "vlan5a", "type", "veth", "peer", "name", "eth0", "netns", &pod.name,
    ]);
    h(&[
        "link", "add", "eni7b", "type", "veth", "peer", "name", "plain0",
    ]);
    for dev in ["vlan5a", "eni7b"] {
        h(&["link", "set", dev, "up"]);
    }
    h(&["-6", "addr", "add", "fd00::1/64", "dev", "vlan5a", "nodad"]);
    h(&[
        "route",
        "add",
        "10.9.0.5/32",
        "dev",
        "vlan5a",
        "table",
        "105",
    ]);
    h(&[
        "-6",
        "route",
        "add",
        "fd00::5/128",
        "dev",
        "vlan5a",
        "table",
        "105",
    ]);
    h(&[
        "rule", "add", "iif", "vlan5a", "lookup", "105", "priority", "10",
    ]);
    h(&[
        "-6", "rule", "add", "iif", "vlan5a", "lookup", "105", "priority", "10",
    ]);
    h(&["route", "add", "10.9.0.7/32", "dev", "eni7b"]);
    (host, pod)
}

fn rules(ns: &TestNetns, v6: bool) -> String {
    ns.exec("ip", &[if v6 { "-6" } else { "-4" }, "rule", "show"])
}

#[test]
fn branch_eni_pod_gets_forward_and_return_rules_removed_again() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let (host, _pod) = sgp_host();
    let netns = host.open();
    for (ip, v6, dst) in [
        ("10.9.0.5", false, "10.9.0.5"),
        ("fd00::5", true, "fd00::5"),
    ] {
        let ip: IpAddr = ip.parse().unwrap();
        let eni = brancheni::detect(&netns, ip).unwrap();
        assert_eq!(
            eni,
            Some(BranchEni {
                table: 105,
                veth: "vlan5a".into(),
                iif_priority: 10
            }),
            "{ip}"
        );
        let eni = eni.unwrap();
        brancheni::add_rules(&netns, ip, &eni).unwrap();
        // Again: already there is fine, nothing doubles.
        brancheni::add_rules(&netns, ip, &eni).unwrap();
        let shown = rules(&host, v6);
        let forward = format!("512:\tfrom all to {dst} lookup 105");
        let back = "9:\tfrom all iif vlan5a lookup local";
        assert_eq!(shown.matches(&forward).count(), 1, "{shown}");
        assert_eq!(shown.matches(back).count(), 1, "{shown}");

        brancheni::del_rules(&netns, ip, &eni).unwrap();
        brancheni::del_rules(&netns, ip, &eni).unwrap();
        let shown = rules(&host, v6);
        assert!(
            !shown.contains(&forward) && !shown.contains(back),
            "{shown}"
        );
        assert!(
            shown.contains("10:\tfrom all iif vlan5a lookup 105"),
            "aws rule kept: {shown}"
        );
    }
}

#[test]
fn plain_veth_pods_and_unknown_ips_are_not_branch_eni() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let (host, _pod) = sgp_host();
    let netns = host.open();
    for ip in ["10.9.0.7", "10.9.0.99", "fd00::7"] {
        assert_eq!(
            brancheni::detect(&netns, ip.parse().unwrap()).unwrap(),
            None,
            "{ip}"
        );
    }
    // No iif rules at all (v4 of a fresh namespace).
    let bare = TestNetns::new("eni-bare");
    assert_eq!(
        brancheni::detect(&bare.open(), "10.9.0.5".parse().unwrap()).unwrap(),
        None
    );
}

#[test]
fn early_demux_gate_reads_the_host_namespace() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let host = TestNetns::new("eni-demux");
    let netns = host.open();
    let proc_dir = Path::new("/proc");
    assert!(
        !brancheni::early_demux_disabled(&netns, proc_dir),
        "kernel default is 1"
    );
    host.exec("sysctl", &["-qw", "net.ipv4.tcp_early_demux=0"]);
    assert!(brancheni::early_demux_disabled(&netns, proc_dir));
    assert!(!brancheni::early_demux_disabled(
        &netns,
        Path::new("/nonexistent")
    ));
}
