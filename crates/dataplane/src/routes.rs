//! Policy routing in a pod namespace: replies to connections ztunnel injected (connmark 0x111,
//! restored onto the packet mark) are looked up in table 100, whose only route delivers
//! everything locally, so they return to ztunnel's transparent socket instead of leaving the pod.
//!
//! Equivalent to `ip route replace local 0.0.0.0/0 dev lo table 100` and
//! `ip rule add fwmark 0x111/0xfff pref 32764 lookup 100` (and the IPv6 pair), over netlink.

use cni_core::redirect::ambient::consts::{
    MARK_MASK, ROUTE_TABLE, RULE_PRIORITY, ZTUNNEL_CONNMARK,
};
use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::link::{LinkAttribute, LinkExtentMask, LinkFlags, LinkMessage};
use netlink_packet_route::route::{
    RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::constants::NETLINK_ROUTE;

use crate::netlink::{NetlinkError, NetlinkSocket, Nlas, Payloads, Raw};
use crate::netns::{Netns, NetnsError};

// Message types, header sizes and attribute types from <linux/rtnetlink.h>, <linux/if_link.h>
// and <linux/fib_rules.h>.
pub const RTM_NEWLINK: u16 = 16;
pub const RTM_NEWROUTE: u16 = 24;
pub const RTM_NEWRULE: u16 = 32;
/// `LOOPBACK_IFINDEX`: `lo`'s index in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;
/// `struct ifinfomsg`; the interface index is its second field, at bytes 4..8.
const IFINFOMSG_LEN: usize = 16;
/// `struct rtmsg`: family, dst_len (byte 1), src_len, tos, table (byte 4), protocol, scope,
/// type (byte 7), flags.
const RTMSG_LEN: usize = 12;
/// `struct fib_rule_hdr`: family, dst_len, src_len, tos, table (byte 4), two reserved, action,
/// flags.
const FIB_RULE_HDR_LEN: usize = 12;
const AF_INET: u8 = libc::AF_INET as u8;
const AF_INET6: u8 = libc::AF_INET6 as u8;
const IFLA_IFNAME: u16 = 3;
const IFLA_AF_SPEC: u16 = 26;
const RTA_OIF: u16 = 4;
const RTA_TABLE: u16 = 15;
const FRA_PRIORITY: u16 = 6;
const FRA_FWMARK: u16 = 10;
const FRA_TABLE: u16 = 15;
const FRA_FWMASK: u16 = 16;

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("{what}: {source}")]
    Netlink {
        what: String,
        #[source]
        source: NetlinkError,
    },
    #[error("no loopback interface in the namespace")]
    NoLoopback,
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Many(Vec<RouteError>),
}

/// Which mark selects which local-delivery table, at which rule priority. Ambient uses
/// [`Policy::AMBIENT`]; sidecar TPROXY mode uses its own (mark 1337, table 133).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub table: u32,
    pub mark: u32,
    pub mask: u32,
    pub priority: u32,
}

impl Policy {
    pub const AMBIENT: Policy = Policy {
        table: ROUTE_TABLE,
        mark: ZTUNNEL_CONNMARK,
        mask: MARK_MASK,
        priority: RULE_PRIORITY,
    };
}

/// One piece of the policy routing, readable in drift reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RoutePiece {
    LocalRouteV4,
    LocalRouteV6,
    MarkRuleV4,
    MarkRuleV6,
}

impl std::fmt::Display for RoutePiece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (m, mm, t, p) = (ZTUNNEL_CONNMARK, MARK_MASK, ROUTE_TABLE, RULE_PRIORITY);
        match self {
            RoutePiece::LocalRouteV4 => write!(f, "ip route local 0.0.0.0/0 dev lo table {t}"),
            RoutePiece::LocalRouteV6 => write!(f, "ip -6 route local ::/0 dev lo table {t}"),
            RoutePiece::MarkRuleV4 => {
                write!(f, "ip rule fwmark {m:#x}/{mm:#x} lookup {t} pref {p}")
            }
            RoutePiece::MarkRuleV6 => {
                write!(f, "ip -6 rule fwmark {m:#x}/{mm:#x} lookup {t} pref {p}")
            }
        }
    }
}

