//! The iptables rule sets, byte for byte against goldens derived from Istio's own test vectors
//! (`cni/pkg/iptables/testdata`). Set `UPDATE_GOLDEN` never: these files are the reference, not
//! a snapshot of our output.

use std::net::Ipv6Addr;
use std::path::PathBuf;

use cni_core::redirect::iptables::{Family, host_probe_rules, inpod_restore, restore_text};
use cni_core::redirect::overrides::{self, DNS_CAPTURE};
use cni_core::redirect::{InpodConfig, InterfaceName};

fn golden(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/iptables")
        .join(format!("{name}.golden"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Istio's test configuration: v6 probe address differs from the production default.
fn base(ipv6: bool) -> InpodConfig {
    InpodConfig {
        ipv6,
        probe_snat_v6: "e9ac:1e77:90ca:399f:4d6d:ece2:2f9b:3164"
            .parse::<Ipv6Addr>()
            .unwrap(),
        ..InpodConfig::default()
    }
}

fn rendered(cfg: &InpodConfig) -> String {
    inpod_restore(cfg)
        .into_iter()
        .map(|(_, text)| text)
        .collect()
}

fn vifs() -> Vec<InterfaceName> {
    vec![
        InterfaceName::new("fake1s0f0").unwrap(),
        InterfaceName::new("fake1s0f1").unwrap(),
    ]
}

fn check(name: &str, cfg: InpodConfig) {
    assert_eq!(rendered(&cfg), golden(name), "{name}");
}

macro_rules! golden_case {
    ($v4:ident, $v6:ident, $cfg:expr) => {
        #[test]
        fn $v4() {
            let f: fn(bool) -> InpodConfig = $cfg;
            check(stringify!($v4), f(false));
        }
        #[test]
        fn $v6() {
            let f: fn(bool) -> InpodConfig = $cfg;
            check(stringify!($v6), f(true));
        }
    };
}

golden_case!(default, default_ipv6, |v6| base(v6));
golden_case!(ingress, ingress_ipv6, |v6| InpodConfig {
    redirect_dns: false,
    ingress_mode: true,
    ..base(v6)
});
golden_case!(virtual_interfaces, virtual_interfaces_ipv6, |v6| {
    InpodConfig {
        redirect_dns: false,
        reroute_virtual_interfaces: vifs(),
        ..base(v6)
    }
});
golden_case!(
    ingress_and_virtual_interfaces,
    ingress_and_virtual_interfaces_ipv6,
    |v6| InpodConfig {
        redirect_dns: false,
        ingress_mode: true,
        reroute_virtual_interfaces: vifs(),
        ..base(v6)
    }
);
// The DNS cases go through the annotation path, as the agent does.
golden_case!(
    dns_pod_enabled_and_off_globally,
    dns_pod_enabled_and_off_globally_ipv6,
    |v6| {
        let global = InpodConfig {
            redirect_dns: false,
            ..base(v6)
        };
        overrides::inpod_config(&global, [(DNS_CAPTURE, "true")])
            .unwrap()
            .0
    }
);
golden_case!(
    dns_pod_disabled_and_on_globally,
    dns_pod_disabled_and_on_globally_ipv6,
    |v6| {
        let global = InpodConfig {
            redirect_dns: true,
            ..base(v6)
        };
        overrides::inpod_config(&global, [(DNS_CAPTURE, "false")])
            .unwrap()
            .0
    }
);

#[test]
fn hostprobe() {
    let cfg = InpodConfig::default();
    assert_eq!(
        restore_text(&host_probe_rules(&cfg, Family::V4)),
        golden("hostprobe")
    );
}

#[test]
fn hostprobe_ipv6() {
    let cfg = InpodConfig::default();
    let text = restore_text(&host_probe_rules(&cfg, Family::V4))
        + &restore_text(&host_probe_rules(&cfg, Family::V6));
    assert_eq!(text, golden("hostprobe_ipv6"));
}
