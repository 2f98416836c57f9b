//! Pod create → Running through a real kubelet (`scripts/real-node`): kubelet → containerd →
//! libcni → bridge → `istio-cni` → agent → ZDS peer, with our chart installed by helm and the
//! ztunnel-like peer as a DaemonSet, both from the images `scripts/node-images` builds. Ambient
//! pods against non-mesh pods in the same node, 50 pods one at a time and 50 created at once:
//! p50/p99 of the time from a pod's POST until the API server reports it Running (the ambient
//! pod's redirection and ZDS hand-off happen inside its sandbox's CNI ADD, before that).
//! With `ZTUNNEL_BIN` (a ztunnel built with its `testing` feature) the peer is the real ztunnel
//! (`deploy/node/ztunnel.yaml`). Needs root; the node binaries and images are built on first use.
//! Run: `cargo bench -p testbed --bench pod_start`. Prints markdown tables for BENCHMARKS.md: the
//! times, and the CPU each process of the node used in each phase (`testbed::cpu_profile`).
//!
//! `cargo bench -p testbed --bench pod_start -- --istiod`: the same on the node with Istio's own
//! control plane (`scripts/real-node mesh install`: istiod from the pin, Istio's charts, our chart,
//! the peer; Istio's ztunnel chart with `ZTUNNEL_BIN`), plus a second table: for each ambient pod,
//! the time from our agent's `ambient.istio.io/redirection: enabled` (first seen by a watch) to
//! istiod listing the workload as HBONE in its `/debug/ambientz` (polled every 50 ms, so each
//! figure is late by up to one poll plus the poll's own time), and from kubelet posting the pod's
//! IP (istiod lists a pod only with an address, which the API has only after the CNI ADD).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::join_all;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use testbed::cpu_profile::{self, Profile};
use testbed::istio_mesh::Mesh;
use testbed::real_node::{PEER, RealNode, ZTUNNEL, busybox_pod};

const PODS: usize = 50;
const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");
const REDIRECTION: &str = "ambient.istio.io/redirection";

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

/// When each pod of a namespace was first seen Running, and first seen annotated `enabled`.
#[derive(Clone, Default)]
struct Running {
    seen: Arc<Mutex<HashMap<String, Instant>>>,
    annotated: Arc<Mutex<HashMap<String, Instant>>>,
    /// First seen with `status.podIP` (kubelet posts it once the sandbox is up).
    addressed: Arc<Mutex<HashMap<String, Instant>>>,
    changed: Arc<tokio::sync::Notify>,
}

impl Running {
    fn watch(client: kube::Client, namespace: &str) -> Running {
        let running = Running::default();
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let r = running.clone();
        tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default()).boxed();
            while let Some(event) = events.next().await {
                let pods = match event {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => vec![p],
                    _ => continue,
                };
                let now = Instant::now();
                for p in pods {
                    let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                    let name = p.metadata.name.clone().unwrap_or_default();
                    if phase == Some("Running") {
                        r.seen.lock().unwrap().entry(name.clone()).or_insert(now);
                    }
                    let enabled = p
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(REDIRECTION));
                    if enabled.map(String::as_str) == Some("enabled") {
                        r.annotated
                            .lock()
                            .unwrap()
                            .entry(name.clone())
                            .or_insert(now);
                    }
                    if p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some() {
                        r.addressed.lock().unwrap().entry(name).or_insert(now);
                    }
                }
                r.changed.notify_waiters();
            }
        });
        running
    }

    async fn wait(&self, name: &str) -> Instant {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let notified = self.changed.notified();
            if let Some(at) = self.seen.lock().unwrap().get(name) {
                return *at;
            }
            assert!(
                Instant::now() < deadline,
                "pod {name} not Running after 120 s"
            );
            let _ = tokio::time::timeout(Duration::from_millis(500), notified).await;
        }
    }
}

fn pod(name: &str) -> Pod {
    serde_json::from_value(busybox_pod(name, &["sleep", "3600"])).unwrap()
}

