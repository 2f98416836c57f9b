//! Sidecar-mode redirection, which the CNI plugin programs in place of the privileged
//! `istio-init` container: which pods get it (detection from the Pod object) and the per-pod
//! settings their annotations select (every value validated). The rule set is rendered from
//! [`SidecarConfig`] by [`iptables`] (byte-identical to Istio's `istio-iptables` output for the
//! same inputs) and by [`nft`] (Istio's `native_nftables` form).

pub mod iptables;
pub mod nft;

use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net};
use serde_json::Value;

use super::iptables::Family;
use super::{InterfaceName, InvalidInterfaceName, parse_go_bool};

pub const ANNOTATION_STATUS: &str = "sidecar.istio.io/status";
pub const INJECT: &str = "sidecar.istio.io/inject";
pub const INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
pub const INCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
pub const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
pub const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
pub const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
pub const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
pub const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
pub const EXCLUDE_INTERFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
pub const REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";
/// Deprecated spelling, read only when [`REROUTE_VIRTUAL_INTERFACES`] is absent.
pub const KUBEVIRT_INTERFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";

/// Istio's env-only outbound settings (`istio-iptables` reads them from its environment).
pub const OWNER_GROUPS: &str = "ISTIO_OUTBOUND_OWNER_GROUPS";
pub const OWNER_GROUPS_EXCLUDE: &str = "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE";
pub const IPV4_LOOPBACK_CIDR: &str = "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR";
/// Istio's cap: the included groups become one rule with a match per group.
const MAX_OWNER_GROUPS_INCLUDE: usize = 64;

pub const PROXY_CONTAINER: &str = "istio-proxy";
pub const INIT_CONTAINER: &str = "istio-init";

/// Owner UID/GID of the proxy when the pod does not set a non-zero one.
pub const DEFAULT_PROXY_ID: u32 = 1337;
/// Envoy's outbound and inbound capture listeners, the HBONE port and the agent's DNS proxy.
pub const OUTBOUND_PORT: u16 = 15001;
pub const INBOUND_PORT: u16 = 15006;
pub const TUNNEL_PORT: u16 = 15008;
pub const DNS_PROXY_PORT: u16 = 15053;
/// Packet mark TPROXY'd inbound connections carry, and the policy-routing table it selects.
pub const INBOUND_TPROXY_MARK: u32 = 1337;
pub const TPROXY_ROUTE_TABLE: u32 = 133;
/// Mark the proxy's own loopback connections to the app get in TPROXY mode.
const OUTBOUND_MARK: u32 = 1338;
/// Ports of the proxy's own listeners (status, health, Prometheus) that Istio always appends to
/// the inbound exclusions.
const ALWAYS_EXCLUDED_INBOUND: [u16; 3] = [15020, 15021, 15090];
const DEFAULT_EXCLUDED_PORT: u16 = 15020;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InterceptionMode {
    Redirect,
    Tproxy,
}

/// A port selection that may be `*` (every port).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ports {
    All,
    /// Empty means none.
    List(Vec<u16>),
}

/// An address selection that may be `*` (every destination).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IpRanges {
    All,
    /// Empty means none.
    List(Vec<IpNet>),
}

/// Whose outgoing traffic is captured, by socket owner group (`ISTIO_OUTBOUND_OWNER_GROUPS`,
/// `_EXCLUDE`). Groups given by name are resolved to GIDs before rendering.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnerGroups {
    /// `*` (the default) minus these groups.
    AllExcept(Vec<u32>),
    /// Only these groups; everything else returns.
    Only(Vec<u32>),
}

