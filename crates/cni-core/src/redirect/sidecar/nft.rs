//! The sidecar rule set as native nftables (`native_nftables`): the same decisions as
//! [`super::iptables`], expressed in the shared nftables model, in Istio's `istio-proxy-*` tables
//! (family `inet`, one table per hook group for both address families). Istio's
//! `insert rule … index N` steps are resolved here, so the model holds every chain in its final
//! order.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use super::{
    DNS_PROXY_PORT, INBOUND_PORT, INBOUND_TPROXY_MARK, InterceptionMode, IpRanges, OUTBOUND_MARK,
    OUTBOUND_PORT, OwnerGroups, Ports, SidecarConfig, TUNNEL_PORT,
};
use crate::redirect::nft::{
    AddrField, Chain, ChainType, CmpOp, Expr, Hook, IfField, L4Proto, OUTPUT, PREROUTING,
    PortField, Prefix, Rule, Ruleset, Table, Verdict, ct_state,
};

pub const NAT_TABLE: &str = "istio-proxy-nat";
pub const MANGLE_TABLE: &str = "istio-proxy-mangle";
pub const RAW_TABLE: &str = "istio-proxy-raw";
/// Every table the sidecar rule set may create; `remove` and `verify` look at exactly these.
pub const TABLES: [&str; 3] = [NAT_TABLE, MANGLE_TABLE, RAW_TABLE];

const INBOUND: &str = "istio-inbound";
const REDIRECT: &str = "istio-redirect";
const IN_REDIRECT: &str = "istio-in-redirect";
const OUT: &str = "istio-output";
const OUT_DNS: &str = "istio-output-dns";
const DIVERT: &str = "istio-divert";
const TPROXY: &str = "istio-tproxy";
const DROP: &str = "istio-drop";

/// Rules of one table in evaluation order per chain.
struct Tbl {
    name: &'static str,
    rules: Vec<Rule>,
}

impl Tbl {
    fn add(&mut self, chain: &str, exprs: Vec<Expr>) {
        self.rules.push(Rule::new(chain, exprs));
    }

    /// Istio's `insert rule … index <index>` in `chain` once per entry of `each`, in its order,
    /// as one splice: inserting a rule at a time scanned and shifted the whole table per rule,
    /// quadratic in the rules one pod's annotations ask for (virtual interfaces × included
    /// ranges; seconds for a few hundred names). Each insert goes before the rule then at `index`
    /// (after the chain's last rule when it is shorter), so entries that find the chain shorter
    /// than `index` land in order and every later one before its predecessor.
    fn insert_each(
        &mut self,
        chain: &str,
        index: usize,
        each: impl IntoIterator<Item = Vec<Expr>>,
    ) {
        let mut batch: Vec<Rule> = each.into_iter().map(|e| Rule::new(chain, e)).collect();
        let at: Vec<usize> = self
            .rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.chain == chain)
            .map(|(i, _)| i)
            .collect();
        let in_order = index.saturating_sub(at.len()).min(batch.len());
        batch[in_order..].reverse();
        let pos = match at.get(index) {
            Some(p) => *p,
            None => at.last().map_or(self.rules.len(), |p| p + 1),
        };
        self.rules.splice(pos..pos, batch);
    }

    /// The table with its base chains (only those with rules) and regular chains in order of
    /// first use.
    fn finish(self, pre: (ChainType, i32), out: (ChainType, i32)) -> Option<Table> {
        if self.rules.is_empty() {
            return None;
        }
        let mut chains: Vec<Chain> = Vec::new();
        for (name, (kind, prio), hook) in [
            (PREROUTING, pre, Hook::Prerouting),
            (OUTPUT, out, Hook::Output),
        ] {
            if self.rules.iter().any(|r| r.chain == name) {
                chains.push(Chain::base(name, kind, hook, prio));
            }
        }
        let mut regular: Vec<String> = Vec::new();
        for rule in &self.rules {
            let jump = rule.exprs.iter().find_map(|e| match e {
                Expr::Verdict(Verdict::Jump(c)) => Some(c.clone()),
                _ => None,
            });
            for name in std::iter::once(rule.chain.clone()).chain(jump) {
                if name != PREROUTING && name != OUTPUT && !regular.contains(&name) {
                    regular.push(name);
                }
            }
        }
        chains.extend(regular.iter().map(|n| Chain::regular(n)));
        Some(Table {
            name: self.name.to_string(),
            sets: Vec::new(),
            chains,
            rules: self.rules,
            flags: 0,
        })
    }
}

