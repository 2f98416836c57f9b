//! The iptables backend of [`InpodRules`]: `iptables-restore --noflush` inside the pod netns.
//!
//! Every change is one restore transaction per family. Verification compares our chains and the
//! jumps into them, as `iptables-save` prints them, with a *canonical* form of the desired rules:
//! the same rules restored once into a scratch namespace and read back with the same tools. That
//! makes the comparison exact (order, spelling, duplicates) without one `iptables -C` process per
//! rule, and it holds for both variants and any tool version.

pub mod detect;
pub mod exec;
pub mod sandbox;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::iptables::inpod_rules;
use cni_core::redirect::iptables::{
    CHAIN_PREFIX, Family, ParseError, Rule, TablesState, jump_target,
    replace_restore_text_claiming, restore_text,
};
use cni_core::redirect::multiset;

use self::detect::{Binaries, DetectError, Reason};
use self::exec::{ExecError, Runner};
use crate::inpod::{Drift, InpodRules, RuleError, RuleState};
use crate::netns::{Netns, NetnsError};

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error(transparent)]
    Detect(#[from] DetectError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("cannot parse {tool} output: {source}")]
    Parse { tool: String, source: ParseError },
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("cannot create a scratch namespace: {0}")]
    Scratch(String),
    #[error("cannot prepare the scratch namespace: {0}")]
    Prepare(String),
    #[error("cannot create lock directory {path}: {source}")]
    LockDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A commit the kernel refused because another writer changed the table since it was read
    /// (legacy's entry-count check, EAGAIN): nothing of it was applied.
    #[error("table changed under the commit by another writer: {0}")]
    Contended(ExecError),
    #[error("{family:?} failed: {source}; rolled back to no rules")]
    RolledBack {
        family: Family,
        #[source]
        source: Box<IptablesError>,
    },
}

impl IptablesError {
    fn contended(&self) -> bool {
        match self {
            IptablesError::Contended(_) => true,
            IptablesError::RolledBack { source, .. } => source.contended(),
            _ => false,
        }
    }
}

/// Tries of one change while other writers keep changing the same tables.
const COMMIT_ATTEMPTS: u64 = 8;

/// Whether `iptables-restore` failed on a `COMMIT` line of `input`: the kernel refused the table
/// replacement (legacy says only `line N failed`), as opposed to a rule it could not parse.
fn failed_at_commit(e: &ExecError, input: &str) -> bool {
    let ExecError::Failed {
        code: 1, stderr, ..
    } = e
    else {
        return false;
    };
    let line = stderr
        .split("line ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<usize>().ok());
    line.and_then(|n| input.lines().nth(n.checked_sub(1)?))
        .is_some_and(|l| l.trim() == "COMMIT")
}

impl From<IptablesError> for RuleError {
    fn from(e: IptablesError) -> Self {
        match e {
            IptablesError::Netns(n) => RuleError::Netns(n),
            other => RuleError::Backend {
                backend: "iptables",
                source: Box::new(other),
            },
        }
    }
}

/// Our part of a table state: `ISTIO_*` chains with their rules, and the rules of other chains
/// that jump into one, keyed by (table, chain).
pub type Owned = BTreeMap<(String, String), Vec<String>>;

/// Rules of builtin chains that are ours although they jump nowhere of ours (the sidecar's
/// TPROXY marks, excluded-interface returns), keyed by (table, chain), in `-save` spelling.
pub type Claims = BTreeMap<(String, String), Vec<String>>;

/// The desired rules as this variant's `-save` prints them.
#[derive(Debug, Default)]
pub struct Canonical {
    pub owned: Owned,
    pub claims: Claims,
}

/// Extracts [`Owned`] from a parsed state.
pub fn owned(state: &TablesState) -> Owned {
    owned_claiming(state, &Claims::new())
}

fn is_istio_jump(rule: &str) -> bool {
    jump_target(rule).is_some_and(|t| t.starts_with(CHAIN_PREFIX))
}

/// The builtin-chain rules of `state` that `claims` names, as `(table, chain, rule)`.
fn claimed_in(state: &TablesState, claims: &Claims) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for ((table, chain), wanted) in claims {
        let wanted: HashSet<&String> = wanted.iter().collect();
        for rule in state.chain(table, chain).into_iter().flatten() {
            if wanted.contains(rule) && !is_istio_jump(rule) {
                out.push((table.clone(), chain.clone(), rule.clone()));
            }
        }
    }
    out
}

