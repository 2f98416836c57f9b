//! The ambient rule sets as nftables data: the in-pod tables (`istio-ambient-*`) and the host's
//! probe SNAT table, built in Istio's transaction order so their rendering matches Istio's.
//! `tests/istio_conformance_ambient.rs` checks it against the pinned Istio's goldens.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{InpodConfig, consts};
use crate::redirect::nft::{
    AddrField, Chain, ChainType, CmpOp, Expr, Hook, IfField, L4Proto, OUTPUT, POSTROUTING,
    PREROUTING, PortField, Prefix, Ruleset, Set, SetKey, Table, Verdict,
};

pub const NAT_TABLE: &str = "istio-ambient-nat";
pub const MANGLE_TABLE: &str = "istio-ambient-mangle";
pub const RAW_TABLE: &str = "istio-ambient-raw";
/// Every table the in-pod rule set may create; `remove` and `verify` look at exactly these.
pub const INPOD_TABLES: [&str; 3] = [NAT_TABLE, MANGLE_TABLE, RAW_TABLE];

pub const ISTIO_PREROUTING: &str = "istio-prerouting";
pub const ISTIO_OUTPUT: &str = "istio-output";

/// Comment Istio puts on the host probe sets.
pub const PROBE_SET_COMMENT: &str = "UUID of the pods that are part of ambient mesh";

/// Loopback destinations that are never captured.
const LOOPBACK_V4: Prefix = Prefix {
    addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
    len: 32,
};
const LOOPBACK_V6: Prefix = Prefix {
    addr: IpAddr::V6(Ipv6Addr::LOCALHOST),
    len: 128,
};
/// `ct mark set ct mark & KEEP | 0x111`: keeps the connmark bits outside our mask.
const CT_MARK_KEEP: u32 = !consts::MARK_MASK;
/// Where pods send DNS (the port ztunnel's DNS proxy captures), not the proxy's own port.
const DNS_SERVER_PORT: u16 = 53;

/// The three in-pod tables, filled in Istio's order; within a table that order is the rendering's.
struct InpodTables {
    nat: Table,
    mangle: Table,
    raw: Table,
}

impl InpodTables {
    fn new() -> Self {
        let mut nat = Table::new(NAT_TABLE);
        let mut mangle = Table::new(MANGLE_TABLE);
        let mut raw = Table::new(RAW_TABLE);
        for (table, pre, out) in [
            (&mut nat, (ChainType::Nat, -100), (ChainType::Nat, -100)),
            (
                &mut mangle,
                (ChainType::Filter, -150),
                (ChainType::Route, -150),
            ),
            (
                &mut raw,
                (ChainType::Filter, -300),
                (ChainType::Filter, -300),
            ),
        ] {
            table.chains = vec![
                Chain::base(PREROUTING, pre.0, Hook::Prerouting, pre.1),
                Chain::base(OUTPUT, out.0, Hook::Output, out.1),
                Chain::regular(ISTIO_PREROUTING),
                Chain::regular(ISTIO_OUTPUT),
            ];
        }
        InpodTables { nat, mangle, raw }
    }
}

fn jump(chain: &str) -> Vec<Expr> {
    vec![Expr::Verdict(Verdict::Jump(chain.to_string()))]
}

/// The packet mark under our mask.
fn mark(op: CmpOp, value: u32) -> Expr {
    Expr::Mark {
        mask: consts::MARK_MASK,
        op,
        value,
    }
}

fn not_ztunnel() -> Expr {
    mark(CmpOp::Ne, consts::ZTUNNEL_MARK)
}

fn addr(field: AddrField, op: CmpOp, prefix: Prefix) -> Expr {
    Expr::Addr { field, op, prefix }
}

fn tcp() -> Expr {
    Expr::L4Proto(L4Proto::Tcp)
}

fn accept() -> Expr {
    Expr::Verdict(Verdict::Accept)
}

/// Per programmed family: the probe SNAT source and the loopback destination. Each IPv4 rule that
/// names an address has an IPv6 twin right after it.
fn family_addrs(cfg: &InpodConfig) -> Vec<(IpAddr, Prefix)> {
    let mut f = vec![(IpAddr::V4(cfg.probe_snat_v4), LOOPBACK_V4)];
    if cfg.ipv6 {
        f.push((IpAddr::V6(cfg.probe_snat_v6), LOOPBACK_V6));
    }
    f
}

/// Builds the in-pod rule set for `cfg`, in Istio's transaction order (nat, mangle, raw; rules in
/// the order Istio appends them). The raw table exists only with DNS capture.
pub fn inpod_ruleset(cfg: &InpodConfig) -> Ruleset {
    let mut t = InpodTables::new();
    let fams = family_addrs(cfg);
    hook_jumps(&mut t, cfg);
    inbound(&mut t, cfg, &fams);
    t.mangle.push(
        ISTIO_OUTPUT,
        vec![
            Expr::CtMark {
                mask: consts::MARK_MASK,
                op: CmpOp::Eq,
                value: consts::ZTUNNEL_CONNMARK,
            },
            Expr::Counter,
            Expr::MarkSetCtMark,
        ],
    );
    if cfg.redirect_dns {
        dns(&mut t, &fams);
    }
    outbound(&mut t, &fams);
    let InpodTables { nat, mangle, raw } = t;
    let mut tables = vec![nat, mangle];
    if cfg.redirect_dns {
        tables.push(raw);
    }
    Ruleset { tables }
}

