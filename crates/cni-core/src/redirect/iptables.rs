//! iptables syntax shared by both modes: the [`Rule`] model, the `iptables-restore` renderer, a
//! parser of `iptables-save` output used to verify what is installed, and the one-transaction
//! replacement of whatever of ours is live. The rule sets themselves are in
//! [`super::ambient::iptables`] and [`super::sidecar::iptables`].

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Prefix of every chain we own; chains with it that we did not plan are foreign leftovers.
pub const CHAIN_PREFIX: &str = "ISTIO_";

const BUILTIN_CHAINS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// Address family: selects `iptables` or `ip6tables` and the per-family addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn loopback(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.1/32",
            Family::V6 => "::1/128",
        }
    }
}

/// How a rule is placed in its chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Position {
    Append,
    /// `-I <chain> <n>`, 1-based.
    Insert(u32),
}

/// One rule: table, chain, placement and the match/target arguments after the chain name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub table: &'static str,
    pub chain: &'static str,
    pub position: Position,
    pub args: String,
}

impl Rule {
    pub(crate) fn append(
        table: &'static str,
        chain: &'static str,
        args: impl Into<String>,
    ) -> Self {
        Rule {
            table,
            chain,
            position: Position::Append,
            args: args.into(),
        }
    }

    /// The `-j` target when it is one of our chains.
    pub fn jump_chain(&self) -> Option<&str> {
        let target = self.args.strip_prefix("-j ")?;
        target.starts_with(CHAIN_PREFIX).then_some(target)
    }

    /// The arguments of `iptables -t <table> -C ...` that check this rule exists.
    pub fn check_args(&self) -> Vec<String> {
        let mut out = vec![
            "-t".to_string(),
            self.table.to_string(),
            "-C".to_string(),
            self.chain.to_string(),
        ];
        out.extend(self.args.split(' ').map(str::to_string));
        out
    }

    fn line(&self) -> String {
        match self.position {
            Position::Append => format!("-A {} {}", self.chain, self.args),
            Position::Insert(n) => format!("-I {} {n} {}", self.chain, self.args),
        }
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "-t {} {}", self.table, self.line())
    }
}

fn is_builtin(chain: &str) -> bool {
    BUILTIN_CHAINS.contains(&chain)
}

/// `iptables-restore --noflush` input: tables in alphabetical order, each with `-N` for our
/// chains (chains with rules first, then bare jump targets), its rules, and `COMMIT`.
pub fn restore_text(rules: &[Rule]) -> String {
    let mut tables: BTreeMap<&str, Vec<&Rule>> = BTreeMap::new();
    for rule in rules {
        tables.entry(rule.table).or_default().push(rule);
    }
    let mut out = String::new();
    for (table, rules) in tables {
        let _ = writeln!(out, "* {table}");
        for chain in declared_chains(&rules) {
            let _ = writeln!(out, "-N {chain}");
        }
        for rule in rules {
            let _ = writeln!(out, "{}", rule.line());
        }
        out.push_str("COMMIT\n");
    }
    out
}

fn declared_chains<'a>(rules: &[&'a Rule]) -> Vec<&'a str> {
    let mut chains: Vec<&str> = Vec::new();
    for rule in rules {
        if !is_builtin(rule.chain) && !chains.contains(&rule.chain) {
            chains.push(rule.chain);
        }
    }
    for rule in rules {
        if let Some(target) = rule.jump_chain()
            && !chains.contains(&target)
        {
            chains.push(target);
        }
    }
    chains
}

/// Chains and rules of some tables, as `iptables-save` (or restore input) lists them. Rules are
/// kept as the text after `-A <chain> ` (or `-I <chain> <n> `), in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TablesState {
    pub tables: BTreeMap<String, BTreeMap<String, Vec<String>>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}: {text:?}")]
pub struct ParseError {
    pub line: usize,
    pub reason: &'static str,
    pub text: String,
}