/// The pieces `ipv6` asks for, given whether IPv6 is enabled on the namespace's `lo`.
pub fn desired(ipv6: bool, lo_ipv6: bool) -> Vec<RoutePiece> {
    let mut out = vec![RoutePiece::LocalRouteV4, RoutePiece::MarkRuleV4];
    if ipv6 {
        if lo_ipv6 {
            out.push(RoutePiece::LocalRouteV6);
        }
        out.push(RoutePiece::MarkRuleV6);
    }
    out.sort();
    out
}

/// Installs the pieces `ipv6` asks for in `netns`. Idempotent: present pieces are left alone.
pub fn apply(netns: &Netns, ipv6: bool) -> Result<(), RouteError> {
    apply_policy(netns, ipv6, &Policy::AMBIENT)
}

/// [`apply`] for another [`Policy`].
pub fn apply_policy(netns: &Netns, ipv6: bool, policy: &Policy) -> Result<(), RouteError> {
    netns.run(|| {
        let mut sock = open()?;
        // Only `lo`'s IPv6 state needs asking, and only when IPv6 is wanted (as in `read`).
        let lo_ipv6 = ipv6 && loopback(&mut sock)?.ipv6;
        // The runtime may run the loopback plugin in parallel with the chain (containerd does), so
        // `lo` can still be down here; the kernel refuses an IPv6 route on a down device
        // (ENETDOWN). Setting it up is what the loopback plugin does anyway.
        set_up(&mut sock, LOOPBACK_IFINDEX)?;
        for piece in desired(ipv6, lo_ipv6) {
            add(&mut sock, piece, LOOPBACK_IFINDEX, policy)?;
        }
        Ok(())
    })?
}

/// Removes every piece (both families; absent ones are fine). All are attempted; failures are
/// joined.
pub fn remove(netns: &Netns) -> Result<(), RouteError> {
    remove_policy(netns, &Policy::AMBIENT)
}

/// [`remove`] for another [`Policy`].
pub fn remove_policy(netns: &Netns, policy: &Policy) -> Result<(), RouteError> {
    netns.run(|| {
        let mut sock = open()?;
        let lo = LOOPBACK_IFINDEX;
        let mut errs = Vec::new();
        for piece in [
            RoutePiece::MarkRuleV4,
            RoutePiece::MarkRuleV6,
            RoutePiece::LocalRouteV4,
            RoutePiece::LocalRouteV6,
        ] {
            if let Err(e) = del(&mut sock, piece, lo, policy) {
                errs.push(e);
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(RouteError::Many(errs))
        }
    })?
}

/// What is installed now, and what `apply(ipv6)` would install.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteState {
    pub present: Vec<RoutePiece>,
    pub desired: Vec<RoutePiece>,
}

impl RouteState {
    pub fn missing(&self) -> Vec<RoutePiece> {
        self.desired
            .iter()
            .filter(|p| !self.present.contains(p))
            .copied()
            .collect()
    }

    pub fn unexpected(&self) -> Vec<RoutePiece> {
        self.present
            .iter()
            .filter(|p| !self.desired.contains(p))
            .copied()
            .collect()
    }
}

/// Reads the pieces back (exact match on table, type, mark, mask and priority).
pub fn read(netns: &Netns, ipv6: bool) -> Result<RouteState, RouteError> {
    read_policy(netns, ipv6, &Policy::AMBIENT)
}