/// The base chains' jumps into ours; raw only for DNS capture.
fn hook_jumps(t: &mut InpodTables, cfg: &InpodConfig) {
    t.mangle.push(PREROUTING, jump(ISTIO_PREROUTING));
    t.mangle.push(OUTPUT, jump(ISTIO_OUTPUT));
    t.nat.push(OUTPUT, jump(ISTIO_OUTPUT));
    if cfg.redirect_dns {
        t.raw.push(PREROUTING, jump(ISTIO_PREROUTING));
        t.raw.push(OUTPUT, jump(ISTIO_OUTPUT));
    }
    t.nat.push(PREROUTING, jump(ISTIO_PREROUTING));
}

/// Virtual interfaces, ztunnel's connmark, the probe bypasses and the inbound capture.
fn inbound(t: &mut InpodTables, cfg: &InpodConfig, fams: &[(IpAddr, Prefix)]) {
    // Virtual interfaces short-circuit first: inbound TCP on them is treated as outbound.
    for iface in &cfg.reroute_virtual_interfaces {
        let iif = || Expr::Iface {
            field: IfField::Iifname,
            op: CmpOp::Eq,
            name: iface.as_str().to_string(),
        };
        t.nat.push(
            ISTIO_PREROUTING,
            vec![
                iif(),
                tcp(),
                Expr::Counter,
                Expr::Redirect {
                    port: consts::OUTBOUND_PORT,
                },
            ],
        );
        t.nat.push(
            ISTIO_PREROUTING,
            vec![iif(), tcp(), Expr::Counter, Expr::Verdict(Verdict::Return)],
        );
    }

    // Packets ztunnel sends into the pod get a connmark, so the app's replies can be routed back.
    t.mangle.push(
        ISTIO_PREROUTING,
        vec![
            mark(CmpOp::Eq, consts::ZTUNNEL_MARK),
            Expr::Counter,
            Expr::CtMarkSetMasked {
                keep: CT_MARK_KEEP,
                or: consts::ZTUNNEL_CONNMARK,
            },
        ],
    );

    if !cfg.ingress_mode {
        for (probe, _) in fams {
            t.nat.push(
                ISTIO_PREROUTING,
                vec![
                    tcp(),
                    addr(AddrField::Saddr, CmpOp::Eq, Prefix::host(*probe)),
                    Expr::Counter,
                    accept(),
                ],
            );
        }
    }
    for (probe, _) in fams {
        t.nat.push(
            ISTIO_OUTPUT,
            vec![
                tcp(),
                addr(AddrField::Daddr, CmpOp::Eq, Prefix::host(*probe)),
                Expr::Counter,
                accept(),
            ],
        );
    }
    if !cfg.ingress_mode {
        for (_, lo) in fams {
            t.nat.push(
                ISTIO_PREROUTING,
                vec![
                    addr(AddrField::Daddr, CmpOp::Ne, *lo),
                    Expr::Port {
                        proto: L4Proto::Tcp,
                        field: PortField::Dport,
                        op: CmpOp::Ne,
                        port: consts::INBOUND_HBONE_PORT,
                    },
                    not_ztunnel(),
                    Expr::Counter,
                    Expr::Redirect {
                        port: consts::INBOUND_PLAINTEXT_PORT,
                    },
                ],
            );
        }
    }
}

/// DNS to ztunnel's DNS proxy, and the conntrack zone of the proxy's upstream queries.
fn dns(t: &mut InpodTables, fams: &[(IpAddr, Prefix)]) {
    let dns_redirect = Expr::Redirect {
        port: consts::DNS_PROXY_PORT,
    };
    t.nat.push(
        ISTIO_OUTPUT,
        vec![
            Expr::Iface {
                field: IfField::Oifname,
                op: CmpOp::Ne,
                name: "lo".to_string(),
            },
            not_ztunnel(),
            Expr::Port {
                proto: L4Proto::Udp,
                field: PortField::Dport,
                op: CmpOp::Eq,
                port: DNS_SERVER_PORT,
            },
            Expr::Counter,
            dns_redirect.clone(),
        ],
    );
    for (_, lo) in fams {
        t.nat.push(
            ISTIO_OUTPUT,
            vec![
                addr(AddrField::Daddr, CmpOp::Ne, *lo),
                Expr::Port {
                    proto: L4Proto::Tcp,
                    field: PortField::Dport,
                    op: CmpOp::Eq,
                    port: DNS_SERVER_PORT,
                },
                not_ztunnel(),
                Expr::Counter,
                dns_redirect.clone(),
            ],
        );
    }
    // Proxy <-> upstream DNS traffic gets its own conntrack zone so its ports cannot collide
    // with the app's own DNS flows.
    t.raw.push(
        ISTIO_OUTPUT,
        vec![
            Expr::Port {
                proto: L4Proto::Udp,
                field: PortField::Dport,
                op: CmpOp::Eq,
                port: DNS_SERVER_PORT,
            },
            mark(CmpOp::Eq, consts::ZTUNNEL_MARK),
            Expr::Counter,
            Expr::CtZoneSet(1),
        ],
    );
    t.raw.push(
        ISTIO_PREROUTING,
        vec![
            Expr::Port {
                proto: L4Proto::Udp,
                field: PortField::Sport,
                op: CmpOp::Eq,
                port: DNS_SERVER_PORT,
            },
            not_ztunnel(),
            Expr::Counter,
            Expr::CtZoneSet(1),
        ],
    );
}

