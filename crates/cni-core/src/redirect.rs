//! Redirection rule sets by mode and syntax: [`ambient`] (ztunnel's in-pod and host rules) and
//! [`sidecar`] (what `istio-init` would program), each rendered as [`iptables`] restore text and
//! as the [`nft`] model. The syntax modules hold what both modes share: the rule models, their
//! renderers and the parsers used to verify what is installed.

pub mod ambient;
pub mod iptables;
pub mod multiset;
pub mod nft;
pub mod sidecar;

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

/// Go's `strconv.ParseBool`, which is what Istio applies to every boolean knob (annotations and
/// env): the exact spellings it accepts, nothing more.
pub fn parse_go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
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

    #[test]
    fn go_parse_bool_spellings() {
        for t in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(parse_go_bool(t), Some(true), "{t}");
        }
        for f in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(parse_go_bool(f), Some(false), "{f}");
        }
        for bad in ["", "yes", "tRUE", " true", "on", "2"] {
            assert_eq!(parse_go_bool(bad), None, "{bad:?}");
        }
    }
}