/// Creates `names` (all at once when `burst`, else each after the previous one is Running);
/// returns each pod's create → Running time, sorted.
async fn create(api: &Api<Pod>, running: &Running, names: &[String], burst: bool) -> Vec<Duration> {
    let one = |name: String| async move {
        let started = Instant::now();
        api.create(&PostParams::default(), &pod(&name))
            .await
            .unwrap();
        running.wait(&name).await - started
    };
    let mut times = if burst {
        join_all(names.iter().cloned().map(one)).await
    } else {
        let mut v = Vec::new();
        for n in names {
            v.push(one(n.clone()).await);
        }
        v
    };
    times.sort();
    times
}

/// Failed sandbox creations (kubelet retries them) in a namespace, printed to stderr; their count.
async fn sandbox_failures(client: &kube::Client, namespace: &str) -> usize {
    let lp = ListParams::default().fields("reason=FailedCreatePodSandBox");
    let events = Api::<Event>::namespaced(client.clone(), namespace)
        .list(&lp)
        .await
        .unwrap();
    for e in &events.items {
        let pod = e.involved_object.name.as_deref().unwrap_or("?");
        eprintln!("{namespace}/{pod}: {}", e.message.as_deref().unwrap_or(""));
    }
    events
        .items
        .iter()
        .map(|e| e.count.unwrap_or(1) as usize)
        .sum()
}

