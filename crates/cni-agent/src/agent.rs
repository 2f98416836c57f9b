//! The long-running `install-cni` process: the installer always, and in ambient mode the node
//! agent (watches, reconcile loop, plugin socket, ZDS server), plus health and metrics.
//!
//! Startup order matters for failing closed: host rules and the probe set first; the ZDS socket is
//! bound early (a ztunnel that connects waits in the backlog) but served only after the pods
//! enrolled before this start are restored, so the first ztunnel gets a complete snapshot.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dataplane::node::{NodeDataplane, NodeOptions};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot, watch};

use crate::ambient::cluster::{Annotator, Cluster, spawn_watches};
use crate::ambient::cni_server::CniServer;
use crate::ambient::config::AmbientConfig;
use crate::ambient::explain::Explainer;
use crate::ambient::mesh::{Mesh, NodeContext, Seams};
use crate::ambient::node::{forget_iptables_variant, record_iptables_variant, seams};
use crate::ambient::reconciler::{Policy, Reconciler};
use crate::handover::{AgentLock, SocketFile, Taken, Waiting};
use crate::http::{Readiness, ReadyFlag, health_router, metrics_router};
use crate::install::Installer;
use crate::install::config::InstallConfig;
use crate::metrics::Metrics;
use crate::netns_cache::NetnsCache;
use crate::uds::PeerCheckedListener;
use crate::zds::{ZdsConfig, ZdsMetrics, ZdsServer};

/// Where health and metrics are served, and who may use the local sockets.
#[derive(Clone, Debug)]
pub struct Ports {
    pub health: SocketAddr,
    pub metrics: Option<SocketAddr>,
    /// UIDs allowed on `log.sock`, `pluginevent.sock` and `debug.sock` (`SO_PEERCRED`).
    pub peer_uids: Vec<u32>,
}

fn serve_unix(
    path: &std::path::Path,
    uids: Vec<u32>,
    router: axum::Router,
    what: &'static str,
) -> anyhow::Result<SocketFile> {
    let listener = PeerCheckedListener::bind(path, uids)
        .with_context(|| format!("{what} socket {}", path.display()))?;
    let file =
        SocketFile::bound(path).with_context(|| format!("{what} socket {}", path.display()))?;
    tokio::spawn(crate::uds::serve_http1(listener, router));
    Ok(file)
}

/// Everything ambient mode needs besides the installer.
pub struct AmbientSetup {
    pub cfg: AmbientConfig,
    pub client: kube::Client,
    pub native_nftables: bool,
    /// Namespace of our DaemonSet (safe-upgrade check).
    pub pod_namespace: String,
    /// This agent's pod (safe-upgrade check), empty when not known.
    pub pod_name: String,
    /// Istio-owned CNI config mode: on an unclear shutdown, keep things in place.
    pub owned_config: bool,
}

const HOST_SETUP_ATTEMPTS: u32 = 10;
const HOST_SETUP_RETRY: Duration = Duration::from_secs(2);

async fn serve_http(
    addr: SocketAddr,
    router: axum::Router,
    what: &'static str,
) -> anyhow::Result<()> {
    let listener = bind_tcp(addr, PORT_HANDOVER)
        .await
        .with_context(|| format!("{what} on {addr}"))?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "{what} server stopped");
        }
    });
    Ok(())
}

/// How long a port held by another process is waited for.
const PORT_HANDOVER: Duration = Duration::from_secs(30);

/// Binds `addr`, waiting up to `patience` while it is in use: on the host network the previous
/// agent, started before this one was created, may still be stopping and holding it. Failing at
/// once would put this agent into the kubelet's crash-loop backoff (10 s and more) after it had
/// already taken over the sockets.
async fn bind_tcp(
    addr: SocketAddr,
    patience: Duration,
) -> std::io::Result<tokio::net::TcpListener> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut logged = false;
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < deadline =>
            {
                if !logged {
                    tracing::info!(%addr, "port in use (the previous agent still stopping?); waiting");
                    logged = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            result => return result,
        }
    }
}

