//! The plugin → agent protocol: what the `istio-cni` plugin asks the node agent during CNI ADD.
//!
//! Transport: HTTP/1.1 over the unix stream socket `<cni_agent_run_dir>/pluginevent.sock`
//! (requests carry `Host: unix`, a `Content-Length` body and `Connection: close`). The plugin gives
//! the whole exchange 5 s.
//!
//! Two endpoints share that socket:
//!
//! - `POST /v1/cmdadd` (ours). Body: Istio's `/cmdadd` body plus `PodUID` and `ContainerID`.
//!   The agent answers 200 with a JSON decision:
//!   - `{"decision":"enrolled"}`: the pod is redirected and ztunnel acked it;
//!   - `{"decision":"not-ambient","reason":"..."}`: the pod is not for the ambient mesh;
//!   - `{"decision":"sidecar","pod":{...}}`: a sidecar pod, with the Pod object the agent saw
//!     (the plugin programs the sidecar redirect rules from it, in `CNI_NETNS`).
//!
//!   Any other status fails the ADD with the response body (fail closed): the runtime retries
//!   the sandbox. A 404 means the agent predates this endpoint (Istio's own agent); the plugin then
//!   decides ambient membership itself from the API server and uses `/cmdadd`.
//! - `POST /cmdadd` (Istio's). Body exactly as Istio's plugin sends it:
//!   `{"Netns":"/var/run/netns/cni-1234","PodName":"web-0","PodNamespace":"default",
//!   "IPs":[{"Interface":0,"Address":{"IP":"10.244.1.5","Mask":"////AA=="},"Gateway":"10.244.1.1"}]}`
//!   (Go's default field names; `Address` is a Go `net.IPNet`, so `Mask` is the base64 of the raw
//!   mask bytes; `IPs` is `null` when the previous result had none). 200 with an empty body is
//!   success, anything else is an error whose body is the reason.
//!
//! Log forwarding uses a second socket, `<cni_agent_run_dir>/log.sock`: `POST /log` with a JSON
//! array of strings, each one JSON log record.

use std::borrow::Cow;
use std::net::IpAddr;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::cni::error::go_html_escape;
pub use crate::cni::result::IpConfig;

/// The agent's CNI event socket, in the run dir.
pub const EVENT_SOCKET: &str = "pluginevent.sock";
/// The agent's log socket, in the run dir.
pub const LOG_SOCKET: &str = "log.sock";
/// The kubeconfig the installer writes for the plugin, in the run dir.
pub const KUBECONFIG_FILE: &str = "istio-cni-kubeconfig";
/// Our decision endpoint.
pub const V1_CMDADD_PATH: &str = "/v1/cmdadd";
/// Istio's event endpoint.
pub const ISTIO_CMDADD_PATH: &str = "/cmdadd";
/// Log forwarding endpoint on [`LOG_SOCKET`].
pub const LOG_PATH: &str = "/log";