/// [`owned`], also counting the builtin-chain rules `claims` names.
pub fn owned_claiming(state: &TablesState, claims: &Claims) -> Owned {
    let mut out = Owned::new();
    for (table, chains) in &state.tables {
        for (chain, rules) in chains {
            if chain.starts_with(CHAIN_PREFIX) {
                out.insert((table.clone(), chain.clone()), rules.clone());
            } else {
                // A set: a pod's annotations can put thousands of claimed rules in a chain.
                let claimed: HashSet<&String> = claims
                    .get(&(table.clone(), chain.clone()))
                    .into_iter()
                    .flatten()
                    .collect();
                let jumps: Vec<String> = rules
                    .iter()
                    .filter(|r| is_istio_jump(r) || claimed.contains(r))
                    .cloned()
                    .collect();
                if !jumps.is_empty() {
                    out.insert((table.clone(), chain.clone()), jumps);
                }
            }
        }
    }
    out
}

/// Compares what is installed with the canonical desired state.
pub fn compare(current: &Owned, desired: &Owned) -> RuleState {
    if current == desired {
        return RuleState::InSync;
    }
    if current.is_empty() {
        return RuleState::Absent;
    }
    let mut drift = Drift::default();
    let fmt = |(t, c): &(String, String), r: &str| format!("-t {t} -A {c} {r}");
    let decl = |(t, c): &(String, String)| format!("-t {t} -N {c}");
    for (key, want) in desired {
        match current.get(key) {
            None => {
                if key.1.starts_with(CHAIN_PREFIX) {
                    drift.missing.push(decl(key));
                }
                drift.missing.extend(want.iter().map(|r| fmt(key, r)));
            }
            Some(have) if have != want => {
                let (missing, spare) = multiset::diff(want.iter().collect(), have.iter().collect());
                if missing.is_empty() && spare.is_empty() {
                    // Same rules, different order: show both orders.
                    drift.missing.extend(want.iter().map(|r| fmt(key, r)));
                    drift.unexpected.extend(have.iter().map(|r| fmt(key, r)));
                } else {
                    drift
                        .missing
                        .extend(missing.into_iter().map(|r| fmt(key, r)));
                    drift
                        .unexpected
                        .extend(spare.into_iter().map(|r| fmt(key, r)));
                }
            }
            Some(_) => {}
        }
    }
    for (key, have) in current {
        if !desired.contains_key(key) {
            if key.1.starts_with(CHAIN_PREFIX) {
                drift.unexpected.push(decl(key));
            }
            drift.unexpected.extend(have.iter().map(|r| fmt(key, r)));
        }
    }
    RuleState::Drifted(drift)
}

/// A family's parsed state, its verdict, and the claimed builtin-chain rules found in it.
type FamilyState = (TablesState, RuleState, Vec<(String, String, String)>);

/// Readies a scratch namespace before the desired rules are restored into it.
pub type Prep<'a> = &'a dyn Fn(&Netns) -> Result<(), IptablesError>;

fn no_prep(_: &Netns) -> Result<(), IptablesError> {
    Ok(())
}

/// Drives one detected iptables variant.
pub struct IptablesBackend {
    bins: Binaries,
    /// Why detection chose `bins` (`None`: given by the caller).
    reason: Option<Reason>,
    lock_dir: Option<PathBuf>,
    canonical: Mutex<HashMap<(Family, String), Arc<Canonical>>>,
}

/// Where per-pod xtables lock files live when the variant supports them.
pub const DEFAULT_LOCK_DIR: &str = "/run/istio-cni-rs/xtables";

impl IptablesBackend {
    /// Detects the variant in the calling thread's namespace (the host). `force` is the value of
    /// `FORCE_IPTABLES_BINARY`.
    pub fn detect(force: Option<&str>, ipv6: bool) -> Result<Self, IptablesError> {
        let found = detect::detect(force, ipv6)?;
        let mut backend = Self::new(found.binaries, Some(PathBuf::from(DEFAULT_LOCK_DIR)));
        backend.reason = Some(found.reason);
        Ok(backend)
    }

    /// `lock_dir`: where pod namespaces get their own xtables lock file (`None`: pods take the
    /// node-wide lock too). Only legacy locks at all.
    pub fn new(bins: Binaries, lock_dir: Option<PathBuf>) -> Self {
        IptablesBackend {
            bins,
            reason: None,
            lock_dir,
            canonical: Mutex::new(HashMap::new()),
        }
    }