/// [`read`] for another [`Policy`].
pub fn read_policy(netns: &Netns, ipv6: bool, policy: &Policy) -> Result<RouteState, RouteError> {
    netns.run(|| {
        let mut sock = open()?;
        // Only `lo`'s IPv6 state needs asking, and only when IPv6 is wanted: its index is always
        // the same (the kernel registers it first in every namespace and checks it got 1).
        let lo_ipv6 = ipv6 && loopback(&mut sock)?.ipv6;
        // One dump of each kind for both families (`AF_UNSPEC`), told apart by the family byte
        // that starts each reply: a restart reads this back for every pod. With strict checking
        // the kernel dumps only the policy's table rather than every route of the pod (its local
        // and multicast routes are most of them), and a family without that table is skipped.
        let by_table = sock.strict_check();
        let mut msg = RouteMessage::default();
        msg.header.address_family = AddressFamily::Unspec;
        if by_table {
            msg.header.table = policy.table as u8;
            msg.attributes.push(RouteAttribute::Table(policy.table));
        }
        let routes = match dump(
            &mut sock,
            RouteNetlinkMessage::GetRoute(msg),
            RTM_NEWROUTE,
            "list routes",
        ) {
            // A filtered dump of a table that does not exist (kernels that report it).
            Err(RouteError::Netlink { source, .. })
                if by_table && source.errno() == Some(libc::ENOENT) =>
            {
                Payloads::default()
            }
            other => other?,
        };
        let rules = dump(
            &mut sock,
            RouteNetlinkMessage::GetRule(RuleMessage::default()),
            RTM_NEWRULE,
            "list rules",
        )?;
        Ok(RouteState {
            present: present(&routes, &rules, policy),
            desired: desired(ipv6, lo_ipv6),
        })
    })?
}

/// The policy's pieces found in a dump of routes and one of rules (`RTM_NEWROUTE` and
/// `RTM_NEWRULE` payloads of both families), sorted. Public so what the kernel dumps can be
/// fuzzed (`fuzz/`).
pub fn present(routes: &Payloads, rules: &Payloads, policy: &Policy) -> Vec<RoutePiece> {
    let mut present = Vec::new();
    for (family, route, rule) in [
        (AF_INET, RoutePiece::LocalRouteV4, RoutePiece::MarkRuleV4),
        (AF_INET6, RoutePiece::LocalRouteV6, RoutePiece::MarkRuleV6),
    ] {
        // Both headers (rtmsg, fib_rule_hdr) start with the family.
        let of_family = |m: &&[u8]| m.first() == Some(&family);
        if routes
            .iter()
            .map(|(_, r)| r)
            .filter(of_family)
            .any(|r| is_our_route(r, LOOPBACK_IFINDEX, policy))
        {
            present.push(route);
        }
        if rules
            .iter()
            .map(|(_, r)| r)
            .filter(of_family)
            .any(|r| is_our_rule(r, policy))
        {
            present.push(rule);
        }
    }
    present.sort();
    present
}

fn open() -> Result<NetlinkSocket, RouteError> {
    NetlinkSocket::open(NETLINK_ROUTE).map_err(|source| RouteError::Netlink {
        what: "open rtnetlink".into(),
        source,
    })
}

/// A dump whose replies of type `reply` are returned undecoded: the pod's checks read a few
/// fields of them, and the netlink crate's messages cost an allocation per attribute.
fn dump(
    sock: &mut NetlinkSocket,
    msg: RouteNetlinkMessage,
    reply: u16,
    what: &str,
) -> Result<Payloads, RouteError> {
    sock.dump_raw(msg, |t| t == reply)
        .map_err(|source| RouteError::Netlink {
            what: what.into(),
            source,
        })
}

/// The bytes of the replies of type `reply`.
fn payloads(replies: Vec<Raw<RouteNetlinkMessage>>, reply: u16) -> Vec<Vec<u8>> {
    replies
        .into_iter()
        .filter_map(|m| match m {
            Raw::Bytes {
                message_type,
                payload,
            } if message_type == reply => Some(payload),
            _ => None,
        })
        .collect()
}

/// The namespace's `lo`: its index, and whether it has IPv6.
#[derive(Debug)]
pub struct Loopback {
    pub index: u32,
    pub ipv6: bool,
}