/// A log record's `time`: `YYYY-MM-DDTHH:MM:SS.uuuuuuZ` in UTC, Istio's logger's format (its
/// `formatDate`), in the plugin's records on [`LOG_SOCKET`] and in every line the agent writes.
pub fn log_time(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, mo, da) = civil_from_days(days as i64);
    format!(
        "{y:04}-{mo:02}-{da:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// One CNI ADD as the agent needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CmdAddRequest {
    pub netns: String,
    pub pod_name: String,
    pub pod_namespace: String,
    /// From the previous plugin's result; preferred over pod status, which is still empty here.
    pub ips: Vec<IpConfig>,
    pub pod_uid: String,
    pub container_id: String,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CmdAddError {
    #[error("invalid cmdadd body: {0}")]
    Json(String),
    #[error("invalid cmdadd body: {field} must be {want}")]
    Field {
        field: &'static str,
        want: &'static str,
    },
    #[error("invalid cmdadd body: bad IP {0:?}")]
    Ip(String),
    #[error("invalid cmdadd body: bad mask for {0}")]
    Mask(String),
}

impl CmdAddRequest {
    /// Istio's `/cmdadd` body, byte for byte as Go's `json.Marshal` produces it.
    pub fn to_istio_json(&self) -> Vec<u8> {
        self.go_body(false)
    }

    /// The `/v1/cmdadd` body: Istio's keys first, then ours.
    pub fn to_v1_json(&self) -> Vec<u8> {
        self.go_body(true)
    }

    fn go_body(&self, ours: bool) -> Vec<u8> {
        let body = GoBody {
            netns: &self.netns,
            pod_name: &self.pod_name,
            pod_namespace: &self.pod_namespace,
            ips: (!self.ips.is_empty()).then(|| self.ips.iter().map(GoIpConfig::from).collect()),
            pod_uid: ours.then_some(self.pod_uid.as_str()),
            container_id: ours.then_some(self.container_id.as_str()),
        };
        go_html_escape(serde_json::to_vec(&body).expect("in memory"))
    }

    /// Parses either body. Keys match case-insensitively and the last of a key's spellings
    /// counts, as with Go's decoder (Istio's agent), so any Go client's body reads alike (Go
    /// alone skips a last spelling that is null; no client sends a key twice). The
    /// members are read in place from the body: a tree of JSON values, each key and string its
    /// own allocation, was a tenth of what an ambient ADD allocated in the agent.
    pub fn from_json(body: &[u8]) -> Result<CmdAddRequest, CmdAddError> {
        let body: &RawValue =
            serde_json::from_slice(body).map_err(|e| CmdAddError::Json(e.to_string()))?;
        let obj = Members::parse(body).ok_or(CmdAddError::Field {
            field: "body",
            want: "an object",
        })?;
        let string = |field: &'static str| -> Result<String, CmdAddError> {
            match obj.get(field) {
                None => Ok(String::new()),
                Some(raw) => serde_json::from_str::<Option<String>>(raw.get())
                    .map(Option::unwrap_or_default)
                    .map_err(|_| CmdAddError::Field {
                        field,
                        want: "a string",
                    }),
            }
        };
        let ips = match obj.get("IPs") {
            None => Vec::new(),
            Some(raw) => serde_json::from_str::<Option<Vec<&RawValue>>>(raw.get())
                .map_err(|_| CmdAddError::Field {
                    field: "IPs",
                    want: "an array",
                })?
                .unwrap_or_default()
                .into_iter()
                .map(parse_go_ip_config)
                .collect::<Result<_, _>>()?,
        };
        Ok(CmdAddRequest {
            netns: string("Netns")?,
            pod_name: string("PodName")?,
            pod_namespace: string("PodNamespace")?,
            ips,
            pod_uid: string("PodUID")?,
            container_id: string("ContainerID")?,
        })
    }
}

/// A JSON object's members in body order, each value left as its text; keys are borrowed from
/// the body unless they hold escapes.
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'a> Members<'a> {
    /// The value of the last member named `key` in any ASCII case: Go's decoder sets a field
    /// from each member whose name folds to it, so the last one stays.
    fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| *v)
            .filter(|v| v.get() != "null")
    }

    /// `raw` as an object's members; `None` when it is not an object.
    fn parse(raw: &'a RawValue) -> Option<Self> {
        serde_json::from_str::<Option<Members<'a>>>(raw.get())
            .ok()
            .flatten()
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visitor<'a> {
            type Value = Members<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members<'a>, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(MemberName(k)) = map.next_key()? {
                    members.push((k, map.next_value()?));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(Visitor(std::marker::PhantomData))
    }
}

/// A member's name, borrowed from the body where it can be (serde's `borrow` on a `Cow`).
#[derive(Deserialize)]
struct MemberName<'a>(#[serde(borrow)] Cow<'a, str>);

/// The agent's answer on `/v1/cmdadd` (status 200).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "kebab-case")]
pub enum CmdAddResponse {
    Enrolled,
    NotAmbient {
        #[serde(default)]
        reason: String,
    },
    /// The Pod as Kubernetes JSON.
    Sidecar {
        pod: Value,
    },
}

/// Field order and names of Istio's Go structs (`CNIPluginAddEvent`, `IPConfig`, `net.IPNet`),
/// which `encoding/json` emits in declaration order.
#[derive(Serialize)]
struct GoBody<'a> {
    #[serde(rename = "Netns")]
    netns: &'a str,
    #[serde(rename = "PodName")]
    pod_name: &'a str,
    #[serde(rename = "PodNamespace")]
    pod_namespace: &'a str,
    #[serde(rename = "IPs")]
    ips: Option<Vec<GoIpConfig>>,
    #[serde(rename = "PodUID", skip_serializing_if = "Option::is_none")]
    pod_uid: Option<&'a str>,
    #[serde(rename = "ContainerID", skip_serializing_if = "Option::is_none")]
    container_id: Option<&'a str>,
}