/// Everything the sidecar rule set depends on, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SidecarConfig {
    pub mode: InterceptionMode,
    pub include_outbound_ip_ranges: IpRanges,
    pub exclude_outbound_ip_ranges: Vec<IpNet>,
    pub include_inbound_ports: Ports,
    /// Already extended with 15020, 15021, 15090 and deduplicated (order kept).
    pub exclude_inbound_ports: Vec<u16>,
    pub include_outbound_ports: Vec<u16>,
    pub exclude_outbound_ports: Vec<u16>,
    pub exclude_interfaces: Vec<InterfaceName>,
    pub reroute_virtual_interfaces: Vec<InterfaceName>,
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    /// `ISTIO_META_DNS_CAPTURE`: all DNS to the agent's DNS proxy.
    pub redirect_dns: bool,
    /// `ISTIO_DUAL_STACK`; carried for parity, no rule depends on it.
    pub dual_stack: bool,
    /// `INVALID_DROP`: drop conntrack-INVALID packets before they reach the app.
    pub drop_invalid: bool,
    /// Also program IPv6 (the pod has an IPv6 address).
    pub ipv6: bool,
    pub owner_groups: OwnerGroups,
    /// `ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR`: the app's own loopback destinations.
    pub loopback_v4: Ipv4Net,
}

impl Default for SidecarConfig {
    fn default() -> Self {
        SidecarConfig {
            mode: InterceptionMode::Redirect,
            include_outbound_ip_ranges: IpRanges::All,
            exclude_outbound_ip_ranges: Vec::new(),
            include_inbound_ports: Ports::All,
            exclude_inbound_ports: with_always_excluded(&[DEFAULT_EXCLUDED_PORT]),
            include_outbound_ports: Vec::new(),
            exclude_outbound_ports: vec![DEFAULT_EXCLUDED_PORT],
            exclude_interfaces: Vec::new(),
            reroute_virtual_interfaces: Vec::new(),
            proxy_uid: DEFAULT_PROXY_ID,
            proxy_gid: DEFAULT_PROXY_ID,
            redirect_dns: false,
            dual_stack: false,
            drop_invalid: false,
            ipv6: false,
            owner_groups: OwnerGroups::AllExcept(Vec::new()),
            loopback_v4: Ipv4Net::new(Ipv4Addr::LOCALHOST, 32).expect("valid prefix"),
        }
    }
}

