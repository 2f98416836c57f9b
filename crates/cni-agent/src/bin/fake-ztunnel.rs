//! fake-ztunnel: the test kit's ztunnel-like ZDS peer as a process, for the demo and for tests
//! that need a peer to crash or exit like ztunnel. Never shipped (`testing` feature only).
//!
//! Exits 1 on a ZDS protocol violation (as ztunnel does) and 0 on SIGTERM/SIGINT. Its view of
//! the world is written as JSON to `--status-file` after every message.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use std::sync::Arc;

use cni_agent::testing::zds_peer::{AddReply, PeerConfig, PodProxies, ZdsPeer};

#[derive(Parser)]
#[command(about = "ztunnel-like ZDS client for tests")]
struct Args {
    /// The agent's ZDS socket (ztunnel's INPOD_UDS).
    #[arg(long, env = "INPOD_UDS", default_value = cni_agent::zds::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Where to write the JSON status.
    #[arg(long)]
    status_file: Option<PathBuf>,
    /// Nack Adds for a UID with this text: `--nack UID=TEXT` (repeatable; `*` for every UID).
    #[arg(long, value_parser = parse_nack)]
    nack: Vec<(String, String)>,
    /// Do not start the in-pod listeners (15001/15006/15008/15053) for Adds.
    #[arg(long)]
    no_proxies: bool,
    /// Cap of the reconnect backoff, in milliseconds.
    #[arg(long, default_value_t = 15_000)]
    max_backoff_ms: u64,
}

fn parse_nack(s: &str) -> Result<(String, String), String> {
    let (uid, text) = s.split_once('=').ok_or("expected UID=TEXT")?;
    Ok((uid.to_string(), text.to_string()))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let mut cfg = PeerConfig::new(&args.socket);
    cfg.status_file = args.status_file;
    cfg.max_backoff = Duration::from_millis(args.max_backoff_ms);
    if !args.no_proxies {
        cfg.proxies = Some(Arc::new(PodProxies));
    }
    let peer = ZdsPeer::start(cfg);
    for (uid, text) in args.nack {
        let uid = (uid != "*").then_some(uid);
        peer.set_add_reply(uid.as_deref(), AddReply::Nack(text));
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    // A process reading the status file (the real-node suite) sees connection counts through
    // the in-pod listeners within a second.
    let _publisher = peer.publish_every(Duration::from_secs(1));
    tokio::select! {
        result = peer.join() => {
            if let Err(protocol) = result {
                eprintln!("fake-ztunnel: protocol error, exiting: {protocol}");
                std::process::exit(1);
            }
        }
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
