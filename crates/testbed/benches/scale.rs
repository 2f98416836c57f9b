//! What the node agent and the API server cost as the cluster grows (root): one real
//! kube-apiserver + etcd filled with namespaces and with pods bound to nodes that do not exist
//! (API objects only, [`testbed::cluster_fill`]), and pods of the agent's own node (Pending API
//! objects in ambient namespaces: what the agent caches of its node before any sandbox). At each
//! size the agent is started fresh and measured:
//!
//! - start-up: spawn → `/readyz` 200 (ours is ready once its watches synced), wall-clock, and
//!   what the API server sent it meanwhile (LIST requests and their response bytes);
//! - memory: `VmHWM` (peak, the initial lists included) and `VmRSS` once settled, from /proc;
//! - CPU-seconds from /proc over a fixed idle window and over a window of churn (namespace
//!   labels changed, pods created and deleted on other nodes and on its own);
//! - at the API server, from its `/metrics`: requests and watch-event bytes per minute, idle and
//!   under churn, less the same window measured with no agent (the server's own loopback
//!   clients watch namespaces too), and its own CPU and RSS;
//! - at the largest size, a kill -9 of the API server and its restart: the LISTs each agent
//!   makes of the new server (one per watch is the floor; more is a relist storm);
//! - at the largest size, the API server's side of N agents (1, 10, 50): with `ISTIO_BIN`,
//!   Istio's agent first, N processes each on a node of its own with no pod
//!   ([`testbed::istio_agent::WatchSide`]: its own network namespace, dirs and node name), killed
//!   before ours; then our agent's pod and namespace watches
//!   (`cni_agent::ambient::cluster::spawn_watches`, as the agent starts them) run in this
//!   process, each with its own client and node name, no network namespace; what the server
//!   sends and spends (its CPU-seconds from /proc) for them idle and under churn, and after its
//!   restart.
//!
//! CPU-seconds, RSS, request counts and bytes do not depend on the machine's load; the start-up
//! time does (it is wall-clock, on two CPUs shared with the API server and anything else).
//!
//! Run: `scripts/bench-node --scale` (`--against-istio` too for Istio's agent, alternating with
//! ours at each size). Knobs: `SCALE_SIZES` (`namespaces:pods,…`, default `1000:10000,10000:50000`),
//! `SCALE_OWN` (own-node pods, default `30,110,250`), `SCALE_WINDOW_SECS` (each idle and churn
//! window, default 20), `SCALE_AGENTS` (watch-side agents, default `1,10,50`; empty: none),
//! `BENCH_ONLY=ours|istio`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use tokio::sync::mpsc;

use cni_agent::ambient::cluster::{Cluster, ClusterEvent, spawn_watches};
use cni_core::enroll::{CompiledSelectors, default_selectors};

use testbed::apiserver_metrics::Scrape;
use testbed::cluster_fill;
use testbed::cpu_profile;
use testbed::kube::KubeTestEnv;
use testbed::node::{Agent, Backend, NodeOptions, TestNode, plugin_binary};

/// Fake nodes the other pods are bound to (100 pods each at 50k).
const OTHER_NODES: usize = 500;
/// Ambient namespaces holding the own node's pods.
const OWN_NAMESPACES: usize = 10;
/// After ready, before the idle window: the agent's start-up work done.
const SETTLE: Duration = Duration::from_secs(5);
/// After the API server's restart: long enough for every backoff to have relisted.
const AFTER_RESTART: Duration = Duration::from_secs(30);

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn sizes() -> Vec<(usize, usize)> {
    let spec = std::env::var("SCALE_SIZES").unwrap_or_else(|_| "1000:10000,10000:50000".into());
    spec.split(',')
        .map(|s| {
            let (ns, pods) = s
                .split_once(':')
                .unwrap_or_else(|| panic!("SCALE_SIZES: {s:?} is not namespaces:pods"));
            let parse = |v: &str| {
                v.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("SCALE_SIZES: {v:?} in {s:?} is not a number"))
            };
            (parse(ns), parse(pods))
        })
        .collect()
}