fn with_always_excluded(ports: &[u16]) -> Vec<u16> {
    let mut out: Vec<u16> = Vec::new();
    for p in ports.iter().chain(ALWAYS_EXCLUDED_INBOUND.iter()) {
        if !out.contains(p) {
            out.push(*p);
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SidecarError {
    #[error("annotation {annotation}={value:?}: {reason}")]
    BadAnnotation {
        annotation: &'static str,
        value: String,
        reason: String,
    },
    #[error("pod object is not a Pod: {0}")]
    NotAPod(&'static str),
    #[error("{name}={value:?}: {reason}")]
    BadEnv {
        name: &'static str,
        value: String,
        reason: String,
    },
}

/// Where Istio's env-only settings come from besides the `istio-proxy` container's own env (which
/// wins), and how group names become GIDs.
pub struct SidecarEnv<'a> {
    /// The plugin process environment, where Istio's plugin reads them.
    pub fallback: &'a dyn Fn(&str) -> Option<String>,
    /// Group name → GID (the node's group database, as `iptables` would resolve it).
    pub group_id: &'a dyn Fn(&str) -> Option<u32>,
}

impl SidecarEnv<'static> {
    /// Only the pod's env; groups must be numeric.
    pub fn pod_only() -> Self {
        SidecarEnv {
            fallback: &|_| None,
            group_id: &|_| None,
        }
    }
}

fn bad_env(name: &'static str, value: &str, reason: impl Into<String>) -> SidecarError {
    SidecarError::BadEnv {
        name,
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn parse_groups(
    name: &'static str,
    value: &str,
    group_id: &dyn Fn(&str) -> Option<u32>,
) -> Result<Vec<u32>, SidecarError> {
    items(value)
        .map(|g| match g.parse::<u32>() {
            Ok(id) => Ok(id),
            Err(_) => group_id(g)
                .ok_or_else(|| bad_env(name, value, format!("no group {g:?} on this node"))),
        })
        .collect()
}

/// Istio's `ParseInterceptFilter` + `ValidateOwnerGroups`: `*` means all groups minus the
/// exclusions (unset: `*`); otherwise only the listed groups, at most 64.
pub fn owner_groups(
    include: Option<&str>,
    exclude: Option<&str>,
    group_id: &dyn Fn(&str) -> Option<u32>,
) -> Result<OwnerGroups, SidecarError> {
    let include = include
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .unwrap_or("*");
    if include == "*" {
        let excluded = parse_groups(OWNER_GROUPS_EXCLUDE, exclude.unwrap_or(""), group_id)?;
        return Ok(OwnerGroups::AllExcept(excluded));
    }
    let only = parse_groups(OWNER_GROUPS, include, group_id)?;
    if only.len() > MAX_OWNER_GROUPS_INCLUDE {
        return Err(bad_env(
            OWNER_GROUPS,
            include,
            format!(
                "at most {MAX_OWNER_GROUPS_INCLUDE} groups, got {}",
                only.len()
            ),
        ));
    }
    Ok(OwnerGroups::Only(only))
}

/// Istio's `ValidateIPv4LoopbackCidr`: an IPv4 loopback prefix of length 8 to 32.
pub fn loopback_cidr(value: &str) -> Result<Ipv4Net, SidecarError> {
    let net: Ipv4Net = value
        .trim()
        .parse()
        .map_err(|e| bad_env(IPV4_LOOPBACK_CIDR, value, format!("not an IPv4 CIDR: {e}")))?;
    if !net.addr().is_loopback() {
        return Err(bad_env(IPV4_LOOPBACK_CIDR, value, "not a loopback address"));
    }
    if net.prefix_len() < 8 {
        return Err(bad_env(IPV4_LOOPBACK_CIDR, value, "prefix shorter than /8"));
    }
    Ok(net)
}

/// What the plugin does with a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Detection {
    /// Program the sidecar redirection described by the config.
    Sidecar(Box<SidecarConfig>),
    /// Leave the pod alone, for the reason given (logged).
    Skip(String),
}

fn bad(annotation: &'static str, value: &str, reason: impl Into<String>) -> SidecarError {
    SidecarError::BadAnnotation {
        annotation,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Istio's `config.Split` for the env-only lists (owner groups): empty items are dropped.
fn items(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// Istio's `parsePorts`: an empty (or blank) value is no ports; otherwise every comma-separated
/// item, trimmed, must be a decimal port, so an empty item (`80,`) fails the ADD. Port 0 is
/// refused too (Istio lets it through to iptables).
fn parse_ports(annotation: &'static str, value: &str) -> Result<Vec<u16>, SidecarError> {
    let list = value.trim();
    if list.is_empty() {
        return Ok(Vec::new());
    }
    list.split(',')
        .map(str::trim)
        .enumerate()
        .map(|(index, p)| {
            if p.is_empty() {
                return Err(bad(
                    annotation,
                    value,
                    format!("item {} is empty", index + 1),
                ));
            }
            if !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad(
                    annotation,
                    value,
                    format!("port {p:?} is not a number"),
                ));
            }
            match p.parse::<u16>() {
                Ok(0) => Err(bad(annotation, value, format!("port {p:?} out of range"))),
                Ok(n) => Ok(n),
                Err(e) => Err(bad(annotation, value, format!("port {p:?}: {e}"))),
            }
        })
        .collect()
}

/// `*` exactly, as Istio compares it; anything else is a port list.
fn parse_ports_wild(annotation: &'static str, value: &str) -> Result<Ports, SidecarError> {
    if value == "*" {
        Ok(Ports::All)
    } else {
        parse_ports(annotation, value).map(Ports::List)
    }
}

/// Istio's `validateCIDRList`: an empty value is no ranges; otherwise every comma-separated item
/// must be a CIDR as written, so an empty item (`10.0.0.0/8,`) or one with spaces around it fails
/// the ADD.
fn parse_cidrs(annotation: &'static str, value: &str) -> Result<Vec<IpNet>, SidecarError> {
    if value.is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .enumerate()
        .map(|(index, c)| {
            if c.is_empty() {
                return Err(bad(
                    annotation,
                    value,
                    format!("item {} is empty", index + 1),
                ));
            }
            c.parse::<IpNet>()
                .map_err(|e| bad(annotation, value, format!("CIDR {c:?}: {e}")))
        })
        .collect()
}

/// Istio's `ValidateInterfaceNames`, which fails the ADD: an empty value is no interfaces;
/// otherwise every comma-separated item, trimmed, must be a name that starts with a letter, so
/// an empty item (`eth0,`) or one starting with a digit, `_` or `.` is refused, as is anything
/// [`InterfaceName`] refuses.
fn parse_interfaces(
    annotation: &'static str,
    value: &str,
) -> Result<Vec<InterfaceName>, SidecarError> {
    if value.is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(str::trim)
        .enumerate()
        .map(|(index, item)| {
            if item.is_empty() {
                return Err(bad(
                    annotation,
                    value,
                    format!("item {} is empty", index + 1),
                ));
            }
            if !item.starts_with(|c: char| c.is_ascii_alphabetic()) {
                return Err(bad(
                    annotation,
                    value,
                    format!("interface name {item:?} does not start with a letter"),
                ));
            }
            InterfaceName::new(item)
                .map_err(|e: InvalidInterfaceName| bad(annotation, value, e.to_string()))
        })
        .collect()
}

/// A Pod object (JSON, as the API server serves it) reduced to what detection reads.
struct PodFacts<'a> {
    pod: &'a Value,
}

impl<'a> PodFacts<'a> {
    fn map(&self, field: &str) -> Option<&'a serde_json::Map<String, Value>> {
        self.pod.get("metadata")?.get(field)?.as_object()
    }

    fn annotation(&self, key: &str) -> Option<&'a str> {
        self.map("annotations")?.get(key)?.as_str()
    }

    fn label(&self, key: &str) -> Option<&'a str> {
        self.map("labels")?.get(key)?.as_str()
    }

    /// Init containers then containers: native sidecars are init containers.
    fn containers(&self) -> impl Iterator<Item = &'a Value> {
        let spec = self.pod.get("spec");
        ["initContainers", "containers"]
            .into_iter()
            .flat_map(move |k| {
                spec.and_then(|s| s.get(k))
                    .and_then(Value::as_array)
                    .map(|a| a.iter())
                    .into_iter()
                    .flatten()
            })
    }

    fn container(&self, name: &str) -> Option<&'a Value> {
        self.containers()
            .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
    }
}

