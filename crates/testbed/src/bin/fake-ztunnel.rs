//! fake-ztunnel: the test kit's ztunnel-like ZDS peer as a process, for the demo and for tests
//! that need a peer to crash or exit like ztunnel. Never shipped (`testing` feature only).
//!
//! Exits 1 on a ZDS protocol violation (as ztunnel does) and 0 on SIGTERM/SIGINT. Its view of
//! the world is written as JSON to `--status-file` after every message and every second: each
//! workload with the connections its in-pod listeners accepted (`accepted`: listener `port`,
//! `peer` address, `original_dst`), so a test on any node can tell which pod's proxy took a
//! connection, from where and to where.
//!
//! `--control-file` steers a running peer (the real node's churn faults): the file's first line,
//! read every 200 ms, is how Adds are answered from then on: `ack`, `nack TEXT`, `delay MS`
//! (ack late) or `crash` (drop the connection instead); a second line `disconnect N` resets the
//! connection each time N changes. A missing file is `ack`.
//!
//! Run as Istio's `ztunnel` chart runs ztunnel's image (arguments `proxy ztunnel`, the file
//! paths from the chart's `env` values), the peer also answers the chart's readiness probe,
//! `GET /healthz/ready` on `:15021`, as ztunnel does: 200 once the agent's snapshot arrived and
//! no Add is pending, else 503. So Istio's installers (`istioctl install`, the `ambient`
//! chart) roll it out as their ztunnel.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use std::sync::Arc;

use testbed::zds_peer::{AddReply, PeerConfig, PeerControl, PodProxies, ZdsPeer};

#[derive(Parser)]
#[command(about = "ztunnel-like ZDS client for tests")]
struct Args {
    /// The agent's ZDS socket (ztunnel's INPOD_UDS).
    #[arg(long, env = "INPOD_UDS", default_value = cni_agent::zds::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Where to write the JSON status.
    #[arg(long, env = "FAKE_ZTUNNEL_STATUS_FILE")]
    status_file: Option<PathBuf>,
    /// Nack Adds for a UID with this text: `--nack UID=TEXT` (repeatable; `*` for every UID).
    #[arg(long, value_parser = parse_nack)]
    nack: Vec<(String, String)>,
    /// Do not start the in-pod listeners (15001/15006/15008/15053) for Adds.
    #[arg(long)]
    no_proxies: bool,
    /// Cap of the reconnect backoff, in milliseconds.
    #[arg(long, env = "FAKE_ZTUNNEL_MAX_BACKOFF_MS", default_value_t = 15_000)]
    max_backoff_ms: u64,
    /// Answers to Adds and connection resets, changed at run time (see the module docs).
    #[arg(long, env = "FAKE_ZTUNNEL_CONTROL_FILE")]
    control_file: Option<PathBuf>,
    /// ztunnel's own command line, `proxy ztunnel`, as Istio's chart passes it: also serve
    /// ztunnel's readiness probe (see the module docs).
    #[arg(value_parser = ["proxy", "ztunnel"])]
    ztunnel_command: Vec<String>,
}

/// ztunnel's readiness port and path (Istio's `ztunnel` chart probes them).
const READINESS_ADDR: &str = "0.0.0.0:15021";
const READINESS_PATH: &str = "/healthz/ready";

/// Answers ztunnel's readiness probe from the peer's status: ready once the snapshot arrived and
/// nothing is pending. One request per connection, as kubelet's probes are.
async fn serve_readiness(listener: tokio::net::TcpListener, peer: PeerControl) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            continue;
        };
        let ready = peer.status().ready;
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let n = conn.read(&mut buf).await.unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]);
            let status = match head.split_whitespace().nth(1) {
                Some(READINESS_PATH) if ready => "200 OK",
                Some(READINESS_PATH) => "503 Service Unavailable",
                _ => "404 Not Found",
            };
            let reply =
                format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            let _ = conn.write_all(reply.as_bytes()).await;
        });
    }
}

/// What a control file asks for.
#[derive(Debug, PartialEq)]
struct Control {
    reply: AddReply,
    disconnect: Option<u64>,
}

fn parse_control(text: &str) -> Result<Control, String> {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("ack");
    let (word, rest) = first.split_once(' ').unwrap_or((first, ""));
    let reply = match word {
        "ack" => AddReply::Ack,
        "nack" if !rest.is_empty() => AddReply::Nack(rest.to_string()),
        "delay" => AddReply::Delay(Duration::from_millis(
            rest.parse()
                .map_err(|_| format!("delay needs milliseconds, not {rest:?}"))?,
        )),
        "crash" => AddReply::Crash,
        _ => {
            return Err(format!(
                "unknown answer {first:?} (ack, nack TEXT, delay MS, crash)"
            ));
        }
    };
    let disconnect = match lines.next() {
        None => None,
        Some(l) => Some(
            l.strip_prefix("disconnect ")
                .and_then(|n| n.trim().parse().ok())
                .ok_or_else(|| format!("expected `disconnect N`, not {l:?}"))?,
        ),
    };
    Ok(Control { reply, disconnect })
}

/// Applies the control file whenever it changes; a bad one is logged and changes nothing.
async fn follow_control(path: PathBuf, peer: PeerControl) {
    let mut last_text = None;
    let mut last_disconnect = None;
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if last_text.as_ref() != Some(&text) {
            match parse_control(&text) {
                Ok(c) => {
                    tracing::info!(reply = ?c.reply, disconnect = ?c.disconnect, "control file applied");
                    peer.set_add_reply(None, c.reply);
                    if last_disconnect.is_some() && c.disconnect != last_disconnect {
                        peer.disconnect();
                    }
                    last_disconnect = c.disconnect;
                }
                Err(e) => eprintln!("fake-ztunnel: {}: {e}; ignored", path.display()),
            }
            last_text = Some(text);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
    let _readiness = if args.ztunnel_command.is_empty() {
        None
    } else {
        let listener = tokio::net::TcpListener::bind(READINESS_ADDR)
            .await
            .unwrap_or_else(|e| panic!("fake-ztunnel: cannot listen on {READINESS_ADDR}: {e}"));
        Some(tokio::spawn(serve_readiness(listener, peer.control())))
    };
    let _control = args
        .control_file
        .map(|path| tokio::spawn(follow_control(path, peer.control())));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_files_are_parsed_or_refused() {
        let ok = |text: &str| parse_control(text).unwrap();
        assert_eq!(ok("").reply, AddReply::Ack);
        assert_eq!(
            ok("nack no proxy\n").reply,
            AddReply::Nack("no proxy".into())
        );
        assert_eq!(
            ok("delay 1500").reply,
            AddReply::Delay(Duration::from_millis(1500))
        );
        assert_eq!(
            ok("crash\ndisconnect 3"),
            Control {
                reply: AddReply::Crash,
                disconnect: Some(3)
            }
        );
        for bad in ["nack", "delay soon", "maybe", "ack\nreconnect"] {
            assert!(parse_control(bad).is_err(), "{bad:?}");
        }
    }
}
