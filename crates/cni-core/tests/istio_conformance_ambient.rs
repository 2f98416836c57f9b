//! Ambient rule conformance with the Istio pinned in `tools/istio/go.mod`: every golden of
//! Istio's iptables and nftables rule tests (`cni/pkg/iptables/testdata`,
//! `cni/pkg/nftables/testdata`, read from the module at test time) is compared with our
//! rendering of the same configuration (`support/istio_pin.rs` says which configuration produced
//! which golden).
//!
//! The test fails when the module cannot be found, when a golden maps to no case of ours (a new
//! golden after a pin bump), when a case of ours has no golden (one renamed or removed), and on
//! every difference not listed under `ambient_rules:` in `tools/istio/conformance-allowlist.yaml`
//! — and on every listed difference that no longer occurs. Only deliberate fixes of Istio
//! quirks, documented in ARCHITECTURE.md, belong in that list.
//!
//! Normalisations, each because the text differs where the meaning cannot:
//! - iptables: the golden's first two lines, `iptables-save` and `ip6tables-save`, are commands
//!   Istio's test stub recorded (its state check before the restore), not restore input; they
//!   are checked and dropped.
//! - both: goldens are compared line by line, so a final newline (Istio joins lines with `\n`
//!   and ends without one) is not a difference.
//! - nftables: runs of spaces are one space (Istio's builder leaves double spaces inside rules;
//!   `nft` splits on whitespace), and `meta mark & <mask>` / `meta mark and <mask>` are written
//!   `mark and <mask>`: `mark` is nft's short form of the same `meta mark` key and `&` the same
//!   operator as `and`, so the kernel gets the same expression. Our rules are read back from the
//!   kernel, which keeps no spelling, so ours uses one spelling throughout.
//! - nftables host: the golden records only the host rule transaction; Istio's set manager
//!   creates the probe sets in an earlier transaction of its own (`host_sets.go`,
//!   `initializeSets`) that no golden records. That transaction is written below as facts and
//!   put before the golden; our batch carries both.
//!
//! Run: `cargo test -p cni-core --test istio_conformance_ambient` (`ISTIO_MODULE_DIR` overrides
//! where the module is).

#[path = "support/istio_pin.rs"]
mod istio_pin;

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::consts::PROBE_SNAT_V4;
use cni_core::redirect::ambient::iptables::{host_probe_rules, inpod_restore};
use cni_core::redirect::ambient::nft::{
    HostProbeConfig, NAT_TABLE, PROBE_SET_COMMENT, host_ruleset, inpod_ruleset, probe_set_name,
};
use cni_core::redirect::iptables::{Family, restore_text};
use istio_pin::istio_module::{self, Allowed, OnlyIn};
use istio_pin::{Backend, Setup};

/// The allowlist file, from the repository root.
const ALLOWLIST: &str = "tools/istio/conformance-allowlist.yaml";

/// Our rendering for a golden's setup.
fn ours(backend: Backend, setup: &Setup) -> String {
    match (backend, setup) {
        (Backend::Iptables, Setup::Inpod(cfg)) => {
            inpod_restore(cfg).into_iter().map(|(_, t)| t).collect()
        }
        (Backend::Nftables, Setup::Inpod(cfg)) => inpod_ruleset(cfg).render(),
        (Backend::Iptables, Setup::Host { ipv6, probe_v6, .. }) => {
            let cfg = InpodConfig {
                ipv6: *ipv6,
                probe_snat_v6: *probe_v6,
                ..InpodConfig::default()
            };
            let mut text = restore_text(&host_probe_rules(&cfg, Family::V4));
            if *ipv6 {
                text += &restore_text(&host_probe_rules(&cfg, Family::V6));
            }
            text
        }
        (
            Backend::Nftables,
            Setup::Host {
                ipv6,
                probe_v6,
                kubelet_uid,
            },
        ) => host_ruleset(&HostProbeConfig {
            kubelet_uid: *kubelet_uid,
            ipv6: *ipv6,
            probe_snat_v4: PROBE_SNAT_V4,
            probe_snat_v6: *probe_v6,
        })
        .render(),
    }
}

/// The transaction Istio's nftables set manager runs before the host rules: the table, and a
/// probe set per family with Istio's comment.
fn istio_set_transaction(ipv6: bool) -> Vec<String> {
    let mut out = vec![format!("add table inet {NAT_TABLE}")];
    for (v6, key) in [(false, "ipv4_addr"), (true, "ipv6_addr")] {
        if v6 && !ipv6 {
            continue;
        }
        out.push(format!(
            "add set inet {NAT_TABLE} {} {{ type {key} ; comment \"{PROBE_SET_COMMENT}\" ; }}",
            probe_set_name(v6)
        ));
    }
    out
}