/// Asks for `lo` by name. Its IPv6 state comes from the same message (the inet6 devconf's
/// `disable_ipv6` in `IFLA_AF_SPEC`) rather than `/proc/sys/net/ipv6/conf/lo/disable_ipv6`,
/// whose path walk was a tenth of the agent's CPU across drift checks. No inet6 part (IPv6 off
/// in the kernel) counts as enabled, as a read error of that file does in Istio: the route add
/// then reports the real problem.
fn loopback(sock: &mut NetlinkSocket) -> Result<Loopback, RouteError> {
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName("lo".into()));
    // Without the link's counters (its IPv6 ones above all), which are most of the kernel's
    // work for this answer and are not read.
    msg.attributes
        .push(LinkAttribute::ExtMask(vec![LinkExtentMask::SkipStats]));
    let links = match sock.get(Raw::Typed(RouteNetlinkMessage::GetLink(msg))) {
        Err(e) if e.errno() == Some(libc::ENODEV) => return Err(RouteError::NoLoopback),
        other => other.map_err(|source| RouteError::Netlink {
            what: "get lo".into(),
            source,
        })?,
    };
    payloads(links, RTM_NEWLINK)
        .iter()
        .find_map(|link| loopback_of(link))
        .ok_or(RouteError::NoLoopback)
}

/// `lo` as an `RTM_NEWLINK` payload (`struct ifinfomsg`, then attributes) describes it; `None`
/// for another link or a malformed message. Public so what the kernel answers can be fuzzed.
pub fn loopback_of(link: &[u8]) -> Option<Loopback> {
    let attrs = Nlas::parse(link.get(IFINFOMSG_LEN..)?)?;
    (attrs.get(IFLA_IFNAME)? == b"lo\0").then(|| Loopback {
        index: u32::from_ne_bytes(link[4..8].try_into().expect("4 bytes")),
        ipv6: !ipv6_disabled(attrs),
    })
}

/// `disable_ipv6` of the link's inet6 devconf (`IFLA_AF_SPEC` → `AF_INET6` →
/// `IFLA_INET6_CONF`, an array of the sysctls as `s32`).
fn ipv6_disabled(link: Nlas<'_>) -> bool {
    const IFLA_INET6_CONF: u16 = 2;
    /// `DEVCONF_DISABLE_IPV6`, the sysctl's index in the array.
    const DEVCONF_DISABLE_IPV6: usize = 26;
    let conf = link
        .get(IFLA_AF_SPEC)
        .and_then(Nlas::parse)
        .and_then(|spec| spec.get(u16::from(AF_INET6)))
        .and_then(Nlas::parse)
        .and_then(|inet6| inet6.get(IFLA_INET6_CONF));
    conf.and_then(|c| c.get(DEVCONF_DISABLE_IPV6 * 4..DEVCONF_DISABLE_IPV6 * 4 + 4))
        .is_some_and(|v| i32::from_ne_bytes(v.try_into().expect("4 bytes")) == 1)
}

fn set_up(sock: &mut NetlinkSocket, index: u32) -> Result<(), RouteError> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.header.flags = LinkFlags::Up;
    msg.header.change_mask = LinkFlags::Up;
    sock.request(RouteNetlinkMessage::SetLink(msg), 0)
        .map_err(|source| RouteError::Netlink {
            what: "set lo up".into(),
            source,
        })
}

fn route_msg(family: AddressFamily, lo: u32, policy: &Policy) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = family;
    msg.header.table = policy.table as u8;
    msg.header.protocol = RouteProtocol::Boot;
    msg.header.scope = RouteScope::Host;
    msg.header.kind = RouteType::Local;
    msg.attributes = vec![RouteAttribute::Table(policy.table), RouteAttribute::Oif(lo)];
    msg
}

fn rule_msg(family: AddressFamily, policy: &Policy) -> RuleMessage {
    let mut msg = RuleMessage::default();
    msg.header.family = family;
    msg.header.table = policy.table as u8;
    msg.header.action = RuleAction::ToTable;
    msg.attributes = vec![
        RuleAttribute::Table(policy.table),
        RuleAttribute::FwMark(policy.mark),
        RuleAttribute::FwMask(policy.mask),
        RuleAttribute::Priority(policy.priority),
    ];
    msg
}