impl TablesState {
    /// Parses `iptables-save` output or restore input. Builtin chains appear only when they
    /// have rules or a declaration; `-N` and `:CHAIN` declarations create empty entries.
    pub fn parse(text: &str) -> Result<Self, ParseError> {
        let mut state = TablesState::default();
        let mut table: Option<String> = None;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            let err = |reason| ParseError {
                line: i + 1,
                reason,
                text: raw.to_string(),
            };
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(name) = line.strip_prefix('*') {
                let name = name.trim().to_string();
                state.tables.entry(name.clone()).or_default();
                table = Some(name);
                continue;
            }
            if line == "COMMIT" {
                table = None;
                continue;
            }
            let Some(current) = table.as_ref() else {
                return Err(err("outside a table"));
            };
            let chains = state
                .tables
                .get_mut(current)
                .expect("table entry created on '*'");
            if let Some(decl) = line.strip_prefix(':') {
                let name = decl
                    .split_whitespace()
                    .next()
                    .ok_or_else(|| err("empty chain declaration"))?;
                chains.entry(name.to_string()).or_default();
            } else if let Some(name) = line.strip_prefix("-N ") {
                chains.entry(name.trim().to_string()).or_default();
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let (chain, args) = rest
                    .split_once(' ')
                    .ok_or_else(|| err("rule without arguments"))?;
                chains
                    .entry(chain.to_string())
                    .or_default()
                    .push(args.to_string());
            } else if let Some(rest) = line.strip_prefix("-I ") {
                let (chain, rest) = rest
                    .split_once(' ')
                    .ok_or_else(|| err("rule without arguments"))?;
                let args = match rest.split_once(' ') {
                    Some((pos, args)) if pos.bytes().all(|b| b.is_ascii_digit()) => args,
                    _ => rest,
                };
                chains
                    .entry(chain.to_string())
                    .or_default()
                    .push(args.to_string());
            } else {
                return Err(err("unknown line"));
            }
        }
        Ok(state)
    }

    pub fn chain(&self, table: &str, chain: &str) -> Option<&Vec<String>> {
        self.tables.get(table)?.get(chain)
    }

    /// Our chains (`ISTIO_*`) per table, and every rule elsewhere that jumps into one.
    pub fn istio_artifacts(&self) -> Vec<Artifact> {
        let mut out = Vec::new();
        for (table, chains) in &self.tables {
            for (chain, rules) in chains {
                if chain.starts_with(CHAIN_PREFIX) {
                    out.push(Artifact::Chain {
                        table: table.clone(),
                        chain: chain.clone(),
                    });
                } else {
                    for rule in rules {
                        if jump_target(rule).is_some_and(|t| t.starts_with(CHAIN_PREFIX)) {
                            out.push(Artifact::Jump {
                                table: table.clone(),
                                chain: chain.clone(),
                                rule: rule.clone(),
                            });
                        }
                    }
                }
            }
        }
        out
    }
}

/// The `-j` target of a rule's arguments.
pub fn jump_target(args: &str) -> Option<&str> {
    let mut words = args.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "--jump" {
            return words.next();
        }
    }
    None
}

/// Something of ours found in a live table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Artifact {
    Chain {
        table: String,
        chain: String,
    },
    Jump {
        table: String,
        chain: String,
        rule: String,
    },
}

/// Restore input that turns the live `current` state into exactly `desired` in one
/// `iptables-restore --noflush` transaction per table: every jump into an `ISTIO_*` chain is
/// deleted, our chains are flushed (and deleted when not desired), missing chains are created,
/// then the desired rules are added. With no artifacts present this is [`restore_text`]; with
/// `desired` empty it removes everything of ours.
pub fn replace_restore_text(current: &TablesState, desired: &[Rule]) -> String {
    replace_restore_text_claiming(current, desired, &[])
}