fn env<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container
        .get("env")?
        .as_array()?
        .iter()
        .find(|e| e.get("name").and_then(Value::as_str) == Some(name))?
        .get("value")?
        .as_str()
}

fn env_bool(container: &Value, name: &str) -> bool {
    // Istio only warns on an unparsable value and keeps the default (off).
    env(container, name)
        .and_then(parse_go_bool)
        .unwrap_or(false)
}

fn security_id(container: &Value, field: &str) -> u32 {
    container
        .get("securityContext")
        .and_then(|s| s.get(field))
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
        .filter(|v| *v != 0)
        .unwrap_or(DEFAULT_PROXY_ID)
}

/// Decides whether the plugin programs sidecar redirection for `pod`, and with which settings.
/// `ipv6`: the pod has an IPv6 address, so the IPv6 rules are programmed as well.
pub fn detect(pod: &Value, ipv6: bool) -> Result<Detection, SidecarError> {
    detect_with(pod, ipv6, &SidecarEnv::pod_only())
}

/// [`detect`], with Istio's env-only settings also read from `host` (the pod's `istio-proxy` env
/// wins) and group names resolved there.
pub fn detect_with(
    pod: &Value,
    ipv6: bool,
    host: &SidecarEnv<'_>,
) -> Result<Detection, SidecarError> {
    if !pod.is_object() {
        return Err(SidecarError::NotAPod("not a JSON object"));
    }
    let facts = PodFacts { pod };
    let skip = |why: &str| Ok(Detection::Skip(why.to_string()));
    if facts.container(INIT_CONTAINER).is_some() {
        return skip("istio-init container present: the pod programs its own rules");
    }
    let Some(proxy) = facts.container(PROXY_CONTAINER) else {
        return skip("no istio-proxy container");
    };
    if env(proxy, "DISABLE_ENVOY").and_then(parse_go_bool) == Some(true) {
        return skip("DISABLE_ENVOY on istio-proxy");
    }
    let args: Vec<&str> = proxy
        .get("args")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if args.len() >= 2 && args[0] == "proxy" && args[1] != "sidecar" {
        return Ok(Detection::Skip(format!(
            "proxy type {} is not sidecar",
            args[1]
        )));
    }
    // The label is the newer API and wins when both are set, even if it does not parse.
    let inject = facts.label(INJECT).or_else(|| facts.annotation(INJECT));
    if inject.and_then(parse_go_bool) == Some(false) {
        return skip("sidecar injection disabled");
    }
    if facts.annotation(ANNOTATION_STATUS).is_none() {
        return skip("no sidecar.istio.io/status annotation: not injected");
    }
    let mut cfg = config_from_annotations(|k| facts.annotation(k))?;
    cfg.proxy_uid = security_id(proxy, "runAsUser");
    cfg.proxy_gid = security_id(proxy, "runAsGroup");
    cfg.redirect_dns = env_bool(proxy, "ISTIO_META_DNS_CAPTURE");
    cfg.dual_stack = env_bool(proxy, "ISTIO_DUAL_STACK");
    cfg.drop_invalid = env_bool(proxy, "INVALID_DROP");
    cfg.ipv6 = ipv6;
    let setting = |name: &str| {
        env(proxy, name)
            .map(str::to_string)
            .or_else(|| (host.fallback)(name))
            .filter(|v| !v.trim().is_empty())
    };
    cfg.owner_groups = owner_groups(
        setting(OWNER_GROUPS).as_deref(),
        setting(OWNER_GROUPS_EXCLUDE).as_deref(),
        host.group_id,
    )?;
    if let Some(v) = setting(IPV4_LOOPBACK_CIDR) {
        cfg.loopback_v4 = loopback_cidr(&v)?;
    }
    Ok(Detection::Sidecar(Box::new(cfg)))
}