#[derive(Serialize)]
struct GoIpConfig {
    #[serde(rename = "Interface")]
    interface: Option<i64>,
    #[serde(rename = "Address")]
    address: GoIpNet,
    #[serde(rename = "Gateway")]
    gateway: String,
}

#[derive(Serialize)]
struct GoIpNet {
    #[serde(rename = "IP")]
    ip: String,
    #[serde(rename = "Mask")]
    mask: String,
}

impl From<&IpConfig> for GoIpConfig {
    fn from(ip: &IpConfig) -> Self {
        let mask: Vec<u8> = match ip.address.netmask() {
            IpAddr::V4(m) => m.octets().to_vec(),
            IpAddr::V6(m) => m.octets().to_vec(),
        };
        GoIpConfig {
            interface: ip.interface,
            address: GoIpNet {
                ip: ip.address.addr().to_string(),
                mask: BASE64.encode(mask),
            },
            gateway: ip.gateway.map(|g| g.to_string()).unwrap_or_default(),
        }
    }
}

fn parse_go_ip_config(raw: &RawValue) -> Result<IpConfig, CmdAddError> {
    let obj = Members::parse(raw).ok_or(CmdAddError::Field {
        field: "IPs[]",
        want: "an object",
    })?;
    let interface = obj
        .get("Interface")
        .map(|n| {
            serde_json::from_str::<i64>(n.get()).map_err(|_| CmdAddError::Field {
                field: "Interface",
                want: "an integer",
            })
        })
        .transpose()?;
    let address = match obj.get("Address") {
        None => Members(Vec::new()),
        Some(a) => Members::parse(a).ok_or(CmdAddError::Field {
            field: "Address",
            want: "an object",
        })?,
    };
    // A member that is not a string reads as absent, as before: the address is then refused.
    let text = |members: &Members<'_>, key: &str| -> Option<String> {
        serde_json::from_str::<String>(members.get(key)?.get()).ok()
    };
    let ip_text = text(&address, "IP").unwrap_or_default();
    // IPv4-mapped IPv6 addresses are IPv4 addresses (Go stores IPv4 in 16 bytes).
    let ip = ip_text
        .parse::<IpAddr>()
        .map_err(|_| CmdAddError::Ip(ip_text.clone()))?
        .to_canonical();
    let mask = match text(&address, "Mask").as_deref() {
        None | Some("") => None,
        Some(m) => Some(
            BASE64
                .decode(m)
                .map_err(|_| CmdAddError::Mask(ip.to_string()))?,
        ),
    };
    let prefix = match mask {
        None => {
            if ip.is_ipv4() {
                32
            } else {
                128
            }
        }
        Some(bytes) => {
            mask_prefix(&bytes, ip.is_ipv4()).ok_or_else(|| CmdAddError::Mask(ip.to_string()))?
        }
    };
    let address = IpNet::new(ip, prefix).map_err(|_| CmdAddError::Mask(ip.to_string()))?;
    let gateway = match text(&obj, "Gateway").as_deref() {
        None | Some("") => None,
        Some(g) => Some(
            g.parse::<IpAddr>()
                .map_err(|_| CmdAddError::Ip(g.to_owned()))?
                .to_canonical(),
        ),
    };
    Ok(IpConfig {
        interface,
        address,
        gateway,
    })
}

/// Prefix length of a contiguous mask; a 16-byte mask on an IPv4 address uses its last 4 bytes.
fn mask_prefix(bytes: &[u8], v4: bool) -> Option<u8> {
    let bytes = match (v4, bytes.len()) {
        (true, 4) | (false, 16) => bytes,
        (true, 16) => &bytes[12..],
        _ => return None,
    };
    let ones: u32 = bytes.iter().map(|b| b.count_ones()).sum();
    let bits = bytes
        .iter()
        .fold(0u128, |acc, b| (acc << 8) | u128::from(*b));
    let width = bytes.len() as u32 * 8;
    let expected = if ones == 0 {
        0
    } else {
        (!0u128 >> (128 - width)) ^ ((1u128 << (width - ones)) - 1)
    };
    (bits == expected).then_some(ones as u8)
}

