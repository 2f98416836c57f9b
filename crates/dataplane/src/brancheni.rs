//! AWS VPC CNI "Security Groups for Pods": such a pod sits behind a branch ENI, and aws-vpc-cni
//! routes its traffic by policy (`iif <veth> lookup <table>`, and a host route to the pod in that
//! table) through the VPC fabric, which drops kubelet's probes once they are SNATed to the
//! link-local probe address. Two host rules send the probes down the veth and the replies back
//! to the host stack, as Istio does (`brancheni_linux.go`):
//!
//! - `ip rule add to <podIP>/32 lookup <table> priority 512` (forward path);
//! - `ip rule add iif <veth> lookup local priority <aws iif rule priority - 1>` (return path).
//!
//! Only nodes prepared for Security Groups for Pods are touched: AWS requires
//! `net.ipv4.tcp_early_demux=0` there, while the kernel default is 1.

use std::net::IpAddr;
use std::path::Path;

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::constants::NETLINK_ROUTE;

use crate::netlink::{NetlinkError, NetlinkSocket};
use crate::netns::{Netns, NetnsError};

/// Priority of the forward rule: the one aws-vpc-cni gives its `to <pod>` rules of plain pods.
pub const FORWARD_PRIORITY: u32 = 512;
const TABLE_MAIN: u32 = 254;
const TABLE_LOCAL: u32 = 255;

#[derive(Debug, thiserror::Error)]
pub enum BranchEniError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("branch ENI rules: {what}: {source}")]
    Netlink {
        what: String,
        #[source]
        source: NetlinkError,
    },
}

/// How aws-vpc-cni routes one branch-ENI pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BranchEni {
    /// The routing table holding the host route to the pod.
    pub table: u32,
    /// The pod's host-side veth.
    pub veth: String,
    /// Priority of aws-vpc-cni's `iif <veth> lookup <table>` rule.
    pub iif_priority: u32,
}

impl BranchEni {
    /// The return rule goes just before aws-vpc-cni's iif rule, so it wins.
    pub fn return_priority(&self) -> u32 {
        self.iif_priority.saturating_sub(1)
    }
}

/// Whether `tcp_early_demux` is off in the host namespace: `<proc_dir>/sys/...` read from a
/// thread inside `host` (the sysctl is per network namespace). Unreadable counts as on.
pub fn early_demux_disabled(host: &Netns, proc_dir: &Path) -> bool {
    let path = proc_dir.join("sys/net/ipv4/tcp_early_demux");
    host.run(|| std::fs::read(&path))
        .ok()
        .and_then(Result::ok)
        .is_some_and(|v| v.first() == Some(&b'0'))
}

fn netlink(what: &str) -> impl FnOnce(NetlinkError) -> BranchEniError + '_ {
    move |source| BranchEniError::Netlink {
        what: what.to_string(),
        source,
    }
}

fn family(ip: IpAddr) -> AddressFamily {
    if ip.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

fn host_bits(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

fn dump(
    sock: &mut NetlinkSocket,
    msg: RouteNetlinkMessage,
    what: &str,
) -> Result<Vec<RouteNetlinkMessage>, BranchEniError> {
    sock.dump(msg).map_err(netlink(what))
}

fn rule_table(r: &RuleMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

fn route_table(r: &RouteMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

fn route_to(r: &RouteMessage, ip: IpAddr) -> bool {
    r.header.destination_prefix_length == host_bits(ip)
        && r.attributes.iter().any(|a| match (a, ip) {
            (RouteAttribute::Destination(RouteAddress::Inet(d)), IpAddr::V4(ip)) => *d == ip,
            (RouteAttribute::Destination(RouteAddress::Inet6(d)), IpAddr::V6(ip)) => *d == ip,
            _ => false,
        })
}

/// Finds whether `ip` is a branch-ENI pod: an `iif` rule into a table (not main or local) that
/// holds a host route to `ip` through the very interface the rule names. `None` for a pod on
/// plain veth routing.
pub fn detect(host: &Netns, ip: IpAddr) -> Result<Option<BranchEni>, BranchEniError> {
    host.run(|| {
        let mut sock = NetlinkSocket::open(NETLINK_ROUTE).map_err(netlink("open rtnetlink"))?;
        let mut get_rules = RuleMessage::default();
        get_rules.header.family = family(ip);
        let iif_rules: Vec<(u32, String, u32)> = dump(
            &mut sock,
            RouteNetlinkMessage::GetRule(get_rules),
            "list rules",
        )?
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewRule(r) => Some(r),
            _ => None,
        })
        .filter_map(|r| {
            let table = rule_table(&r);
            let iif = r.attributes.iter().find_map(|a| match a {
                RuleAttribute::Iifname(n) => Some(n.clone()),
                _ => None,
            })?;
            let priority = r
                .attributes
                .iter()
                .find_map(|a| match a {
                    RuleAttribute::Priority(p) => Some(*p),
                    _ => None,
                })
                .unwrap_or(0);
            (table != 0 && table != TABLE_MAIN && table != TABLE_LOCAL)
                .then_some((table, iif, priority))
        })
        .collect();
        if iif_rules.is_empty() {
            return Ok(None);
        }
        let mut get_routes = RouteMessage::default();
        get_routes.header.address_family = family(ip);
        let routes: Vec<RouteMessage> = dump(
            &mut sock,
            RouteNetlinkMessage::GetRoute(get_routes),
            "list routes",
        )?
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewRoute(r) if route_to(&r, ip) => Some(r),
            _ => None,
        })
        .collect();
        if routes.is_empty() {
            return Ok(None);
        }
        let links: Vec<(u32, String)> = dump(
            &mut sock,
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            "list links",
        )?
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => {
                let name = l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                })?;
                Some((l.header.index, name))
            }
            _ => None,
        })
        .collect();
        for route in &routes {
            let table = route_table(route);
            let Some(oif) = route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(i) => Some(*i),
                _ => None,
            }) else {
                continue;
            };
            let Some((_, dev)) = links.iter().find(|(i, _)| *i == oif) else {
                continue;
            };
            if let Some((_, _, priority)) = iif_rules
                .iter()
                .find(|(t, iif, _)| *t == table && iif == dev)
            {
                return Ok(Some(BranchEni {
                    table,
                    veth: dev.clone(),
                    iif_priority: *priority,
                }));
            }
        }
        Ok(None)
    })?
}