fn own_counts() -> Vec<usize> {
    let spec = std::env::var("SCALE_OWN").unwrap_or_else(|_| "30,110,250".into());
    spec.split(',')
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("SCALE_OWN: {v:?} is not a number"))
        })
        .collect()
}

fn agent_counts() -> Vec<usize> {
    let spec = std::env::var("SCALE_AGENTS").unwrap_or_else(|_| "1,10,50".into());
    spec.split(',')
        .filter(|v| !v.trim().is_empty())
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("SCALE_AGENTS: {v:?} is not a number"))
        })
        .collect()
}

/// What one window cost at the API server.
#[derive(Clone, Copy, Default)]
struct ApiCost {
    /// Requests an agent makes (reads, watches, `pods/status` patches), not the bench's writes.
    requests: f64,
    lists: f64,
    /// Bytes of watch events sent, and of responses to LISTs.
    watch_bytes: f64,
    list_bytes: f64,
    /// CPU of kube-apiserver and etcd.
    server_cpu_ms: f64,
}

impl ApiCost {
    fn between(before: &Scrape, after: &Scrape, cpu: Option<&cpu_profile::Profile>) -> ApiCost {
        let agent_verbs = |l: &std::collections::HashMap<&str, &str>| match l.get("verb") {
            Some(&("LIST" | "WATCH" | "GET")) => true,
            Some(&"PATCH") => l.get("subresource") == Some(&"status"),
            _ => false,
        };
        let own = |comm: &str| cpu.map_or(0.0, |c| cpu_ms(c, comm));
        ApiCost {
            requests: after.growth(before, "apiserver_request_total", agent_verbs),
            lists: after.growth(before, "apiserver_request_total", |l| {
                l.get("verb") == Some(&"LIST")
            }),
            watch_bytes: after.growth(before, "apiserver_watch_events_sizes_sum", |_| true),
            list_bytes: after.growth(before, "apiserver_response_sizes_sum", |l| {
                l.get("verb") == Some(&"LIST")
            }),
            server_cpu_ms: own("kube-apiserver") + own("etcd"),
        }
    }

    fn minus(self, base: ApiCost) -> ApiCost {
        ApiCost {
            requests: (self.requests - base.requests).max(0.0),
            lists: (self.lists - base.lists).max(0.0),
            watch_bytes: (self.watch_bytes - base.watch_bytes).max(0.0),
            list_bytes: (self.list_bytes - base.list_bytes).max(0.0),
            server_cpu_ms: self.server_cpu_ms - base.server_cpu_ms,
        }
    }
}

/// One agent at one size.
#[derive(Default)]
struct Measure {
    ready_ms: f64,
    startup: ApiCost,
    hwm_kib: u64,
    rss_kib: u64,
    idle_cpu_ms: f64,
    churn_cpu_ms: f64,
    idle: ApiCost,
    churn: ApiCost,
    server_rss_kib: u64,
    /// After the API server's restart (largest size only): LISTs by resource.
    restart: Option<String>,
}

/// The bench's cluster: the server, the node whose agent is measured, and what is filled so far.
struct Bench {
    node: TestNode,
    namespaces: usize,
    pods: usize,
    own: usize,
    own_namespaces: Vec<String>,
    window: Duration,
    /// Churn counters, so names never repeat across windows.
    churned: usize,
}

fn process_named(comm: &str) -> Option<u32> {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (name, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
        let ppid = rest.split_whitespace().nth(1)?;
        (name == comm && ppid == me).then_some(pid)
    })
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn cpu_ms(profile: &cpu_profile::Profile, comm: &str) -> f64 {
    profile
        .by_name
        .iter()
        .find(|u| u.comm == comm)
        .map_or(0.0, |u| u.own.as_secs_f64() * 1000.0)
}

fn tree() -> cpu_profile::Snapshot {
    cpu_profile::snapshot_tree(std::process::id())
}