/// Runs until `shutdown` completes, then cleans up as an upgrade or an uninstall requires.
/// `unhonoured`: settings given a value the agent cannot honour, named in the log and `/readyz`.
pub async fn run(
    install: InstallConfig,
    ports: Ports,
    ambient: Option<AmbientSetup>,
    repair: Option<crate::repair::RepairSetup>,
    unhonoured: Vec<String>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    metrics.set_build(if install.entry.native_nftables {
        "nftables"
    } else {
        "iptables"
    });
    let readiness = Readiness::new();
    for setting in unhonoured {
        tracing::warn!("setting not honoured: {setting}");
        readiness.unhonoured(setting);
    }
    let install_flag = readiness.condition("installer");

    let run_dir = install.run_dir.clone();
    let mut installer = Installer::new(install).count_results(metrics.installs.clone());
    let mut install_ready = installer.readiness();
    let mut install_failure = installer.failure();
    {
        let (flag, metrics) = (install_flag.clone(), metrics.clone());
        tokio::spawn(async move {
            loop {
                let ready = *install_ready.borrow_and_update();
                match install_failure.borrow_and_update().clone() {
                    Some(reason) => flag.fail(reason),
                    None => flag.set(ready),
                }
                metrics.install_ready.set(i64::from(ready));
                let changed = tokio::select! {
                    r = install_ready.changed() => r,
                    r = install_failure.changed() => r,
                };
                if changed.is_err() {
                    return;
                }
            }
        });
    }

    let (stop_tx, stop_rx) = watch::channel(false);

    let mut sockets = vec![serve_unix(
        &run_dir.join(cni_core::cmdadd::LOG_SOCKET),
        ports.peer_uids.clone(),
        crate::logsock::router(),
        "plugin log",
    )?];
    let previous = match AgentLock::take(&run_dir) {
        Ok(Taken::Free(lock)) => {
            lock.hold_until_exit();
            None
        }
        Ok(Taken::Held(waiting)) => {
            tracing::info!("the previous agent is still running; taking over alongside it");
            Some(waiting)
        }
        Err(e) => {
            tracing::warn!(error = %e, "no agent lock: a previous agent's last pods are checked only by drift checks");
            None
        }
    };
    let mut node = match ambient {
        Some(setup) => Some(
            start_ambient(
                setup,
                &run_dir,
                &ports.peer_uids,
                &metrics,
                &readiness,
                previous,
                stop_rx.clone(),
            )
            .await?,
        ),
        None => None,
    };
    if let Some(r) = repair {
        let controller =
            crate::repair::RepairController::from_setup(r, metrics.pods_repaired.clone());
        let synced = readiness.condition("repair");
        tokio::spawn(controller.run(Some(synced), stopped(stop_rx.clone())));
    }

    spawn_heap_trims();
    serve_http(ports.health, health_router(readiness.clone()), "health").await?;
    if let Some(addr) = ports.metrics {
        serve_http(addr, metrics_router(Arc::new(registry)), "metrics").await?;
    }

    let (result, requested) = tokio::select! {
        r = installer.run() => (r.map_err(anyhow::Error::from), false),
        () = shutdown => (Ok(()), true),
    };
    install_flag.set(false);

    // Only a requested stop can be an uninstall. An agent that fails (the installer's files are
    // retried in place, so a configuration error or a lost inotify instance) is restarted by the
    // kubelet: unchaining the plugin on the way out would let new ambient pods start
    // unredirected until then, so the node stays as it is (fail closed).
    let full_cleanup = requested
        && match &node {
            None => true,
            Some(n) => !n.keep_for_upgrade().await,
        };
    let _ = stop_tx.send(true);
    // A missing socket makes the plugin fail ambient pods at once (fail closed) instead of waiting.
    if let Some(n) = &mut node {
        sockets.append(&mut n.sockets);
        if let Some(checks) = n.drift_checks.take() {
            let _ = tokio::time::timeout(DRIFT_CHECK_STOP, checks).await;
        }
    }
    for socket in &sockets {
        socket.remove();
    }
    if full_cleanup {
        tracing::info!("uninstalling: removing the plugin, its config and host rules");
        if let Err(e) = installer.cleanup() {
            tracing::error!(error = %e, "installer cleanup failed");
        }
        if let Some(n) = &node {
            let dp = n.dataplane.clone();
            if let Err(e) = tokio::task::spawn_blocking(move || dp.teardown_host()).await? {
                tracing::error!(error = %e, "host cleanup failed");
            }
            if let Err(e) = forget_iptables_variant(&n.dataplane, &run_dir) {
                tracing::error!(error = %e, "cannot remove the iptables variant recorded for Istio's agent");
            }
        }
    } else if requested {
        tracing::info!(
            "upgrade or reboot: leaving the plugin and host rules in place (new ambient pods wait for the new agent)"
        );
    } else {
        tracing::warn!(
            "the agent failed: leaving the plugin and host rules in place (new ambient pods wait for its restart)"
        );
    }
    // Let the ZDS server close its connections and unlink its socket.
    tokio::time::sleep(Duration::from_millis(50)).await;
    // After the servers stopped, so no ADD records one again.
    if requested && node.is_some() {
        let removed = crate::ambient::hints::NetnsHints::new(&run_dir).clear();
        tracing::info!(
            removed,
            "removed the netns hints (the next agent may not know them)"
        );
    }
    result
}

