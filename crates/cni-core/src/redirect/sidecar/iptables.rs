//! The sidecar rule set in iptables syntax: `iptables-restore` input byte-identical to Istio's
//! `istio-iptables` output for the same inputs. It uses the shared [`Rule`] model and restore
//! renderer, so verification and replacement work as for ambient.
//! `tests/istio_conformance_sidecar.rs` and `tests/sidecar_golden.rs` check it against Istio's
//! goldens.

use ipnet::{IpNet, Ipv4Net};

use super::{
    DNS_PROXY_PORT, INBOUND_PORT, INBOUND_TPROXY_MARK, InterceptionMode, IpRanges, OUTBOUND_MARK,
    OUTBOUND_PORT, OwnerGroups, Ports, SidecarConfig, TUNNEL_PORT, families,
};
use crate::redirect::iptables::{Family, Position, Rule, restore_text};

const ISTIO_INBOUND: &str = "ISTIO_INBOUND";
const ISTIO_REDIRECT: &str = "ISTIO_REDIRECT";
const ISTIO_IN_REDIRECT: &str = "ISTIO_IN_REDIRECT";
const ISTIO_OUTPUT: &str = "ISTIO_OUTPUT";
const ISTIO_OUTPUT_DNS: &str = "ISTIO_OUTPUT_DNS";
const ISTIO_DIVERT: &str = "ISTIO_DIVERT";
const ISTIO_TPROXY: &str = "ISTIO_TPROXY";
const ISTIO_DROP: &str = "ISTIO_DROP";

/// Rules in the order Istio's builder emits them, for one family.
struct Builder {
    family: Family,
    loopback_v4: Ipv4Net,
    rules: Vec<Rule>,
}

impl Builder {
    fn add(&mut self, table: &'static str, chain: &'static str, args: String) {
        self.rules.push(Rule {
            table,
            chain,
            position: Position::Append,
            args,
        });
    }

    fn insert(&mut self, table: &'static str, chain: &'static str, pos: u32, args: String) {
        self.rules.push(Rule {
            table,
            chain,
            position: Position::Insert(pos),
            args,
        });
    }

    fn pick<'a>(&self, v4: &'a str, v6: &'a str) -> &'a str {
        match self.family {
            Family::V4 => v4,
            Family::V6 => v6,
        }
    }

    fn lo(&self) -> String {
        match self.family {
            Family::V4 => self.loopback_v4.to_string(),
            Family::V6 => self.family.loopback().to_string(),
        }
    }

    fn inbound_passthrough(&self) -> &'static str {
        self.pick("127.0.0.6/32", "::6/128")
    }

    fn matches(&self, net: &IpNet) -> bool {
        matches!(
            (self.family, net),
            (Family::V4, IpNet::V4(_)) | (Family::V6, IpNet::V6(_))
        )
    }
}

/// The sidecar rules for one family, as `istio-iptables` orders them.
/// The sidecar rules for one family, as `istio-iptables` orders them.
pub fn rules(cfg: &SidecarConfig, family: Family) -> Vec<Rule> {
    let mut b = Builder {
        family,
        loopback_v4: cfg.loopback_v4,
        rules: Vec::new(),
    };
    interfaces_and_fixed_chains(&mut b, cfg);
    inbound(&mut b, cfg);
    outbound(&mut b, cfg);
    outbound_ranges(&mut b, cfg);
    if cfg.mode == InterceptionMode::Tproxy {
        tproxy_tail(&mut b, cfg);
    }
    b.rules
}

/// `iptables-restore --noflush` input per programmed family.
pub fn restore(cfg: &SidecarConfig) -> Vec<(Family, String)> {
    families(cfg)
        .into_iter()
        .map(|f| (f, restore_text(&rules(cfg, f))))
        .collect()
}