impl Bench {
    fn admin(&self) -> kube::Client {
        self.node.kube.client()
    }

    async fn scrape(&self) -> Scrape {
        Scrape::read(&self.admin())
            .await
            .expect("API server /metrics")
    }

    async fn grow(&mut self, namespaces: usize, pods: usize) {
        let started = Instant::now();
        cluster_fill::namespaces(&self.admin(), self.namespaces, namespaces)
            .await
            .expect("fill namespaces");
        let ns_took = started.elapsed();
        cluster_fill::pods_on_nodes(
            &self.admin(),
            self.pods,
            pods,
            namespaces,
            "elsewhere",
            OTHER_NODES,
        )
        .await
        .expect("fill pods");
        eprintln!(
            "bench: filled {} namespaces in {:.1}s, {} pods in {:.1}s",
            namespaces - self.namespaces,
            ns_took.as_secs_f64(),
            pods - self.pods,
            (started.elapsed() - ns_took).as_secs_f64()
        );
        (self.namespaces, self.pods) = (namespaces, pods);
    }

    async fn grow_own(&mut self, own: usize) {
        cluster_fill::pods_on_node(
            &self.admin(),
            &self.node.node_name,
            self.own,
            own,
            &self.own_namespaces,
        )
        .await
        .expect("fill own pods");
        self.own = own;
    }

    /// Puts `agent`'s plugin where its installer takes it from, and makes it the node's agent.
    fn switch_to(&mut self, agent: &Agent) {
        self.node.kill_agent();
        let plugin = match agent {
            Agent::Ours => plugin_binary(),
            Agent::Istio(bin) => bin.join("istio-cni"),
        };
        let (to, tmp) = (
            self.node.path("src-bin/istio-cni"),
            self.node.path("src-bin/.istio-cni"),
        );
        std::fs::copy(plugin, &tmp).unwrap();
        std::fs::rename(&tmp, &to).unwrap();
        self.node.health_port = match agent {
            Agent::Ours => testbed::ports::unused(),
            Agent::Istio(_) => testbed::istio_agent::READINESS_PORT,
        };
        self.node.agent_kind = agent.clone();
    }

    /// The agent's own process (Istio's runs below its launcher).
    fn agent_process(&self) -> u32 {
        let pid = self.node.agent_pid().expect("agent running");
        match self.node.agent_kind {
            Agent::Ours => pid,
            Agent::Istio(_) => testbed::istio_agent::agent_process(pid).expect("Istio's agent"),
        }
    }

