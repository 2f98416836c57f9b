//! The `install-cni` command line: subcommands, logging setup and signal handling. `main.rs` only
//! calls [`main`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::ambient::config::{AmbientArgs, AmbientConfig};
use crate::config::{self, ProcessEnv};
use crate::install::Installer;
use crate::install::config::{ConfMode, InstallArgs, InstallConfig};
use crate::logging::LogArgs;

/// Istio CNI node agent (installer).
#[derive(Parser, Debug)]
#[command(name = "install-cni", version)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub install: InstallArgs,
    #[command(flatten)]
    pub log: LogArgs,
    #[command(flatten)]
    pub ambient: AmbientArgs,
    #[command(flatten)]
    pub repair: crate::repair::RepairArgs,
}

/// Without a subcommand the agent runs until SIGTERM/SIGINT, then cleans up.
#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Install the plugin and keep it installed (`--once`: one pass, print the config path, exit).
    Install {
        #[arg(long)]
        once: bool,
    },
    /// Remove the plugin, its CNI config entry and its kubeconfig from this node.
    Uninstall,
    /// Print the version.
    Version,
    /// Why is (or isn't) a pod meshed: asks the running agent on this node.
    Explain {
        /// `<namespace>/<pod>`
        #[arg(required_unless_present = "node", conflicts_with = "node")]
        pod: Option<String>,
        /// Every pod the agent watches on this node: meshed or why not, and the last add error.
        #[arg(long)]
        node: bool,
        /// `text` or `json`.
        #[arg(short = 'o', long = "output", default_value = "text", value_parser = ["text", "json"])]
        output: String,
    },
    /// Program, verify or remove pod/host redirection by hand.
    Dataplane(crate::dataplane_cli::DataplaneArgs),
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; running until killed");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}

/// Runs the parsed command.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    if cli.command == Some(Command::Version) {
        println!("install-cni {}", env!("CARGO_PKG_VERSION"));
        return Ok(());
    }
    if let Some(Command::Explain { pod, node, output }) = &cli.command {
        use crate::ambient::explain;
        let subject = explain::Subject::new(pod.as_deref(), *node)?;
        let socket = cli
            .install
            .cni_agent_run_dir
            .join(crate::agent::DEBUG_SOCKET);
        print!(
            "{}",
            explain::explain(&socket, &subject, output == "json").await?
        );
        return Ok(());
    }
    let cfg = InstallConfig::from_args(&cli.install, &cli.log)?;
    if cli.command.is_none() {
        return run_agent(cli, cfg).await;
    }
    cfg.log("installer configuration");
    let run_dir = cfg.run_dir.clone();
    let mut installer = Installer::new(cfg);
    match cli.command {
        Some(Command::Install { once: true }) => {
            let path = tokio::select! {
                r = installer.install_all() => r?,
                _ = shutdown_signal() => anyhow::bail!("interrupted before the install completed"),
            };
            println!("{}", path.display());
        }
        Some(Command::Uninstall) => {
            crate::ambient::hints::NetnsHints::new(&run_dir).clear();
            installer.uninstall()?;
        }
        _ => {
            let result = tokio::select! {
                r = installer.run() => r,
                _ = shutdown_signal() => Ok(()),
            };
            let cleaned = installer.cleanup();
            result?;
            cleaned?;
        }
    }
    Ok(())
}

/// The DaemonSet's process: installer, health and metrics, and the ambient agent when enabled.
async fn run_agent(cli: Cli, mut cfg: InstallConfig) -> anyhow::Result<()> {
    let a = &cli.ambient;
    let ports = crate::agent::Ports {
        health: std::net::SocketAddr::from(([0, 0, 0, 0], a.health_port)),
        metrics: u16::try_from(a.monitoring_port)
            .ok()
            .filter(|p| *p > 0)
            .map(|p| std::net::SocketAddr::from(([0, 0, 0, 0], p))),
        peer_uids: a.allowed_peer_uids.clone(),
    };
    let ambient = if cli.install.ambient_enabled {
        // Istio's Helm chart always sets the selectors; an unset variable means Istio's default
        // rather than "nothing is ambient", and the plugin config says the same.
        let mut selectors: Vec<cni_core::enroll::EnablementSelector> =
            serde_json::from_value(cfg.entry.enablement_selectors.clone())?;
        if selectors.is_empty() {
            selectors = cni_core::enroll::default_selectors();
            cfg.entry.enablement_selectors = serde_json::to_value(&selectors)?;
        }
        let exclude = cfg.entry.exclude_namespaces.clone().unwrap_or_default();
        let ambient = AmbientConfig::from_args(a, &selectors, exclude)?;
        let client = crate::kube_client::from_environment().await?;
        Some(crate::agent::AmbientSetup {
            cfg: ambient,
            client,
            native_nftables: cli.install.native_nftables,
            pod_namespace: cli.install.pod_namespace.clone(),
            pod_name: cli.install.pod_name.clone(),
            owned_config: matches!(cfg.mode, ConfMode::Owned { .. }),
        })
    } else {
        None
    };
    // An empty REPAIR_NODE_NAME means this node (NODE_NAME), not Istio's unscheduled-pods-only.
    let repair = match crate::repair::RepairConfig::from_args(&cli.repair, a.node_name.as_deref())?
    {
        Some(cfg) => Some(crate::repair::RepairSetup {
            in_place: (cfg.action == crate::repair::RepairAction::Repair)
                .then(|| crate::repair::inplace::InPlaceRepair::from_args(&cli.install, a))
                .transpose()?,
            cfg,
            client: match &ambient {
                Some(a) => a.client.clone(),
                None => crate::kube_client::from_environment().await?,
            },
        }),
        None => None,
    };
    cfg.log("agent configuration");
    let unhonoured = a.unhonoured();
    crate::agent::run(cfg, ports, ambient, repair, unhonoured, shutdown_signal()).await
}

/// Process entry point: parse, set up logging, run on a tokio runtime.
pub fn main() -> ExitCode {
    dataplane::heap::limit_arenas(2);
    let cli: Cli = match config::parse_from(std::env::args_os(), &ProcessEnv) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Err(e) = crate::logging::init(&cli.log) {
        eprintln!("install-cni: {e}");
        return ExitCode::FAILURE;
    }
    // Synchronous and self-contained: no runtime, no installer configuration.
    if let Some(Command::Dataplane(args)) = cli.command {
        return crate::dataplane_cli::run(args).unwrap_or_else(|e| {
            eprintln!(
                "install-cni dataplane: {}",
                crate::logging::describe_error(&e)
            );
            ExitCode::from(2)
        });
    }
    // Netns work runs on blocking threads. Two keep a 2-core node's rule transactions going (100
    // ADDs at once still take ~0.3 s), while every pool thread kept alive by periodic work holds
    // its stack and glibc's per-thread cache: at 16 threads that was 1.4 MiB of RSS.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("install-cni: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(cli));
    // No pod work after this: the next agent may take over.
    drop(runtime);
    crate::handover::release();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{}", crate::logging::describe_error(&e));
            ExitCode::FAILURE
        }
    }
}