/// One nft line in a single spelling: whitespace runs collapsed, packet-mark matches as
/// `mark and`.
fn nft_spelling(line: &str) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut out: Vec<&str> = Vec::with_capacity(words.len());
    let mut i = 0;
    while i < words.len() {
        if words[i] == "meta"
            && words.get(i + 1) == Some(&"mark")
            && matches!(words.get(i + 2), Some(&"&") | Some(&"and"))
        {
            out.extend(["mark", "and"]);
            i += 3;
        } else {
            out.push(words[i]);
            i += 1;
        }
    }
    out.join(" ")
}

/// Istio's golden and ours, as the lines to compare.
fn compared_lines(
    backend: Backend,
    setup: &Setup,
    golden: &str,
) -> Result<(Vec<String>, Vec<String>), String> {
    let ours = ours(backend, setup);
    match backend {
        Backend::Iptables => {
            let families = istio_pin::iptables_golden_families(golden)?;
            let istio = families.concat().lines().map(String::from).collect();
            Ok((istio, ours.lines().map(String::from).collect()))
        }
        Backend::Nftables => {
            let mut istio = Vec::new();
            if let Setup::Host { ipv6, .. } = setup {
                istio.extend(istio_set_transaction(*ipv6));
            }
            istio.extend(golden.lines().map(String::from));
            let istio = istio.iter().map(|l| nft_spelling(l)).collect();
            Ok((istio, ours.lines().map(nft_spelling).collect()))
        }
    }
}

/// The lines only one side has, spelt as the allowlist lists them.
fn line_diff(istio: &[String], ours: &[String]) -> Vec<String> {
    istio_module::line_diff(istio, ours)
        .into_iter()
        .map(|(side, line)| match side {
            OnlyIn::Istio => format!("istio only: {line}"),
            OnlyIn::Ours => format!("ours only: {line}"),
        })
        .collect()
}

/// One difference found: the golden (`<backend>/<file>`) and the line only one side has.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Difference {
    case: String,
    difference: String,
}

fn load_allowlist() -> Vec<Allowed> {
    istio_module::allowlist("ambient_rules")
}

/// Problems left after the allowlist: differences it does not list, entries that match
/// nothing found (stale), entries without a reason.
fn judge(found: &[Difference], allowed: &[Allowed]) -> Vec<String> {
    let mut problems = Vec::new();
    for d in found {
        if !allowed
            .iter()
            .any(|a| a.case == d.case && a.difference == d.difference)
        {
            problems.push(format!("{}: {}", d.case, d.difference));
        }
    }
    for a in allowed {
        if a.why.trim().is_empty() {
            problems.push(format!(
                "allowlist entry {}: {:?} gives no why",
                a.case, a.difference
            ));
        }
        if !found
            .iter()
            .any(|d| a.case == d.case && a.difference == d.difference)
        {
            problems.push(format!(
                "stale allowlist entry (no longer occurs, remove it): {}: {}",
                a.case, a.difference
            ));
        }
    }
    problems
}

#[test]
fn ambient_rules_match_istio_goldens() {
    let module = istio_pin::module_dir();
    let mut problems = Vec::new();
    let mut found = Vec::new();
    let mut compared = 0;
    for backend in Backend::ALL {
        let files = istio_pin::golden_files(&module, backend);
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        for want in istio_pin::expected_goldens() {
            if !names.contains(&want.as_str()) {
                problems.push(format!(
                    "case {}/{want} has no golden in {}: renamed or removed upstream?",
                    backend.label(),
                    backend.golden_dir()
                ));
            }
        }
        for (name, path) in &files {
            let case = format!("{}/{name}", backend.label());
            let Some(setup) = istio_pin::setup(backend, name) else {
                problems.push(format!(
                    "no case maps to golden {case} ({}): read Istio's test that writes it and \
                     add its configuration to tests/support/istio_pin.rs",
                    path.display()
                ));
                continue;
            };
            let golden =
                std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            match compared_lines(backend, &setup, &golden) {
                Ok((istio, ours)) => {
                    compared += 1;
                    found.extend(line_diff(&istio, &ours).into_iter().map(|difference| {
                        Difference {
                            case: case.clone(),
                            difference,
                        }
                    }));
                }
                Err(e) => problems.push(format!("{case}: cannot read the golden: {e}")),
            }
        }
    }
    problems.extend(judge(&found, &load_allowlist()));
    assert!(
        problems.is_empty(),
        "ambient rules differ from istio.io/istio@{} ({} goldens compared; fix ours, or list a \
         deliberate QUIRK fix under ambient_rules: in {ALLOWLIST}):\n{}",
        istio_module::pinned_version(),
        compared,
        problems.join("\n")
    );
    assert_eq!(
        compared,
        2 * istio_pin::expected_goldens().len(),
        "every expected golden of both backends compared"
    );
    eprintln!(
        "{compared} Istio goldens compared, {} allowlisted differences",
        found.len()
    );
}

