//! Golden files of the nftables rendering, one per override case. The expected text is Istio's
//! transaction for the same case (`cni/pkg/nftables/testdata`), with the two normalisations
//! described in `cni_core::redirect::nft` (single spaces; packet marks spelled `mark and`).
//! Regenerate with `UPDATE_GOLDEN=1 cargo test -p cni-core --test nft_golden` and review the diff.

use std::net::Ipv6Addr;
use std::path::PathBuf;

use cni_core::redirect::nft::{HostProbeConfig, host_ruleset, inpod_ruleset};
use cni_core::redirect::{InpodConfig, InterfaceName, consts};

/// The IPv6 probe address of Istio's test configuration.
const TEST_PROBE_V6: Ipv6Addr = Ipv6Addr::new(
    0xe9ac, 0x1e77, 0x90ca, 0x399f, 0x4d6d, 0xece2, 0x2f9b, 0x3164,
);

fn check(name: &str, text: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/nft")
        .join(format!("{name}.golden"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        text,
        want,
        "{name}: rendering differs from {}",
        path.display()
    );
}

fn cfg(ipv6: bool) -> InpodConfig {
    InpodConfig {
        ipv6,
        probe_snat_v6: TEST_PROBE_V6,
        ..InpodConfig::default()
    }
}

fn virtual_interfaces() -> Vec<InterfaceName> {
    ["fake1s0f0", "fake1s0f1"]
        .iter()
        .map(|n| InterfaceName::new(n).unwrap())
        .collect()
}

fn host(ipv6: bool) -> HostProbeConfig {
    HostProbeConfig {
        kubelet_uid: 1000,
        ipv6,
        probe_snat_v4: consts::PROBE_SNAT_V4,
        probe_snat_v6: TEST_PROBE_V6,
    }
}

#[test]
fn default() {
    check("default", &inpod_ruleset(&cfg(false)).render());
}

#[test]
fn default_ipv6() {
    check("default_ipv6", &inpod_ruleset(&cfg(true)).render());
}

#[test]
fn ingress() {
    let c = InpodConfig {
        ingress_mode: true,
        redirect_dns: false,
        ..cfg(false)
    };
    check("ingress", &inpod_ruleset(&c).render());
}

#[test]
fn ingress_ipv6() {
    let c = InpodConfig {
        ingress_mode: true,
        redirect_dns: false,
        ..cfg(true)
    };
    check("ingress_ipv6", &inpod_ruleset(&c).render());
}

#[test]
fn virtual_interfaces_case() {
    let c = InpodConfig {
        reroute_virtual_interfaces: virtual_interfaces(),
        redirect_dns: false,
        ..cfg(false)
    };
    check("virtual_interfaces", &inpod_ruleset(&c).render());
}

#[test]
fn virtual_interfaces_ipv6() {
    let c = InpodConfig {
        reroute_virtual_interfaces: virtual_interfaces(),
        redirect_dns: false,
        ..cfg(true)
    };
    check("virtual_interfaces_ipv6", &inpod_ruleset(&c).render());
}

#[test]
fn ingress_and_virtual_interfaces() {
    let c = InpodConfig {
        ingress_mode: true,
        reroute_virtual_interfaces: virtual_interfaces(),
        redirect_dns: false,
        ..cfg(false)
    };
    check(
        "ingress_and_virtual_interfaces",
        &inpod_ruleset(&c).render(),
    );
}

/// The pod enables DNS capture while it is off globally: the effective setting is "on", so the
/// rules equal the default case.
#[test]
fn dns_pod_enabled_and_off_globally() {
    let text = inpod_ruleset(&InpodConfig {
        redirect_dns: true,
        ..cfg(false)
    })
    .render();
    check("dns_pod_enabled_and_off_globally", &text);
    check("default", &text);
}

#[test]
fn dns_pod_disabled_and_on_globally() {
    let c = InpodConfig {
        redirect_dns: false,
        ..cfg(false)
    };
    check(
        "dns_pod_disabled_and_on_globally",
        &inpod_ruleset(&c).render(),
    );
}

#[test]
fn hostprobe() {
    check("hostprobe", &host_ruleset(&host(false)).render());
}

#[test]
fn hostprobe_ipv6() {
    check("hostprobe_ipv6", &host_ruleset(&host(true)).render());
}

/// A hand-checked anchor independent of the golden files: the rule lines Istio's default golden
/// carries, normalised as described above, appear in our rendering in the same order.
#[test]
fn default_matches_istio_rule_lines() {
    let istio = "\
add rule inet istio-ambient-nat output jump istio-output
add rule inet istio-ambient-nat prerouting jump istio-prerouting
add rule inet istio-ambient-nat istio-prerouting meta l4proto tcp ip saddr 169.254.7.127 counter accept
add rule inet istio-ambient-nat istio-output meta l4proto tcp ip daddr 169.254.7.127 counter accept
add rule inet istio-ambient-nat istio-prerouting ip daddr != 127.0.0.1/32 tcp dport != 15008 mark and 0xfff  != 0x539 counter redirect to :15006
add rule inet istio-ambient-nat istio-output oifname != lo mark and 0xfff != 0x539 udp dport 53 counter redirect to :15053
add rule inet istio-ambient-nat istio-output ip daddr != 127.0.0.1/32 tcp dport 53 mark and 0xfff != 0x539 counter redirect to :15053
add rule inet istio-ambient-nat istio-output meta l4proto tcp mark and 0xfff == 0x111 counter accept
add rule inet istio-ambient-nat istio-output oifname lo ip daddr != 127.0.0.1/32 counter accept
add rule inet istio-ambient-nat istio-output meta l4proto tcp ip daddr != 127.0.0.1/32 mark and 0xfff != 0x539 counter redirect to :15001
add rule inet istio-ambient-mangle prerouting jump istio-prerouting
add rule inet istio-ambient-mangle output jump istio-output
add rule inet istio-ambient-mangle istio-prerouting meta mark & 0xfff == 0x539 counter ct mark set ct mark & 0xfffff000 |  0x111
add rule inet istio-ambient-mangle istio-output ct mark and 0xfff == 0x111 counter meta mark set ct mark
add rule inet istio-ambient-raw prerouting jump istio-prerouting
add rule inet istio-ambient-raw output jump istio-output
add rule inet istio-ambient-raw istio-output udp dport 53 meta mark and 0xfff == 0x539 counter ct zone set 1
add rule inet istio-ambient-raw istio-prerouting udp sport 53 meta mark and 0xfff != 0x539 counter ct zone set 1
";
    let normalise = |s: &str| {
        s.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace("meta mark & ", "mark and ")
            .replace("meta mark and ", "mark and ")
    };
    let ours: Vec<String> = inpod_ruleset(&cfg(false))
        .render()
        .lines()
        .filter(|l| l.starts_with("add rule"))
        .map(normalise)
        .collect();
    let theirs: Vec<String> = istio.lines().map(normalise).collect();
    assert_eq!(ours, theirs);
}