fn tcp() -> Expr {
    Expr::L4Proto(L4Proto::Tcp)
}

fn port(proto: L4Proto, field: PortField, op: CmpOp, port: u16) -> Expr {
    Expr::Port {
        proto,
        field,
        op,
        port,
    }
}

fn dport(proto: L4Proto, op: CmpOp, p: u16) -> Expr {
    port(proto, PortField::Dport, op, p)
}

fn iface(field: IfField, op: CmpOp, name: &str) -> Expr {
    Expr::Iface {
        field,
        op,
        name: name.to_string(),
    }
}

fn lo_out() -> Expr {
    iface(IfField::Oifname, CmpOp::Eq, "lo")
}

fn addr(field: AddrField, op: CmpOp, net: IpNet) -> Expr {
    Expr::Addr {
        field,
        op,
        prefix: Prefix {
            addr: net.addr(),
            len: net.prefix_len(),
        },
    }
}

fn net(a: IpAddr, len: u8) -> IpNet {
    IpNet::new(a, len).expect("valid prefix length")
}

fn owner(gid: bool, op: CmpOp, id: u32) -> Expr {
    Expr::Owner { gid, op, id }
}

fn mark(op: CmpOp, value: u32) -> Expr {
    Expr::Mark {
        mask: u32::MAX,
        op,
        value,
    }
}

fn jump(chain: &str) -> Vec<Expr> {
    vec![
        Expr::Counter,
        Expr::Verdict(Verdict::Jump(chain.to_string())),
    ]
}

fn with(mut head: Vec<Expr>, tail: Vec<Expr>) -> Vec<Expr> {
    head.extend(tail);
    head
}

fn ret() -> Vec<Expr> {
    vec![Expr::Counter, Expr::Verdict(Verdict::Return)]
}

/// Per address family: the loopback destination, the inbound passthrough source and whether
/// it is IPv6.
fn family_addrs(cfg: &SidecarConfig) -> Vec<(IpNet, IpNet, bool)> {
    let mut out = vec![(
        // Masked as the kernel (and `nft list`) holds it, so read-back compares equal.
        IpNet::V4(cfg.loopback_v4.trunc()),
        net(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6)), 32),
        false,
    )];
    if cfg.ipv6 {
        out.push((
            net(IpAddr::V6(Ipv6Addr::LOCALHOST), 128),
            net(IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6)), 128),
            true,
        ));
    }
    out
}

fn wanted(cfg: &SidecarConfig, n: &IpNet) -> bool {
    n.addr().is_ipv4() || cfg.ipv6
}

/// The three tables, filled in Istio's order; within a table that order is the rendering's.
struct Tables {
    nat: Tbl,
    mangle: Tbl,
    raw: Tbl,
}

/// The sidecar rule set for `cfg`.
pub fn ruleset(cfg: &SidecarConfig) -> Ruleset {
    let tbl = |name| Tbl {
        name,
        rules: Vec::new(),
    };
    let mut t = Tables {
        nat: tbl(NAT_TABLE),
        mangle: tbl(MANGLE_TABLE),
        raw: tbl(RAW_TABLE),
    };
    let fams = family_addrs(cfg);
    interfaces_and_fixed_chains(&mut t, cfg);
    inbound(&mut t, cfg, &fams);
    outbound_owners(&mut t, cfg, &fams);
    if cfg.redirect_dns {
        dns(&mut t, cfg);
    }
    outbound_ranges(&mut t, cfg, &fams);
    if cfg.mode == InterceptionMode::Tproxy {
        tproxy_tail(&mut t, cfg, &fams);
    }
    let Tables { nat, mangle, raw } = t;
    let tables = [
        nat.finish((ChainType::Nat, -100), (ChainType::Nat, -100)),
        mangle.finish((ChainType::Filter, -150), (ChainType::Route, -150)),
        raw.finish((ChainType::Filter, -300), (ChainType::Filter, -300)),
    ];
    Ruleset {
        tables: tables.into_iter().flatten().collect(),
    }
}

