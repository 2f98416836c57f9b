//! What a live switch of the CNI agent (Istio's ↔ ours, one backend ↔ the other) does to a real
//! node's pods, measured while it happens (issue #22, `tests/istio_on_real_node/migration.rs`):
//!
//! - [`Prober`]: from inside each ambient pod's network namespace, a connection attempt every
//!   100 ms to a [`Witness`] on the node. The witness answers each connection with the address it
//!   came from. Redirected, the connection lands on the peer's in-pod listener, which forwards it
//!   from a socket of its own, so the witness names another port; a connection the witness sees
//!   coming from the prober's own socket escaped redirection.
//! - [`SocketWatch`]: whether an agent serves the plugin's `pluginevent.sock` on the node (a
//!   connect every 20 ms), so the gap during which no agent serves ADDs is measured per node.
//! - [`create_during`]: pods created while a switch runs, and how long each sandbox waited for
//!   its network (the CNI ADD, which waits for an agent).
//! - [`incarnation`]: a pod's containers and sandbox, to tell that no pod was restarted.
//! - [`agent_state`]: which agent runs on the node.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dataplane::netns::Netns;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};

use crate::real_node::Node;

/// How often each pod probes.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// How long a probe waits for the witness's answer before it counts as failed.
pub const PROBE_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP listener in the node's network namespace (on an address of the node, e.g. its bridge
/// gateway) that answers every connection with `<client ip>:<client port>\n` and closes it.
pub struct Witness {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Witness {
    /// Listens on `ip:port` inside `node`'s network namespace (a `&RealNode` is its node 1).
    pub fn start<'a>(node: impl Into<Node<'a>>, ip: IpAddr, port: u16) -> Witness {
        let node = node.into();
        let ns = Netns::open(format!("/proc/{}/ns/net", node.holder_pid())).expect("node netns");
        let addr = SocketAddr::new(ip, port);
        let listener = ns
            .run(|| TcpListener::bind(addr))
            .unwrap()
            .unwrap_or_else(|e| panic!("witness on {addr}: {e}"));
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, from)) => {
                        let _ = conn.set_nonblocking(false);
                        let _ = conn.write_all(format!("{from}\n").as_bytes());
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Witness {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Witness {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One pod's probe results.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Probed {
    pub probes: u64,
    /// Answered by the witness through the peer (redirected).
    pub redirected: u64,
    /// Answered by the witness straight from the prober's socket: escaped redirection.
    pub escaped: u64,
    /// No answer (refused, timed out, closed before the witness answered).
    pub failed: u64,
    /// What the first failures were, for the report.
    pub errors: Vec<String>,
}

/// Probes from inside each of a set of pods until stopped (see the module docs).
pub struct Prober {
    stop: Arc<AtomicBool>,
    pods: BTreeMap<String, (Arc<Mutex<Probed>>, JoinHandle<()>)>,
    witness: SocketAddr,
}

impl Prober {
    pub fn new(witness: &Witness) -> Prober {
        Prober {
            stop: Arc::new(AtomicBool::new(false)),
            pods: BTreeMap::new(),
            witness: witness.addr,
        }
    }

    /// Starts probing from pod `name` (UID `uid`) on `node`.
    pub fn add<'a>(&mut self, node: impl Into<Node<'a>>, name: &str, uid: &str) {
        let path = node
            .into()
            .pod_netns(uid)
            .unwrap_or_else(|| panic!("no process of pod {name} on the node"));
        // Held open by the prober: the namespace cannot go away under it.
        let ns = Netns::open(&path).unwrap_or_else(|e| panic!("{name}'s netns: {e}"));
        let counts = Arc::new(Mutex::new(Probed::default()));
        let (stop, c, to) = (self.stop.clone(), counts.clone(), self.witness);
        let thread = std::thread::spawn(move || {
            ns.run(|| {
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let outcome = probe_once(to);
                    let mut c = c.lock().unwrap();
                    c.probes += 1;
                    match outcome {
                        Ok(true) => c.redirected += 1,
                        Ok(false) => c.escaped += 1,
                        Err(e) => {
                            c.failed += 1;
                            if c.errors.len() < 5 {
                                c.errors.push(e);
                            }
                        }
                    }
                    drop(c);
                    next += PROBE_INTERVAL;
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    } else {
                        next = now;
                    }
                }
            })
            .expect("enter the pod's netns")
        });
        self.pods.insert(name.to_string(), (counts, thread));
    }

    /// The results so far, per pod name.
    pub fn results(&self) -> BTreeMap<String, Probed> {
        self.pods
            .iter()
            .map(|(n, (c, _))| (n.clone(), c.lock().unwrap().clone()))
            .collect()
    }

    /// The results summed over every pod.
    pub fn total(&self) -> Probed {
        let mut t = Probed::default();
        for p in self.results().into_values() {
            t.probes += p.probes;
            t.redirected += p.redirected;
            t.escaped += p.escaped;
            t.failed += p.failed;
            t.errors.extend(p.errors);
        }
        t
    }

    /// Stops every prober and returns the final results.
    pub fn stop(mut self) -> BTreeMap<String, Probed> {
        self.stop.store(true, Ordering::Relaxed);
        let results = self.results();
        for (_, (_, t)) in std::mem::take(&mut self.pods) {
            let _ = t.join();
        }
        results
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One connection to the witness from this thread's namespace: `Ok(true)` when the witness saw
/// another socket than ours (the peer's), `Ok(false)` when it saw ours (escaped).
fn probe_once(to: SocketAddr) -> Result<bool, String> {
    let conn = TcpStream::connect_timeout(&to, Duration::from_secs(1))
        .map_err(|e| format!("connect: {e}"))?;
    let ours = conn.local_addr().map_err(|e| e.to_string())?;
    // Generous: on a loaded machine (two nodes, pods starting, other tests) an answer through the
    // peer took over 2 s a few times; a late answer still tells redirected from escaped.
    conn.set_read_timeout(Some(PROBE_READ_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&conn)
        .read_line(&mut line)
        .map_err(|e| format!("read: {e}"))?;
    let seen: SocketAddr = line
        .trim()
        .parse()
        .map_err(|_| format!("no answer ({line:?})"))?;
    Ok(seen != ours)
}

/// The plugin's socket on the node, where an agent serves ADDs.
pub const PLUGIN_EVENT_SOCKET: &str = "/run/istio-cni/pluginevent.sock";

/// When a sample was taken, and the inode of the socket an agent answered on (`None`: nobody).
type Sample = (Duration, Option<u64>);

/// Whether an agent serves `pluginevent.sock` on a node, sampled every 20 ms until stopped.
pub struct SocketWatch {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What a [`SocketWatch`] saw.
#[derive(Clone, Debug, Default)]
pub struct Served {
    /// The longest stretch without an agent serving ADDs.
    pub longest_gap: Duration,
    /// All such stretches added up.
    pub total_gap: Duration,
    /// How many different sockets (agents) answered, in order.
    pub agents: usize,
    pub samples: usize,
}

impl SocketWatch {
    /// Watches `node`'s socket (a `&RealNode` is its node 1).
    pub fn start<'a>(node: impl Into<Node<'a>>) -> SocketWatch {
        let path: PathBuf = node.into().node_path(PLUGIN_EVENT_SOCKET);
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (samples.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let t0 = Instant::now();
            while !st.load(Ordering::Relaxed) {
                let serving = std::os::unix::net::UnixStream::connect(&path)
                    .ok()
                    .and_then(|_| std::fs::metadata(&path).ok())
                    .map(|m| m.ino());
                s.lock().unwrap().push((t0.elapsed(), serving));
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        SocketWatch {
            samples,
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop(mut self) -> Served {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        served(&self.samples.lock().unwrap())
    }
}

impl Drop for SocketWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Gaps between samples: from the first sample nobody served to the next one somebody did.
fn served(samples: &[Sample]) -> Served {
    let mut out = Served {
        samples: samples.len(),
        ..Default::default()
    };
    let mut down_since: Option<Duration> = None;
    let mut last_agent = None;
    for (t, s) in samples {
        match (s, down_since) {
            (None, None) => down_since = Some(*t),
            (Some(_), Some(since)) => {
                let gap = *t - since;
                out.total_gap += gap;
                out.longest_gap = out.longest_gap.max(gap);
                down_since = None;
            }
            _ => {}
        }
        if let Some(ino) = s
            && last_agent != Some(*ino)
        {
            out.agents += 1;
            last_agent = Some(*ino);
        }
    }
    if let (Some(since), Some((end, _))) = (down_since, samples.last()) {
        let gap = *end - since;
        out.total_gap += gap;
        out.longest_gap = out.longest_gap.max(gap);
    }
    out
}

/// A pod [`create_during`] made, and how long its sandbox waited for its network: from the
/// create call to the pod's `PodReadyToStartContainers` condition (the kubelet sets it once the
/// sandbox, CNI ADD included, is up), observed every 50 ms.
#[derive(Clone, Debug)]
pub struct Created {
    pub name: String,
    pub uid: String,
    pub waited: Duration,
}

/// A pod [`create_during`] made whose sandbox was not up in time.
#[derive(Clone, Debug)]
pub struct NoSandbox {
    pub name: String,
}

/// Creates pod `make(i)` in `ns` every `every` until `done` is set (at least one), then waits
/// until each one's sandbox is up, or `wait` has passed.
pub async fn create_during(
    client: kube::Client,
    ns: String,
    every: Duration,
    wait: Duration,
    done: Arc<AtomicBool>,
    make: impl Fn(usize) -> serde_json::Value + Send + 'static,
) -> Vec<Result<Created, NoSandbox>> {
    let api = Api::<Pod>::namespaced(client, &ns);
    let mut waits = Vec::new();
    let mut i = 0;
    while i == 0 || !done.load(Ordering::Relaxed) {
        let pod: Pod = serde_json::from_value(make(i)).unwrap();
        let t0 = Instant::now();
        let created = api.create(&PostParams::default(), &pod).await.unwrap();
        let (name, uid) = (
            created.metadata.name.clone().unwrap(),
            created.metadata.uid.clone().unwrap(),
        );
        let api = api.clone();
        waits.push(tokio::spawn(async move {
            let deadline = t0 + wait;
            loop {
                if let Ok(Some(p)) = api.get_opt(&name).await
                    && sandbox_ready(&p)
                {
                    return Ok(Created {
                        name,
                        uid,
                        waited: t0.elapsed(),
                    });
                }
                if Instant::now() > deadline {
                    return Err(NoSandbox { name });
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
        i += 1;
        tokio::time::sleep(every).await;
    }
    let mut out = Vec::new();
    for w in waits {
        out.push(w.await.unwrap());
    }
    out
}

fn sandbox_ready(p: &Pod) -> bool {
    let conds = p.status.as_ref().and_then(|s| s.conditions.as_ref());
    conds.is_some_and(|cs| {
        cs.iter()
            .any(|c| c.type_ == "PodReadyToStartContainers" && c.status == "True")
    })
}

/// A pod's containers and sandbox: the same value later means the pod was not restarted (no
/// container restarted, same container IDs, same network namespace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Incarnation {
    pub restarts: i32,
    pub containers: Vec<String>,
    /// The inode of the sandbox's network namespace.
    pub netns: u64,
}

/// Pod `ns/name`'s [`Incarnation`] on `node` (a `&RealNode` is its node 1).
pub async fn incarnation<'a>(node: impl Into<Node<'a>>, ns: &str, name: &str) -> Incarnation {
    let node = node.into();
    let p = crate::real_node::get(node.cluster(), ns, name)
        .await
        .unwrap_or_else(|| panic!("{ns}/{name} is gone"));
    let uid = p.metadata.uid.clone().unwrap();
    let statuses = p
        .status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default();
    let netns = node
        .pod_netns(&uid)
        .and_then(|path| std::fs::metadata(path).ok())
        .map(|m| m.ino())
        .unwrap_or_else(|| panic!("{ns}/{name}: no sandbox on the node"));
    Incarnation {
        restarts: statuses.iter().map(|c| c.restart_count).sum(),
        containers: statuses
            .iter()
            .map(|c| c.container_id.clone().unwrap_or_default())
            .collect(),
        netns,
    }
}

/// Which agent runs on a node: the DaemonSet's image and its pods there.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentState {
    pub image: String,
    /// `name ready` of each agent pod.
    pub pods: Vec<String>,
}

pub fn agent_state(node: &crate::real_node::RealNode) -> AgentState {
    let image = crate::migrate::agent_image(node);
    let pods = crate::migrate::agent_pods(
        node,
        None,
        "jsonpath={range .items[*]}{.metadata.name} {.status.containerStatuses[0].ready} {.spec.containers[0].image}{\"\\n\"}{end}",
    );
    AgentState {
        image,
        pods: pods.lines().map(str::to_string).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_run_from_the_first_unserved_sample_to_the_next_served_one() {
        let ms = Duration::from_millis;
        let s = served(&[
            (ms(0), Some(1)),
            (ms(20), None),
            (ms(40), None),
            (ms(60), Some(2)),
            (ms(80), None),
            (ms(100), Some(2)),
        ]);
        assert_eq!(s.longest_gap, ms(40));
        assert_eq!(s.total_gap, ms(60));
        assert_eq!(s.agents, 2);
        assert_eq!(served(&[(ms(0), None), (ms(30), None)]).total_gap, ms(30));
    }
}