fn rule(ip: IpAddr, table: u32, priority: u32) -> RuleMessage {
    let mut msg = RuleMessage::default();
    msg.header.family = family(ip);
    msg.header.action = RuleAction::ToTable;
    msg.header.table = u8::try_from(table).unwrap_or(0);
    msg.attributes = vec![
        RuleAttribute::Table(table),
        RuleAttribute::Priority(priority),
    ];
    msg
}

fn forward_rule(ip: IpAddr, eni: &BranchEni) -> RuleMessage {
    let mut msg = rule(ip, eni.table, FORWARD_PRIORITY);
    msg.header.dst_len = host_bits(ip);
    msg.attributes.push(RuleAttribute::Destination(ip));
    msg
}

fn return_rule(ip: IpAddr, eni: &BranchEni) -> RuleMessage {
    let mut msg = rule(ip, TABLE_LOCAL, eni.return_priority());
    msg.attributes
        .push(RuleAttribute::Iifname(eni.veth.clone()));
    msg
}

fn add(sock: &mut NetlinkSocket, msg: RuleMessage) -> Result<bool, NetlinkError> {
    match sock.request(RouteNetlinkMessage::NewRule(msg), NLM_F_CREATE | NLM_F_EXCL) {
        Ok(()) => Ok(true),
        Err(e) if e.errno() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

fn del(sock: &mut NetlinkSocket, msg: RuleMessage) -> Result<(), NetlinkError> {
    match sock.request(RouteNetlinkMessage::DelRule(msg), 0) {
        Err(e) if matches!(e.errno(), Some(libc::ENOENT | libc::ESRCH)) => Ok(()),
        other => other,
    }
}

/// Adds the forward and return rules for `ip` (existing ones are fine). If the return rule
/// fails, a forward rule added here is removed again.
pub fn add_rules(host: &Netns, ip: IpAddr, eni: &BranchEni) -> Result<(), BranchEniError> {
    host.run(|| {
        let mut sock = NetlinkSocket::open(NETLINK_ROUTE).map_err(netlink("open rtnetlink"))?;
        let added = add(&mut sock, forward_rule(ip, eni))
            .map_err(netlink(&format!("add to {ip} lookup {}", eni.table)))?;
        if let Err(e) = add(&mut sock, return_rule(ip, eni)) {
            if added {
                let _ = del(&mut sock, forward_rule(ip, eni));
            }
            return Err(netlink(&format!("add iif {} lookup local", eni.veth))(e));
        }
        Ok(())
    })?
}

/// Removes both rules of `ip`; rules already gone are fine. Both are attempted.
pub fn del_rules(host: &Netns, ip: IpAddr, eni: &BranchEni) -> Result<(), BranchEniError> {
    host.run(|| {
        let mut sock = NetlinkSocket::open(NETLINK_ROUTE).map_err(netlink("open rtnetlink"))?;
        let forward = del(&mut sock, forward_rule(ip, eni))
            .map_err(netlink(&format!("delete to {ip} lookup {}", eni.table)));
        let back = del(&mut sock, return_rule(ip, eni))
            .map_err(netlink(&format!("delete iif {} lookup local", eni.veth)));
        forward.and(back)
    })?
}