    /// `AMBIENT_USE_SCOPED_XTABLES_LOCKING` (Istio's default: on). Off, pod commands queue on
    /// the node-wide lock with kube-proxy; they stay in the NSS sandbox either way.
    pub fn with_scoped_locking(mut self, on: bool) -> Self {
        if !on {
            self.lock_dir = None;
        }
        self
    }

    /// The lock file commands in pod namespace `netns` take (`None`: the node-wide
    /// `/run/xtables.lock`, or no lock at all with nft and legacy before 1.6.2).
    pub fn pod_lock_file(&self, netns: &Netns) -> Option<PathBuf> {
        let dir = self.lock_dir.as_ref().filter(|_| self.bins.wants_wait())?;
        let id = netns.id();
        Some(dir.join(format!("xtables-{}-{}.lock", id.dev, id.ino)))
    }

    pub fn binaries(&self) -> &Binaries {
        &self.bins
    }

    /// The tools and why detection chose them, for logs: `iptables-nft (nft 1.8.9): kubelet's
    /// KUBE-IPTABLES-HINT chain is in the nft IPv4 tables`.
    pub fn choice(&self) -> String {
        match &self.reason {
            Some(why) => format!("{}: {why}", self.bins),
            None => format!("{}: given", self.bins),
        }
    }

