//! Which iptables variant (legacy or nf_tables) to drive, decided once from host state.
//!
//! Order, as in Istio: a forced variant wins; otherwise legacy when it is usable *and* already
//! holds rules (someone on this node uses it, so we must too), else nft when usable, else the
//! plain `iptables` alternative. The same variant is then used inside every pod.

use std::process::Command;

/// The two kernel backends of the iptables tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Legacy,
    Nft,
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Variant::Legacy => "legacy",
            Variant::Nft => "nft",
        })
    }
}

/// A detected tool set: binary name prefix (`iptables`, `iptables-nft`, `iptables-legacy`),
/// variant and version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binaries {
    /// `iptables`, `iptables-nft` or `iptables-legacy`; ip6tables and the save/restore tools are
    /// derived from it.
    pub prefix: String,
    pub variant: Variant,
    pub version: (u32, u32, u32),
}

#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    #[error("FORCE_IPTABLES_BINARY={0:?}: expected \"legacy\" or \"nft\"")]
    BadForce(String),
    #[error("{binary} is not usable: {reason}")]
    Unusable { binary: String, reason: String },
    #[error("no usable iptables found (tried iptables-legacy, iptables-nft, iptables): {0}")]
    NoneUsable(String),
}

impl Binaries {
    /// The tool for `family` and `tool` (`""`, `"-save"`, `"-restore"`).
    pub fn tool(&self, v6: bool, tool: &str) -> String {
        let base = if v6 {
            self.prefix.replacen("iptables", "ip6tables", 1)
        } else {
            self.prefix.clone()
        };
        format!("{base}{tool}")
    }

    /// Legacy from 1.6.2 takes the global xtables lock only with `--wait`.
    pub fn wants_wait(&self) -> bool {
        self.variant == Variant::Legacy && self.version >= (1, 6, 2)
    }

    /// Legacy from 1.8.6 reads the lock path from `XTABLES_LOCKFILE`, so each pod can have its own.
    pub fn scoped_lock(&self) -> bool {
        self.variant == Variant::Legacy && self.version >= (1, 8, 6)
    }
}

/// Detects the tools, honouring `force` (the value of `FORCE_IPTABLES_BINARY`, if set).
/// `ipv6` also requires the ip6tables variant to be usable.
pub fn detect(force: Option<&str>, ipv6: bool) -> Result<Binaries, DetectError> {
    match force.map(str::trim).filter(|s| !s.is_empty()) {
        Some("legacy") => probe("iptables-legacy", ipv6),
        Some("nft") => probe("iptables-nft", ipv6),
        Some(other) => Err(DetectError::BadForce(other.to_string())),
        None => {
            let mut reasons = Vec::new();
            match probe("iptables-legacy", ipv6) {
                Ok(b) if has_rules("iptables-legacy-save") => return Ok(b),
                Ok(_) => {}
                Err(e) => reasons.push(e.to_string()),
            }
            for prefix in ["iptables-nft", "iptables"] {
                match probe(prefix, ipv6) {
                    Ok(b) => return Ok(b),
                    Err(e) => reasons.push(e.to_string()),
                }
            }
            Err(DetectError::NoneUsable(reasons.join("; ")))
        }
    }
}

fn has_rules(save: &str) -> bool {
    Command::new(save)
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).lines().count() >= 3)
        .unwrap_or(false)
}

fn probe(prefix: &str, ipv6: bool) -> Result<Binaries, DetectError> {
    let unusable = |binary: &str, reason: String| DetectError::Unusable {
        binary: binary.to_string(),
        reason,
    };
    let out = Command::new(prefix)
        .arg("--version")
        .output()
        .map_err(|e| unusable(prefix, e.to_string()))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (variant, version) = parse_version(&text);
    let bins = Binaries {
        prefix: prefix.to_string(),
        variant,
        version,
    };
    let mut families = vec![false];
    if ipv6 {
        families.push(true);
    }
    for v6 in families {
        let save = bins.tool(v6, "-save");
        let out = Command::new(&save)
            .output()
            .map_err(|e| unusable(&save, e.to_string()))?;
        if !out.status.success() {
            return Err(unusable(
                &save,
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        // Listing nat proves the kernel has the table (or can load it) without changing anything.
        let bin = bins.tool(v6, "");
        let mut cmd = Command::new(&bin);
        if bins.wants_wait() {
            cmd.arg("--wait=30");
        }
        let out = cmd
            .args(["-t", "nat", "-S", "OUTPUT"])
            .output()
            .map_err(|e| unusable(&bin, e.to_string()))?;
        if !out.status.success() {
            let reason = format!(
                "nat table unavailable: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return Err(unusable(&bin, reason));
        }
    }
    Ok(bins)
}

/// `iptables v1.8.7 (nf_tables)` → nft 1.8.7; no `nf_tables` → legacy; unparsable → legacy 0.0.0.
pub fn parse_version(text: &str) -> (Variant, (u32, u32, u32)) {
    let variant = if text.contains("nf_tables") {
        Variant::Nft
    } else {
        Variant::Legacy
    };
    let version = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix('v'))
        .and_then(|v| {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
            Some((
                parts.next()??,
                parts.next()??,
                parts.next().flatten().unwrap_or(0),
            ))
        })
        .unwrap_or((0, 0, 0));
    (variant, version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_strings() {
        assert_eq!(
            parse_version("iptables v1.8.7 (nf_tables)\n"),
            (Variant::Nft, (1, 8, 7))
        );
        assert_eq!(
            parse_version("iptables v1.8.9 (legacy)\n"),
            (Variant::Legacy, (1, 8, 9))
        );
        assert_eq!(
            parse_version("iptables v1.6.1\n"),
            (Variant::Legacy, (1, 6, 1))
        );
        assert_eq!(parse_version("garbage"), (Variant::Legacy, (0, 0, 0)));
    }

    #[test]
    fn tool_names() {
        let b = Binaries {
            prefix: "iptables-nft".into(),
            variant: Variant::Nft,
            version: (1, 8, 9),
        };
        assert_eq!(b.tool(false, "-save"), "iptables-nft-save");
        assert_eq!(b.tool(true, "-restore"), "ip6tables-nft-restore");
        assert_eq!(b.tool(true, ""), "ip6tables-nft");
        let legacy = Binaries {
            prefix: "iptables-legacy".into(),
            variant: Variant::Legacy,
            version: (1, 8, 9),
        };
        assert!(legacy.wants_wait() && legacy.scoped_lock());
        let old = Binaries {
            version: (1, 8, 5),
            ..legacy
        };
        assert!(old.wants_wait() && !old.scoped_lock());
    }

    #[test]
    fn bad_force_value_is_an_error() {
        assert!(
            matches!(detect(Some("both"), false), Err(DetectError::BadForce(v)) if v == "both")
        );
    }

    #[test]
    fn forced_variants_are_detected() {
        crate::require_root!();
        assert_eq!(detect(Some("nft"), true).unwrap().variant, Variant::Nft);
        assert_eq!(
            detect(Some("legacy"), true).unwrap().variant,
            Variant::Legacy
        );
    }
}