/// Go's decoder prefers an exact key and falls back to a case-insensitive match.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_times() {
        use std::time::{Duration, UNIX_EPOCH};
        assert_eq!(log_time(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let t = UNIX_EPOCH + Duration::from_micros(1_709_210_096_123_456);
        assert_eq!(log_time(t), "2024-02-29T12:34:56.123456Z");
        let t = UNIX_EPOCH + Duration::from_secs(4_102_444_799);
        assert_eq!(log_time(t), "2099-12-31T23:59:59.000000Z");
    }

    fn sample() -> CmdAddRequest {
        CmdAddRequest {
            netns: "/var/run/netns/cni-1234".into(),
            pod_name: "web-0".into(),
            pod_namespace: "default".into(),
            ips: vec![IpConfig {
                interface: Some(0),
                address: "10.244.1.5/24".parse().unwrap(),
                gateway: Some("10.244.1.1".parse().unwrap()),
            }],
            pod_uid: "863b91d4-4b68-4efa-917f-4b560e3e86aa".into(),
            container_id: "abc123".into(),
        }
    }

    #[test]
    fn istio_body_golden() {
        assert_eq!(
            String::from_utf8(sample().to_istio_json()).unwrap(),
            r#"{"Netns":"/var/run/netns/cni-1234","PodName":"web-0","PodNamespace":"default","IPs":[{"Interface":0,"Address":{"IP":"10.244.1.5","Mask":"////AA=="},"Gateway":"10.244.1.1"}]}"#
        );
        let none = CmdAddRequest {
            ips: vec![],
            ..sample()
        };
        assert_eq!(
            String::from_utf8(none.to_istio_json()).unwrap(),
            r#"{"Netns":"/var/run/netns/cni-1234","PodName":"web-0","PodNamespace":"default","IPs":null}"#
        );
    }

    #[test]
    fn istio_body_ipv6_and_missing_parts() {
        let r = CmdAddRequest {
            ips: vec![IpConfig {
                interface: None,
                address: "fd00:10:244::5/64".parse().unwrap(),
                gateway: None,
            }],
            ..sample()
        };
        let body = String::from_utf8(r.to_istio_json()).unwrap();
        assert!(
            body.ends_with(r#""IPs":[{"Interface":null,"Address":{"IP":"fd00:10:244::5","Mask":"//////////8AAAAAAAAAAA=="},"Gateway":""}]}"#),
            "{body}"
        );
    }

    #[test]
    fn v1_body_appends_our_keys_and_round_trips() {
        let body = String::from_utf8(sample().to_v1_json()).unwrap();
        assert!(
            body.ends_with(r#""Gateway":"10.244.1.1"}],"PodUID":"863b91d4-4b68-4efa-917f-4b560e3e86aa","ContainerID":"abc123"}"#),
            "{body}"
        );
        assert_eq!(CmdAddRequest::from_json(body.as_bytes()).unwrap(), sample());
        let istio = CmdAddRequest::from_json(&sample().to_istio_json()).unwrap();
        assert_eq!(
            istio,
            CmdAddRequest {
                pod_uid: String::new(),
                container_id: String::new(),
                ..sample()
            }
        );
    }

    #[test]
    fn parses_like_go() {
        // Lower-case keys, a 16-byte mask on an IPv4-mapped address, no mask at all.
        let body = br#"{"netns":"/n","podname":"p","PODNAMESPACE":"ns","ips":[
            {"interface":1,"address":{"ip":"::ffff:10.0.0.7","mask":"/////////////////wAA/w=="}},
            {"Address":{"IP":"10.0.0.8"}}]}"#;
        let r = CmdAddRequest::from_json(body).unwrap_err();
        assert_eq!(r, CmdAddError::Mask("10.0.0.7".into()));
        let body = br#"{"netns":"/n","podname":"p","PODNAMESPACE":"ns","ips":[
            {"interface":1,"address":{"ip":"::ffff:10.0.0.7","mask":"/////////////////////w=="}},
            {"Address":{"IP":"10.0.0.8"}}]}"#;
        let r = CmdAddRequest::from_json(body).unwrap();
        assert_eq!(
            (
                r.netns.as_str(),
                r.pod_name.as_str(),
                r.pod_namespace.as_str()
            ),
            ("/n", "p", "ns")
        );
        assert_eq!(r.ips[0].address.to_string(), "10.0.0.7/32");
        assert_eq!(r.ips[0].interface, Some(1));
        assert_eq!(r.ips[1].address.to_string(), "10.0.0.8/32");
        assert!(matches!(
            CmdAddRequest::from_json(b"{"),
            Err(CmdAddError::Json(_))
        ));
        assert!(matches!(
            CmdAddRequest::from_json(br#"{"IPs":{}}"#),
            Err(CmdAddError::Field { .. })
        ));
        assert!(matches!(
            CmdAddRequest::from_json(br#"{"IPs":[{"Address":{"IP":"x"}}]}"#),
            Err(CmdAddError::Ip(_))
        ));
    }

    #[test]
    fn the_last_spelling_of_a_key_counts_as_with_go() {
        let body = br#"{"Netns":"/a","netns":"/b","PodName":null,"podName":"p","IPs":null,
            "PodNamespace":"ns","Pod\u004eamespace":"escaped"}"#;
        let r = CmdAddRequest::from_json(body).unwrap();
        assert_eq!(
            (
                r.netns.as_str(),
                r.pod_name.as_str(),
                r.pod_namespace.as_str()
            ),
            ("/b", "p", "escaped")
        );
        assert!(r.ips.is_empty());
        // Here Go keeps "p" (a null member leaves a string field alone); we read the last
        // member, and null as absent. No client sends a key twice.
        let r = CmdAddRequest::from_json(br#"{"PodName":"p","podname":null}"#).unwrap();
        assert_eq!(r.pod_name, "");
    }

    #[test]
    fn what_is_not_the_expected_shape_is_named() {
        for (body, field) in [
            (&br#"[1]"#[..], "body"),
            (br#"null"#, "body"),
            (br#"{"Netns":1}"#, "Netns"),
            (br#"{"IPs":[1]}"#, "IPs[]"),
            (br#"{"IPs":[{"Interface":1.5}]}"#, "Interface"),
            (br#"{"IPs":[{"Address":"10.0.0.1"}]}"#, "Address"),
        ] {
            match CmdAddRequest::from_json(body) {
                Err(CmdAddError::Field { field: f, .. }) => {
                    assert_eq!(f, field, "{}", String::from_utf8_lossy(body))
                }
                other => panic!("{}: {other:?}", String::from_utf8_lossy(body)),
            }
        }
        assert_eq!(
            CmdAddRequest::from_json(br#"{"IPs":[{"Address":{"IP":5}}]}"#),
            Err(CmdAddError::Ip(String::new()))
        );
    }

    #[test]
    fn masks() {
        assert_eq!(mask_prefix(&[255, 255, 255, 0], true), Some(24));
        assert_eq!(mask_prefix(&[0, 0, 0, 0], true), Some(0));
        assert_eq!(mask_prefix(&[255, 0, 255, 0], true), None);
        assert_eq!(mask_prefix(&[255; 16], false), Some(128));
        assert_eq!(mask_prefix(&[255; 3], true), None);
    }

    #[test]
    fn responses() {
        let cases = [
            (CmdAddResponse::Enrolled, r#"{"decision":"enrolled"}"#),
            (
                CmdAddResponse::NotAmbient {
                    reason: "no selector matches".into(),
                },
                r#"{"decision":"not-ambient","reason":"no selector matches"}"#,
            ),
            (
                CmdAddResponse::Sidecar {
                    pod: serde_json::json!({"kind": "Pod"}),
                },
                r#"{"decision":"sidecar","pod":{"kind":"Pod"}}"#,
            ),
        ];
        for (resp, json) in cases {
            assert_eq!(serde_json::to_string(&resp).unwrap(), json);
            assert_eq!(serde_json::from_str::<CmdAddResponse>(json).unwrap(), resp);
        }
        assert_eq!(
            serde_json::from_str::<CmdAddResponse>(r#"{"decision":"not-ambient"}"#).unwrap(),
            CmdAddResponse::NotAmbient {
                reason: String::new()
            }
        );
        assert!(serde_json::from_str::<CmdAddResponse>(r#"{"decision":"maybe"}"#).is_err());
    }

    /// `/cmdadd` bodies come from any root process on the node: nesting deep enough to
    /// overflow a recursive parser, wherever it is, is refused as an error.
    #[test]
    fn deeply_nested_body_is_an_error() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        for (body, refused) in [
            (
                format!(r#"{{"Netns":"/x","PodName":"p","PodNamespace":"n","IPs":{deep}}}"#),
                true,
            ),
            (format!(r#"{{"Netns":{deep}}}"#), true),
            (format!(r#"{{"IPs":[{{"Address":{deep}}}]}}"#), true),
            (deep.clone(), true),
            // A member nobody reads is skipped without recursing, however deep (Go's decoder
            // refuses nesting beyond 10,000 levels; nothing here needs to).
            (format!(r#"{{"Other":{deep},"PodName":"p"}}"#), false),
        ] {
            let parsed = CmdAddRequest::from_json(body.as_bytes());
            assert_eq!(parsed.is_err(), refused, "{:?}", parsed.map(|r| r.pod_name));
        }
    }
}
