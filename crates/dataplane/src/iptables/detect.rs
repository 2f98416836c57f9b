//! Which iptables variant (legacy or nf_tables) to drive, decided once from host state.
//!
//! Istio (`shouldUseBinaryForCurrentContext`) takes legacy when `iptables-legacy-save` prints
//! three lines or more. An empty table prints that much (header, chain lines, `COMMIT`), and its
//! own usability probe creates the legacy `nat` table, so a node whose kubelet and kube-proxy use
//! nft ends up with legacy as soon as anything, Istio included, has touched legacy once. We
//! decide from what kubelet and kube-proxy leave instead, the order of Kubernetes'
//! iptables-wrappers, both address families each time:
//!
//! 1. kubelet's `KUBE-IPTABLES-HINT` or `KUBE-KUBELET-CANARY` chain in nft's `mangle` table, then
//!    anywhere in legacy's dump (asking legacy for `-t mangle` would create that table);
//! 2. otherwise whichever variant holds more rule lines (`-A …`; chain lines and empty tables
//!    count for nothing), legacy only when it has strictly more;
//! 3. no rules anywhere: nft, else the plain `iptables` alternative, as Istio.
//!
//! Only the chosen tools are probed (their probe may create a table), and a variant the node is
//! seen to use that cannot be driven is an error, never a silent switch to the other one: pods
//! get rules only in the node's variant. `FORCE_IPTABLES_BINARY` skips all of it.

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
    #[error("no usable iptables found (tried iptables-nft, iptables): {0}")]
    NoneUsable(String),
    #[error("this node uses iptables {variant} ({reason}), but it cannot be driven: {source}")]
    InUseButUnusable {
        variant: Variant,
        reason: Reason,
        source: Box<DetectError>,
    },
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

    /// Legacy from 1.8.6 reads the lock path from `XTABLES_LOCKFILE`; before, a pod's own lock
    /// must be bound over `/run/xtables.lock`.
    pub fn scoped_lock(&self) -> bool {
        self.variant == Variant::Legacy && self.version >= (1, 8, 6)
    }
}

/// Why a variant was chosen: the evidence, for the startup log and `install-cni` output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// `FORCE_IPTABLES_BINARY`.
    Forced,
    /// kubelet's chain `chain` is in `variant`'s tables of one family.
    KubeletChain {
        variant: Variant,
        v6: bool,
        chain: &'static str,
    },
    /// No kubelet chain; rule lines counted over both families.
    RuleLines { legacy: usize, nft: usize },
    /// Nothing is programmed in either variant: Istio's preference.
    NoRules,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Forced => f.write_str("forced by FORCE_IPTABLES_BINARY"),
            Reason::KubeletChain { variant, v6, chain } => write!(
                f,
                "kubelet's {chain} chain is in the {variant} {} tables",
                if *v6 { "IPv6" } else { "IPv4" }
            ),
            Reason::RuleLines { legacy, nft } => write!(
                f,
                "no kubelet chain; rule lines: legacy {legacy}, nft {nft}"
            ),
            Reason::NoRules => f.write_str("no rules in either variant; nft preferred"),
        }
    }
}

/// The chosen tools and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detection {
    pub binaries: Binaries,
    pub reason: Reason,
}

impl std::fmt::Display for Detection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.binaries, self.reason)
    }
}

impl std::fmt::Display for Binaries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (a, b, c) = self.version;
        write!(f, "{} ({} {a}.{b}.{c})", self.prefix, self.variant)
    }
}

/// The kubelet chains (Kubernetes 1.17 and later) that mark the variant kubelet uses.
const KUBELET_CHAINS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// The first kubelet chain declared in a `-save` dump.
fn kubelet_chain(dump: &str) -> Option<&'static str> {
    dump.lines().find_map(|line| {
        let name = line.strip_prefix(':')?.split_whitespace().next()?;
        KUBELET_CHAINS.into_iter().find(|c| *c == name)
    })
}

/// Rules in a `-save` dump: its `-A` lines. Headers, chain lines and `COMMIT` are no rules.
fn rule_lines(dump: &str) -> usize {
    dump.lines().filter(|l| l.starts_with('-')).count()
}