/// How often memory freed after a burst of pod operations goes back to the kernel.
const HEAP_TRIM_INTERVAL: Duration = Duration::from_secs(10);

/// A node's burst of sandboxes (a reboot, a rollout) leaves megabytes free in the allocator;
/// without a trim the agent's resident memory stays at its high-water mark.
fn spawn_heap_trims() {
    tokio::spawn(async {
        loop {
            tokio::time::sleep(HEAP_TRIM_INTERVAL).await;
            let _ = tokio::task::spawn_blocking(dataplane::heap::release_free_memory).await;
        }
    });
}

/// Beyond Istio: enrolled pods' rules, and the host's probe rules and sets, are re-verified
/// continuously, so a flushed table or a deleted rule is repaired within one interval instead of
/// leaving pods unredirected (or their probes failing) until the agent restarts. A host repair
/// that fails holds readiness false until one succeeds.
fn spawn_drift_checks(
    cluster: crate::ambient::cluster::SharedCache,
    mesh: Arc<Mesh>,
    every: Duration,
    host_ready: ReadyFlag,
    stopped: impl Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    host_ready.set(true);
    mesh.export_drift_repairs();
    tokio::spawn(async move {
        tokio::pin!(stopped);
        loop {
            // A check once begun runs to its end: its host work runs on threads of its own.
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = &mut stopped => return,
            }
            // Hints a full run dir refused, now that there may be room.
            mesh.hints.write_pending();
            match mesh.repair_host().await {
                Ok(_) => host_ready.set(true),
                Err(e) => {
                    tracing::error!(error = %e, "cannot check or repair the host probe rules");
                    host_ready.set(false);
                }
            }
            let enrolled: Vec<Arc<crate::ambient::cluster::CachedPod>> = cluster
                .read()
                .unwrap()
                .pods
                .values()
                .filter(|p| p.redirection() == cni_core::reconcile::Redirection::Enabled)
                .cloned()
                .collect();
            mesh.repair_drift(&enrolled).await;
        }
    })
}

/// The running ambient parts the shutdown path needs.
struct AmbientNode {
    dataplane: Arc<NodeDataplane>,
    client: kube::Client,
    pod_namespace: String,
    node_name: String,
    owned_config: bool,
    disable_safe_upgrade: bool,
    /// The pod watch's cache, and whether it has listed: where the shutdown looks for this
    /// agent's own pod.
    cluster: Arc<Cluster>,
    readiness: Arc<Readiness>,
    pod_name: String,
    /// The plugin event and debug sockets.
    sockets: Vec<SocketFile>,
    /// Ended before an uninstall's teardown: a check still running would put host rules back.
    drift_checks: Option<tokio::task::JoinHandle<()>>,
}

impl AmbientNode {
    async fn keep_for_upgrade(&self) -> bool {
        !self.disable_safe_upgrade
            && crate::ambient::upgrade::is_upgrade(
                &self.client,
                &self.pod_namespace,
                &self.node_name,
                self.owned_config,
                || self.own_pod(),
            )
            .await
    }

    fn own_pod(&self) -> crate::ambient::upgrade::OwnPod {
        let key = (self.pod_namespace.clone(), self.pod_name.clone());
        let cached = self
            .cluster
            .read()
            .unwrap()
            .pods
            .get(&key)
            .map(|p| p.metadata.deletion_timestamp.is_some());
        crate::ambient::upgrade::OwnPod::from_watch(
            !self.pod_name.is_empty(),
            !self.readiness.not_ready().contains(&WATCHES),
            cached,
        )
    }
}

/// The readiness condition of the pod and namespace watches' first lists.
const WATCHES: &str = "watches";
/// Resolves once a stop is requested.
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// How long a stop waits for a drift check under way to finish.
const DRIFT_CHECK_STOP: Duration = Duration::from_secs(10);

