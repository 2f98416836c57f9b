//! The error object a plugin prints on stdout before exiting 1 (CNI spec "Error" section).

use serde::{Deserialize, Serialize};

/// Well-known error codes (CNI spec; values fixed by the spec).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODING_FAILURE: u32 = 6;
    pub const INVALID_NETWORK_CONFIG: u32 = 7;
    pub const INVALID_NETNS: u32 = 8;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// libcni's code for any error a plugin's own handler returns.
    pub const INTERNAL: u32 = 999;
}

/// `{"code": N, "msg": "...", "details": "..."}`; `details` is omitted when empty.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{msg}{}", if details.is_empty() { String::new() } else { format!("; {details}") })]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    /// An error from our own handlers (libcni wraps those as code 999).
    pub fn internal(msg: impl Into<String>) -> Self {
        CniError::new(code::INTERNAL, msg)
    }

    /// The bytes libcni prints: 4-space indented JSON with Go's HTML escaping, no trailing newline.
    pub fn to_json(&self) -> Vec<u8> {
        go_pretty(self)
    }
}

/// Serialises like Go's `json.MarshalIndent(v, "", "    ")`, which runtimes have always received
/// from Go plugins; `<`, `>`, `&`, U+2028 and U+2029 are escaped as Go does.
pub fn go_pretty<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    value
        .serialize(&mut ser)
        .expect("serialising to memory cannot fail");
    go_html_escape(out)
}

/// Applies Go's `encoding/json` HTML escaping to serde_json output. Those characters can only
/// occur inside JSON strings, so a byte-level replacement is exact.
pub fn go_html_escape(json: Vec<u8>) -> Vec<u8> {
    let text = String::from_utf8(json).expect("serde_json emits UTF-8");
    if !text.contains(['<', '>', '&', '\u{2028}', '\u{2029}']) {
        return text.into_bytes();
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_like_libcni() {
        let e = CniError::new(
            code::INVALID_ENV,
            "required env variables [CNI_PATH] missing",
        );
        assert_eq!(
            String::from_utf8(e.to_json()).unwrap(),
            "{\n    \"code\": 4,\n    \"msg\": \"required env variables [CNI_PATH] missing\"\n}"
        );
        let e = CniError::with_details(1, "incompatible CNI versions", "config is \"9.9.9\"");
        assert_eq!(
            String::from_utf8(e.to_json()).unwrap(),
            "{\n    \"code\": 1,\n    \"msg\": \"incompatible CNI versions\",\n    \"details\": \"config is \\\"9.9.9\\\"\"\n}"
        );
    }

    #[test]
    fn escapes_html_like_go() {
        let e = CniError::internal("a<b>&c");
        let s = String::from_utf8(e.to_json()).unwrap();
        assert!(s.contains(r#""a\u003cb\u003e\u0026c""#), "{s}");
        let back: CniError = serde_json::from_slice(s.as_bytes()).unwrap();
        assert_eq!(back.msg, "a<b>&c");
    }

    #[test]
    fn display_joins_details() {
        assert_eq!(
            CniError::with_details(7, "bad", "why").to_string(),
            "bad; why"
        );
        assert_eq!(CniError::new(7, "bad").to_string(), "bad");
    }
}