/// Excluded and virtual interfaces, the INVALID drop, and the chains every mode starts with.
fn interfaces_and_fixed_chains(b: &mut Builder, cfg: &SidecarConfig) {
    let tproxy = cfg.mode == InterceptionMode::Tproxy;

    for i in &cfg.exclude_interfaces {
        b.add("nat", "PREROUTING", format!("-i {i} -j RETURN"));
        b.add("nat", "OUTPUT", format!("-o {i} -j RETURN"));
    }
    if tproxy {
        for i in &cfg.exclude_interfaces {
            b.add("mangle", "PREROUTING", format!("-i {i} -j RETURN"));
            b.add("mangle", "OUTPUT", format!("-o {i} -j RETURN"));
        }
    }
    for i in &cfg.reroute_virtual_interfaces {
        b.insert("nat", "PREROUTING", 1, format!("-i {i} -j RETURN"));
    }
    if cfg.drop_invalid {
        b.add(
            "mangle",
            "PREROUTING",
            format!("-m conntrack --ctstate INVALID -j {ISTIO_DROP}"),
        );
        b.add("mangle", ISTIO_DROP, "-j DROP".into());
    }
    b.add(
        "nat",
        ISTIO_INBOUND,
        format!("-p tcp --dport {TUNNEL_PORT} -j RETURN"),
    );
    b.add(
        "nat",
        ISTIO_REDIRECT,
        format!("-p tcp -j REDIRECT --to-ports {OUTBOUND_PORT}"),
    );
    b.add(
        "nat",
        ISTIO_IN_REDIRECT,
        format!("-p tcp -j REDIRECT --to-ports {INBOUND_PORT}"),
    );
}

/// Everything from the OUTPUT jump to the outbound port includes: what returns unredirected.
fn outbound(b: &mut Builder, cfg: &SidecarConfig) {
    let (uid, gid) = (cfg.proxy_uid, cfg.proxy_gid);
    let lo = b.lo();
    b.add("nat", "OUTPUT", format!("-j {ISTIO_OUTPUT}"));
    for p in &cfg.exclude_outbound_ports {
        b.add("nat", ISTIO_OUTPUT, format!("-p tcp --dport {p} -j RETURN"));
        b.add("nat", ISTIO_OUTPUT, format!("-p udp --dport {p} -j RETURN"));
    }
    let passthrough = b.inbound_passthrough();
    b.add(
        "nat",
        ISTIO_OUTPUT,
        format!("-o lo -s {passthrough} -j RETURN"),
    );
    // Include ranges that contain loopback capture the app's own loopback traffic too, so the
    // "app on lo → straight through" shortcut must not exist then.
    let include_has_loopback = match &cfg.include_outbound_ip_ranges {
        IpRanges::All => false,
        IpRanges::List(nets) => nets.iter().any(|n| n.addr().is_loopback()),
    };
    for (flag, id) in [("--uid-owner", uid), ("--gid-owner", gid)] {
        let not_tunnel = if cfg.redirect_dns && flag == "--uid-owner" {
            format!("-m multiport ! --dports 53,{TUNNEL_PORT}")
        } else {
            format!("! --dport {TUNNEL_PORT}")
        };
        b.add(
            "nat",
            ISTIO_OUTPUT,
            format!(
                "-o lo ! -d {lo} -p tcp {not_tunnel} -m owner {flag} {id} -j {ISTIO_IN_REDIRECT}"
            ),
        );
        if !include_has_loopback {
            let args = if cfg.redirect_dns {
                format!("-o lo -p tcp ! --dport 53 -m owner ! {flag} {id} -j RETURN")
            } else {
                format!("-o lo -m owner ! {flag} {id} -j RETURN")
            };
            b.add("nat", ISTIO_OUTPUT, args);
        }
        b.add(
            "nat",
            ISTIO_OUTPUT,
            format!("-m owner {flag} {id} -j RETURN"),
        );
    }
    match &cfg.owner_groups {
        OwnerGroups::AllExcept(groups) => {
            for g in groups {
                b.add(
                    "nat",
                    ISTIO_OUTPUT,
                    format!("-m owner --gid-owner {g} -j RETURN"),
                );
            }
        }
        OwnerGroups::Only(groups) => {
            let matches: Vec<String> = groups
                .iter()
                .map(|g| format!("-m owner ! --gid-owner {g} "))
                .collect();
            b.add(
                "nat",
                ISTIO_OUTPUT,
                format!("{}-j RETURN", matches.concat()),
            );
        }
    }
    if cfg.redirect_dns {
        dns(b, cfg);
    }
    b.add("nat", ISTIO_OUTPUT, format!("-d {lo} -j RETURN"));
    let excluded: Vec<IpNet> = cfg
        .exclude_outbound_ip_ranges
        .iter()
        .filter(|n| b.matches(n))
        .copied()
        .collect();
    for net in excluded {
        b.add("nat", ISTIO_OUTPUT, format!("-d {net} -j RETURN"));
    }
    for p in &cfg.include_outbound_ports {
        b.add(
            "nat",
            ISTIO_OUTPUT,
            format!("-p tcp --dport {p} -j {ISTIO_REDIRECT}"),
        );
    }
}

