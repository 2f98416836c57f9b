//! Ambient mode: what in-pod and host redirection must look like, independent of the syntax that
//! programs it. [`iptables`] and [`nft`] render the same decisions from [`InpodConfig`];
//! [`overrides`] combines the node's settings with a pod's annotations.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::InterfaceName;

pub mod iptables;
pub mod nft;
pub mod overrides;

/// Ports, marks and names shared with ztunnel and Istio. Changing any of them breaks wire
/// compatibility.
pub mod consts {
    /// ztunnel's outbound capture listener.
    pub const OUTBOUND_PORT: u16 = 15001;
    /// ztunnel's inbound plaintext capture listener.
    pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
    /// ztunnel's inbound HBONE listener; never redirected.
    pub const INBOUND_HBONE_PORT: u16 = 15008;
    /// ztunnel's DNS proxy; pods' DNS (port 53) is redirected to it.
    pub const DNS_PROXY_PORT: u16 = 15053;
    /// `SO_MARK` on every socket ztunnel makes in a pod netns.
    pub const ZTUNNEL_MARK: u32 = 0x539;
    /// Connmark of the connections ztunnel injects into the pod (spoofed source), restored onto
    /// their packets so the app's replies are routed back to ztunnel. Istio's `InpodTProxyMark`,
    /// named here after what it marks: ambient has no TPROXY, and the sidecar's TPROXY mark is
    /// another value ([`crate::redirect::sidecar::INBOUND_TPROXY_MARK`]).
    pub const ZTUNNEL_CONNMARK: u32 = 0x111;
    /// Mask applied to both marks.
    pub const MARK_MASK: u32 = 0xfff;
    /// Policy routing table that delivers [`ZTUNNEL_CONNMARK`]ed replies locally.
    pub const ROUTE_TABLE: u32 = 100;
    /// Priority of the fwmark rule.
    pub const RULE_PRIORITY: u32 = 32764;
    /// Default link-local address kubelet probes are SNATed to.
    pub const PROBE_SNAT_V4: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 7, 127);
    /// Default IPv6 probe SNAT address.
    pub const PROBE_SNAT_V6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(
        0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff,
    );
    /// Host address set of enrolled pod IPs (suffixed `-v4` / `-v6`).
    pub const PROBE_SET_PREFIX: &str = "istio-inpod-probes";
}

/// Inputs of the ambient in-pod rule set: the global settings combined with a pod's overrides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InpodConfig {
    /// Capture DNS (UDP and TCP port 53) to ztunnel's DNS proxy.
    pub redirect_dns: bool,
    /// Also program the IPv6 rule set.
    pub ipv6: bool,
    /// `ambient.istio.io/bypass-inbound-capture`: only outbound traffic is captured.
    pub ingress_mode: bool,
    /// `istio.io/reroute-virtual-interfaces`: inbound TCP on these interfaces goes to the outbound
    /// listener. Names are validated by [`InterfaceName`], so they can never inject rule syntax.
    pub reroute_virtual_interfaces: Vec<InterfaceName>,
    /// Source address kubelet probes arrive with (host SNAT); they bypass capture.
    pub probe_snat_v4: Ipv4Addr,
    pub probe_snat_v6: Ipv6Addr,
}

impl Default for InpodConfig {
    fn default() -> Self {
        InpodConfig {
            redirect_dns: true,
            ipv6: false,
            ingress_mode: false,
            reroute_virtual_interfaces: Vec::new(),
            probe_snat_v4: consts::PROBE_SNAT_V4,
            probe_snat_v6: consts::PROBE_SNAT_V6,
        }
    }
}
