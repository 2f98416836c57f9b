//! What in-pod and host redirection must look like, independent of the backend that programs it.
//! Backends (iptables text, nftables over netlink) render from these inputs; see the submodules.

use std::net::{Ipv4Addr, Ipv6Addr};

pub mod iptables;
pub mod nft;
pub mod overrides;
pub mod sidecar;

/// Ports, marks and names shared with ztunnel and Istio. Changing any of them breaks wire
/// compatibility.
pub mod consts {
    /// ztunnel's outbound capture listener.
    pub const OUTBOUND_PORT: u16 = 15001;
    /// ztunnel's inbound plaintext capture listener.
    pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
    /// ztunnel's inbound HBONE listener; never redirected.
    pub const INBOUND_HBONE_PORT: u16 = 15008;
    /// ztunnel's DNS proxy.
    pub const DNS_PROXY_PORT: u16 = 15053;
    /// `SO_MARK` on every socket ztunnel makes in a pod netns.
    pub const ZTUNNEL_MARK: u32 = 0x539;
    /// Connmark for packets ztunnel injected (spoofed source); replies are routed back to it.
    pub const TPROXY_MARK: u32 = 0x111;
    /// Mask applied to both marks.
    pub const MARK_MASK: u32 = 0xfff;
    /// Policy routing table that delivers marked replies locally.
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

/// A Linux interface name that is safe to place in an iptables argument or an nftables
/// expression: 1 to 15 bytes of `[A-Za-z0-9_.-]`, not `.` or `..`, not starting with `-`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct InterfaceName(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid interface name {name:?}: {reason}")]
pub struct InvalidInterfaceName {
    pub name: String,
    pub reason: &'static str,
}

impl InterfaceName {
    /// Linux IFNAMSIZ minus the terminating NUL.
    pub const MAX_LEN: usize = 15;

    pub fn new(name: &str) -> Result<Self, InvalidInterfaceName> {
        let bad = |reason| {
            Err(InvalidInterfaceName {
                name: name.to_string(),
                reason,
            })
        };
        if name.is_empty() {
            return bad("empty");
        }
        if name.len() > Self::MAX_LEN {
            return bad("longer than 15 bytes");
        }
        if name == "." || name == ".." {
            return bad("reserved name");
        }
        if name.starts_with('-') {
            return bad("starts with '-'");
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        {
            return bad("only letters, digits, '_', '.' and '-' are allowed");
        }
        Ok(InterfaceName(name.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for InterfaceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names() {
        for ok in ["eth0", "fake1s0f0", "veth_a.b-c", "a23456789012345"] {
            assert_eq!(InterfaceName::new(ok).unwrap().as_str(), ok);
        }
        for bad in [
            "",
            ".",
            "..",
            "-j",
            "eth0 -j ACCEPT",
            "a234567890123456",
            "eth0;x",
            "ä",
        ] {
            assert!(InterfaceName::new(bad).is_err(), "{bad:?} accepted");
        }
    }
}
