//! CNI spec versions: which ones we accept, how they compare, and the VERSION command's output.

use super::error::{CniError, code};

/// Every spec version a Go plugin built on libcni v1.3.0 accepts, in libcni's order.
pub const SUPPORTED: [&str; 7] = [
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The version we implement (`cniVersion` of the VERSION output).
pub const CURRENT: &str = "1.1.0";

/// `(major, minor, micro)`. An empty string is 0.1.0, as in libcni (no `cniVersion` declared).
pub fn parse(version: &str) -> Result<(u64, u64, u64), String> {
    if version.is_empty() {
        return Ok((0, 1, 0));
    }
    let parts: Vec<&str> = version.split('.').collect();
    if parts.len() >= 4 {
        return Err(format!("invalid version {version:?}: too many parts"));
    }
    let num = |i: usize, what: &str| -> Result<u64, String> {
        match parts.get(i) {
            None => Ok(0),
            Some(p) => p
                .parse::<u64>()
                .map_err(|e| format!("failed to convert {what} version part {p:?}: {e}")),
        }
    };
    Ok((num(0, "major")?, num(1, "minor")?, num(2, "micro")?))
}

/// `a >= b`, both parsed with [`parse`]; a parse failure is a decoding error (code 6).
pub fn at_least(a: &str, b: &str) -> Result<bool, CniError> {
    let pa = parse(a).map_err(|e| CniError::new(code::DECODING_FAILURE, e))?;
    let pb = parse(b).map_err(|e| CniError::new(code::DECODING_FAILURE, e))?;
    Ok(pa >= pb)
}

/// The config version must be one of [`SUPPORTED`], exactly (libcni's reconciler compares strings).
pub fn check_supported(config_version: &str) -> Result<(), CniError> {
    if SUPPORTED.contains(&config_version) {
        return Ok(());
    }
    let list: Vec<String> = SUPPORTED.iter().map(|v| format!("{v:?}")).collect();
    Err(CniError::with_details(
        code::INCOMPATIBLE_VERSION,
        "incompatible CNI versions",
        format!(
            "config is {config_version:?}, plugin supports [{}]",
            list.join(" ")
        ),
    ))
}

/// The `cniVersion` of a config or result document; absent or empty means 0.1.0.
pub fn decode(json: &[u8]) -> Result<String, CniError> {
    #[derive(serde::Deserialize)]
    struct V {
        #[serde(rename = "cniVersion", default)]
        cni_version: Option<String>,
    }
    let v: V = serde_json::from_slice(json).map_err(|e| {
        CniError::new(
            code::DECODING_FAILURE,
            format!("decoding version from network config: {e}"),
        )
    })?;
    Ok(v.cni_version
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "0.1.0".to_owned()))
}

/// What VERSION prints: compact JSON and a newline (Go's `json.Encoder`).
pub fn version_info_json() -> String {
    let list: Vec<String> = SUPPORTED.iter().map(|v| format!("\"{v}\"")).collect();
    format!(
        "{{\"cniVersion\":\"{CURRENT}\",\"supportedVersions\":[{}]}}\n",
        list.join(",")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_output_is_libcni_byte_for_byte() {
        assert_eq!(
            version_info_json(),
            "{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"0.1.0\",\"0.2.0\",\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\"]}\n"
        );
    }

    #[test]
    fn compares_versions() {
        assert!(at_least("0.4.0", "0.4.0").unwrap());
        assert!(at_least("1.0.0", "0.4.0").unwrap());
        assert!(!at_least("0.3.1", "0.4.0").unwrap());
        assert!(!at_least("", "0.4.0").unwrap());
        assert!(at_least("1.1", "1.1.0").unwrap());
        assert_eq!(
            at_least("1.x.0", "1.0.0").unwrap_err().code,
            code::DECODING_FAILURE
        );
        assert!(parse("1.2.3.4").unwrap_err().contains("too many parts"));
    }

    #[test]
    fn unsupported_version_names_both_sides() {
        check_supported("0.3.1").unwrap();
        let e = check_supported("0.5.0").unwrap_err();
        assert_eq!(e.code, 1);
        assert_eq!(e.msg, "incompatible CNI versions");
        assert_eq!(
            e.details,
            r#"config is "0.5.0", plugin supports ["0.1.0" "0.2.0" "0.3.0" "0.3.1" "0.4.0" "1.0.0" "1.1.0"]"#
        );
    }

    #[test]
    fn decodes_version_with_default() {
        assert_eq!(decode(br#"{"name":"x"}"#).unwrap(), "0.1.0");
        assert_eq!(decode(br#"{"cniVersion":""}"#).unwrap(), "0.1.0");
        assert_eq!(decode(br#"{"cniVersion":"1.0.0"}"#).unwrap(), "1.0.0");
        assert_eq!(decode(b"nope").unwrap_err().code, code::DECODING_FAILURE);
    }
}
