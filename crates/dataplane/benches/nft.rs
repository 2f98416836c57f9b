//! Per-pod cost of the nftables backend in one fresh namespace: apply (alone, and together with
//! the policy routes as an enrollment does), verify and remove. Needs root; prints median and p99.
//!
//! `cargo bench -p dataplane --bench nft` (`NFT_BENCH_RUNS` overrides the 300 runs).

use std::time::{Duration, Instant};

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::nft::inpod_ruleset;
use dataplane::inpod::{InpodRules, RuleState};
use dataplane::nft::{NftablesBackend, with_socket};
use dataplane::routes;
use dataplane::test_support::TestNetns;

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let pct = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    println!(
        "{name:<38} n={:<4} median {:>8.1} µs   p99 {:>8.1} µs",
        samples.len(),
        pct(0.5).as_secs_f64() * 1e6,
        pct(0.99).as_secs_f64() * 1e6
    );
}

fn measure(runs: usize, mut f: impl FnMut()) -> Vec<Duration> {
    for _ in 0..runs / 10 {
        f();
    }
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect()
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("nft bench needs root (network namespaces); skipped");
        return;
    }
    let runs: usize = std::env::var("NFT_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let ns = TestNetns::new("nft-bench");
    let netns = ns.open();
    let backend = NftablesBackend::new();
    let cfg = InpodConfig::default();

    // Enrollment programs a namespace that has never seen our rules: a new netns per run
    // (all created before the timing, and deleted after it, so the kernel's namespace setup and
    // teardown work does not run during the measurement).
    let fresh: Vec<TestNetns> = (0..2 * runs).map(|_| TestNetns::new("nft-bench")).collect();
    let (rules_only, with_routes) = fresh.split_at(runs);
    let mut samples = Vec::with_capacity(runs);
    for ns in rules_only {
        let netns = ns.open();
        let t = Instant::now();
        backend.apply(&netns, &cfg).unwrap();
        samples.push(t.elapsed());
    }
    report("apply, new netns (rules)", samples);
    let mut samples = Vec::with_capacity(runs);
    for ns in with_routes {
        let netns = ns.open();
        let t = Instant::now();
        routes::apply(&netns, cfg.ipv6).unwrap();
        backend.apply(&netns, &cfg).unwrap();
        samples.push(t.elapsed());
    }
    report("apply, new netns (rules+routes)", samples);
    drop(fresh);

    // Programming the same namespace again waits for the kernel to finish freeing what the
    // previous transaction replaced (see `nft::close_later`).

    report(
        "re-apply, same netns (rules)",
        measure(runs, || backend.apply(&netns, &cfg).unwrap()),
    );
    report(
        "re-apply, same netns (rules+routes)",
        measure(runs, || {
            routes::apply(&netns, cfg.ipv6).unwrap();
            backend.apply(&netns, &cfg).unwrap();
        }),
    );
    report(
        "verify",
        measure(runs, || {
            assert_eq!(backend.verify(&netns, &cfg).unwrap(), RuleState::InSync)
        }),
    );
    report(
        "remove",
        measure(runs, || backend.remove(&netns, &cfg).unwrap()),
    );
    // The kernel batch alone, without the per-call netns thread and socket setup.
    let batch_only = with_socket(&netns, |sock| {
        Ok(measure(runs, || {
            NftablesBackend::apply_batch(&inpod_ruleset(&cfg))
                .commit(sock)
                .unwrap()
        }))
    })
    .unwrap();
    report("apply batch only (socket reused)", batch_only);
}
