//! The nftables model both modes render into, as plain data: tables, chains, sets and rules made
//! of typed expressions. The dataplane encodes this model to netfilter netlink and decodes the
//! kernel's state back into it, so `verify` compares like with like; the text rendering is what
//! operators, goldens and drift reports read. The rule sets themselves are in
//! [`super::ambient::nft`] and [`super::sidecar::nft`].
//!
//! The text follows the `nft` syntax of Istio's transactions (`add table …`, `add rule …`). Two
//! spellings are normalised because the model cannot (and need not) remember them: packet-mark
//! matches are always written `mark and <mask> <op> <value>` (Istio mixes `meta mark &`,
//! `meta mark and` and `mark and` for the same expression) and runs of spaces are single.

use std::fmt;
use std::net::IpAddr;

use super::multiset;

/// Base chain names, after their hooks, in every table of ours.
pub const PREROUTING: &str = "prerouting";
pub const OUTPUT: &str = "output";
pub const POSTROUTING: &str = "postrouting";

/// Conntrack state bits (`NF_CT_STATE_*_BIT`), in the order `nft` prints them.
pub mod ct_state {
    pub const INVALID: u32 = 1;
    pub const ESTABLISHED: u32 = 2;
    pub const RELATED: u32 = 4;
    pub const NEW: u32 = 8;
    pub const NAMES: [(u32, &str); 4] = [
        (INVALID, "invalid"),
        (ESTABLISHED, "established"),
        (RELATED, "related"),
        (NEW, "new"),
    ];
}

/// A whole rule set; every table is of family `inet` (one table serves IPv4 and IPv6).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ruleset {
    pub tables: Vec<Table>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    pub name: String,
    /// Sets survive a re-apply (their elements are managed one by one); only rules are flushed.
    /// Without sets the whole table is replaced.
    pub sets: Vec<Set>,
    pub chains: Vec<Chain>,
    /// In the order they are added; within one chain this is the evaluation order.
    pub rules: Vec<Rule>,
    /// `NFT_TABLE_F_*` as the kernel reports them. Ours never have any: a dormant table
    /// evaluates none of its rules, and an owned one vanishes with the process that owns it.
    pub flags: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    /// `None` for a regular chain, reachable only by jumps.
    pub base: Option<BaseChain>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BaseChain {
    pub kind: ChainType,
    pub hook: Hook,
    pub priority: i32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainType {
    Filter,
    Nat,
    Route,
}

impl ChainType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
            ChainType::Route => "route",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "filter" => ChainType::Filter,
            "nat" => ChainType::Nat,
            "route" => ChainType::Route,
            _ => return None,
        })
    }
}

/// Netfilter hooks of the inet family, numbered as in `<linux/netfilter.h>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    Prerouting = 0,
    Input = 1,
    Forward = 2,
    Output = 3,
    Postrouting = 4,
}

