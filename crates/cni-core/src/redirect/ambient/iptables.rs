//! The ambient rule sets in iptables syntax: `iptables-restore` input for the pod and the host,
//! and the removal commands.
//!
//! The restore text is byte-identical to Istio's (table order, `-N` order, rule order and
//! spelling), so a node can move between Istio's agent and ours without the rules looking drifted.
//! `tests/istio_conformance_ambient.rs` checks it against the pinned Istio's goldens.

use super::InpodConfig;
use super::consts::{
    DNS_PROXY_PORT, INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, MARK_MASK, OUTBOUND_PORT,
    ZTUNNEL_CONNMARK, ZTUNNEL_MARK,
};
use crate::redirect::iptables::{Family, Position, Rule, restore_text};

/// Chain jumped to from PREROUTING in the pod (mangle, nat, raw).
pub const CHAIN_PREROUTING: &str = "ISTIO_PRERT";
/// Chain jumped to from OUTPUT in the pod (mangle, nat, raw).
pub const CHAIN_OUTPUT: &str = "ISTIO_OUTPUT";
/// Host chain jumped to from nat POSTROUTING.
pub const CHAIN_HOST_POSTROUTING: &str = "ISTIO_POSTRT";

const RESTORE_MASK: u32 = 0xffff_ffff;

impl Family {
    /// Name of the host probe address set for this family.
    pub fn probe_set(self) -> String {
        super::nft::probe_set_name(self == Family::V6)
    }
}

fn mark(value: u32) -> String {
    format!("{value:#x}/{MARK_MASK:#x}")
}

/// The in-pod rules for one family, in Istio's append order.
pub fn inpod_rules(cfg: &InpodConfig, family: Family) -> Vec<Rule> {
    let ztunnel = mark(ZTUNNEL_MARK);
    let connmark = mark(ZTUNNEL_CONNMARK);
    let lo = family.loopback();
    let probe = match family {
        Family::V4 => cfg.probe_snat_v4.to_string(),
        Family::V6 => cfg.probe_snat_v6.to_string(),
    };
    let (pre, out) = (CHAIN_PREROUTING, CHAIN_OUTPUT);
    let mut r = vec![
        Rule::append("mangle", "PREROUTING", format!("-j {pre}")),
        Rule::append("mangle", "OUTPUT", format!("-j {out}")),
        Rule::append("nat", "OUTPUT", format!("-j {out}")),
    ];
    if cfg.redirect_dns {
        r.push(Rule::append("raw", "PREROUTING", format!("-j {pre}")));
        r.push(Rule::append("raw", "OUTPUT", format!("-j {out}")));
    }
    r.push(Rule::append("nat", "PREROUTING", format!("-j {pre}")));
    // Virtual interfaces (VMs, DinD) send their traffic in as if it were the pod's own egress.
    for iface in &cfg.reroute_virtual_interfaces {
        r.push(Rule::append(
            "nat",
            pre,
            format!("-i {iface} -p tcp -j REDIRECT --to-ports {OUTBOUND_PORT}"),
        ));
        r.push(Rule::append(
            "nat",
            pre,
            format!("-i {iface} -p tcp -j RETURN"),
        ));
    }
    // Packets ztunnel injects carry its mark; remember it on the connection so replies find it.
    // Ingress mode needs it too: inbound HBONE still reaches the pod through ztunnel, and without
    // the connmark the app's replies leave the pod instead of returning to ztunnel (Istio 1.29).
    r.push(Rule::append(
        "mangle",
        pre,
        format!("-m mark --mark {ztunnel} -j CONNMARK --set-xmark {connmark}"),
    ));
    if !cfg.ingress_mode {
        // Kubelet probes arrive SNATed to the probe address and go straight to the app.
        r.push(Rule::append(
            "nat",
            pre,
            format!("-s {probe} -p tcp -m tcp -j ACCEPT"),
        ));
    }
    r.push(Rule::append(
        "nat",
        out,
        format!("-d {probe} -p tcp -m tcp -j ACCEPT"),
    ));
    if !cfg.ingress_mode {
        r.push(Rule::append(
            "nat",
            pre,
            format!(
                "! -d {lo} -p tcp ! --dport {INBOUND_HBONE_PORT} -m mark ! --mark {ztunnel} -j REDIRECT --to-ports {INBOUND_PLAINTEXT_PORT}"
            ),
        ));
    }
    r.push(Rule::append(
        "mangle",
        out,
        format!(
            "-m connmark --mark {connmark} -j CONNMARK --restore-mark --nfmask {RESTORE_MASK:#x} --ctmask {RESTORE_MASK:#x}"
        ),
    ));
    if cfg.redirect_dns {
        r.push(Rule::append(
            "nat",
            out,
            format!("! -o lo -p udp -m mark ! --mark {ztunnel} -m udp --dport 53 -j REDIRECT --to-port {DNS_PROXY_PORT}"),
        ));
        r.push(Rule::append(
            "nat",
            out,
            format!("! -d {lo} -p tcp --dport 53 -m mark ! --mark {ztunnel} -j REDIRECT --to-ports {DNS_PROXY_PORT}"),
        ));
        // Separate conntrack zone for proxy<->upstream DNS so its ports never collide with the app's.
        r.push(Rule::append(
            "raw",
            out,
            format!("-p udp -m mark --mark {ztunnel} -m udp --dport 53 -j CT --zone 1"),
        ));
        r.push(Rule::append(
            "raw",
            pre,
            format!("-p udp -m mark ! --mark {ztunnel} -m udp --sport 53 -j CT --zone 1"),
        ));
    }
    r.push(Rule::append(
        "nat",
        out,
        format!("-p tcp -m mark --mark {connmark} -j ACCEPT"),
    ));
    // The app calling its own pod IP goes over lo and must not loop through ztunnel.
    r.push(Rule::append(
        "nat",
        out,
        format!("! -d {lo} -o lo -j ACCEPT"),
    ));
    r.push(Rule::append(
        "nat",
        out,
        format!(
            "! -d {lo} -p tcp -m mark ! --mark {ztunnel} -j REDIRECT --to-ports {OUTBOUND_PORT}"
        ),
    ));
    r
}