/// Deletes every pod of `api` and waits until their sandboxes are gone from the node too (the
/// API forgets a pod deleted with no grace period before its sandbox is torn down), so the next
/// phase neither shares the node with a teardown nor is charged for one. `shims`: how many
/// shims the node runs without the bench's pods; a pod's shim (one per sandbox) outlives its
/// containers, so the count back at that number means every bench pod's processes have gone.
async fn delete_all(node: &RealNode, api: &Api<Pod>, shims: usize) {
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    api.delete_collection(&dp, &ListParams::default())
        .await
        .unwrap();
    node.eventually("pods deleted", Duration::from_secs(180), || async {
        api.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    node.eventually("pods' sandboxes gone", Duration::from_secs(180), || async {
        (node.node_processes(SHIM).len() <= shims).then_some(())
    })
    .await;
}

/// A containerd shim as `/proc/<pid>/comm` names it (truncated to 15 characters).
const SHIM: &str = "containerd-shim";

/// When istiod first listed each pod of a namespace as HBONE, polled from its `/debug/ambientz`.
#[derive(Clone, Default)]
struct Hbone {
    seen: Arc<Mutex<HashMap<String, Instant>>>,
    /// How long each poll took (the figures' resolution).
    polls: Arc<Mutex<Vec<Duration>>>,
}

impl Hbone {
    fn poll(mesh: Arc<Mesh>, namespace: &str) -> (Hbone, tokio::task::JoinHandle<()>) {
        let hbone = Hbone::default();
        let (h, ns) = (hbone.clone(), namespace.to_string());
        let task = tokio::spawn(async move {
            loop {
                let started = Instant::now();
                if let Some(w) = mesh.istiod_workloads().await {
                    let now = Instant::now();
                    h.polls.lock().unwrap().push(now - started);
                    let mut seen = h.seen.lock().unwrap();
                    for ((wns, name), wl) in w {
                        if wns == ns && wl.tunnel_protocol == "HBONE" {
                            seen.entry(name).or_insert(now);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        (hbone, task)
    }

    /// (annotation → HBONE, pod IP posted → HBONE) for `names`, each sorted; waits up to 60 s
    /// for each.
    async fn lags(&self, running: &Running, names: &[String]) -> (Vec<Duration>, Vec<Duration>) {
        let mut lags = Vec::new();
        let mut from_ip = Vec::new();
        for n in names {
            let deadline = Instant::now() + Duration::from_secs(60);
            let at = loop {
                if let Some(at) = self.seen.lock().unwrap().get(n) {
                    break *at;
                }
                assert!(
                    Instant::now() < deadline,
                    "istiod never listed {n} as HBONE"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            let annotated = *running
                .annotated
                .lock()
                .unwrap()
                .get(n)
                .unwrap_or_else(|| panic!("{n} was never seen annotated"));
            lags.push(at.saturating_duration_since(annotated));
            let addressed = *running
                .addressed
                .lock()
                .unwrap()
                .get(n)
                .unwrap_or_else(|| panic!("{n} was never seen with an IP"));
            from_ip.push(at.saturating_duration_since(addressed));
        }
        lags.sort();
        from_ip.sort();
        (lags, from_ip)
    }
}

/// One column per phase: the CPU time each process name of the node used from the first POST
/// until the last pod was Running, own + reaped children's, for names above 50 ms in any phase.
fn print_profiles(profiles: &[(&str, &str, Profile)]) {
    let mut names: Vec<&str> = Vec::new();
    for (_, _, p) in profiles {
        for u in &p.by_name {
            if u.total().as_millis() >= 50 && !names.contains(&u.comm.as_str()) {
                names.push(&u.comm);
            }
        }
    }
    let head: Vec<String> = profiles
        .iter()
        .map(|(label, mode, _)| format!("{label}, {mode}: CPU ms own (+ reaped children)"))
        .collect();
    println!("| process (node's, by name) | {} |", head.join(" | "));
    println!("|---|{}", "---|".repeat(profiles.len()));
    for name in names {
        let cells: Vec<String> = profiles
            .iter()
            .map(
                |(_, _, p)| match p.by_name.iter().find(|u| u.comm == name) {
                    Some(u) if u.reaped.is_zero() => format!("{}", u.own.as_millis()),
                    Some(u) => format!("{} (+ {})", u.own.as_millis(), u.reaped.as_millis()),
                    None => "0".into(),
                },
            )
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    let total: Vec<String> = profiles
        .iter()
        .map(|(_, _, p)| {
            let ms: u128 = p.by_name.iter().map(|u| u.total().as_millis()).sum();
            format!("{ms}")
        })
        .collect();
    println!("| all of the node | {} |", total.join(" | "));
    let busy: Vec<String> = profiles
        .iter()
        .map(|(_, _, p)| format!("{:.0} %", p.machine_busy * 100.0))
        .collect();
    println!("| the machine's CPUs busy | {} |", busy.join(" | "));
}

#[tokio::main]
async fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("pod_start bench: needs root (the node runs in namespaces of its own)");
        std::process::exit(1);
    }
    let with_istiod = std::env::args().any(|a| a == "--istiod");
    let real_ztunnel = std::env::var_os("ZTUNNEL_BIN").is_some();
    let mesh = if with_istiod {
        let m = Mesh::up(real_ztunnel).await;
        eprintln!(
            "pod_start bench: istiod from the pin, ztunnel: {}",
            if real_ztunnel { "Istio's chart" } else { PEER }
        );
        Some(Arc::new(m))
    } else {
        None
    };
    let plain = if mesh.is_none() {
        let node = RealNode::up().await;
        let peer = if real_ztunnel {
            assert!(node.has_real_ztunnel(), "ZTUNNEL_BIN set, no ztunnel.tar");
            ZTUNNEL
        } else {
            PEER
        };
        eprintln!("pod_start bench: ZDS peer from {peer}");
        node.install_chart_with(&[], peer).await;
        Some(node)
    } else {
        None
    };
    let node: &RealNode = match (&mesh, &plain) {
        (Some(m), _) => &m.node,
        (None, Some(n)) => n,
        (None, None) => unreachable!("one of the two was started"),
    };
    let client = node.client();
    let mut lag_rows = Vec::new();
    let shims = node.node_processes(SHIM).len();

    let mut rows = Vec::new();
    let mut profiles = Vec::new();
    for (label, ambient) in [("non-mesh", false), ("ambient", true)] {
        let ns_name = format!("bench-{}", if ambient { "ambient" } else { "plain" });
        let labels = if ambient {
            json!({AMBIENT.0: AMBIENT.1})
        } else {
            json!({})
        };
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": ns_name, "labels": labels}}))
                .unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns_name);
        let running = Running::watch(client.clone(), &ns_name);

        // Warm-up: the first sandbox of a namespace also pays for caches filling.
        create(
            &api,
            &running,
            &["warmup-0".into(), "warmup-1".into()],
            false,
        )
        .await;
        for (mode, burst) in [("one at a time", false), ("50 at once", true)] {
            let names: Vec<String> = (0..PODS)
                .map(|i| format!("{}-{i}", if burst { "b" } else { "s" }))
                .collect();
            let poller = match &mesh {
                Some(m) if ambient => Some(Hbone::poll(m.clone(), &ns_name)),
                _ => None,
            };
            let before = cpu_profile::snapshot(node.holder_pid());
            let times = create(&api, &running, &names, burst).await;
            profiles.push((
                label,
                mode,
                cpu_profile::between(&before, &cpu_profile::snapshot(node.holder_pid())),
            ));
            if let Some((hbone, task)) = poller {
                let (lags, from_ip) = hbone.lags(&running, &names).await;
                task.abort();
                // Its clone of the mesh goes with it, so the node is torn down below.
                let _ = task.await;
                let max = lags.last().unwrap().as_secs_f64() * 1000.0;
                let mut polls = hbone.polls.lock().unwrap().clone();
                polls.sort();
                let poll = pct(&polls, 0.5);
                lag_rows.push((
                    mode,
                    pct(&lags, 0.5),
                    pct(&lags, 0.99),
                    max,
                    pct(&from_ip, 0.5),
                    pct(&from_ip, 0.99),
                    poll,
                ));
            }
            if ambient {
                for n in &names {
                    let p = api.get(n).await.unwrap();
                    let value = p
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(REDIRECTION));
                    assert_eq!(
                        value.map(String::as_str),
                        Some("enabled"),
                        "pod {n} not redirected"
                    );
                }
            }
            let failures = sandbox_failures(&client, &ns_name).await;
            let max = times.last().unwrap().as_secs_f64() * 1000.0;
            rows.push((
                label,
                mode,
                pct(&times, 0.5),
                pct(&times, 0.99),
                max,
                failures,
            ));
            delete_all(node, &api, shims).await;
            // Events outlive their pods: the next mode counts only its own.
            let dp = DeleteParams::default();
            Api::<Event>::namespaced(client.clone(), &ns_name)
                .delete_collection(&dp, &ListParams::default())
                .await
                .unwrap();
        }
    }

    println!(
        "| pods ({PODS}) | created | create → Running p50 ms | p99 ms | max ms | failed sandbox creations |"
    );
    println!("|---|---|---|---|---|---|");
    for (label, mode, p50, p99, max, failures) in rows {
        println!("| {label} | {mode} | {p50:.0} | {p99:.0} | {max:.0} | {failures} |");
    }
    if !lag_rows.is_empty() {
        println!();
        println!(
            "| ambient pods ({PODS}) | created | our annotation → istiod HBONE p50 ms | p99 ms | max ms | pod IP posted → HBONE p50 ms | p99 ms | one poll of /debug/ambientz, p50 ms |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for (mode, p50, p99, max, ip50, ip99, poll) in lag_rows {
            println!(
                "| ambient | {mode} | {p50:.0} | {p99:.0} | {max:.0} | {ip50:.0} | {ip99:.0} | {poll:.0} |"
            );
        }
    }
    println!();
    print_profiles(&profiles);
    // The node goes down here; then exit without waiting for the runtime: the pod watches
    // retry against the gone API server without pause, and one run hung at shutdown after its
    // tables were printed. (A mesh node also has its watchdog, which tears it down at exit.)
    drop(plain);
    drop(mesh);
    use std::io::Write;
    let _ = std::io::stdout().flush();
    std::process::exit(0);
}