/// Whether an `RTM_NEWROUTE` payload (`struct rtmsg`, then attributes) is the policy's local
/// route: type local, default destination, out through `lo`, in the policy's table.
fn is_our_route(route: &[u8], lo: u32, policy: &Policy) -> bool {
    const RTN_LOCAL: u8 = 2;
    let Some(attrs) = route.get(RTMSG_LEN..).and_then(Nlas::parse) else {
        return false;
    };
    // The table in the header is 8 bits; RTA_TABLE has the full id.
    let table = attrs.get_u32_ne(RTA_TABLE).unwrap_or(u32::from(route[4]));
    table == policy.table
        && route[7] == RTN_LOCAL
        && route[1] == 0
        && attrs.get_u32_ne(RTA_OIF) == Some(lo)
}

/// Whether an `RTM_NEWRULE` payload (`struct fib_rule_hdr`, then attributes) is the policy's
/// mark rule.
fn is_our_rule(rule: &[u8], policy: &Policy) -> bool {
    let Some(attrs) = rule.get(FIB_RULE_HDR_LEN..).and_then(Nlas::parse) else {
        return false;
    };
    let value = |kind| attrs.get_u32_ne(kind);
    let table = value(FRA_TABLE).unwrap_or(u32::from(rule[4]));
    table == policy.table
        && value(FRA_FWMARK) == Some(policy.mark)
        && value(FRA_FWMASK) == Some(policy.mask)
        && value(FRA_PRIORITY) == Some(policy.priority)
}

fn family_of(piece: RoutePiece) -> AddressFamily {
    match piece {
        RoutePiece::LocalRouteV4 | RoutePiece::MarkRuleV4 => AddressFamily::Inet,
        RoutePiece::LocalRouteV6 | RoutePiece::MarkRuleV6 => AddressFamily::Inet6,
    }
}

fn add(
    sock: &mut NetlinkSocket,
    piece: RoutePiece,
    lo: u32,
    policy: &Policy,
) -> Result<(), RouteError> {
    let family = family_of(piece);
    let result = match piece {
        RoutePiece::LocalRouteV4 | RoutePiece::LocalRouteV6 => sock.request(
            RouteNetlinkMessage::NewRoute(route_msg(family, lo, policy)),
            NLM_F_CREATE | NLM_F_REPLACE,
        ),
        // Rules have no REPLACE semantics; EXCL turns a duplicate into EEXIST, which means done.
        RoutePiece::MarkRuleV4 | RoutePiece::MarkRuleV6 => {
            match sock.request(
                RouteNetlinkMessage::NewRule(rule_msg(family, policy)),
                NLM_F_CREATE | NLM_F_EXCL,
            ) {
                Err(e) if e.errno() == Some(libc::EEXIST) => Ok(()),
                other => other,
            }
        }
    };
    result.map_err(|source| RouteError::Netlink {
        what: format!("add {piece}"),
        source,
    })
}