/// Excluded and virtual interfaces, the INVALID drop, and the chains every mode starts with.
fn interfaces_and_fixed_chains(t: &mut Tables, cfg: &SidecarConfig) {
    let Tables { nat, mangle, .. } = t;
    let tproxy = cfg.mode == InterceptionMode::Tproxy;
    let eq = CmpOp::Eq;
    for i in &cfg.exclude_interfaces {
        nat.add(
            PREROUTING,
            with(vec![iface(IfField::Iifname, eq, i.as_str())], ret()),
        );
        nat.add(
            OUTPUT,
            with(vec![iface(IfField::Oifname, eq, i.as_str())], ret()),
        );
    }
    if tproxy {
        for i in &cfg.exclude_interfaces {
            mangle.add(
                PREROUTING,
                with(vec![iface(IfField::Iifname, eq, i.as_str())], ret()),
            );
            mangle.add(
                OUTPUT,
                with(vec![iface(IfField::Oifname, eq, i.as_str())], ret()),
            );
        }
    }
    nat.insert_each(
        PREROUTING,
        0,
        cfg.reroute_virtual_interfaces
            .iter()
            .map(|i| with(vec![iface(IfField::Iifname, eq, i.as_str())], ret())),
    );
    if cfg.drop_invalid {
        mangle.add(
            PREROUTING,
            with(vec![tcp(), Expr::CtState(ct_state::INVALID)], jump(DROP)),
        );
        mangle.add(DROP, vec![Expr::Counter, Expr::Verdict(Verdict::Drop)]);
    }
    nat.add(
        INBOUND,
        with(vec![tcp(), dport(L4Proto::Tcp, eq, TUNNEL_PORT)], ret()),
    );
    nat.add(
        REDIRECT,
        vec![
            tcp(),
            Expr::Counter,
            Expr::Redirect {
                port: OUTBOUND_PORT,
            },
        ],
    );
    nat.add(
        IN_REDIRECT,
        vec![tcp(), Expr::Counter, Expr::Redirect { port: INBOUND_PORT }],
    );
}

/// The inbound capture: TPROXY in mangle or REDIRECT in nat, for every port or the listed ones.
fn inbound(t: &mut Tables, cfg: &SidecarConfig, fams: &[(IpNet, IpNet, bool)]) {
    let Tables { nat, mangle, .. } = t;
    let tproxy = cfg.mode == InterceptionMode::Tproxy;
    let (eq, ne) = (CmpOp::Eq, CmpOp::Ne);
    let capture_inbound = !matches!(&cfg.include_inbound_ports, Ports::List(p) if p.is_empty());
    if capture_inbound && tproxy {
        mangle.add(
            DIVERT,
            vec![Expr::Counter, Expr::MarkSet(INBOUND_TPROXY_MARK)],
        );
        mangle.add(DIVERT, vec![Expr::Counter, Expr::Verdict(Verdict::Accept)]);
        for (lo, _, v6) in fams {
            mangle.add(
                TPROXY,
                vec![
                    tcp(),
                    addr(AddrField::Daddr, ne, *lo),
                    Expr::Tproxy {
                        v6: *v6,
                        port: INBOUND_PORT,
                    },
                    Expr::MarkSet(INBOUND_TPROXY_MARK),
                    Expr::Counter,
                    Expr::Verdict(Verdict::Accept),
                ],
            );
        }
        mangle.add(PREROUTING, with(vec![tcp()], jump(INBOUND)));
        let established = || Expr::CtState(ct_state::RELATED | ct_state::ESTABLISHED);
        match &cfg.include_inbound_ports {
            Ports::All => {
                for p in &cfg.exclude_inbound_ports {
                    mangle.add(
                        INBOUND,
                        with(vec![tcp(), dport(L4Proto::Tcp, eq, *p)], ret()),
                    );
                }
                mangle.add(INBOUND, with(vec![tcp(), established()], jump(DIVERT)));
                mangle.add(INBOUND, with(vec![tcp()], jump(TPROXY)));
            }
            Ports::List(ports) => {
                for p in ports {
                    mangle.add(
                        INBOUND,
                        with(
                            vec![tcp(), established(), dport(L4Proto::Tcp, eq, *p)],
                            jump(DIVERT),
                        ),
                    );
                    mangle.add(
                        INBOUND,
                        with(vec![tcp(), dport(L4Proto::Tcp, eq, *p)], jump(TPROXY)),
                    );
                }
            }
        }
    } else if capture_inbound {
        nat.add(PREROUTING, with(vec![tcp()], jump(INBOUND)));
        match &cfg.include_inbound_ports {
            Ports::All => {
                for p in &cfg.exclude_inbound_ports {
                    nat.add(
                        INBOUND,
                        with(vec![tcp(), dport(L4Proto::Tcp, eq, *p)], ret()),
                    );
                }
                nat.add(INBOUND, with(vec![tcp()], jump(IN_REDIRECT)));
            }
            Ports::List(ports) => {
                for p in ports {
                    nat.add(
                        INBOUND,
                        with(vec![tcp(), dport(L4Proto::Tcp, eq, *p)], jump(IN_REDIRECT)),
                    );
                }
            }
        }
    }
}

