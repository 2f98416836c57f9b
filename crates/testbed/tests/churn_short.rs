//! The churn harness (`scripts/churn`) cut to 30 cycles for CI: pods created and deleted on the
//! emulated node while the agent is killed (also mid-ADD), the peer nacks, acks late, crashes and
//! restarts, the API server restarts and answers 429/5xx, another writer rewrites the CNI config
//! and the run dir is full, with zero invariant violations. Root only; `CHURN_SEED` replays a run.
//! Own main (harness = false): the private mount namespace must be made before any thread starts.

use testbed::churn::{ChurnConfig, emulated};
use testbed::node::Backend;

fn main() {
    if !dataplane::test_support::can_run_privileged() {
        eprintln!("churn_short: needs root; skipped");
        return;
    }
    let seed = std::env::var("CHURN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(14);
    let mut cfg = ChurnConfig::new(30, seed);
    // Short runs meet every kind of fault only when faults are frequent.
    cfg.fault_percent = 60;
    cfg.quiet_every = 10;
    eprintln!("churn_short: seed {seed}");
    let report = emulated::run_emulated(&cfg, Backend::Nftables);
    println!("{}", report.markdown());
    assert!(
        report.violations.is_empty(),
        "churn violations (seed {seed}): {:#?}",
        report.violations
    );
    assert_eq!(report.pods_created, 30);
    assert!(
        report.faults.values().sum::<u64>() >= 10,
        "too few faults: {:?}",
        report.faults
    );
}