/// Which dump [`decide`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dump {
    /// `ip(6)tables-nft-save -t mangle`.
    NftMangle { v6: bool },
    /// `ip(6)tables-<variant>-save`, every table.
    All { variant: Variant, v6: bool },
}

/// The variant the node uses (`None`: no evidence) and why, from `-save` dumps `dump` returns
/// (empty when the tool is missing or fails). Asks only for the dumps it needs.
pub fn decide(mut dump: impl FnMut(Dump) -> String) -> (Option<Variant>, Reason) {
    for v6 in [false, true] {
        if let Some(chain) = kubelet_chain(&dump(Dump::NftMangle { v6 })) {
            let variant = Variant::Nft;
            return (Some(variant), Reason::KubeletChain { variant, v6, chain });
        }
    }
    let mut legacy = 0;
    for v6 in [false, true] {
        let text = dump(Dump::All {
            variant: Variant::Legacy,
            v6,
        });
        if let Some(chain) = kubelet_chain(&text) {
            let variant = Variant::Legacy;
            return (Some(variant), Reason::KubeletChain { variant, v6, chain });
        }
        legacy += rule_lines(&text);
    }
    let nft: usize = [false, true]
        .into_iter()
        .map(|v6| {
            rule_lines(&dump(Dump::All {
                variant: Variant::Nft,
                v6,
            }))
        })
        .sum();
    let reason = Reason::RuleLines { legacy, nft };
    match (legacy, nft) {
        (0, 0) => (None, Reason::NoRules),
        (l, n) if l > n => (Some(Variant::Legacy), reason),
        _ => (Some(Variant::Nft), reason),
    }
}

fn run_dump(which: Dump) -> String {
    let (variant, v6, args): (_, _, &[&str]) = match which {
        Dump::NftMangle { v6 } => (Variant::Nft, v6, &["-t", "mangle"]),
        Dump::All { variant, v6 } => (variant, v6, &[]),
    };
    let save = format!("{}tables-{variant}-save", if v6 { "ip6" } else { "ip" });
    match Command::new(&save).args(args).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        _ => String::new(),
    }
}

fn prefix(variant: Variant) -> &'static str {
    match variant {
        Variant::Legacy => "iptables-legacy",
        Variant::Nft => "iptables-nft",
    }
}