impl Hook {
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }

    pub fn from_number(n: u32) -> Option<Self> {
        Some(match n {
            0 => Hook::Prerouting,
            1 => Hook::Input,
            2 => Hook::Forward,
            3 => Hook::Output,
            4 => Hook::Postrouting,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Set {
    pub name: String,
    pub key: SetKey,
    pub comment: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetKey {
    Ipv4Addr,
    Ipv6Addr,
}

impl SetKey {
    pub fn as_str(self) -> &'static str {
        match self {
            SetKey::Ipv4Addr => "ipv4_addr",
            SetKey::Ipv6Addr => "ipv6_addr",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub chain: String,
    pub exprs: Vec<Expr>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Ne,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L4Proto {
    Tcp,
    Udp,
}

impl L4Proto {
    pub fn number(self) -> u8 {
        match self {
            L4Proto::Tcp => 6,
            L4Proto::Udp => 17,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            6 => Some(L4Proto::Tcp),
            17 => Some(L4Proto::Udp),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            L4Proto::Tcp => "tcp",
            L4Proto::Udp => "udp",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrField {
    Saddr,
    Daddr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortField {
    Sport,
    Dport,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IfField {
    Iifname,
    Oifname,
}

/// An address and prefix length; the family of `addr` decides `ip` or `ip6`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    pub addr: IpAddr,
    pub len: u8,
}

impl Prefix {
    pub fn host(addr: IpAddr) -> Self {
        Prefix {
            addr,
            len: Self::max_len(addr),
        }
    }

    pub fn max_len(addr: IpAddr) -> u8 {
        if addr.is_ipv4() { 32 } else { 128 }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(String),
}

/// One statement of a rule. Matches are followed by statements; each variant has exactly one
/// low-level expansion (the one `nft` itself produces), which the dataplane encodes and decodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    /// `meta l4proto tcp`
    L4Proto(L4Proto),
    /// `ip saddr 169.254.7.127`, `ip6 daddr != ::1/128`
    Addr {
        field: AddrField,
        op: CmpOp,
        prefix: Prefix,
    },
    /// `tcp dport != 15008` (implies the protocol)
    Port {
        proto: L4Proto,
        field: PortField,
        op: CmpOp,
        port: u16,
    },
    /// `oifname != lo`
    Iface {
        field: IfField,
        op: CmpOp,
        name: String,
    },
    /// `mark and 0xfff != 0x539` (the packet mark)
    Mark {
        mask: u32,
        op: CmpOp,
        value: u32,
    },
    /// `ct mark and 0xfff == 0x111` (the connection mark)
    CtMark {
        mask: u32,
        op: CmpOp,
        value: u32,
    },
    /// `skuid 1000`, `skgid != 1337`: the owner of the sending socket
    Owner {
        gid: bool,
        op: CmpOp,
        id: u32,
    },
    /// `ip daddr @istio-inpod-probes-v4`
    AddrInSet {
        field: AddrField,
        v6: bool,
        set: String,
    },
    Counter,
    Verdict(Verdict),
    /// `redirect to :15001`
    Redirect {
        port: u16,
    },
    /// `snat to 169.254.7.127`
    Snat {
        addr: IpAddr,
    },
    /// `ct mark set ct mark & 0xfffff000 | 0x111`
    CtMarkSetMasked {
        keep: u32,
        or: u32,
    },
    /// `meta mark set ct mark`
    MarkSetCtMark,
    /// `ct zone set 1`
    CtZoneSet(u16),
    /// `meta mark set 1337`
    MarkSet(u32),
    /// `ct mark set mark`
    CtMarkSetMark,
    /// `ct state related,established` (any of the [`ct_state`] bits)
    CtState(u32),
    /// `tproxy ip to :15006`
    Tproxy {
        v6: bool,
        port: u16,
    },
    /// Kernel state this model does not describe (someone else's rule); the text says what it
    /// is so a drift report stays readable.
    Unknown(String),
}

impl fmt::Display for CmpOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CmpOp::Eq => "==",
            CmpOp::Ne => "!=",
        })
    }
}

/// Prefix for an implicit-equality match: nothing for `==`, `!= ` otherwise.
fn neg(op: CmpOp) -> &'static str {
    match op {
        CmpOp::Eq => "",
        CmpOp::Ne => "!= ",
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::L4Proto(p) => write!(f, "meta l4proto {}", p.as_str()),
            Expr::Addr { field, op, prefix } => {
                let fam = if prefix.addr.is_ipv4() { "ip" } else { "ip6" };
                write!(
                    f,
                    "{fam} {} {}{}",
                    addr_field(*field),
                    neg(*op),
                    prefix.addr
                )?;
                // Istio writes negated loopback matches with their length (`!= 127.0.0.1/32`) and
                // host matches without; both encode identically, so the operator decides.
                if prefix.len != Prefix::max_len(prefix.addr) || *op == CmpOp::Ne {
                    write!(f, "/{}", prefix.len)?;
                }
                Ok(())
            }
            Expr::Port {
                proto,
                field,
                op,
                port,
            } => {
                let field = match field {
                    PortField::Sport => "sport",
                    PortField::Dport => "dport",
                };
                write!(f, "{} {field} {}{port}", proto.as_str(), neg(*op))
            }
            Expr::Iface { field, op, name } => {
                let field = match field {
                    IfField::Iifname => "iifname",
                    IfField::Oifname => "oifname",
                };
                write!(f, "{field} {}{name}", neg(*op))
            }
            // A full mask is no mask: `nft` then compares the whole mark, as Istio's sidecar
            // rules (`mark 1337`) do.
            Expr::Mark {
                mask: u32::MAX,
                op,
                value,
            } => write!(f, "mark {}{value}", neg(*op)),
            Expr::Mark { mask, op, value } => write!(f, "mark and {mask:#x} {op} {value:#x}"),
            Expr::CtMark {
                mask: u32::MAX,
                op,
                value,
            } => write!(f, "ct mark {}{value}", neg(*op)),
            Expr::CtMark { mask, op, value } => {
                write!(f, "ct mark and {mask:#x} {op} {value:#x}")
            }
            Expr::Owner { gid, op, id } => {
                let key = if *gid { "skgid" } else { "skuid" };
                write!(f, "{key} {}{id}", neg(*op))
            }
            Expr::AddrInSet { field, v6, set } => {
                let fam = if *v6 { "ip6" } else { "ip" };
                write!(f, "{fam} {} @{set}", addr_field(*field))
            }
            Expr::Counter => f.write_str("counter"),
            Expr::Verdict(Verdict::Accept) => f.write_str("accept"),
            Expr::Verdict(Verdict::Drop) => f.write_str("drop"),
            Expr::Verdict(Verdict::Return) => f.write_str("return"),
            Expr::Verdict(Verdict::Jump(chain)) => write!(f, "jump {chain}"),
            Expr::Redirect { port } => write!(f, "redirect to :{port}"),
            Expr::Snat { addr } => write!(f, "snat to {addr}"),
            Expr::CtMarkSetMasked { keep, or } => {
                write!(f, "ct mark set ct mark & {keep:#x} | {or:#x}")
            }
            Expr::MarkSetCtMark => f.write_str("meta mark set ct mark"),
            Expr::CtZoneSet(zone) => write!(f, "ct zone set {zone}"),
            Expr::MarkSet(mark) => write!(f, "meta mark set {mark}"),
            Expr::CtMarkSetMark => f.write_str("ct mark set mark"),
            Expr::CtState(bits) => {
                let names: Vec<&str> = ct_state::NAMES
                    .iter()
                    .filter(|(bit, _)| bits & bit != 0)
                    .map(|(_, n)| *n)
                    .collect();
                write!(f, "ct state {}", names.join(","))
            }
            Expr::Tproxy { v6, port } => {
                write!(f, "tproxy {} to :{port}", if *v6 { "ip6" } else { "ip" })
            }
            Expr::Unknown(text) => f.write_str(text),
        }
    }
}

fn addr_field(field: AddrField) -> &'static str {
    match field {
        AddrField::Saddr => "saddr",
        AddrField::Daddr => "daddr",
    }
}

impl Rule {
    pub fn new(chain: &str, exprs: Vec<Expr>) -> Self {
        Rule {
            chain: chain.to_string(),
            exprs,
        }
    }

    /// The rule's expressions as `nft` text, without table and chain.
    pub fn body(&self) -> String {
        let parts: Vec<String> = self.exprs.iter().map(ToString::to_string).collect();
        parts.join(" ")
    }
}

impl Chain {
    pub fn regular(name: &str) -> Self {
        Chain {
            name: name.to_string(),
            base: None,
        }
    }

    pub fn base(name: &str, kind: ChainType, hook: Hook, priority: i32) -> Self {
        Chain {
            name: name.to_string(),
            base: Some(BaseChain {
                kind,
                hook,
                priority,
            }),
        }
    }
}

impl Table {
    pub(crate) fn new(name: &str) -> Self {
        Table {
            name: name.to_string(),
            ..Table::default()
        }
    }

    pub(crate) fn push(&mut self, chain: &str, exprs: Vec<Expr>) {
        self.rules.push(Rule::new(chain, exprs));
    }

    pub fn add_table_line(&self) -> String {
        // The kernel's flag bits, as `nft` names them.
        const NAMES: [(u32, &str); 3] = [(1, "dormant"), (2, "owner"), (4, "persist")];
        if self.flags == 0 {
            return format!("add table inet {}", self.name);
        }
        let mut names: Vec<String> = NAMES
            .iter()
            .filter(|(bit, _)| self.flags & bit != 0)
            .map(|(_, name)| name.to_string())
            .collect();
        let unknown = self.flags & !NAMES.iter().fold(0, |all, (bit, _)| all | bit);
        if unknown != 0 {
            names.push(format!("{unknown:#x}"));
        }
        format!(
            "add table inet {} {{ flags {}; }}",
            self.name,
            names.join(",")
        )
    }

    pub fn set_line(&self, set: &Set) -> String {
        let mut line = format!(
            "add set inet {} {} {{ type {} ;",
            self.name,
            set.name,
            set.key.as_str()
        );
        if let Some(c) = &set.comment {
            line.push_str(&format!(" comment \"{c}\" ;"));
        }
        line.push_str(" }");
        line
    }

    pub fn chain_line(&self, chain: &Chain) -> String {
        match &chain.base {
            None => format!("add chain inet {} {}", self.name, chain.name),
            Some(b) => format!(
                "add chain inet {} {} {{ type {} hook {} priority {} ; }}",
                self.name,
                chain.name,
                b.kind.as_str(),
                b.hook.as_str(),
                b.priority
            ),
        }
    }

    pub fn rule_line(&self, rule: &Rule) -> String {
        format!("add rule inet {} {} {}", self.name, rule.chain, rule.body())
    }

    /// The rules of one chain, in evaluation order.
    pub fn chain_rules<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a Rule> + 'a {
        self.rules.iter().filter(move |r| r.chain == chain)
    }

    /// The table as the `nft -f` transaction that creates it from any prior state. A table with
    /// sets (the host's) is written as Istio's two transactions, sent as one batch: the sets are
    /// created (an existing set keeps its elements), then the table's rules are replaced as for
    /// any table (`flush table` deletes rules, never sets or their elements).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut line = |l: String| {
            out.push_str(&l);
            out.push('\n');
        };
        if !self.sets.is_empty() {
            line(self.add_table_line());
            for set in &self.sets {
                line(self.set_line(set));
            }
        }
        line(self.add_table_line());
        line(format!("flush table inet {}", self.name));
        for chain in &self.chains {
            line(self.chain_line(chain));
        }
        for rule in &self.rules {
            line(self.rule_line(rule));
        }
        out
    }
}