/// The readiness condition of the host's probe rules and sets, while drift checks run.
const HOST_PROBE_RULES: &str = "host probe rules";

/// `install-cni explain` asks the running agent here.
pub const DEBUG_SOCKET: &str = "debug.sock";

async fn start_ambient(
    setup: AmbientSetup,
    run_dir: &std::path::Path,
    peer_uids: &[u32],
    metrics: &Metrics,
    readiness: &Arc<Readiness>,
    previous: Option<Waiting>,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<AmbientNode> {
    let cfg = setup.cfg;
    // The watches' first lists (a TLS handshake and two LISTs) run while the host is set up:
    // their events wait in the channel until the reconciler starts. On a restart the restore
    // waits for both.
    let cluster = Arc::new(Cluster::default());
    let (tx, rx) = mpsc::unbounded_channel();
    spawn_watches(
        setup.client.clone(),
        &cfg.node_name,
        &cfg.selectors,
        cluster.clone(),
        tx.clone(),
        readiness.condition(WATCHES),
    );
    let host = if let Some(path) = &cfg.host_netns {
        dataplane::netns::Netns::open(path)?
    } else if cfg.switch_to_host_ns {
        dataplane::netns::Netns::open(cfg.host_prefix.join("proc/1/ns/net"))?
    } else {
        dataplane::netns::Netns::current()?
    };
    let host_id = host.id();
    let (nft, force, scoped_lock, inpod, proc_dir) = (
        setup.native_nftables,
        cfg.force_iptables_binary.clone(),
        cfg.scoped_xtables_locking,
        cfg.inpod.clone(),
        cfg.proc_dir.clone(),
    );
    let branch_eni = cfg.aws_branch_eni_probe;
    let journal =
        nft.then(|| crate::ambient::hints::NetnsHints::new(run_dir).generations_journal());
    let dataplane = tokio::task::spawn_blocking(move || {
        let dataplane = NodeDataplane::new(
            host,
            NodeOptions {
                backend: if nft { "nftables" } else { "iptables" },
                force_iptables: force.as_deref(),
                scoped_xtables_locking: scoped_lock,
                cfg: inpod,
                proc_dir: &proc_dir,
                aws_branch_eni: branch_eni,
            },
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok::<_, anyhow::Error>(match journal {
            Some(Ok(journal)) => dataplane.remembering_generations(journal),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "no journal of nftables generations: a restart reads every pod's rules back");
                dataplane
            }
            None => dataplane,
        })
    })
    .await??;
    if let Err(e) = record_iptables_variant(&dataplane, run_dir) {
        tracing::warn!(error = %e, "cannot record the iptables variant for Istio's agent");
    }
    let dataplane = Arc::new(dataplane);
    for attempt in 1..=HOST_SETUP_ATTEMPTS {
        let dp = dataplane.clone();
        match tokio::task::spawn_blocking(move || dp.setup_host()).await? {
            Ok(()) => {
                tracing::info!(backend = dataplane.backend(), "host probe rules in place");
                break;
            }
            Err(e) if attempt == HOST_SETUP_ATTEMPTS => anyhow::bail!("host probe rules: {e}"),
            Err(e) => {
                tracing::warn!(error = %e, attempt, "host probe rules failed; retrying");
                tokio::time::sleep(HOST_SETUP_RETRY).await;
            }
        }
    }

    let cache = Arc::new(NetnsCache::new(cfg.host_prefix.clone()));
    let zds_cfg = ZdsConfig {
        socket_path: cfg.zds_socket.clone(),
        allowed_uids: cfg.allowed_peer_uids.clone(),
        ..ZdsConfig::default()
    };
    let zds_metrics = ZdsMetrics {
        ztunnel_connected: metrics.ztunnel_connected.clone(),
        ack_latency: metrics.zds_ack_seconds.clone(),
    };
    let (zds_server, zds) = ZdsServer::bind_with_metrics(zds_cfg, cache.clone(), zds_metrics)?;

    let annotator = Annotator::new(setup.client.clone());
    let (rules, probes) = seams(dataplane.clone());
    let mesh = Arc::new(Mesh::new(
        Seams {
            rules,
            probes,
            annotations: Arc::new(annotator.clone()),
            ztunnel: Arc::new(zds.clone()),
        },
        NodeContext {
            cache,
            hints: crate::ambient::hints::NetnsHints::new(run_dir),
            global: cfg.inpod.clone(),
            proc_dir: cfg.proc_dir.clone(),
            host_prefix: cfg.host_prefix.clone(),
            host_netns: host_id,
            // As repair's (repair::inplace): the chart's cniNetnsDir mount.
            netns_dir: cfg.host_prefix.join("var/run/netns"),
        },
        metrics.clone(),
    ));
    let policy = Arc::new(Policy {
        selectors: cfg.selectors.clone(),
        exclude_namespaces: cfg.exclude_namespaces.clone(),
        system_namespace: cfg.system_namespace.clone(),
    });
    if let Some(waiting) = previous {
        tokio::spawn(await_previous_agent(waiting, tx.clone()));
    }
    let (restored_tx, restored_rx) = oneshot::channel();
    // Runs while the watches' first lists are still on their way (see `precheck_hinted`).
    let prechecks = tokio::spawn({
        let (mesh, reconcile) = (mesh.clone(), cfg.reconcile_on_startup);
        async move { mesh.precheck_hinted(reconcile).await }
    });
    let reconciler = Reconciler {
        cache: cluster.clone(),
        mesh: mesh.clone(),
        policy: policy.clone(),
        reconcile_on_startup: cfg.reconcile_on_startup,
        prechecks: Some(prechecks),
    };
    tokio::spawn(reconciler.run(rx, tx, restored_tx));

    let server = Arc::new(CniServer {
        cache: cluster.clone(),
        mesh: mesh.clone(),
        policy: policy.clone(),
        annotator,
    });
    let event_socket = serve_unix(
        &run_dir.join(cni_core::cmdadd::EVENT_SOCKET),
        peer_uids.to_vec(),
        crate::ambient::cni_server::router(server),
        "plugin event",
    )?;
    let explainer = Arc::new(Explainer {
        cache: cluster.clone(),
        mesh: mesh.clone(),
        policy,
        zds: zds.clone(),
    });
    let debug_socket = serve_unix(
        &run_dir.join(DEBUG_SOCKET),
        peer_uids.to_vec(),
        crate::ambient::explain::router(explainer),
        "debug",
    )?;
    let drift_checks = cfg.drift_check_interval.map(|every| {
        spawn_drift_checks(
            cluster.clone(),
            mesh,
            every,
            readiness.condition(HOST_PROBE_RULES),
            stopped(stop.clone()),
        )
    });

    let zds_flag = readiness.condition("zds");
    tokio::spawn(async move {
        if restored_rx.await.is_ok() {
            tracing::info!("CNI ambient server marking ready");
            tokio::spawn(zds_server.serve(stopped(stop)));
            loop {
                zds_flag.set(zds.serving());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    });

    Ok(AmbientNode {
        dataplane,
        cluster,
        readiness: readiness.clone(),
        pod_name: setup.pod_name,
        client: setup.client,
        pod_namespace: setup.pod_namespace,
        node_name: cfg.node_name,
        owned_config: setup.owned_config,
        disable_safe_upgrade: cfg.disable_safe_upgrade,
        sockets: vec![event_socket, debug_socket],
        drift_checks,
    })
}

/// Waits for the previous agent to exit, then has the reconciler check the enrolled pods once
/// more: until it exited it could still be enrolling a pod with its own backend (an ADD it took
/// before this agent bound the socket), after this agent's restore or adoption had checked it.
async fn await_previous_agent(
    waiting: Waiting,
    events: mpsc::UnboundedSender<crate::ambient::cluster::ClusterEvent>,
) {
    // A thread of its own, not the blocking pool: the runtime waits for the pool's tasks when it
    // shuts down, and this one ends only when the previous agent does.
    let (tx, rx) = oneshot::channel();
    std::thread::spawn(move || tx.send(waiting.wait()));
    match rx.await {
        Ok(Ok(lock)) => {
            tracing::info!("the previous agent exited");
            lock.hold_until_exit();
            let _ = events.send(crate::ambient::cluster::ClusterEvent::PreviousAgentExited);
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot wait for the previous agent"),
        Err(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_port_is_taken_over_once_its_holder_lets_go() {
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = holder.local_addr().unwrap();
        let released = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(holder);
        });
        let listener = bind_tcp(addr, Duration::from_secs(10)).await.unwrap();
        assert_eq!(listener.local_addr().unwrap(), addr);
        released.await.unwrap();
    }

    #[tokio::test]
    async fn a_port_held_past_the_patience_is_an_error() {
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = holder.local_addr().unwrap();
        let err = bind_tcp(addr, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    }
}