/// The OUTPUT jump, excluded ports, and what the proxy's own and the owner groups' traffic does.
fn outbound_owners(t: &mut Tables, cfg: &SidecarConfig, fams: &[(IpNet, IpNet, bool)]) {
    let Tables { nat, .. } = t;
    let (eq, ne) = (CmpOp::Eq, CmpOp::Ne);
    nat.add(OUTPUT, jump(OUT));
    for p in &cfg.exclude_outbound_ports {
        nat.add(OUT, with(vec![dport(L4Proto::Tcp, eq, *p)], ret()));
        nat.add(OUT, with(vec![dport(L4Proto::Udp, eq, *p)], ret()));
    }
    for (_, passthrough, _) in fams {
        nat.add(
            OUT,
            with(
                vec![lo_out(), addr(AddrField::Saddr, eq, *passthrough)],
                ret(),
            ),
        );
    }
    let include_has_loopback = match &cfg.include_outbound_ip_ranges {
        IpRanges::All => false,
        IpRanges::List(nets) => nets.iter().any(|n| n.addr().is_loopback()),
    };
    for (gid, id) in [(false, cfg.proxy_uid), (true, cfg.proxy_gid)] {
        for (lo, _, _) in fams {
            let mut m = vec![lo_out(), tcp(), addr(AddrField::Daddr, ne, *lo)];
            // The proxy's own DNS queries over lo go to the DNS proxy, not the inbound listener.
            if cfg.redirect_dns && !gid {
                m.push(dport(L4Proto::Tcp, ne, 53));
            }
            m.push(dport(L4Proto::Tcp, ne, TUNNEL_PORT));
            m.push(owner(gid, eq, id));
            nat.add(OUT, with(m, jump(IN_REDIRECT)));
        }
        if !include_has_loopback {
            let m = if cfg.redirect_dns {
                vec![
                    lo_out(),
                    tcp(),
                    dport(L4Proto::Tcp, ne, 53),
                    owner(gid, ne, id),
                ]
            } else {
                vec![lo_out(), owner(gid, ne, id)]
            };
            nat.add(OUT, with(m, ret()));
        }
        nat.add(OUT, with(vec![owner(gid, eq, id)], ret()));
    }
    match &cfg.owner_groups {
        OwnerGroups::AllExcept(groups) => {
            for g in groups {
                nat.add(OUT, with(vec![owner(true, eq, *g)], ret()));
            }
        }
        OwnerGroups::Only(groups) => {
            let m = groups.iter().map(|g| owner(true, ne, *g)).collect();
            nat.add(OUT, with(m, ret()));
        }
    }
}

/// DNS to the agent's DNS proxy, and the conntrack zones of its two legs.
fn dns(t: &mut Tables, cfg: &SidecarConfig) {
    let Tables { nat, raw, .. } = t;
    let eq = CmpOp::Eq;
    raw.add(OUTPUT, jump(OUT_DNS));
    nat.add(OUT, jump(OUT_DNS));
    let to_dns = || {
        vec![
            Expr::Counter,
            Expr::Redirect {
                port: DNS_PROXY_PORT,
            },
        ]
    };
    nat.add(
        OUT_DNS,
        with(vec![tcp(), dport(L4Proto::Tcp, eq, 53)], to_dns()),
    );
    nat.add(OUT_DNS, with(vec![dport(L4Proto::Udp, eq, 53)], to_dns()));
    let zone = |z| vec![Expr::Counter, Expr::CtZoneSet(z)];
    for (gid, id) in [(false, cfg.proxy_uid), (true, cfg.proxy_gid)] {
        raw.add(
            OUT_DNS,
            with(
                vec![dport(L4Proto::Udp, eq, 53), owner(gid, eq, id)],
                zone(1),
            ),
        );
        raw.add(
            OUT_DNS,
            with(
                vec![
                    port(L4Proto::Udp, PortField::Sport, eq, DNS_PROXY_PORT),
                    owner(gid, eq, id),
                ],
                zone(2),
            ),
        );
    }
    raw.add(PREROUTING, jump(INBOUND));
    raw.add(OUT_DNS, with(vec![dport(L4Proto::Udp, eq, 53)], zone(2)));
    raw.add(
        INBOUND,
        with(vec![port(L4Proto::Udp, PortField::Sport, eq, 53)], zone(1)),
    );
}