impl Ruleset {
    pub fn render(&self) -> String {
        self.tables.iter().map(Table::render).collect()
    }

    pub fn table(&self, name: &str) -> Option<&Table> {
        self.tables.iter().find(|t| t.name == name)
    }
}

/// What differs between a desired rule set and the kernel's state of the same tables, one `nft`
/// line per entry. Rules are compared per chain and in order; a chain whose rules are all present
/// but reordered is reported as wholly missing and wholly unexpected.
pub fn diff(desired: &Ruleset, actual: &Ruleset) -> (Vec<String>, Vec<String>) {
    let mut missing = Vec::new();
    let mut unexpected = Vec::new();
    for want in &desired.tables {
        match actual.table(&want.name) {
            None => missing.extend(table_lines(want)),
            Some(have) => diff_table(want, have, &mut missing, &mut unexpected),
        }
    }
    for have in &actual.tables {
        if desired.table(&have.name).is_none() {
            unexpected.extend(table_lines(have));
        }
    }
    (missing, unexpected)
}

fn table_lines(t: &Table) -> Vec<String> {
    let mut lines = vec![t.add_table_line()];
    lines.extend(t.sets.iter().map(|s| t.set_line(s)));
    lines.extend(t.chains.iter().map(|c| t.chain_line(c)));
    for c in &t.chains {
        lines.extend(t.chain_rules(&c.name).map(|r| t.rule_line(r)));
    }
    lines
}