fn del(
    sock: &mut NetlinkSocket,
    piece: RoutePiece,
    lo: u32,
    policy: &Policy,
) -> Result<(), RouteError> {
    let family = family_of(piece);
    let result = match piece {
        RoutePiece::LocalRouteV4 | RoutePiece::LocalRouteV6 => sock.request(
            RouteNetlinkMessage::DelRoute(route_msg(family, lo, policy)),
            0,
        ),
        RoutePiece::MarkRuleV4 | RoutePiece::MarkRuleV6 => {
            sock.request(RouteNetlinkMessage::DelRule(rule_msg(family, policy)), 0)
        }
    };
    match result {
        // Already gone, or the family is disabled in this namespace: nothing to remove.
        Err(e)
            if matches!(
                e.errno(),
                Some(libc::ENOENT | libc::ESRCH | libc::EAFNOSUPPORT)
            ) =>
        {
            Ok(())
        }
        other => other.map_err(|source| RouteError::Netlink {
            what: format!("delete {piece}"),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::TestNetns;

    fn rule_lines(ns: &TestNetns, family: &str) -> Vec<String> {
        ns.exec("ip", &[family, "rule", "show"])
            .lines()
            .filter(|l| l.contains("fwmark 0x111/0xfff"))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn apply_is_idempotent_and_remove_leaves_nothing() {
        crate::require_root!();
        let ns = TestNetns::new("routes");
        let netns = ns.open();
        apply(&netns, true).unwrap();
        apply(&netns, true).unwrap();

        let v4 = rule_lines(&ns, "-4");
        assert_eq!(v4.len(), 1, "{v4:?}");
        assert!(
            v4[0].starts_with("32764:") && v4[0].contains("lookup 100"),
            "{v4:?}"
        );
        assert_eq!(rule_lines(&ns, "-6").len(), 1);
        let routes = ns.exec("ip", &["route", "show", "table", "100"]);
        assert!(
            routes.contains("local default dev lo scope host"),
            "{routes}"
        );
        let routes6 = ns.exec("ip", &["-6", "route", "show", "table", "100"]);
        assert!(routes6.contains("local default dev lo"), "{routes6}");

        let state = read(&netns, true).unwrap();
        assert!(
            state.missing().is_empty() && state.unexpected().is_empty(),
            "{state:?}"
        );
        // Asking for v4 only makes the v6 pieces unexpected.
        let state = read(&netns, false).unwrap();
        assert_eq!(
            state.unexpected(),
            [RoutePiece::LocalRouteV6, RoutePiece::MarkRuleV6]
        );

        remove(&netns).unwrap();
        remove(&netns).unwrap();
        assert!(rule_lines(&ns, "-4").is_empty() && rule_lines(&ns, "-6").is_empty());
        assert_eq!(ns.exec("ip", &["route", "show", "table", "100"]).trim(), "");
        assert_eq!(
            ns.exec("ip", &["-6", "route", "show", "table", "100"])
                .trim(),
            ""
        );
        assert_eq!(read(&netns, true).unwrap().present, []);
    }

    #[test]
    fn lo_is_interface_one_in_a_new_namespace() {
        crate::require_root!();
        let ns = TestNetns::new("lo-index");
        let lo = ns
            .open()
            .run(|| loopback(&mut open().unwrap()).map(|lo| lo.index))
            .unwrap()
            .unwrap();
        // The read of a pod's routes relies on it.
        assert_eq!(lo, LOOPBACK_IFINDEX);
    }

    #[test]
    fn v6_route_skipped_when_lo_has_ipv6_disabled() {
        crate::require_root!();
        let ns = TestNetns::new("routes6off");
        ns.exec("sysctl", &["-qw", "net.ipv6.conf.lo.disable_ipv6=1"]);
        let netns = ns.open();
        apply(&netns, true).unwrap();
        let state = read(&netns, true).unwrap();
        assert_eq!(
            state.desired,
            [
                RoutePiece::LocalRouteV4,
                RoutePiece::MarkRuleV4,
                RoutePiece::MarkRuleV6
            ]
        );
        assert!(state.missing().is_empty(), "{state:?}");
    }

    #[test]
    fn apply_brings_a_down_lo_up_so_the_v6_route_is_accepted() {
        crate::require_root!();
        let ns = TestNetns::new("routeslodown");
        // As a pod whose loopback plugin has not run yet (containerd runs it in parallel).
        ns.exec("ip", &["link", "set", "lo", "down"]);
        let netns = ns.open();
        apply(&netns, true).unwrap();
        assert!(
            ns.exec("ip", &["link", "show", "lo"]).contains(",UP"),
            "lo stays down"
        );
        let state = read(&netns, true).unwrap();
        assert!(state.missing().is_empty(), "{state:?}");
    }
}