/// The outbound capture by destination, and the virtual interfaces' redirect to it.
fn outbound_ranges(b: &mut Builder, cfg: &SidecarConfig) {
    match &cfg.include_outbound_ip_ranges {
        IpRanges::All => {
            b.add("nat", ISTIO_OUTPUT, format!("-j {ISTIO_REDIRECT}"));
            for i in &cfg.reroute_virtual_interfaces {
                b.insert(
                    "nat",
                    "PREROUTING",
                    1,
                    format!("-i {i} -j {ISTIO_REDIRECT}"),
                );
            }
        }
        IpRanges::List(nets) => {
            let nets: Vec<IpNet> = nets.iter().filter(|n| b.matches(n)).copied().collect();
            for net in nets {
                for i in &cfg.reroute_virtual_interfaces {
                    b.insert(
                        "nat",
                        "PREROUTING",
                        1,
                        format!("-i {i} -d {net} -j {ISTIO_REDIRECT}"),
                    );
                }
                b.add("nat", ISTIO_OUTPUT, format!("-d {net} -j {ISTIO_REDIRECT}"));
            }
        }
    }
}

fn inbound(b: &mut Builder, cfg: &SidecarConfig) {
    let tproxy = cfg.mode == InterceptionMode::Tproxy;
    if matches!(&cfg.include_inbound_ports, Ports::List(p) if p.is_empty()) {
        return;
    }
    let table = if tproxy {
        b.add(
            "mangle",
            ISTIO_DIVERT,
            format!("-j MARK --set-mark {INBOUND_TPROXY_MARK}"),
        );
        b.add("mangle", ISTIO_DIVERT, "-j ACCEPT".into());
        let lo = b.lo();
        b.add(
            "mangle",
            ISTIO_TPROXY,
            format!(
                "! -d {lo} -p tcp -j TPROXY --tproxy-mark {INBOUND_TPROXY_MARK}/0xffffffff --on-port {INBOUND_PORT}"
            ),
        );
        "mangle"
    } else {
        "nat"
    };
    b.add(table, "PREROUTING", format!("-p tcp -j {ISTIO_INBOUND}"));
    match &cfg.include_inbound_ports {
        Ports::All => {
            for p in &cfg.exclude_inbound_ports {
                b.add(
                    table,
                    ISTIO_INBOUND,
                    format!("-p tcp --dport {p} -j RETURN"),
                );
            }
            if tproxy {
                b.add(
                    "mangle",
                    ISTIO_INBOUND,
                    format!("-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j {ISTIO_DIVERT}"),
                );
                b.add("mangle", ISTIO_INBOUND, format!("-p tcp -j {ISTIO_TPROXY}"));
            } else {
                b.add(
                    "nat",
                    ISTIO_INBOUND,
                    format!("-p tcp -j {ISTIO_IN_REDIRECT}"),
                );
            }
        }
        Ports::List(ports) => {
            for p in ports {
                if tproxy {
                    b.add(
                        "mangle",
                        ISTIO_INBOUND,
                        format!(
                            "-p tcp --dport {p} -m conntrack --ctstate RELATED,ESTABLISHED -j {ISTIO_DIVERT}"
                        ),
                    );
                    b.add(
                        "mangle",
                        ISTIO_INBOUND,
                        format!("-p tcp --dport {p} -j {ISTIO_TPROXY}"),
                    );
                } else {
                    b.add(
                        "nat",
                        ISTIO_INBOUND,
                        format!("-p tcp --dport {p} -j {ISTIO_IN_REDIRECT}"),
                    );
                }
            }
        }
    }
}