/// The annotation-driven part of the config (Istio's `NewRedirect`); IDs and env keep defaults.
pub fn config_from_annotations<'a>(
    get: impl Fn(&str) -> Option<&'a str>,
) -> Result<SidecarConfig, SidecarError> {
    let mut cfg = SidecarConfig::default();
    if let Some(v) = get(INTERCEPTION_MODE) {
        cfg.mode = match v {
            "REDIRECT" => InterceptionMode::Redirect,
            "TPROXY" => InterceptionMode::Tproxy,
            _ => return Err(bad(INTERCEPTION_MODE, v, "expected REDIRECT or TPROXY")),
        };
    }
    if let Some(v) = get(INCLUDE_OUTBOUND_IP_RANGES) {
        cfg.include_outbound_ip_ranges = if v == "*" {
            IpRanges::All
        } else {
            IpRanges::List(parse_cidrs(INCLUDE_OUTBOUND_IP_RANGES, v)?)
        };
    }
    if let Some(v) = get(EXCLUDE_OUTBOUND_IP_RANGES) {
        cfg.exclude_outbound_ip_ranges = parse_cidrs(EXCLUDE_OUTBOUND_IP_RANGES, v)?;
    }
    if let Some(v) = get(INCLUDE_INBOUND_PORTS) {
        cfg.include_inbound_ports = parse_ports_wild(INCLUDE_INBOUND_PORTS, v)?;
    }
    if let Some(v) = get(EXCLUDE_INBOUND_PORTS) {
        // Istio accepts `*` here and would render `--dport *`, which iptables rejects; excluding
        // every inbound port means capturing none.
        match parse_ports_wild(EXCLUDE_INBOUND_PORTS, v)? {
            Ports::All => {
                cfg.include_inbound_ports = Ports::List(Vec::new());
                cfg.exclude_inbound_ports = with_always_excluded(&[]);
            }
            Ports::List(p) => cfg.exclude_inbound_ports = with_always_excluded(&p),
        }
    }
    if let Some(v) = get(INCLUDE_OUTBOUND_PORTS) {
        cfg.include_outbound_ports = match parse_ports_wild(INCLUDE_OUTBOUND_PORTS, v)? {
            // Every port is what the wildcard IP include already captures.
            Ports::All => Vec::new(),
            Ports::List(p) => p,
        };
    }
    if let Some(v) = get(EXCLUDE_OUTBOUND_PORTS) {
        // Same `*` fix as inbound: no outbound capture at all.
        match parse_ports_wild(EXCLUDE_OUTBOUND_PORTS, v)? {
            Ports::All => {
                cfg.exclude_outbound_ports = Vec::new();
                cfg.include_outbound_ip_ranges = IpRanges::List(Vec::new());
                cfg.include_outbound_ports = Vec::new();
            }
            Ports::List(p) => cfg.exclude_outbound_ports = p,
        }
    }
    if let Some(v) = get(EXCLUDE_INTERFACES) {
        cfg.exclude_interfaces = parse_interfaces(EXCLUDE_INTERFACES, v)?;
    }
    if let Some(v) = get(REROUTE_VIRTUAL_INTERFACES) {
        cfg.reroute_virtual_interfaces = parse_interfaces(REROUTE_VIRTUAL_INTERFACES, v)?;
    } else if let Some(v) = get(KUBEVIRT_INTERFACES) {
        cfg.reroute_virtual_interfaces = parse_interfaces(KUBEVIRT_INTERFACES, v)?;
    }
    Ok(cfg)
}