/// [`replace_restore_text`], also deleting `claimed` rules of builtin chains as `(table, chain,
/// rule)` in `-save` spelling: rules of ours that jump nowhere of ours (the sidecar's TPROXY
/// marks, excluded-interface returns), which the `ISTIO_*` artifacts alone would not reveal.
pub fn replace_restore_text_claiming(
    current: &TablesState,
    desired: &[Rule],
    claimed: &[(String, String, String)],
) -> String {
    #[derive(Default)]
    struct Plan<'a> {
        deletes: Vec<String>,
        flushes: Vec<String>,
        drops: Vec<String>,
        rules: Vec<&'a Rule>,
    }
    let mut tables: BTreeMap<String, Plan<'_>> = BTreeMap::new();
    for rule in desired {
        tables
            .entry(rule.table.to_string())
            .or_default()
            .rules
            .push(rule);
    }
    let wanted: BTreeMap<String, Vec<&str>> = tables
        .iter()
        .map(|(t, p)| (t.clone(), declared_chains(&p.rules)))
        .collect();
    for artifact in current.istio_artifacts() {
        match artifact {
            Artifact::Jump { table, chain, rule } => {
                let plan = tables.entry(table.clone()).or_default();
                plan.deletes.push(format!("-D {chain} {rule}"));
            }
            Artifact::Chain { table, chain } => {
                let keep = wanted
                    .get(&table)
                    .is_some_and(|w| w.contains(&chain.as_str()));
                let plan = tables.entry(table.clone()).or_default();
                plan.flushes.push(format!("-F {chain}"));
                if !keep {
                    plan.drops.push(format!("-X {chain}"));
                }
            }
        }
    }
    for (table, chain, rule) in claimed {
        let plan = tables.entry(table.clone()).or_default();
        plan.deletes.push(format!("-D {chain} {rule}"));
    }
    let mut out = String::new();
    for (table, plan) in tables {
        let _ = writeln!(out, "* {table}");
        for line in plan.deletes.iter().chain(&plan.flushes).chain(&plan.drops) {
            let _ = writeln!(out, "{line}");
        }
        for chain in declared_chains(&plan.rules) {
            if current.chain(&table, chain).is_none() {
                let _ = writeln!(out, "-N {chain}");
            }
        }
        for rule in plan.rules {
            let _ = writeln!(out, "{}", rule.line());
        }
        out.push_str("COMMIT\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::ambient::InpodConfig;
    use crate::redirect::ambient::iptables::{host_probe_rules, inpod_rules};

    const SAVE: &str = "# Generated by iptables-save v1.8.9 (nf_tables)
*mangle
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:ISTIO_PRERT - [0:0]
:ISTIO_OLD - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A PREROUTING -j ISTIO_OLD
-A OUTPUT -m comment --comment \"not ours\" -j ACCEPT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
COMMIT
# Completed
";

    #[test]
    fn parses_save_output() {
        let s = TablesState::parse(SAVE).unwrap();
        assert_eq!(
            s.chain("mangle", "PREROUTING").unwrap(),
            &["-j ISTIO_PRERT", "-j ISTIO_OLD"]
        );
        assert_eq!(s.chain("mangle", "ISTIO_OLD").unwrap().len(), 0);
        assert_eq!(s.chain("mangle", "ISTIO_PRERT").unwrap().len(), 1);
        let artifacts = s.istio_artifacts();
        assert_eq!(artifacts.len(), 4, "{artifacts:?}");
    }

    #[test]
    fn parses_restore_input_with_insert_positions() {
        let s = TablesState::parse(&restore_text(&host_probe_rules(
            &InpodConfig::default(),
            Family::V4,
        )))
        .unwrap();
        assert_eq!(s.chain("nat", "POSTROUTING").unwrap(), &["-j ISTIO_POSTRT"]);
        assert!(s.chain("nat", "ISTIO_POSTRT").unwrap()[0].starts_with("-m owner --socket-exists"));
    }

    #[test]
    fn rejects_rules_outside_a_table() {
        let err = TablesState::parse("-A OUTPUT -j ACCEPT\n").unwrap_err();
        assert_eq!(err.line, 1);
    }

    #[test]
    fn replace_on_clean_state_is_plain_restore() {
        let cfg = InpodConfig::default();
        let rules = inpod_rules(&cfg, Family::V4);
        assert_eq!(
            replace_restore_text(&TablesState::default(), &rules),
            restore_text(&rules)
        );
    }

    #[test]
    fn replace_removes_foreign_and_flushes_kept_chains_in_one_transaction() {
        let current = TablesState::parse(SAVE).unwrap();
        let cfg = InpodConfig {
            redirect_dns: false,
            ..Default::default()
        };
        let text = replace_restore_text(&current, &inpod_rules(&cfg, Family::V4));
        let mangle: Vec<&str> = text.lines().take_while(|l| *l != "COMMIT").collect();
        assert_eq!(
            mangle[..7],
            [
                "* mangle",
                "-D PREROUTING -j ISTIO_PRERT",
                "-D PREROUTING -j ISTIO_OLD",
                "-F ISTIO_OLD",
                "-F ISTIO_PRERT",
                "-X ISTIO_OLD",
                // ISTIO_PRERT exists already: flushed above, never re-declared.
                "-N ISTIO_OUTPUT",
            ]
        );
        assert!(!text.contains("-X ISTIO_PRERT"));
        assert!(!text.contains("not ours"));
    }

    #[test]
    fn replace_with_nothing_desired_removes_everything() {
        let current = TablesState::parse(SAVE).unwrap();
        let text = replace_restore_text(&current, &[]);
        assert!(
            text.contains("-X ISTIO_PRERT") && text.contains("-X ISTIO_OLD"),
            "{text}"
        );
        assert!(!text.contains("-A "), "{text}");
    }

    #[test]
    fn check_args_split_the_rule() {
        let r = &inpod_rules(&InpodConfig::default(), Family::V4)[0];
        assert_eq!(
            r.check_args(),
            ["-t", "mangle", "-C", "PREROUTING", "-j", "ISTIO_PRERT"]
        );
    }
}