/// Loopback and excluded destinations return; included ports and ranges are captured.
fn outbound_ranges(t: &mut Tables, cfg: &SidecarConfig, fams: &[(IpNet, IpNet, bool)]) {
    let Tables { nat, .. } = t;
    let eq = CmpOp::Eq;
    for (lo, _, _) in fams {
        nat.add(OUT, with(vec![addr(AddrField::Daddr, eq, *lo)], ret()));
    }
    for n in cfg
        .exclude_outbound_ip_ranges
        .iter()
        .filter(|n| wanted(cfg, n))
    {
        nat.add(OUT, with(vec![addr(AddrField::Daddr, eq, *n)], ret()));
    }
    for p in &cfg.include_outbound_ports {
        nat.add(OUT, with(vec![dport(L4Proto::Tcp, eq, *p)], jump(REDIRECT)));
    }
    match &cfg.include_outbound_ip_ranges {
        IpRanges::All => {
            nat.add(OUT, jump(REDIRECT));
            nat.insert_each(
                PREROUTING,
                0,
                cfg.reroute_virtual_interfaces.iter().map(|i| {
                    with(
                        vec![iface(IfField::Iifname, eq, i.as_str())],
                        jump(REDIRECT),
                    )
                }),
            );
        }
        IpRanges::List(nets) => {
            let nets: Vec<&IpNet> = nets.iter().filter(|n| wanted(cfg, n)).collect();
            // Istio interleaves these inserts with the OUT appends; the inserts land before
            // every OUT rule either way (the interfaces' RETURN rules are in PREROUTING already).
            nat.insert_each(
                PREROUTING,
                0,
                nets.iter().flat_map(|n| {
                    cfg.reroute_virtual_interfaces.iter().map(|i| {
                        with(
                            vec![
                                iface(IfField::Iifname, eq, i.as_str()),
                                addr(AddrField::Daddr, eq, **n),
                            ],
                            jump(REDIRECT),
                        )
                    })
                }),
            );
            for n in nets {
                nat.add(
                    OUT,
                    with(vec![addr(AddrField::Daddr, eq, *n)], jump(REDIRECT)),
                );
            }
        }
    }
}