fn dns(b: &mut Builder, cfg: &SidecarConfig) {
    let (uid, gid) = (cfg.proxy_uid, cfg.proxy_gid);
    b.add("raw", "OUTPUT", format!("-j {ISTIO_OUTPUT_DNS}"));
    b.add("nat", ISTIO_OUTPUT, format!("-j {ISTIO_OUTPUT_DNS}"));
    b.add(
        "nat",
        ISTIO_OUTPUT_DNS,
        format!("-p tcp --dport 53 -j REDIRECT --to-ports {DNS_PROXY_PORT}"),
    );
    b.add(
        "nat",
        ISTIO_OUTPUT_DNS,
        format!("-p udp --dport 53 -j REDIRECT --to-port {DNS_PROXY_PORT}"),
    );
    // The proxy's upstream queries and its answers to the app get separate conntrack zones, so
    // the two legs of one lookup never share (and clash on) a conntrack entry.
    for (flag, id) in [("--uid-owner", uid), ("--gid-owner", gid)] {
        b.add(
            "raw",
            ISTIO_OUTPUT_DNS,
            format!("-p udp --dport 53 -m owner {flag} {id} -j CT --zone 1"),
        );
        b.add(
            "raw",
            ISTIO_OUTPUT_DNS,
            format!("-p udp --sport {DNS_PROXY_PORT} -m owner {flag} {id} -j CT --zone 2"),
        );
    }
    b.add("raw", "PREROUTING", format!("-j {ISTIO_INBOUND}"));
    b.add(
        "raw",
        ISTIO_OUTPUT_DNS,
        "-p udp --dport 53 -j CT --zone 2".into(),
    );
    b.add(
        "raw",
        ISTIO_INBOUND,
        "-p udp --sport 53 -j CT --zone 1".into(),
    );
}

fn tproxy_tail(b: &mut Builder, cfg: &SidecarConfig) {
    let lo = b.lo();
    b.add(
        "mangle",
        "PREROUTING",
        format!("-p tcp -m mark --mark {INBOUND_TPROXY_MARK} -j CONNMARK --save-mark"),
    );
    b.add(
        "mangle",
        "OUTPUT",
        format!("-p tcp -o lo -m mark --mark {INBOUND_TPROXY_MARK} -j RETURN"),
    );
    for (flag, id) in [
        ("--uid-owner", cfg.proxy_uid),
        ("--gid-owner", cfg.proxy_gid),
    ] {
        b.add(
            "mangle",
            "OUTPUT",
            format!(
                "! -d {lo} -p tcp -o lo -m owner {flag} {id} -j MARK --set-mark {OUTBOUND_MARK}"
            ),
        );
    }
    b.add(
        "mangle",
        "OUTPUT",
        format!("-p tcp -m connmark --mark {INBOUND_TPROXY_MARK} -j CONNMARK --restore-mark"),
    );
    b.insert(
        "mangle",
        ISTIO_INBOUND,
        1,
        format!("-p tcp -m mark --mark {INBOUND_TPROXY_MARK} -j RETURN"),
    );
    let passthrough = b.inbound_passthrough();
    b.insert(
        "mangle",
        ISTIO_INBOUND,
        2,
        format!("-p tcp -s {passthrough} -i lo -j RETURN"),
    );
    b.insert(
        "mangle",
        ISTIO_INBOUND,
        3,
        format!("-p tcp -i lo -m mark ! --mark {OUTBOUND_MARK} -j RETURN"),
    );
}
