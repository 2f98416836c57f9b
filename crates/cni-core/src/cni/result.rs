//! What we read from a previous plugin's result (its IP configs) and the result we print when
//! there is none.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Deserialize;
use serde_json::Value;

use super::error::{CniError, code};
use super::version;

/// One address a previous plugin assigned, in the 1.x result shape (`interface` is an index into
/// the result's `interfaces`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpConfig {
    pub interface: Option<i64>,
    /// Host address plus prefix length (`10.244.1.5/24`), not the network.
    pub address: IpNet,
    pub gateway: Option<IpAddr>,
}

/// The IP configs of a `prevResult` of spec version `conf_version`: `ips` for 0.3.0 and later,
/// `ip4`/`ip6` for 0.1.0/0.2.0 (where libcni keeps one address per family and no interface).
pub fn prev_result_ips(prev_result: &str, conf_version: &str) -> Result<Vec<IpConfig>, CniError> {
    let bad = |e: String| {
        CniError::new(
            code::DECODING_FAILURE,
            format!("could not parse prevResult: {e}"),
        )
    };
    if version::at_least(conf_version, "0.3.0")? {
        #[derive(Deserialize)]
        struct Ip {
            #[serde(default)]
            interface: Option<i64>,
            address: String,
            #[serde(default)]
            gateway: Option<String>,
        }
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            ips: Option<Vec<Ip>>,
        }
        let r: R = serde_json::from_str(prev_result).map_err(|e| bad(e.to_string()))?;
        r.ips
            .unwrap_or_default()
            .into_iter()
            .map(|ip| {
                Ok(IpConfig {
                    interface: ip.interface,
                    address: parse_cidr(&ip.address).map_err(bad)?,
                    gateway: parse_gateway(ip.gateway.as_deref()).map_err(bad)?,
                })
            })
            .collect()
    } else {
        #[derive(Deserialize)]
        struct Ip {
            ip: String,
            #[serde(default)]
            gateway: Option<String>,
        }
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            ip4: Option<Ip>,
            #[serde(default)]
            ip6: Option<Ip>,
        }
        let r: R = serde_json::from_str(prev_result).map_err(|e| bad(e.to_string()))?;
        [r.ip4, r.ip6]
            .into_iter()
            .flatten()
            .map(|ip| {
                Ok(IpConfig {
                    interface: None,
                    address: parse_cidr(&ip.ip).map_err(bad)?,
                    gateway: parse_gateway(ip.gateway.as_deref()).map_err(bad)?,
                })
            })
            .collect()
    }
}

fn parse_cidr(s: &str) -> Result<IpNet, String> {
    s.parse::<IpNet>()
        .map_err(|_| format!("invalid CIDR address: {s}"))
}

fn parse_gateway(s: Option<&str>) -> Result<Option<IpAddr>, String> {
    match s {
        None | Some("") => Ok(None),
        Some(g) => g
            .parse()
            .map(Some)
            .map_err(|_| format!("invalid gateway: {g}")),
    }
}

/// The result a plugin prints when it got no `prevResult`: libcni converts an empty 1.x result to
/// the config's version, and the pre-1.0 shapes keep an empty `dns` object.
pub fn empty_result(conf_version: &str) -> Value {
    let mut obj = serde_json::Map::new();
    obj.insert("cniVersion".into(), Value::String(conf_version.to_owned()));
    if !version::at_least(conf_version, "1.0.0").unwrap_or(true) {
        obj.insert("dns".into(), Value::Object(Default::default()));
    }
    Value::Object(obj)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_1x_and_04_ips() {
        let r = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"eth0"}],
            "ips":[{"interface":0,"address":"10.244.1.5/24","gateway":"10.244.1.1"},
                   {"address":"fd00::5/64"}]}"#;
        let ips = prev_result_ips(r, "1.0.0").unwrap();
        assert_eq!(
            ips,
            vec![
                IpConfig {
                    interface: Some(0),
                    address: "10.244.1.5/24".parse().unwrap(),
                    gateway: Some("10.244.1.1".parse().unwrap()),
                },
                IpConfig {
                    interface: None,
                    address: "fd00::5/64".parse().unwrap(),
                    gateway: None
                },
            ]
        );
        // 0.3.x results carry "version" too; it is ignored.
        let r = r#"{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.1.0.9/16"}]}"#;
        assert_eq!(
            prev_result_ips(r, "0.3.1").unwrap()[0].address.to_string(),
            "10.1.0.9/16"
        );
        assert!(
            prev_result_ips(r#"{"cniVersion":"1.0.0"}"#, "1.0.0")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn reads_020_ips() {
        let r =
            r#"{"cniVersion":"0.2.0","ip4":{"ip":"10.1.0.9/16","gateway":"10.1.0.1"},"dns":{}}"#;
        let ips = prev_result_ips(r, "0.2.0").unwrap();
        assert_eq!(ips.len(), 1);
        assert_eq!(ips[0].gateway, Some("10.1.0.1".parse().unwrap()));
    }

    #[test]
    fn rejects_garbage() {
        let e = prev_result_ips(r#"{"ips":[{"address":"nope"}]}"#, "1.0.0").unwrap_err();
        assert!(e.msg.contains("invalid CIDR address: nope"), "{}", e.msg);
        assert!(prev_result_ips(r#"{"ips":5}"#, "1.0.0").is_err());
    }

    #[test]
    fn empty_result_per_version() {
        assert_eq!(
            empty_result("1.0.0").to_string(),
            r#"{"cniVersion":"1.0.0"}"#
        );
        assert_eq!(
            empty_result("1.1.0").to_string(),
            r#"{"cniVersion":"1.1.0"}"#
        );
        assert_eq!(
            empty_result("0.4.0").to_string(),
            r#"{"cniVersion":"0.4.0","dns":{}}"#
        );
        assert_eq!(
            empty_result("0.2.0").to_string(),
            r#"{"cniVersion":"0.2.0","dns":{}}"#
        );
    }
}