/// The host-netns probe SNAT rules for one family.
pub fn host_probe_rules(cfg: &InpodConfig, family: Family) -> Vec<Rule> {
    let to = match family {
        Family::V4 => cfg.probe_snat_v4.to_string(),
        Family::V6 => cfg.probe_snat_v6.to_string(),
    };
    vec![
        Rule {
            table: "nat",
            chain: "POSTROUTING",
            position: Position::Insert(1),
            args: format!("-j {CHAIN_HOST_POSTROUTING}"),
        },
        Rule::append(
            "nat",
            CHAIN_HOST_POSTROUTING,
            format!(
                "-m owner --socket-exists -p tcp -m set --match-set {} dst -j SNAT --to-source {to}",
                family.probe_set()
            ),
        ),
    ]
}

/// The in-pod restore text for every family `cfg` enables (v4 first).
pub fn inpod_restore(cfg: &InpodConfig) -> Vec<(Family, String)> {
    families(cfg)
        .into_iter()
        .map(|f| (f, restore_text(&inpod_rules(cfg, f))))
        .collect()
}

/// The families `cfg` programs.
pub fn families(cfg: &InpodConfig) -> Vec<Family> {
    if cfg.ipv6 {
        vec![Family::V4, Family::V6]
    } else {
        vec![Family::V4]
    }
}

/// Istio's in-pod removal, as `iptables` argument lists, in order; every error is ignored (the
/// optional raw chains and already-removed jumps fail harmlessly).
pub fn inpod_removal_commands() -> Vec<Vec<&'static str>> {
    let (pre, out) = (CHAIN_PREROUTING, CHAIN_OUTPUT);
    let mut cmds = vec![
        vec!["-t", "mangle", "-D", "PREROUTING", "-j", pre],
        vec!["-t", "mangle", "-D", "OUTPUT", "-j", out],
        vec!["-t", "nat", "-D", "OUTPUT", "-j", out],
        vec!["-t", "raw", "-D", "PREROUTING", "-j", pre],
        vec!["-t", "raw", "-D", "OUTPUT", "-j", out],
        vec!["-t", "nat", "-D", "PREROUTING", "-j", pre],
    ];
    for op in ["-F", "-X"] {
        for table in ["mangle", "nat", "raw"] {
            for chain in [pre, out] {
                cmds.push(vec!["-t", table, op, chain]);
            }
        }
    }
    cmds
}

/// Host rule removal (run before re-creating them at startup, and on shutdown).
pub fn host_removal_commands() -> Vec<Vec<&'static str>> {
    let c = CHAIN_HOST_POSTROUTING;
    vec![
        vec!["-t", "nat", "-D", "POSTROUTING", "-j", c],
        vec!["-t", "nat", "-F", c],
        vec!["-t", "nat", "-X", c],
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_commands_match_istio_order() {
        let cmds = inpod_removal_commands();
        assert_eq!(cmds.len(), 18);
        assert_eq!(
            cmds[0],
            ["-t", "mangle", "-D", "PREROUTING", "-j", "ISTIO_PRERT"]
        );
        assert_eq!(
            cmds[5],
            ["-t", "nat", "-D", "PREROUTING", "-j", "ISTIO_PRERT"]
        );
        assert_eq!(cmds[6], ["-t", "mangle", "-F", "ISTIO_PRERT"]);
        assert_eq!(cmds[17], ["-t", "raw", "-X", "ISTIO_OUTPUT"]);
    }
}