fn diff_table(want: &Table, have: &Table, missing: &mut Vec<String>, unexpected: &mut Vec<String>) {
    // A pod in sync (every drift check, every restart) is equal as data: nothing to render.
    if same_table(want, have) {
        return;
    }
    if want.flags != have.flags {
        missing.push(want.add_table_line());
        unexpected.push(have.add_table_line());
    }
    let set_lines = |t: &Table| -> Vec<String> { t.sets.iter().map(|s| t.set_line(s)).collect() };
    multiset_diff(set_lines(want), set_lines(have), missing, unexpected);
    let chain_lines =
        |t: &Table| -> Vec<String> { t.chains.iter().map(|c| t.chain_line(c)).collect() };
    multiset_diff(chain_lines(want), chain_lines(have), missing, unexpected);

    let mut names: Vec<&str> = want.chains.iter().map(|c| c.name.as_str()).collect();
    for c in &have.chains {
        if !names.contains(&c.name.as_str()) {
            names.push(&c.name);
        }
    }
    for name in names {
        let w: Vec<String> = want.chain_rules(name).map(|r| want.rule_line(r)).collect();
        let h: Vec<String> = have.chain_rules(name).map(|r| have.rule_line(r)).collect();
        if w == h {
            continue;
        }
        let (before_m, before_u) = (missing.len(), unexpected.len());
        multiset_diff(w.clone(), h.clone(), missing, unexpected);
        if missing.len() == before_m && unexpected.len() == before_u {
            missing.extend(w);
            unexpected.extend(h);
        }
    }
}