/// Replies to ztunnel's connections, the app's own loopback calls, and the outbound capture.
fn outbound(t: &mut InpodTables, fams: &[(IpAddr, Prefix)]) {
    t.nat.push(
        ISTIO_OUTPUT,
        vec![
            tcp(),
            mark(CmpOp::Eq, consts::ZTUNNEL_CONNMARK),
            Expr::Counter,
            accept(),
        ],
    );
    // The app calling its own pod IP goes over lo and must not loop through ztunnel.
    for (_, lo) in fams {
        t.nat.push(
            ISTIO_OUTPUT,
            vec![
                Expr::Iface {
                    field: IfField::Oifname,
                    op: CmpOp::Eq,
                    name: "lo".to_string(),
                },
                addr(AddrField::Daddr, CmpOp::Ne, *lo),
                Expr::Counter,
                accept(),
            ],
        );
    }
    for (_, lo) in fams {
        t.nat.push(
            ISTIO_OUTPUT,
            vec![
                tcp(),
                addr(AddrField::Daddr, CmpOp::Ne, *lo),
                not_ztunnel(),
                Expr::Counter,
                Expr::Redirect {
                    port: consts::OUTBOUND_PORT,
                },
            ],
        );
    }
}

/// Inputs of the host-side probe rule (host network namespace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostProbeConfig {
    /// Owner of kubelet's sockets: only its probes are SNATed.
    pub kubelet_uid: u32,
    pub ipv6: bool,
    pub probe_snat_v4: Ipv4Addr,
    pub probe_snat_v6: Ipv6Addr,
}

pub fn probe_set_name(v6: bool) -> String {
    format!(
        "{}-{}",
        consts::PROBE_SET_PREFIX,
        if v6 { "v6" } else { "v4" }
    )
}

/// The host table: the probe address set(s) and the postrouting SNAT of kubelet's probes to
/// enrolled pods. nftables has no `--socket-exists`, so kubelet is recognised by its UID.
pub fn host_ruleset(cfg: &HostProbeConfig) -> Ruleset {
    let mut table = Table::new(NAT_TABLE);
    table.chains = vec![Chain::base(
        POSTROUTING,
        ChainType::Nat,
        Hook::Postrouting,
        100,
    )];
    let mut fams = vec![(false, IpAddr::V4(cfg.probe_snat_v4))];
    if cfg.ipv6 {
        fams.push((true, IpAddr::V6(cfg.probe_snat_v6)));
    }
    for (v6, snat) in fams {
        table.sets.push(Set {
            name: probe_set_name(v6),
            key: if v6 {
                SetKey::Ipv6Addr
            } else {
                SetKey::Ipv4Addr
            },
            comment: Some(PROBE_SET_COMMENT.to_string()),
        });
        table.push(
            POSTROUTING,
            vec![
                Expr::L4Proto(L4Proto::Tcp),
                Expr::Owner {
                    gid: false,
                    op: CmpOp::Eq,
                    id: cfg.kubelet_uid,
                },
                Expr::AddrInSet {
                    field: AddrField::Daddr,
                    v6,
                    set: probe_set_name(v6),
                },
                Expr::Counter,
                Expr::Snat { addr: snat },
            ],
        );
    }
    Ruleset {
        tables: vec![table],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negated_loopback_keeps_its_length_and_hosts_do_not() {
        let ne = Expr::Addr {
            field: AddrField::Daddr,
            op: CmpOp::Ne,
            prefix: LOOPBACK_V6,
        };
        assert_eq!(ne.to_string(), "ip6 daddr != ::1/128");
        let eq = Expr::Addr {
            field: AddrField::Saddr,
            op: CmpOp::Eq,
            prefix: Prefix::host(IpAddr::V4(consts::PROBE_SNAT_V4)),
        };
        assert_eq!(eq.to_string(), "ip saddr 169.254.7.127");
    }

    #[test]
    fn no_dns_means_no_raw_table() {
        let rs = inpod_ruleset(&InpodConfig {
            redirect_dns: false,
            ..InpodConfig::default()
        });
        assert!(rs.table(RAW_TABLE).is_none());
        let text = rs.render();
        assert!(!text.contains("dport 53") && !text.contains(":15053"));
    }
}