/// The families the config programs (v4 always; v6 when the pod has an IPv6 address).
pub fn families(cfg: &SidecarConfig) -> Vec<Family> {
    if cfg.ipv6 {
        vec![Family::V4, Family::V6]
    } else {
        vec![Family::V4]
    }
}

/// The address family of a pod IP, for [`detect`]'s `ipv6` argument.
pub fn has_ipv6(ips: impl IntoIterator<Item = IpAddr>) -> bool {
    ips.into_iter()
        .any(|ip| ip.is_ipv6() && !ip.is_loopback() && !is_v6_link_local(ip))
}

fn is_v6_link_local(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interfaces(annotation: &str, value: &str) -> Result<Vec<String>, SidecarError> {
        let cfg = config_from_annotations(|k| (k == annotation).then_some(value))?;
        let list = if annotation == EXCLUDE_INTERFACES {
            cfg.exclude_interfaces
        } else {
            cfg.reroute_virtual_interfaces
        };
        Ok(list.iter().map(|i| i.as_str().to_string()).collect())
    }

    /// Istio fails the ADD for these (`ValidateInterfaceNames`); so must we, naming the
    /// annotation and the item.
    #[test]
    fn interface_lists_refuse_what_istio_refuses() {
        for annotation in [
            EXCLUDE_INTERFACES,
            REROUTE_VIRTUAL_INTERFACES,
            KUBEVIRT_INTERFACES,
        ] {
            for (value, names) in [
                ("eth0,", "item 2 is empty"),
                (",eth0", "item 1 is empty"),
                ("eth0,,eth1", "item 2 is empty"),
                ("eth0, ", "item 2 is empty"),
                (" ", "item 1 is empty"),
                ("eth0,1net", "\"1net\" does not start with a letter"),
                ("_tap", "\"_tap\" does not start with a letter"),
                (".vlan", "\".vlan\" does not start with a letter"),
                ("-j", "\"-j\" does not start with a letter"),
                ("averyverylongname", "longer than 15 bytes"),
                ("eth0;x", "only letters"),
            ] {
                let err = interfaces(annotation, value)
                    .expect_err(&format!("{annotation}={value:?} accepted"));
                let msg = err.to_string();
                assert!(
                    msg.contains(annotation) && msg.contains(names),
                    "{annotation}={value:?}: {msg}"
                );
                assert!(
                    matches!(&err, SidecarError::BadAnnotation { annotation: a, .. } if *a == annotation)
                );
            }
            for (value, want) in [
                ("", vec![]),
                ("eth0", vec!["eth0"]),
                (" eth0 , net1", vec!["eth0", "net1"]),
                ("a_b.c-d9", vec!["a_b.c-d9"]),
            ] {
                assert_eq!(interfaces(annotation, value).unwrap(), want, "{value:?}");
            }
        }
    }

    /// Port and CIDR lists as Istio's `parsePorts` / `validateCIDRList` take them: an empty item
    /// fails the ADD, CIDRs are taken as written, `*` only exactly.
    #[test]
    fn port_and_cidr_lists_refuse_what_istio_refuses() {
        let parse = |k: &str, v: &str| config_from_annotations(|a| (a == k).then_some(v));
        for (key, value, names) in [
            (INCLUDE_INBOUND_PORTS, "80,", "item 2 is empty"),
            (EXCLUDE_INBOUND_PORTS, "6000,7000,", "item 3 is empty"),
            (EXCLUDE_OUTBOUND_PORTS, "22,,23", "item 2 is empty"),
            (INCLUDE_OUTBOUND_PORTS, "+80", "\"+80\" is not a number"),
            (INCLUDE_INBOUND_PORTS, " *", "\"*\" is not a number"),
            (INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8,", "item 2 is empty"),
            (EXCLUDE_OUTBOUND_IP_RANGES, ",10.0.0.0/8", "item 1 is empty"),
            (
                EXCLUDE_OUTBOUND_IP_RANGES,
                "10.0.0.0/8, 10.1.0.0/16",
                "\" 10.1.0.0/16\"",
            ),
            (INCLUDE_OUTBOUND_IP_RANGES, " *", "\" *\""),
            (EXCLUDE_OUTBOUND_IP_RANGES, " ", "\" \""),
        ] {
            let err = parse(key, value).expect_err(&format!("{key}={value:?} accepted"));
            let msg = err.to_string();
            assert!(msg.contains(key) && msg.contains(names), "{msg}");
        }
        let cfg = parse(INCLUDE_INBOUND_PORTS, " 80 , 8080 ").unwrap();
        assert_eq!(cfg.include_inbound_ports, Ports::List(vec![80, 8080]));
        let cfg = parse(INCLUDE_INBOUND_PORTS, "  ").unwrap();
        assert_eq!(cfg.include_inbound_ports, Ports::List(vec![]));
        let cfg = parse(INCLUDE_OUTBOUND_IP_RANGES, "10.0.0.0/8,fd00::/8").unwrap();
        assert_eq!(
            cfg.include_outbound_ip_ranges,
            IpRanges::List(vec![
                "10.0.0.0/8".parse().unwrap(),
                "fd00::/8".parse().unwrap()
            ])
        );
        let cfg = parse(INCLUDE_OUTBOUND_IP_RANGES, "").unwrap();
        assert_eq!(cfg.include_outbound_ip_ranges, IpRanges::List(vec![]));
    }
}