    fn runner<'a>(
        &'a self,
        netns: &'a Netns,
        scoped_lock: bool,
    ) -> Result<Runner<'a>, IptablesError> {
        let lock_file = self.pod_lock_file(netns).filter(|_| scoped_lock);
        if let (Some(dir), Some(_)) = (&self.lock_dir, &lock_file) {
            create_lock_dir(dir)?;
        }
        Ok(Runner {
            bins: &self.bins,
            netns,
            lock_file,
        })
    }

    fn save(&self, runner: &Runner<'_>, family: Family) -> Result<TablesState, IptablesError> {
        let tool = self.bins.tool(family == Family::V6, "-save");
        let text = runner.run(family == Family::V6, "-save", &[], None)?;
        TablesState::parse(&text).map_err(|source| IptablesError::Parse { tool, source })
    }

    fn restore(
        &self,
        runner: &Runner<'_>,
        family: Family,
        text: &str,
    ) -> Result<(), IptablesError> {
        tracing::debug!(family = ?family, "iptables-restore --noflush:\n{text}");
        match runner.run(family == Family::V6, "-restore", &["--noflush"], Some(text)) {
            Ok(_) => Ok(()),
            Err(e) if failed_at_commit(&e, text) => Err(IptablesError::Contended(e)),
            Err(e) => Err(e.into()),
        }
    }

    /// The desired rules as this variant's `-save` prints them, learnt once per rule set by
    /// restoring them into a throwaway namespace.
    fn canonical(
        &self,
        family: Family,
        rules: &[Rule],
        prep: Prep<'_>,
    ) -> Result<Arc<Canonical>, IptablesError> {
        if rules.is_empty() {
            return Ok(Arc::new(Canonical::default()));
        }
        let text = restore_text(rules);
        let key = (family, text);
        if let Some(hit) = self
            .canonical
            .lock()
            .expect("canonical cache poisoned")
            .get(&key)
        {
            return Ok(hit.clone());
        }
        let scratch = scratch_netns()?;
        prep(&scratch)?;
        let runner = self.runner(&scratch, true)?;
        self.restore(&runner, family, &key.1)?;
        let scratch_state = self.save(&runner, family)?;
        let mut claims = Claims::new();
        for (table, chains) in &scratch_state.tables {
            for (chain, rules) in chains {
                let mine: Vec<String> = rules
                    .iter()
                    .filter(|r| !chain.starts_with(CHAIN_PREFIX) && !is_istio_jump(r))
                    .cloned()
                    .collect();
                if !mine.is_empty() {
                    claims.insert((table.clone(), chain.clone()), mine);
                }
            }
        }
        let learnt = Arc::new(Canonical {
            owned: owned_claiming(&scratch_state, &claims),
            claims,
        });
        if let Some(lock) = &runner.lock_file {
            let _ = std::fs::remove_file(lock);
        }
        self.canonical
            .lock()
            .expect("canonical cache poisoned")
            .insert(key, learnt.clone());
        Ok(learnt)
    }

    /// State of one family: the parsed save output and its verdict against `rules`. A family
    /// whose tools fail while nothing is desired (IPv6 off in the kernel) counts as clean.
    /// `claim`: rules whose builtin-chain parts count as ours (the desired ones, or on removal
    /// the ones once programmed). Also returns those parts found installed.
    fn family_state(
        &self,
        runner: &Runner<'_>,
        family: Family,
        rules: &[Rule],
        claim: &[Rule],
        prep: Prep<'_>,
    ) -> Result<FamilyState, IptablesError> {
        let current = match self.save(runner, family) {
            Ok(s) => s,
            Err(_) if rules.is_empty() => {
                return Ok((TablesState::default(), RuleState::InSync, Vec::new()));
            }
            Err(e) => return Err(e),
        };
        let empty = current.tables.values().all(|chains| {
            chains
                .iter()
                .all(|(name, rules)| rules.is_empty() && !name.starts_with(CHAIN_PREFIX))
        });
        if empty {
            // Nothing at all is installed (a fresh pod): no need to learn the canonical form
            // (a scratch namespace and two tool runs) to know none of it is ours.
            let verdict = if rules.is_empty() {
                RuleState::InSync
            } else {
                RuleState::Absent
            };
            return Ok((current, verdict, Vec::new()));
        }
        let desired = self.canonical(family, rules, prep)?;
        let claims = if claim == rules {
            desired.claims.clone()
        } else {
            self.canonical(family, claim, prep)?.claims.clone()
        };
        let verdict = compare(&owned_claiming(&current, &claims), &desired.owned);
        let claimed = claimed_in(&current, &claims);
        Ok((current, verdict, claimed))
    }

    /// Makes `netns` hold exactly `rules_for(family)` for both families, from a fresh read each
    /// time a concurrent writer made the kernel refuse a commit. Returns the states seen before
    /// the change.
    fn converge(
        &self,
        netns: &Netns,
        scoped_lock: bool,
        rules_for: impl Fn(Family) -> Vec<Rule>,
        claim_for: impl Fn(Family) -> Vec<Rule>,
        prep: Prep<'_>,
    ) -> Result<Vec<RuleState>, IptablesError> {
        let mut attempt = 1;
        loop {
            match self.converge_once(netns, scoped_lock, &rules_for, &claim_for, prep) {
                Err(e) if e.contended() && attempt < COMMIT_ATTEMPTS => {
                    tracing::debug!(attempt, error = %e, "iptables commit raced another writer; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(5 * attempt));
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn converge_once(
        &self,
        netns: &Netns,
        scoped_lock: bool,
        rules_for: impl Fn(Family) -> Vec<Rule>,
        claim_for: impl Fn(Family) -> Vec<Rule>,
        prep: Prep<'_>,
    ) -> Result<Vec<RuleState>, IptablesError> {
        let runner = self.runner(netns, scoped_lock)?;
        let mut before = Vec::new();
        let mut plans = Vec::new();
        for family in [Family::V4, Family::V6] {
            let rules = rules_for(family);
            let claim = claim_for(family);
            let (current, verdict, claimed) =
                self.family_state(&runner, family, &rules, &claim, prep)?;
            if verdict != RuleState::InSync {
                plans.push((
                    family,
                    replace_restore_text_claiming(&current, &rules, &claimed),
                ));
            }
            before.push(verdict);
        }
        let fresh = before
            .iter()
            .all(|s| matches!(s, RuleState::Absent | RuleState::InSync));
        let mut applied = Vec::new();
        for (family, text) in plans {
            if let Err(e) = self.restore(&runner, family, &text) {
                // A pod that had nothing must not keep half a rule set: undo the families done.
                if fresh && !applied.is_empty() {
                    for done in applied {
                        let state = self.save(&runner, done)?;
                        let rules = rules_for(done);
                        let claims = self.canonical(done, &rules, prep)?.claims.clone();
                        let text = replace_restore_text_claiming(
                            &state,
                            &[],
                            &claimed_in(&state, &claims),
                        );
                        let _ = self.restore(&runner, done, &text);
                    }
                    return Err(IptablesError::RolledBack {
                        family,
                        source: Box::new(e),
                    });
                }
                return Err(e);
            }
            applied.push(family);
        }
        Ok(before)
    }

    fn state(
        &self,
        netns: &Netns,
        scoped_lock: bool,
        rules_for: impl Fn(Family) -> Vec<Rule>,
        prep: Prep<'_>,
    ) -> Result<RuleState, IptablesError> {
        let runner = self.runner(netns, scoped_lock)?;
        let mut states = Vec::new();
        for family in [Family::V4, Family::V6] {
            let rules = rules_for(family);
            states.push((
                tag(
                    family,
                    self.family_state(&runner, family, &rules, &rules, prep)?.1,
                ),
                !rules.is_empty(),
            ));
        }
        Ok(merge(states))
    }

    /// Programs `rules_for(family)` in a host namespace with the global lock. `prep` readies the
    /// scratch namespace used to learn the canonical form (e.g. creates sets the rules refer to).
    pub fn converge_host(
        &self,
        netns: &Netns,
        rules_for: impl Fn(Family) -> Vec<Rule>,
        prep: Prep<'_>,
    ) -> Result<(), IptablesError> {
        self.converge(netns, false, &rules_for, &rules_for, prep)
            .map(|_| ())
    }

    /// Programs `rules_for(family)` in a pod namespace under its own xtables lock (the sidecar
    /// rules). Returns the states seen before the change.
    pub fn converge_pod(
        &self,
        netns: &Netns,
        rules_for: impl Fn(Family) -> Vec<Rule>,
    ) -> Result<Vec<RuleState>, IptablesError> {
        self.converge(netns, true, &rules_for, &rules_for, &no_prep)
    }

    /// Reads a pod namespace's state against `rules_for`.
    pub fn verify_pod(
        &self,
        netns: &Netns,
        rules_for: impl Fn(Family) -> Vec<Rule>,
    ) -> Result<RuleState, IptablesError> {
        self.state(netns, true, rules_for, &no_prep)
    }

    /// Removes every `ISTIO_*` chain and jump from a pod namespace, plus the builtin-chain rules
    /// that `programmed_for(family)` would have added.
    pub fn remove_pod(
        &self,
        netns: &Netns,
        programmed_for: impl Fn(Family) -> Vec<Rule>,
    ) -> Result<(), IptablesError> {
        self.converge(netns, true, |_| Vec::new(), programmed_for, &no_prep)?;
        if let Ok(runner) = self.runner(netns, true)
            && let Some(lock) = runner.lock_file
        {
            let _ = std::fs::remove_file(lock);
        }
        Ok(())
    }

    /// Reads the host state against `rules_for`.
    pub fn verify_host(
        &self,
        netns: &Netns,
        rules_for: impl Fn(Family) -> Vec<Rule>,
        prep: Prep<'_>,
    ) -> Result<RuleState, IptablesError> {
        self.state(netns, false, rules_for, prep)
    }
}

fn rules_for(cfg: &InpodConfig) -> impl Fn(Family) -> Vec<Rule> + '_ {
    move |family| {
        if family == Family::V6 && !cfg.ipv6 {
            Vec::new()
        } else {
            inpod_rules(cfg, family)
        }
    }
}

/// Marks IPv6 drift lines, which otherwise read exactly like their IPv4 twins.
fn tag(family: Family, state: RuleState) -> RuleState {
    match (family, state) {
        (Family::V6, RuleState::Drifted(d)) => RuleState::Drifted(Drift {
            missing: d
                .missing
                .into_iter()
                .map(|l| format!("(ipv6) {l}"))
                .collect(),
            unexpected: d
                .unexpected
                .into_iter()
                .map(|l| format!("(ipv6) {l}"))
                .collect(),
        }),
        (_, s) => s,
    }
}

/// Per family (state, whether it has desired rules): all in sync → in sync; every family with
/// rules absent and the others clean → absent; otherwise drifted, differences together.
fn merge(states: Vec<(RuleState, bool)>) -> RuleState {
    if states.iter().all(|(s, _)| *s == RuleState::InSync) {
        return RuleState::InSync;
    }
    let absent = |(s, wanted): &(RuleState, bool)| {
        if *wanted {
            *s == RuleState::Absent
        } else {
            *s == RuleState::InSync
        }
    };
    if states.iter().all(absent) {
        return RuleState::Absent;
    }
    let mut drift = Drift::default();
    for (s, _) in states {
        match s {
            RuleState::Drifted(d) => {
                drift.missing.extend(d.missing);
                drift.unexpected.extend(d.unexpected);
            }
            RuleState::Absent => drift
                .missing
                .push("(every rule of one address family)".into()),
            RuleState::InSync => {}
        }
    }
    RuleState::Drifted(drift)
}

fn create_lock_dir(dir: &std::path::Path) -> Result<(), IptablesError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| IptablesError::LockDir {
            path: dir.to_owned(),
            source,
        })
}

/// A new, empty network namespace, alive as long as the returned handle.
fn scratch_netns() -> Result<Netns, IptablesError> {
    std::thread::spawn(|| {
        // The thread exits right after, so its namespace switch never leaks to other work.
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| e.to_string())?;
        Netns::current().map_err(|e| e.to_string())
    })
    .join()
    .map_err(|_| IptablesError::Scratch("thread panicked".into()))?
    .map_err(IptablesError::Scratch)
}