/// Detects the tools in the calling thread's network namespace, honouring `force` (the value
/// of `FORCE_IPTABLES_BINARY`, if set). `ipv6` also requires the ip6tables tools to be usable.
pub fn detect(force: Option<&str>, ipv6: bool) -> Result<Detection, DetectError> {
    let forced = |variant| {
        Ok(Detection {
            binaries: probe(prefix(variant), ipv6)?,
            reason: Reason::Forced,
        })
    };
    match force.map(str::trim).filter(|s| !s.is_empty()) {
        Some("legacy") => return forced(Variant::Legacy),
        Some("nft") => return forced(Variant::Nft),
        Some(other) => return Err(DetectError::BadForce(other.to_string())),
        None => {}
    }
    match decide(run_dump) {
        (Some(variant), reason) => match probe(prefix(variant), ipv6) {
            Ok(binaries) => Ok(Detection { binaries, reason }),
            Err(e) => Err(DetectError::InUseButUnusable {
                variant,
                reason,
                source: Box::new(e),
            }),
        },
        (None, reason) => {
            let mut reasons = Vec::new();
            for prefix in ["iptables-nft", "iptables"] {
                match probe(prefix, ipv6) {
                    Ok(binaries) => {
                        return Ok(Detection {
                            binaries,
                            reason: reason.clone(),
                        });
                    }
                    Err(e) => reasons.push(e.to_string()),
                }
            }
            Err(DetectError::NoneUsable(reasons.join("; ")))
        }
    }
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

    const EMPTY_NAT: &str = "# Generated by iptables-save v1.8.9\n*nat\n:PREROUTING ACCEPT [0:0]\n\
        :INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n# Completed\n";

    fn with_rules(n: usize) -> String {
        let mut s = String::from("*filter\n:INPUT ACCEPT [0:0]\n");
        for i in 0..n {
            s.push_str(&format!("-A INPUT -p tcp --dport {i} -j ACCEPT\n"));
        }
        s + "COMMIT\n"
    }

    fn hint(chain: &str) -> String {
        format!("*mangle\n:PREROUTING ACCEPT [0:0]\n:{chain} - [0:0]\nCOMMIT\n")
    }

    /// `decide` over fixed dumps; also returns the dumps it asked for.
    fn decide_over(dumps: &[(Dump, String)]) -> ((Option<Variant>, Reason), Vec<Dump>) {
        let mut asked = Vec::new();
        let verdict = decide(|d| {
            asked.push(d);
            dumps
                .iter()
                .find(|(k, _)| *k == d)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        });
        (verdict, asked)
    }

    const LEGACY_V4: Dump = Dump::All {
        variant: Variant::Legacy,
        v6: false,
    };
    const LEGACY_V6: Dump = Dump::All {
        variant: Variant::Legacy,
        v6: true,
    };
    const NFT_V4: Dump = Dump::All {
        variant: Variant::Nft,
        v6: false,
    };

    #[test]
    fn an_empty_legacy_table_is_no_evidence() {
        let ((v, r), _) = decide_over(&[(LEGACY_V4, EMPTY_NAT.into())]);
        assert_eq!((v, r), (None, Reason::NoRules));
        let ((v, r), _) = decide_over(&[(LEGACY_V4, EMPTY_NAT.into()), (NFT_V4, with_rules(1))]);
        assert_eq!(
            (v, r),
            (Some(Variant::Nft), Reason::RuleLines { legacy: 0, nft: 1 })
        );
    }

    #[test]
    fn legacy_wins_only_with_more_rule_lines() {
        let ((v, r), _) = decide_over(&[(LEGACY_V6, with_rules(2)), (NFT_V4, with_rules(1))]);
        assert_eq!(
            (v, r),
            (
                Some(Variant::Legacy),
                Reason::RuleLines { legacy: 2, nft: 1 }
            )
        );
        let ((v, _), _) = decide_over(&[(LEGACY_V4, with_rules(3)), (NFT_V4, with_rules(3))]);
        assert_eq!(v, Some(Variant::Nft));
    }

    #[test]
    fn kubelet_chains_outrank_rule_counts_nft_first() {
        // nft's hint found in its v4 mangle dump: nothing else is read.
        let ((v, r), asked) = decide_over(&[
            (Dump::NftMangle { v6: false }, hint("KUBE-IPTABLES-HINT")),
            (LEGACY_V4, with_rules(50) + &hint("KUBE-KUBELET-CANARY")),
        ]);
        assert_eq!(v, Some(Variant::Nft));
        assert_eq!(
            r,
            Reason::KubeletChain {
                variant: Variant::Nft,
                v6: false,
                chain: "KUBE-IPTABLES-HINT"
            }
        );
        assert_eq!(asked, vec![Dump::NftMangle { v6: false }]);

        // Legacy's canary in the v6 dump outranks nft's larger rule count.
        let ((v, r), asked) = decide_over(&[
            (LEGACY_V6, hint("KUBE-KUBELET-CANARY")),
            (NFT_V4, with_rules(40)),
        ]);
        assert_eq!(v, Some(Variant::Legacy));
        assert_eq!(
            r.to_string(),
            "kubelet's KUBE-KUBELET-CANARY chain is in the legacy IPv6 tables"
        );
        assert!(!asked.contains(&NFT_V4), "{asked:?}");

        // A rule that merely mentions the chain, or a longer name, is no declaration.
        let ((v, _), _) = decide_over(&[(
            LEGACY_V4,
            "*mangle\n:KUBE-IPTABLES-HINTS - [0:0]\n-A X -j KUBE-IPTABLES-HINT\nCOMMIT\n".into(),
        )]);
        assert_eq!(v, Some(Variant::Legacy), "counted as one rule line only");
        assert_eq!(kubelet_chain(":KUBE-IPTABLES-HINTS - [0:0]\n"), None);
    }

    #[test]
    fn detection_says_what_and_why() {
        let d = Detection {
            binaries: Binaries {
                prefix: "iptables-nft".into(),
                variant: Variant::Nft,
                version: (1, 8, 9),
            },
            reason: Reason::RuleLines { legacy: 0, nft: 7 },
        };
        assert_eq!(
            d.to_string(),
            "iptables-nft (nft 1.8.9): no kubelet chain; rule lines: legacy 0, nft 7"
        );
    }
}