/// TPROXY mode's marks: the inbound mark kept on the connection, and the proxy's loopback calls.
fn tproxy_tail(t: &mut Tables, cfg: &SidecarConfig, fams: &[(IpNet, IpNet, bool)]) {
    let Tables { mangle, .. } = t;
    let (eq, ne) = (CmpOp::Eq, CmpOp::Ne);
    mangle.add(
        PREROUTING,
        vec![
            tcp(),
            mark(eq, INBOUND_TPROXY_MARK),
            Expr::Counter,
            Expr::CtMarkSetMark,
        ],
    );
    mangle.add(
        OUTPUT,
        with(vec![lo_out(), tcp(), mark(eq, INBOUND_TPROXY_MARK)], ret()),
    );
    for (gid, id) in [(false, cfg.proxy_uid), (true, cfg.proxy_gid)] {
        for (lo, _, _) in fams {
            mangle.add(
                OUTPUT,
                vec![
                    lo_out(),
                    tcp(),
                    addr(AddrField::Daddr, ne, *lo),
                    owner(gid, eq, id),
                    Expr::Counter,
                    Expr::MarkSet(OUTBOUND_MARK),
                ],
            );
        }
    }
    mangle.add(
        OUTPUT,
        vec![
            tcp(),
            Expr::CtMark {
                mask: u32::MAX,
                op: eq,
                value: INBOUND_TPROXY_MARK,
            },
            Expr::Counter,
            Expr::MarkSetCtMark,
        ],
    );
    mangle.insert_each(
        INBOUND,
        0,
        [with(vec![tcp(), mark(eq, INBOUND_TPROXY_MARK)], ret())],
    );
    mangle.insert_each(
        INBOUND,
        1,
        fams.iter().map(|(_, passthrough, _)| {
            with(
                vec![
                    iface(IfField::Iifname, eq, "lo"),
                    tcp(),
                    addr(AddrField::Saddr, eq, *passthrough),
                ],
                ret(),
            )
        }),
    );
    mangle.insert_each(
        INBOUND,
        2,
        [with(
            vec![
                iface(IfField::Iifname, eq, "lo"),
                tcp(),
                mark(ne, OUTBOUND_MARK),
            ],
            ret(),
        )],
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::sidecar::{
        INCLUDE_OUTBOUND_IP_RANGES, REROUTE_VIRTUAL_INTERFACES, config_from_annotations,
    };

    fn lines(table: &Table, chain: &str) -> Vec<String> {
        table
            .chain_rules(chain)
            .map(|r| table.rule_line(r))
            .collect()
    }

    /// The shape of the `annotations` fuzz finding: hundreds of interface names, most of them
    /// repeated, times a list of ranges with repeats. Istio programs one rule per pair, each
    /// inserted at the head of `prerouting`, duplicates included; so do we, in its order (the
    /// last pair first), without the per-rule rescans that made this input take seconds.
    #[test]
    fn every_virtual_interface_and_range_pair_lands_in_istios_order() {
        let names: Vec<String> = (0..600).map(|i| format!("veth{}", i % 60)).collect();
        let nets: Vec<String> = (0..12).map(|i| format!("10.{}.0.0/16", i % 4)).collect();
        let (names_v, nets_v) = (names.join(","), nets.join(","));
        let cfg = config_from_annotations(|k| match k {
            REROUTE_VIRTUAL_INTERFACES => Some(names_v.as_str()),
            INCLUDE_OUTBOUND_IP_RANGES => Some(nets_v.as_str()),
            _ => None,
        })
        .unwrap();
        let rules = ruleset(&cfg);
        let nat = rules.table(NAT_TABLE).unwrap();
        let got = lines(nat, PREROUTING);

        let head = |rest: &str| format!("add rule inet {NAT_TABLE} prerouting {rest}");
        let mut want: Vec<String> = Vec::new();
        for net in nets.iter().rev() {
            for name in names.iter().rev() {
                want.push(head(&format!(
                    "iifname {name} ip daddr {net} counter jump istio-redirect"
                )));
            }
        }
        for name in names.iter().rev() {
            want.push(head(&format!("iifname {name} counter return")));
        }
        want.push(head("meta l4proto tcp counter jump istio-inbound"));
        assert_eq!(got.len(), 600 * 12 + 600 + 1);
        assert_eq!(got, want);
        // Every range is still captured from the pod's own traffic, once each.
        assert_eq!(
            lines(nat, OUT)
                .iter()
                .filter(|l| l.ends_with("jump istio-redirect") && l.contains("ip daddr 10."))
                .count(),
            12
        );
    }

    /// A batch into a chain shorter than `index` lands as Istio's one-by-one inserts would: the
    /// first entries after the chain's last rule in order until the chain reaches `index`, each
    /// later one before its predecessor.
    #[test]
    fn a_batch_past_the_end_of_a_chain_lands_as_inserts_one_by_one_would() {
        let named = |n: &str| vec![iface(IfField::Iifname, CmpOp::Eq, n)];
        let mut t = Tbl {
            name: NAT_TABLE,
            rules: Vec::new(),
        };
        t.add(PREROUTING, named("r0"));
        t.add(OUTPUT, named("o0"));
        t.insert_each(PREROUTING, 2, ["x1", "x2", "x3", "x4"].map(named));
        t.insert_each(OUTPUT, 0, ["y1", "y2"].map(named));
        let order: Vec<String> = t
            .rules
            .iter()
            .map(|r| format!("{} {}", r.chain, r.body()))
            .collect();
        assert_eq!(
            order,
            [
                "prerouting iifname r0",
                "prerouting iifname x1",
                "prerouting iifname x4",
                "prerouting iifname x3",
                "prerouting iifname x2",
                "output iifname y2",
                "output iifname y1",
                "output iifname o0",
            ]
        );
    }
}