impl InpodRules for IptablesBackend {
    fn name(&self) -> &'static str {
        "iptables"
    }

    fn render(&self, cfg: &InpodConfig) -> String {
        cni_core::redirect::ambient::iptables::inpod_restore(cfg)
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    fn apply(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), RuleError> {
        self.converge(netns, true, rules_for(cfg), rules_for(cfg), &no_prep)?;
        Ok(())
    }

    fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, RuleError> {
        Ok(self.state(netns, true, rules_for(cfg), &no_prep)?)
    }

    fn remove(&self, netns: &Netns, _cfg: &InpodConfig) -> Result<(), RuleError> {
        self.converge(netns, true, |_| Vec::new(), |_| Vec::new(), &no_prep)?;
        if let Ok(runner) = self.runner(netns, true)
            && let Some(lock) = runner.lock_file
        {
            let _ = std::fs::remove_file(lock);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(code: i32, stderr: &str) -> ExecError {
        ExecError::Failed {
            binary: "iptables-legacy-restore".into(),
            code,
            class: "other problem",
            stderr: stderr.into(),
        }
    }

    #[test]
    fn only_a_refused_commit_counts_as_contention() {
        let input = "*nat\n-N ISTIO_OUTPUT\nCOMMIT\n";
        assert!(failed_at_commit(
            &failed(1, "iptables-restore: line 3 failed"),
            input
        ));
        // A rule the tool could not apply, a parameter problem, a line that does not exist.
        assert!(!failed_at_commit(
            &failed(1, "iptables-restore: line 2 failed"),
            input
        ));
        assert!(!failed_at_commit(
            &failed(2, "iptables-restore: line 3 failed"),
            input
        ));
        assert!(!failed_at_commit(
            &failed(1, "iptables-restore: line 9 failed"),
            input
        ));
        assert!(!failed_at_commit(
            &failed(1, "iptables-restore: line 0 failed"),
            input
        ));
        let contended = IptablesError::RolledBack {
            family: Family::V6,
            source: Box::new(IptablesError::Contended(failed(1, "line 3 failed"))),
        };
        assert!(contended.contended());
    }

    /// The shape of the `annotations` fuzz finding on the iptables side: a `PREROUTING` of
    /// thousands of rules (virtual interfaces × ranges, most repeated) of which one is missing
    /// and one foreign; the drift names exactly those two, and the returns of ours among the
    /// jumps are found as ours.
    #[test]
    fn a_drifted_chain_of_thousands_of_repeated_rules_reports_only_what_differs() {
        let rules: Vec<String> = (0..6_000)
            .map(|i| format!("-d 10.{}.0.0/16 -i veth{} -j ISTIO_REDIRECT", i % 4, i % 60))
            .chain((0..300).map(|i| format!("-i veth{} -j RETURN", i % 60)))
            .collect();
        let mut live = TablesState::default();
        let nat = live.tables.entry("nat".into()).or_default();
        nat.insert("PREROUTING".into(), rules.clone());
        let claims = Claims::from([(
            ("nat".to_string(), "PREROUTING".to_string()),
            rules[6_000..].to_vec(),
        )]);
        let desired = owned_claiming(&live, &claims);
        assert_eq!(desired.values().map(Vec::len).sum::<usize>(), 6_300);
        assert_eq!(claimed_in(&live, &claims).len(), 300);

        let prerouting = live
            .tables
            .get_mut("nat")
            .and_then(|t| t.get_mut("PREROUTING"))
            .unwrap();
        let gone = prerouting.remove(7);
        prerouting.push("-j ISTIO_INBOUND".into());
        let RuleState::Drifted(drift) = compare(&owned_claiming(&live, &claims), &desired) else {
            panic!("a missing and a foreign rule are drift");
        };
        assert_eq!(drift.missing, [format!("-t nat -A PREROUTING {gone}")]);
        assert_eq!(drift.unexpected, ["-t nat -A PREROUTING -j ISTIO_INBOUND"]);
    }
}
