//! churn: the churn harness of issue #14 (`scripts/churn`) on the emulated node, or with
//! `--real-node` on a real kubelet + containerd node (`scripts/real-node`). Pod create/delete
//! cycles with random faults, invariants checked throughout; prints the report as a markdown
//! table (for RELIABILITY.md) and exits 1 on any invariant violation. Root only.
//! Test tooling (`testing` feature), never shipped.

use std::process::ExitCode;

use clap::Parser;

use testbed::churn::{ChurnConfig, FaultKind, emulated, real};
use testbed::node::Backend;

#[derive(Parser)]
#[command(about = "pod churn with fault injection on the emulated node or a real node")]
struct Args {
    /// On a real node (kubelet, containerd: scripts/real-node) with our chart, instead of the
    /// emulated node. Needs the node binaries and images (scripts/churn builds them).
    #[arg(long)]
    real_node: bool,
    #[arg(long, default_value_t = 1000)]
    cycles: u64,
    /// Seed of the schedule of actions and faults (default: from the clock; always printed).
    #[arg(long)]
    seed: Option<u64>,
    /// The emulated node's backend (the real node's values choose nftables).
    #[arg(long, value_parser = ["nftables", "iptables"], default_value = "nftables")]
    backend: String,
    /// Live pods kept while churning.
    #[arg(long, default_value_t = 12)]
    population: usize,
    /// Only these faults, by the names the report prints (comma-separated, e.g.
    /// `ApiErrorBurst,ApiSlowAnswers,ApiConnectionReset,ApiRestart`); default: every fault the
    /// node supports.
    #[arg(long, value_delimiter = ',', value_parser = parse_fault)]
    faults: Vec<FaultKind>,
}

fn parse_fault(name: &str) -> Result<FaultKind, String> {
    FaultKind::ALL
        .into_iter()
        .find(|k| format!("{k:?}") == name)
        .ok_or_else(|| format!("unknown fault {name:?}; one of {:?}", FaultKind::ALL))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !nix::unistd::geteuid().is_root() {
        eprintln!("churn needs root (network and mount namespaces)");
        return ExitCode::from(2);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,testbed::churn=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let on = if args.real_node {
        "the real node"
    } else {
        "the emulated node"
    };
    eprintln!("churn: {} cycles on {on}, seed {seed}", args.cycles);
    let mut cfg = ChurnConfig::new(args.cycles, seed);
    cfg.population = args.population;
    cfg.kinds = (!args.faults.is_empty()).then_some(args.faults);
    let backend = match args.backend.as_str() {
        "iptables" => Backend::Iptables,
        _ => Backend::Nftables,
    };
    let report = if args.real_node {
        real::run_real(&cfg)
    } else {
        emulated::run_emulated(&cfg, backend)
    };
    println!("{}", report.markdown());
    if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
