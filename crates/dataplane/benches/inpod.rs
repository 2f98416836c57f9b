//! Per-pod cost of enroll (routes + rules), verify and unenroll, for each backend, on an empty
//! node and with 250 pods already programmed: time, and the allocations each makes. Needs
//! root. `cargo bench -p dataplane` (`INPOD_BENCH_SAMPLES`, `INPOD_BENCH_BACKGROUND` adjust the
//! sizes).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cni_core::redirect::ambient::InpodConfig;
use dataplane::inpod::{InpodRules, RuleState};
use dataplane::netns::Netns;
use dataplane::nft::NftablesBackend;
use dataplane::nft::generations::Generations;
use dataplane::test_support::TestNetns;
use dataplane::{BackendOptions, RuleBackend, pod};

/// The system allocator, counting allocations: their number per operation is the part of its
/// cost that machine load cannot blur, and on musl (the agent's static build) each one takes a
/// global lock.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// `f`'s result and the allocations (and reallocations) it made.
fn counted<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    let out = f();
    (out, ALLOCATIONS.load(Ordering::Relaxed) - before)
}

fn stats(mut v: Vec<Duration>) -> String {
    v.sort();
    let pick = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    format!(
        "median {:>7.2} ms  p99 {:>7.2} ms",
        pick(0.5).as_secs_f64() * 1e3,
        pick(0.99).as_secs_f64() * 1e3
    )
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone, Copy)]
enum Op {
    Enroll,
    Verify,
    Unenroll,
}

impl Op {
    /// The operation; enroll and unenroll answer `InSync` when they succeed.
    fn run(self, netns: &Netns, cfg: &InpodConfig, b: &dyn InpodRules) -> RuleState {
        match self {
            Op::Enroll => pod::enroll(netns, cfg, b).expect("enroll"),
            Op::Verify => return pod::verify(netns, cfg, b).expect("verify"),
            Op::Unenroll => pod::unenroll(netns, cfg, b).expect("unenroll"),
        }
        RuleState::InSync
    }
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("inpod bench needs root; skipped");
        return;
    }
    let samples = env_usize("INPOD_BENCH_SAMPLES", 50);
    let background = env_usize("INPOD_BENCH_BACKGROUND", 250);
    let cfg = InpodConfig::default();
    // The agent runs its nftables backend remembering generations, on pooled namespace workers
    // (`Netns::run_detached`) that keep the desired rules and their batch between pods: its
    // verify of a pod unchanged since the enroll asks for the generation instead of reading the
    // tables back. The other rows run each operation on a thread of its own.
    let remembering: Arc<dyn InpodRules> = Arc::new(NftablesBackend::remembering(Arc::new(
        Generations::in_memory(),
    )));
    let backends = ["iptables", "nftables"].map(|name| {
        let b: Arc<dyn InpodRules> =
            Arc::new(RuleBackend::new(name, &BackendOptions::default()).expect("backend"));
        (name, b, false)
    });
    for (name, b, pooled) in
        backends
            .into_iter()
            .chain([("nftables, as the agent runs it", remembering, true)])
    {
        // One pod operation, on a pooled worker where the agent would use one.
        let run = |netns: &Arc<Netns>, op: Op| -> RuleState {
            let (b, cfg) = (b.clone(), cfg.clone());
            let job = move |netns: &Netns| op.run(netns, &cfg, b.as_ref());
            if !pooled {
                return job(netns);
            }
            let (tx, rx) = std::sync::mpsc::channel();
            netns
                .clone()
                .run_detached(job, move |r| drop(tx.send(r)))
                .expect("submit");
            rx.recv().expect("worker").expect("in the pod's namespace")
        };
        for pods_before in [0, background] {
            let others: Vec<TestNetns> = (0..pods_before).map(|_| TestNetns::new("bg")).collect();
            for ns in &others {
                run(&Arc::new(ns.open()), Op::Enroll);
            }
            let (mut apply, mut verify, mut remove) = (Vec::new(), Vec::new(), Vec::new());
            let mut allocs = [Vec::new(), Vec::new(), Vec::new()];
            // One warm-up pod so one-time costs (variant canonical form, module loads) are excluded.
            for i in 0..=samples {
                let ns = TestNetns::new("bench");
                let netns = Arc::new(ns.open());
                let t = Instant::now();
                let (_, a_allocs) = counted(|| run(&netns, Op::Enroll));
                let a = t.elapsed();
                let t = Instant::now();
                let (state, v_allocs) = counted(|| run(&netns, Op::Verify));
                let v = t.elapsed();
                assert_eq!(state, RuleState::InSync);
                let t = Instant::now();
                let (_, r_allocs) = counted(|| run(&netns, Op::Unenroll));
                let r = t.elapsed();
                if i > 0 {
                    apply.push(a);
                    verify.push(v);
                    remove.push(r);
                    for (all, n) in allocs.iter_mut().zip([a_allocs, v_allocs, r_allocs]) {
                        all.push(n);
                    }
                }
            }
            println!("{name:<8} with {pods_before:>3} pods programmed, {samples} samples:");
            let [a_allocs, v_allocs, r_allocs] = allocs.map(median);
            println!("  apply  {}  {a_allocs:>5} allocations", stats(apply));
            println!("  verify {}  {v_allocs:>5} allocations", stats(verify));
            println!("  remove {}  {r_allocs:>5} allocations", stats(remove));
        }
    }
    sandbox_cost(samples * 4);
    leftover_check_cost(samples * 4);
}

