//! Per-pod overrides of the in-pod rule set, read from pod annotations and combined with the
//! node-wide settings into the [`InpodConfig`] a backend renders.

use super::InpodConfig;
use crate::redirect::{InterfaceName, InvalidInterfaceName, parse_go_bool};

/// `true` → only outbound traffic is captured ("ingress mode").
pub const BYPASS_INBOUND_CAPTURE: &str = "ambient.istio.io/bypass-inbound-capture";
/// `true`/`false` overrides the node's DNS capture setting for this pod.
pub const DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";
/// Comma-separated interfaces whose inbound TCP is treated as outbound.
pub const REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverrideError {
    /// Istio passes these names unchecked into iptables arguments; we refuse them instead.
    #[error("annotation {annotation}: {source}")]
    BadInterface {
        annotation: &'static str,
        #[source]
        source: InvalidInterfaceName,
    },
}

/// An annotation that was present but ignored, for the caller to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ignored {
    pub annotation: &'static str,
    pub value: String,
}

/// The effective configuration for a pod, plus the annotations that were ignored because their
/// value is not a boolean (Istio warns and carries on; so do we).
pub fn inpod_config<'a>(
    global: &InpodConfig,
    annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(InpodConfig, Vec<Ignored>), OverrideError> {
    let mut cfg = global.clone();
    let mut ignored = Vec::new();
    for (key, value) in annotations {
        match key {
            BYPASS_INBOUND_CAPTURE => match parse_go_bool(value) {
                Some(v) => cfg.ingress_mode = v,
                None => ignored.push(Ignored {
                    annotation: BYPASS_INBOUND_CAPTURE,
                    value: value.to_string(),
                }),
            },
            DNS_CAPTURE => match parse_go_bool(value) {
                Some(v) => cfg.redirect_dns = v,
                None => ignored.push(Ignored {
                    annotation: DNS_CAPTURE,
                    value: value.to_string(),
                }),
            },
            REROUTE_VIRTUAL_INTERFACES => cfg.reroute_virtual_interfaces = interface_list(value)?,
            _ => {}
        }
    }
    Ok((cfg, ignored))
}

/// Entries are trimmed and empty ones dropped, as in Istio; each must be a valid interface name.
pub fn interface_list(value: &str) -> Result<Vec<InterfaceName>, OverrideError> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            InterfaceName::new(s).map_err(|source| OverrideError::BadInterface {
                annotation: REROUTE_VIRTUAL_INTERFACES,
                source,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&'static str, &'static str)], global: &InpodConfig) -> InpodConfig {
        inpod_config(global, pairs.iter().copied()).unwrap().0
    }

    #[test]
    fn no_annotations_is_the_global_config() {
        let global = InpodConfig {
            redirect_dns: false,
            ipv6: true,
            ..Default::default()
        };
        assert_eq!(cfg(&[("unrelated", "x")], &global), global);
    }

    #[test]
    fn dns_annotation_overrides_both_ways() {
        let on = InpodConfig {
            redirect_dns: true,
            ..Default::default()
        };
        let off = InpodConfig {
            redirect_dns: false,
            ..Default::default()
        };
        assert!(!cfg(&[(DNS_CAPTURE, "false")], &on).redirect_dns);
        assert!(cfg(&[(DNS_CAPTURE, "T")], &off).redirect_dns);
    }

    #[test]
    fn unparsable_booleans_are_ignored_and_reported() {
        let global = InpodConfig::default();
        let (got, ignored) = inpod_config(
            &global,
            [(DNS_CAPTURE, "nope"), (BYPASS_INBOUND_CAPTURE, "yes")],
        )
        .unwrap();
        assert_eq!(got, global);
        assert_eq!(ignored.len(), 2);
        assert_eq!(
            ignored[0],
            Ignored {
                annotation: DNS_CAPTURE,
                value: "nope".into()
            }
        );
    }

    #[test]
    fn bypass_inbound_sets_ingress_mode() {
        assert!(cfg(&[(BYPASS_INBOUND_CAPTURE, "true")], &InpodConfig::default()).ingress_mode);
    }

    #[test]
    fn interfaces_are_trimmed_and_validated() {
        let got = cfg(
            &[(REROUTE_VIRTUAL_INTERFACES, " eth1 ,, veth-x,")],
            &InpodConfig::default(),
        );
        let names: Vec<&str> = got
            .reroute_virtual_interfaces
            .iter()
            .map(|i| i.as_str())
            .collect();
        assert_eq!(names, ["eth1", "veth-x"]);

        let err = inpod_config(
            &InpodConfig::default(),
            [(REROUTE_VIRTUAL_INTERFACES, "eth0,eth1 -j ACCEPT")],
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(REROUTE_VIRTUAL_INTERFACES) && msg.contains("eth1 -j ACCEPT"),
            "{msg}"
        );
    }
}
