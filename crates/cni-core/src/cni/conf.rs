//! The standard fields of a plugin's network configuration. `prevResult` stays raw JSON: a chained
//! plugin that changes nothing must hand the previous plugin's result on untouched.

use serde::Deserialize;
use serde_json::value::RawValue;

#[derive(Debug, Default, Deserialize)]
pub struct NetConf {
    #[serde(rename = "cniVersion", default, deserialize_with = "super::nullable")]
    pub cni_version: String,
    #[serde(default, deserialize_with = "super::nullable")]
    pub name: String,
    #[serde(rename = "type", default, deserialize_with = "super::nullable")]
    pub plugin_type: String,
    #[serde(rename = "prevResult", default)]
    pub prev_result: Option<Box<RawValue>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_prev_result_text() {
        let text = r#"{"cniVersion":"1.0.0","name":"n","type":"istio-cni","prevResult":{ "cniVersion" : "1.0.0", "ips":[{"address":"10.0.0.2/24"}] },"x":1}"#;
        let c: NetConf = serde_json::from_str(text).unwrap();
        assert_eq!(c.cni_version, "1.0.0");
        assert_eq!(c.plugin_type, "istio-cni");
        assert_eq!(
            c.prev_result.unwrap().get(),
            r#"{ "cniVersion" : "1.0.0", "ips":[{"address":"10.0.0.2/24"}] }"#
        );
        let c: NetConf =
            serde_json::from_str(r#"{"name":"n","prevResult":null,"type":null}"#).unwrap();
        assert!(c.prev_result.is_none());
        assert_eq!(c.plugin_type, "");
    }
}