/// What looking for the other backend's rules (after a backend switch) adds to every enroll,
/// verify and unenroll, in a pod holding only the backend in use's rules: no iptables tool
/// runs then, only the cheap gates.
fn leftover_check_cost(samples: usize) {
    use dataplane::leftovers::Previous;
    let cfg = InpodConfig::default();
    let (mut on_nft, mut on_ipt) = (Vec::new(), Vec::new());
    let (mut allocs_nft, mut allocs_ipt) = (Vec::new(), Vec::new());
    let mut other_variant = String::new();
    for (name, times, allocs) in [
        ("nftables", &mut on_nft, &mut allocs_nft),
        ("iptables", &mut on_ipt, &mut allocs_ipt),
    ] {
        let b = RuleBackend::new(name, &BackendOptions::default()).expect("backend");
        // As the agent's node dataplane looks: an iptables node also for the other variant.
        let previous = Previous::of(&b);
        if let Previous::NftablesAnd(other) = &previous {
            other_variant = other.names();
        }
        let ns = TestNetns::new("bench-left");
        let netns = ns.open();
        pod::enroll(&netns, &cfg, &b).expect("enroll");
        for _ in 0..samples {
            let t = Instant::now();
            let (found, n) = counted(|| previous.in_pod(&netns).expect("previous backend check"));
            times.push(t.elapsed());
            allocs.push(n);
            assert!(!found, "{name} pod has no rules of the other backend");
        }
    }
    println!("previous-backend check in an enrolled pod, {samples} samples:");
    println!(
        "  nftables node (iptables gates) {}  {:>5} allocations",
        stats(on_nft),
        median(allocs_nft)
    );
    println!(
        "  iptables node (nftables read, {} gate) {}  {:>5} allocations",
        other_variant,
        stats(on_ipt),
        median(allocs_ipt)
    );
}

/// What the xtables sandbox (a private mount namespace per iptables child) adds to starting a
/// child in a pod namespace: `/bin/true` both ways, interleaved so machine load hits both alike.
fn sandbox_cost(samples: usize) {
    let ns = TestNetns::new("bench-sandbox");
    let netns = ns.open();
    let (mut plain, mut sandboxed) = (Vec::new(), Vec::new());
    for _ in 0..samples {
        let t = Instant::now();
        let mut cmd = std::process::Command::new("true");
        netns.spawn(&mut cmd).unwrap().wait().unwrap();
        plain.push(t.elapsed());
        let t = Instant::now();
        let mut cmd = std::process::Command::new("true");
        dataplane::iptables::sandbox::spawn(&netns, &mut cmd, None)
            .unwrap()
            .wait()
            .unwrap();
        sandboxed.push(t.elapsed());
    }
    println!("child start in a pod netns, {samples} samples:");
    println!("  plain     {}", stats(plain));
    println!("  sandboxed {}", stats(sandboxed));
}