/// Sets, chains and each chain's rules in order equal: the lines below would all match.
fn same_table(want: &Table, have: &Table) -> bool {
    want.flags == have.flags
        && want.sets == have.sets
        && want.chains == have.chains
        && want.rules.len() == have.rules.len()
        && want
            .chains
            .iter()
            .all(|c| want.chain_rules(&c.name).eq(have.chain_rules(&c.name)))
}

/// [`multiset::diff`], appended to the reports.
fn multiset_diff(
    want: Vec<String>,
    have: Vec<String>,
    missing: &mut Vec<String>,
    unexpected: &mut Vec<String>,
) {
    let (m, u) = multiset::diff(want, have);
    missing.extend(m);
    unexpected.extend(u);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::ambient::InpodConfig;
    use crate::redirect::ambient::nft::{ISTIO_OUTPUT, RAW_TABLE, inpod_ruleset};

    #[test]
    fn diff_of_identical_sets_is_empty() {
        let rs = inpod_ruleset(&InpodConfig::default());
        assert_eq!(diff(&rs, &rs), (vec![], vec![]));
    }

    #[test]
    fn a_flagged_table_is_drift_even_with_every_rule_in_place() {
        let want = inpod_ruleset(&InpodConfig::default());
        let mut have = want.clone();
        have.tables[0].flags = 1 | 8;
        let name = &want.tables[0].name;
        assert_eq!(
            diff(&want, &have),
            (
                vec![format!("add table inet {name}")],
                vec![format!("add table inet {name} {{ flags dormant,0x8; }}")]
            )
        );
    }

    #[test]
    fn diff_names_missing_and_foreign_rules() {
        let want = inpod_ruleset(&InpodConfig::default());
        let mut have = want.clone();
        let nat = &mut have.tables[0];
        let gone = nat.rules.remove(nat.rules.len() - 1);
        nat.rules
            .push(Rule::new(ISTIO_OUTPUT, vec![Expr::Verdict(Verdict::Drop)]));
        have.tables.retain(|t| t.name != RAW_TABLE);
        let (missing, unexpected) = diff(&want, &have);
        assert!(missing.contains(&want.tables[0].rule_line(&gone)));
        assert!(missing.contains(&"add table inet istio-ambient-raw".to_string()));
        assert_eq!(
            unexpected,
            vec!["add rule inet istio-ambient-nat istio-output drop".to_string()]
        );
    }

    /// The shape of the `annotations` fuzz finding (a rule per virtual interface and range, most
    /// of them repeated) in a drifted chain: only what differs is reported.
    #[test]
    fn a_drifted_chain_of_thousands_of_repeated_rules_reports_only_what_differs() {
        let line = |i: usize| {
            vec![
                Expr::Iface {
                    field: IfField::Iifname,
                    op: CmpOp::Eq,
                    name: format!("veth{}", i % 60),
                },
                Expr::Verdict(Verdict::Jump("istio-redirect".into())),
            ]
        };
        let mut want = inpod_ruleset(&InpodConfig::default());
        want.tables[0]
            .rules
            .extend((0..6_000).map(|i| Rule::new(PREROUTING, line(i))));
        let mut have = want.clone();
        let nat = &mut have.tables[0];
        let gone = nat.rules.remove(nat.rules.len() - 6_000 + 7);
        let moved = nat.rules.remove(nat.rules.len() - 1);
        nat.rules.insert(0, moved);
        nat.rules
            .push(Rule::new(PREROUTING, vec![Expr::Verdict(Verdict::Drop)]));
        let (missing, unexpected) = diff(&want, &have);
        let nat = &want.tables[0];
        assert_eq!(missing, vec![nat.rule_line(&gone)]);
        assert_eq!(
            unexpected,
            vec![format!("add rule inet {} prerouting drop", nat.name)]
        );
    }

    #[test]
    fn reordered_chain_is_reported() {
        let want = inpod_ruleset(&InpodConfig::default());
        let mut have = want.clone();
        let nat = &mut have.tables[0];
        let last = nat.rules.pop().unwrap();
        nat.rules.insert(2, last);
        let (missing, unexpected) = diff(&want, &have);
        assert!(!missing.is_empty() && missing.len() == unexpected.len());
    }
}