    /// Changes for one window, at fixed rates, spread over it: every 100 ms a namespace label
    /// and a pod created and one deleted on another node; every second the same on this node.
    async fn churn(&mut self) {
        let admin = self.admin();
        let ticks = (self.window.as_millis() / 100) as usize;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        for t in 0..ticks {
            tick.tick().await;
            let n = self.churned;
            self.churned += 1;
            let ns = cluster_fill::namespace_name(n % self.namespaces);
            let patch = json!({"metadata": {"labels": {"bench-rev": n.to_string()}}});
            Api::<Namespace>::all(admin.clone())
                .patch(&ns, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .expect("namespace label");
            let pods = Api::<Pod>::namespaced(admin.clone(), &ns);
            let pod = cluster_fill::pod_object(&format!("churn-{n:06}"), "elsewhere-0");
            pods.create(&Default::default(), &pod)
                .await
                .expect("churn pod");
            if n > 0 {
                let prev = cluster_fill::namespace_name((n - 1) % self.namespaces);
                Api::<Pod>::namespaced(admin.clone(), &prev)
                    .delete(&format!("churn-{:06}", n - 1), &DeleteParams::default())
                    .await
                    .expect("delete churn pod");
            }
            if t % 10 == 0 {
                let own_ns = &self.own_namespaces[n % self.own_namespaces.len()];
                let own = Api::<Pod>::namespaced(admin.clone(), own_ns);
                let name = format!("own-churn-{n:06}");
                own.create(
                    &Default::default(),
                    &cluster_fill::pod_object(&name, &self.node.node_name),
                )
                .await
                .expect("own churn pod");
                own.delete(&name, &DeleteParams::default())
                    .await
                    .expect("delete own churn pod");
            }
        }
        // The last churn pod goes too: the cluster stays the size measured.
        let n = self.churned - 1;
        let _ = Api::<Pod>::namespaced(admin, &cluster_fill::namespace_name(n % self.namespaces))
            .delete(&format!("churn-{n:06}"), &DeleteParams::default())
            .await;
    }

    /// An idle window then a churn window: what the server and the tree's processes spent.
    async fn windows(
        &mut self,
    ) -> (
        (ApiCost, cpu_profile::Profile),
        (ApiCost, cpu_profile::Profile),
    ) {
        let (s0, c0) = (self.scrape().await, tree());
        tokio::time::sleep(self.window).await;
        let (s1, c1) = (self.scrape().await, tree());
        self.churn().await;
        // Events of the last changes still on their way to the watchers.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (s2, c2) = (self.scrape().await, tree());
        let (idle_cpu, churn_cpu) = (
            cpu_profile::between(&c0, &c1),
            cpu_profile::between(&c1, &c2),
        );
        (
            (ApiCost::between(&s0, &s1, Some(&idle_cpu)), idle_cpu),
            (ApiCost::between(&s1, &s2, Some(&churn_cpu)), churn_cpu),
        )
    }

    /// The agent started fresh at this size, measured, and killed.
    async fn measure(
        &mut self,
        agent: &Agent,
        baseline: (ApiCost, ApiCost),
        restart: bool,
    ) -> Measure {
        self.switch_to(agent);
        let before = self.scrape().await;
        let started = Instant::now();
        self.node.start_agent();
        let deadline = started + Duration::from_secs(120);
        loop {
            if let Some((200, _)) = self.node.readyz() {
                break;
            }
            if let Some(status) = self.node.agent_exited() {
                panic!("agent exited with {status}:\n{}", self.node.agent_log());
            }
            assert!(
                Instant::now() < deadline,
                "agent not ready after 120s:\n{}",
                self.node.agent_log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ready_ms = started.elapsed().as_secs_f64() * 1000.0;
        // Our agent's ports are only found free: a taken one restarts it (rare; the time above
        // is then of the first start's failure).
        self.node.wait_ready().await;
        tokio::time::sleep(SETTLE).await;
        let after_start = self.scrape().await;
        let startup = ApiCost::between(&before, &after_start, None);
        let ((idle, idle_cpu), (churn, churn_cpu)) = self.windows().await;
        let pid = self.agent_process();
        let server = process_named("kube-apiserver").map_or(0, |p| rss_kib(p, "VmRSS"));
        let mut m = Measure {
            ready_ms,
            startup,
            hwm_kib: rss_kib(pid, "VmHWM"),
            rss_kib: rss_kib(pid, "VmRSS"),
            idle_cpu_ms: cpu_ms(&idle_cpu, "install-cni"),
            churn_cpu_ms: cpu_ms(&churn_cpu, "install-cni"),
            idle: idle.minus(baseline.0),
            churn: churn.minus(baseline.1),
            server_rss_kib: server,
            restart: None,
        };
        if restart {
            m.restart = Some(self.restart_lists().await);
        }
        self.node.kill_agent();
        m
    }

    /// Kills the API server and starts it again; the LISTs it then served, by resource. Its
    /// counters start at zero: every LIST is a relist, the agent's or its own loopback clients'.
    async fn restart_lists(&mut self) -> String {
        self.node.kube.restart_apiserver().await;
        tokio::time::sleep(AFTER_RESTART).await;
        let s = self.scrape().await;
        ["pods", "namespaces"]
            .iter()
            .map(|r| {
                let lists = s.sum("apiserver_request_total", |l| {
                    l.get("verb") == Some(&"LIST") && l.get("resource") == Some(r)
                });
                let bytes = s.sum("apiserver_response_sizes_sum", |l| {
                    l.get("verb") == Some(&"LIST") && l.get("resource") == Some(r)
                });
                format!("{r}: {lists:.0} LISTs, {:.0} KiB", bytes / 1024.0)
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Starts watch-side agents until `to` run: each its own client (its own connections) and
    /// node name; returns once all have synced. They run until the bench ends.
    async fn add_watchers(&self, from: usize, to: usize) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        let env = &self.node.kube;
        env.write_kubeconfig(&path, env.admin_token());
        let selectors = CompiledSelectors::compile(&default_selectors()).unwrap();
        let mut synced = Vec::new();
        for i in from..to {
            let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
            let cfg = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .unwrap();
            let (tx, mut rx) = mpsc::unbounded_channel();
            spawn_watches(
                kube::Client::try_from(cfg).unwrap(),
                &format!("watch-only-{i}"),
                &selectors,
                Arc::new(Cluster::default()),
                tx,
                cni_agent::http::Readiness::new().condition("watches"),
            );
            synced.push(async move {
                while !matches!(rx.recv().await, Some(ClusterEvent::Synced) | None) {}
            });
        }
        tokio::time::timeout(Duration::from_secs(600), futures::future::join_all(synced))
            .await
            .expect("watch-side agents synced within 600 s");
    }

    /// The same windows with no agent: what the server's own clients cost.
    async fn baseline(&mut self) -> (ApiCost, ApiCost) {
        self.node.kill_agent();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let ((idle, _), (churn, _)) = self.windows().await;
        (idle, churn)
    }
}

fn per_minute(v: f64, window: Duration) -> f64 {
    v * 60.0 / window.as_secs_f64()
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("scale benchmarks need root; skipped");
        return;
    }
    let mut agents = vec![Agent::Ours];
    if let Some(bin) = testbed::istio_agent::istio_bin() {
        agents.push(Agent::Istio(bin));
    }
    match std::env::var("BENCH_ONLY").as_deref() {
        Ok("istio") => agents.retain(|a| matches!(a, Agent::Istio(_))),
        Ok("ours") => agents.retain(|a| matches!(a, Agent::Ours)),
        _ => {}
    }
    let window = Duration::from_secs(env_or("SCALE_WINDOW_SECS", 20));
    let node = TestNode::start_on(
        KubeTestEnv::start().await,
        Backend::Nftables,
        NodeOptions::default(),
    )
    .await;
    let mut bench = Bench {
        node,
        namespaces: 0,
        pods: 0,
        own: 0,
        own_namespaces: (0..OWN_NAMESPACES).map(|i| format!("own-{i}")).collect(),
        window,
        churned: 0,
    };
    for ns in bench.own_namespaces.clone() {
        bench
            .node
            .create_namespace(&ns, &[("istio.io/dataplane-mode", "ambient")])
            .await;
    }
    let sizes = sizes();
    let owns = own_counts();
    let mut rows: Vec<(usize, usize, usize, String, Measure)> = Vec::new();
    let mut point = 0;
    for (si, &(namespaces, pods)) in sizes.iter().enumerate() {
        bench.grow(namespaces, pods).await;
        let mut baseline = None;
        for (oi, &own) in owns.iter().enumerate() {
            bench.grow_own(own).await;
            if baseline.is_none() {
                baseline = Some(bench.baseline().await);
            }
            let last = si + 1 == sizes.len() && oi + 1 == owns.len();
            // Alternate which agent goes first, so a drift in the machine's load hits both alike.
            let mut order = agents.clone();
            if point % 2 == 1 {
                order.reverse();
            }
            point += 1;
            for agent in order {
                let name = match agent {
                    Agent::Ours => "ours".to_string(),
                    Agent::Istio(_) => "Istio's".to_string(),
                };
                eprintln!(
                    "bench: {namespaces} namespaces, {pods} other pods, {own} own pods: {name} agent (load {})",
                    std::fs::read_to_string("/proc/loadavg")
                        .unwrap_or_default()
                        .trim()
                );
                let m = bench.measure(&agent, baseline.unwrap(), last).await;
                eprintln!(
                    "bench:   ready {:.0} ms, HWM {:.1} MiB, RSS {:.1} MiB, idle CPU {:.0} ms",
                    m.ready_ms,
                    mib(m.hwm_kib),
                    mib(m.rss_kib),
                    m.idle_cpu_ms
                );
                rows.push((namespaces, pods, own, name, m));
            }
        }
    }
    bench.node.kill_agent();
    let restart_baseline = bench.restart_lists().await;
    let w = window;
    println!(
        "windows of {}s each; per-minute figures are the window's × {:.1}; API-server figures are less the same window with no agent",
        w.as_secs(),
        60.0 / w.as_secs_f64()
    );
    println!();
    println!(
        "| namespaces / other pods / own pods | agent | ready (wall-clock) | start-up LISTs, KiB listed | VmHWM | RSS steady | CPU idle, ms/min | CPU churn, ms/min | requests/min idle / churn | watch KiB/min idle / churn | kube-apiserver + etcd CPU for it, ms/min idle / churn | kube-apiserver RSS |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (ns, pods, own, name, m) in &rows {
        println!(
            "| {ns} / {pods} / {own} | {name} | {:.0} ms | {:.0}, {:.0} | {:.1} MiB | {:.1} MiB | {:.0} | {:.0} | {:.1} / {:.1} | {:.1} / {:.1} | {:.0} / {:.0} | {:.0} MiB |",
            m.ready_ms,
            m.startup.lists,
            m.startup.list_bytes / 1024.0,
            mib(m.hwm_kib),
            mib(m.rss_kib),
            per_minute(m.idle_cpu_ms, w),
            per_minute(m.churn_cpu_ms, w),
            per_minute(m.idle.requests, w),
            per_minute(m.churn.requests, w),
            per_minute(m.idle.watch_bytes, w) / 1024.0,
            per_minute(m.churn.watch_bytes, w) / 1024.0,
            per_minute(m.idle.server_cpu_ms, w),
            per_minute(m.churn.server_cpu_ms, w),
            mib(m.server_rss_kib),
        );
    }
    println!();
    println!(
        "churn: 10 namespace label changes/s, 10 pods created and 10 deleted/s on other nodes, 1 created and deleted/s on the agent's node"
    );
    for (_, _, _, name, m) in &rows {
        if let Some(r) = &m.restart {
            println!(
                "kube-apiserver killed and restarted, {name} agent running: in the next {}s {r}",
                AFTER_RESTART.as_secs()
            );
        }
    }
    println!(
        "the same with no agent (the server's own clients): {}",
        restart_baseline
    );
    let istio = agents.iter().find_map(|a| match a {
        Agent::Istio(bin) => Some(bin.clone()),
        Agent::Ours => None,
    });
    watch_side_agents(&mut bench, istio.as_deref()).await;
}

/// The API server's side of N agents at the largest size (see the module's comment): Istio's
/// first (processes, killed before ours start), then ours (tasks of this process, running until
/// it ends).
async fn watch_side_agents(bench: &mut Bench, istio: Option<&std::path::Path>) {
    let counts = agent_counts();
    if counts.is_empty() {
        return;
    }
    let w = bench.window;
    let baseline = bench.baseline().await;
    println!();
    println!(
        "watch-side agents, {} namespaces, {} other pods; per minute, less the same window with none (whose kube-apiserver + etcd CPU was {:.0} / {:.0} ms/min idle / churn)",
        bench.namespaces,
        bench.pods,
        per_minute(baseline.0.server_cpu_ms, w),
        per_minute(baseline.1.server_cpu_ms, w),
    );
    println!(
        "ours: the agent's pod and namespace watches in this process, each its own client and node name; Istio's: its install-cni, each on a node of its own (netns, dirs, node name) with no pod"
    );
    println!();
    println!(
        "| agents | whose | start-up LISTs, MiB listed, MiB over watches | requests/min idle / churn | watch MiB/min idle / churn | kube-apiserver + etcd CPU, ms/min idle / churn (less none) | kube-apiserver RSS | agent RSS, each |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    if let Some(bin) = istio {
        // A failing setup of Istio's agents ends their part, not the bench.
        if let Err(e) = istio_watch_side(bench, bin, &counts, baseline).await {
            println!(
                "| | Istio's | failed: {} | | | | | |",
                e.lines().next().unwrap_or_default()
            );
            eprintln!("bench: Istio's watch-side agents failed: {e}");
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let mut running = 0;
    for n in counts {
        let before = bench.scrape().await;
        bench.add_watchers(running, n).await;
        running = n;
        let startup = ApiCost::between(&before, &bench.scrape().await, None);
        let ((idle, _), (churn, _)) = bench.windows().await;
        print_watch_side(
            bench,
            n,
            "ours",
            startup,
            (idle, churn),
            baseline,
            "in the bench's process",
        );
        eprintln!("bench: {n} watch-side agents measured");
    }
    println!();
    println!(
        "kube-apiserver killed and restarted, {running} of our watch-side agents running: in the next {}s {}",
        AFTER_RESTART.as_secs(),
        bench.restart_lists().await
    );
}

/// Istio's agents watch-side, `counts` of them in turn (each on a node of its own), killed at the end.
async fn istio_watch_side(
    bench: &mut Bench,
    bin: &std::path::Path,
    counts: &[usize],
    baseline: (ApiCost, ApiCost),
) -> Result<(), String> {
    let mut running: Vec<testbed::istio_agent::WatchSide> = Vec::new();
    for &n in counts {
        let before = bench.scrape().await;
        while running.len() < n {
            let name = format!("istio-watch-only-{}", running.len());
            running.push(testbed::istio_agent::WatchSide::start(
                &bench.node.kube,
                bin,
                &name,
            ));
        }
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let mut synced = 0;
            for a in running.iter_mut() {
                synced += usize::from(a.synced()?);
            }
            if synced == n {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("{synced} of {n} Istio agents synced after 600 s"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(SETTLE).await;
        let startup = ApiCost::between(&before, &bench.scrape().await, None);
        let ((idle, _), (churn, _)) = bench.windows().await;
        let rss: Vec<u64> = running
            .iter()
            .filter_map(|a| a.agent_process())
            .map(|p| rss_kib(p, "VmRSS"))
            .collect();
        let each = rss.iter().sum::<u64>() as f64 / rss.len().max(1) as f64 / 1024.0;
        print_watch_side(
            bench,
            n,
            "Istio's",
            startup,
            (idle, churn),
            baseline,
            &format!("{each:.1} MiB"),
        );
        eprintln!("bench: {n} Istio watch-side agents measured");
    }
    Ok(())
}

/// One row of the watch-side table.
fn print_watch_side(
    bench: &Bench,
    n: usize,
    whose: &str,
    startup: ApiCost,
    (idle, churn): (ApiCost, ApiCost),
    baseline: (ApiCost, ApiCost),
    agent_rss: &str,
) {
    let w = bench.window;
    let (idle_less, churn_less) = (idle.minus(baseline.0), churn.minus(baseline.1));
    let server = process_named("kube-apiserver").map_or(0, |p| rss_kib(p, "VmRSS"));
    println!(
        "| {n} | {whose} | {:.0}, {:.1}, {:.1} | {:.1} / {:.1} | {:.2} / {:.2} | {:.0} / {:.0} | {:.0} MiB | {agent_rss} |",
        startup.lists,
        startup.list_bytes / 1048576.0,
        startup.watch_bytes / 1048576.0,
        per_minute(idle_less.requests, w),
        per_minute(churn_less.requests, w),
        per_minute(idle_less.watch_bytes, w) / 1048576.0,
        per_minute(churn_less.watch_bytes, w) / 1048576.0,
        per_minute(idle_less.server_cpu_ms, w),
        per_minute(churn_less.server_cpu_ms, w),
        mib(server),
    );
}
