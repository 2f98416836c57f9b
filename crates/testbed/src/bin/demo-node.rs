//! demo-node: a whole ambient node on this machine, from scratch, then torn down again.
//!
//! A real kube-apiserver and etcd, the real `install-cni` agent (installer + ambient agent), Debian's
//! bridge CNI chained with our `istio-cni` by the installer, pods as network namespaces created
//! through that chain, and a ztunnel-like peer that proxies every enrolled pod's traffic. Test
//! tooling (crate `testbed`), run by `scripts/demo`; never shipped.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use testbed::node::{Backend, TestNode, TestPod, app_request, serve_hello};
use testbed::zds_peer::{PeerConfig, PodProxies, ZdsPeer};

#[derive(Parser)]
#[command(about = "Run a demo ambient node on this machine (root), then clean up")]
struct Args {
    /// Leave the node running (until Ctrl-C) and print how to explore it.
    #[arg(long)]
    keep: bool,
    /// In-pod rule backend.
    #[arg(long, default_value = "nftables", value_parser = ["iptables", "nftables"])]
    backend: String,
    /// Ambient pods to create.
    #[arg(long, default_value_t = 3)]
    pods: usize,
}

const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");
const APP_PORT: u16 = 8080;

struct Row {
    pod: TestPod,
    add: Duration,
}

fn step(msg: &str) {
    println!("==> {msg}");
}

async fn table(node: &TestNode, peer: &ZdsPeer, rows: &[Row]) {
    let status = peer.status();
    println!(
        "{:<18} {:<12} {:<12} {:<9} {:>11} {:>9}",
        "POD", "IP", "REDIRECTION", "BACKEND", "PROXY CONNS", "CNI ADD"
    );
    for r in rows {
        let annotation = node.redirection(&r.pod).await.unwrap_or_else(|| "-".into());
        let conns = status
            .workloads
            .get(&r.pod.uid)
            .map_or("-".to_string(), |w| w.connections.to_string());
        let backend = if annotation == "enabled" {
            format!("{:?}", node.backend).to_lowercase()
        } else {
            "-".into()
        };
        println!(
            "{:<18} {:<12} {:<12} {:<9} {:>11} {:>7.1}ms",
            format!("{}/{}", r.pod.namespace, r.pod.name),
            r.pod.ip.map_or("-".to_string(), |ip| ip.to_string()),
            annotation,
            backend,
            conns,
            r.add.as_secs_f64() * 1000.0
        );
    }
}

/// Every pod asks the next one (and the plain pod asks the first ambient pod).
fn traffic(rows: &[Row]) {
    for (i, r) in rows.iter().enumerate() {
        let to = &rows[(i + 1) % rows.len()].pod;
        match app_request(&r.pod, to, APP_PORT) {
            Ok(answer) => println!(
                "    {} -> {}:{APP_PORT}  {}",
                r.pod.name,
                to.name,
                answer.trim()
            ),
            Err(e) => println!("    {} -> {}:{APP_PORT}  FAILED: {e}", r.pod.name, to.name),
        }
    }
}

async fn run(args: Args) {
    let backend = if args.backend == "iptables" {
        Backend::Iptables
    } else {
        Backend::Nftables
    };
    step("starting kube-apiserver + etcd, and the install-cni agent (installer + ambient agent)");
    let node = TestNode::start(backend).await;
    step("starting a ztunnel-like peer on the agent's ZDS socket");
    let mut cfg = PeerConfig::new(node.path("zt/ztunnel.sock"));
    cfg.proxies = Some(Arc::new(PodProxies));
    cfg.max_backoff = Duration::from_millis(200);
    let peer = ZdsPeer::start(cfg);
    peer.wait_for("snapshot", Duration::from_secs(10), |s| s.snapshot_received)
        .await
        .expect("peer synced");

    step("creating namespace demo (istio.io/dataplane-mode=ambient) and namespace plain");
    node.create_namespace("demo", &[AMBIENT]).await;
    node.create_namespace("plain", &[]).await;
    let mut rows = Vec::new();
    let names: Vec<(String, String)> = (1..=args.pods)
        .map(|i| ("demo".to_string(), format!("app-{i}")))
        .chain(std::iter::once(("plain".to_string(), "web-1".to_string())))
        .collect();
    for (ns, name) in names {
        let started = Instant::now();
        let (pod, result) = node.create_pod(&ns, &name, &[]).await;
        let add = started.elapsed();
        if let Err(e) = result {
            panic!("CNI ADD of {ns}/{name} failed: {e}\n{}", node.agent_log());
        }
        serve_hello(&pod, APP_PORT);
        rows.push(Row { pod, add });
    }
    // The CNI ADD time column is the whole runtime-side ADD: bridge, portmap and istio-cni (which
    // waits for rules + ztunnel ack + annotation).
    step("sending traffic between the pods");
    traffic(&rows);
    table(&node, &peer, &rows).await;

    step("removing the ambient label from namespace demo: its pods leave the mesh");
    node.label_namespace("demo", AMBIENT.0, None).await;
    for r in &rows {
        node.wait_redirection(&r.pod, None).await;
    }
    traffic(&rows);
    table(&node, &peer, &rows).await;

    if args.keep {
        step("relabelling namespace demo so you can explore an enrolled node");
        node.label_namespace("demo", AMBIENT.0, Some(AMBIENT.1))
            .await;
        let bin = testbed::node::binary_dir();
        println!("\nThe node keeps running until Ctrl-C. Try:");
        println!(
            "  CNI_AGENT_RUN_DIR={} {}/install-cni explain demo/app-1",
            node.path("run").display(),
            bin.display()
        );
        println!(
            "  ip netns exec {} nft list ruleset",
            rows[0].pod.netns.name
        );
        println!(
            "  curl -s 127.0.0.1:{}/metrics | grep istio_cni",
            node.metrics_port
        );
        println!("  curl -s 127.0.0.1:{}/readyz", node.health_port);
        println!(
            "  cat {}   # the chained CNI config",
            node.path("net.d/10-e2e.conflist").display()
        );
        println!(
            "  less {}   # the agent's log",
            node.path("agent.log").display()
        );
        std::future::pending::<()>().await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    if !nix::unistd::geteuid().is_root() {
        eprintln!("demo-node needs root (it creates network namespaces)");
        std::process::exit(1);
    }
    // Everything the demo creates is owned by values dropped when `run` returns, so an interrupt
    // that ends `run` here cleans up as a normal finish does.
    tokio::select! {
        () = run(args) => step("done; cleaning up"),
        _ = tokio::signal::ctrl_c() => step("interrupted; cleaning up"),
    }
}