#[test]
fn allowlist_file_parses() {
    let allowed = load_allowlist();
    for a in &allowed {
        assert!(
            a.case.starts_with("iptables/") || a.case.starts_with("nftables/"),
            "{a:?}"
        );
    }
}

fn lines(text: &str) -> Vec<String> {
    text.lines().map(String::from).collect()
}

#[test]
fn line_diff_names_what_either_side_lacks_and_reordering() {
    let istio = lines("a\nb\nc\nd");
    assert_eq!(line_diff(&istio, &istio), Vec::<String>::new());
    assert_eq!(
        line_diff(&istio, &lines("a\nc\nd\ne")),
        ["istio only: b", "ours only: e"]
    );
    // Swapped lines are a difference even though both sides have them.
    let swapped = line_diff(&istio, &lines("a\nc\nb\nd"));
    assert_eq!(swapped.len(), 2, "{swapped:?}");
    assert!(swapped.iter().any(|d| d.starts_with("istio only: ")));
    assert!(swapped.iter().any(|d| d.starts_with("ours only: ")));
    assert_eq!(line_diff(&istio, &[]).len(), 4);
}

#[test]
fn allowlist_takes_listed_differences_and_fails_unlisted_and_stale_ones() {
    let d = |case: &str, difference: &str| Difference {
        case: case.into(),
        difference: difference.into(),
    };
    let a = |case: &str, difference: &str, why: &str| Allowed {
        case: case.into(),
        difference: difference.into(),
        why: why.into(),
    };
    let found = [
        d("iptables/default.golden", "ours only: x"),
        d("iptables/default.golden", "istio only: y"),
    ];
    let allowed = [a("iptables/default.golden", "ours only: x", "QUIRK: x")];
    assert_eq!(
        judge(&found, &allowed),
        ["iptables/default.golden: istio only: y"]
    );
    // The same difference in another golden is not covered.
    assert_eq!(
        judge(&[d("nftables/default.golden", "ours only: x")], &allowed).len(),
        2
    );
    // Fixed since: the entry is stale.
    let stale = judge(&[], &allowed);
    assert_eq!(stale.len(), 1);
    assert!(stale[0].starts_with("stale allowlist entry"), "{stale:?}");
    // No reason given.
    let found = [d("iptables/default.golden", "ours only: x")];
    assert_eq!(
        judge(&found, &[a("iptables/default.golden", "ours only: x", " ")]).len(),
        1
    );
}

#[test]
fn allowlist_reads_only_its_own_key() {
    let text = "sidecar_rules:\n  - anything: 1\nambient_rules:\n  - case: iptables/ingress.golden\n    \
         difference: 'ours only: -A X'\n    why: QUIRK\n";
    assert_eq!(
        istio_module::parse_allowlist(text, "ambient_rules")
            .unwrap()
            .len(),
        1
    );
    assert!(
        istio_module::parse_allowlist("installer: []\n", "ambient_rules")
            .unwrap()
            .is_empty()
    );
    // A misspelt field is an error, not a silently ignored entry.
    assert!(
        istio_module::parse_allowlist(
            "ambient_rules:\n  - case: a\n    diference: b\n    why: c\n",
            "ambient_rules"
        )
        .is_err()
    );
}

#[test]
fn nft_spelling_changes_only_spelling() {
    assert_eq!(
        nft_spelling(
            "meta mark & 0xfff == 0x539 counter ct mark set ct mark & 0xfffff000 |  0x111"
        ),
        "mark and 0xfff == 0x539 counter ct mark set ct mark & 0xfffff000 | 0x111"
    );
    assert_eq!(
        nft_spelling("udp dport 53 meta mark and 0xfff != 0x539"),
        "udp dport 53 mark and 0xfff != 0x539"
    );
    // Statements and other keys keep their words.
    assert_eq!(
        nft_spelling("ct mark and 0xfff == 0x111 counter meta mark set ct mark"),
        "ct mark and 0xfff == 0x111 counter meta mark set ct mark"
    );
}

#[test]
fn iptables_goldens_must_start_with_the_recorded_commands() {
    let body = "* nat\n-N ISTIO_POSTRT\nCOMMIT\n";
    assert!(istio_pin::iptables_golden_families(body).is_err());
    let two = format!("iptables-save\nip6tables-save\n{body}{body}");
    assert_eq!(
        istio_pin::iptables_golden_families(&two).unwrap(),
        [body, body]
    );
    let v4 = "* mangle\nCOMMIT\n* nat\nCOMMIT\n* raw\nCOMMIT\n";
    let v6 = "* mangle\nCOMMIT\n* nat\nCOMMIT\n";
    let text = format!("iptables-save\nip6tables-save\n{v4}{v6}");
    assert_eq!(
        istio_pin::iptables_golden_families(&text).unwrap(),
        [v4, v6]
    );
}
