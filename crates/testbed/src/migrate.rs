//! Issue #22 on the real node ([`crate::real_node`]): our agent with the iptables backend, Istio's
//! own agent (its `cni` chart read from the pinned module, its binaries built from it into
//! `localhost/istio/install-cni:dev-distroless` by `scripts/node-images`), and the switch between the two.
//! Pods, the witness, the peer's view and the iptables rules of a pod or of the node, as the
//! tests of `tests/on_real_node/real_node_iptables.rs` and `tests/istio_on_real_node/istio_agent.rs` check them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::real_node::{Node, PEER, RealNode, VALUES};

/// Istio's image hub on the node: Istio's chart renders `<hub>/install-cni:<tag>`, and our hub
/// would name our image.
pub const ISTIO_HUB: &str = "localhost/istio";
/// Istio's image as its chart renders it with [`ISTIO_HUB`], tag `dev` and the `ambient` profile's
/// `distroless` variant ([`values_args`]).
pub const ISTIO_IMAGE: &str = "localhost/istio/install-cni:dev-distroless";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A file of the repository, as an absolute path (helm runs in the test's working directory).
pub fn repo_path(p: &str) -> String {
    repo().join(p).to_str().unwrap().to_string()
}

/// The pinned Istio's module directory (`tools/istio/moddir.sh`).
pub fn istio_moddir() -> PathBuf {
    let out = Command::new(repo().join("tools/istio/moddir.sh"))
        .output()
        .expect("tools/istio/moddir.sh");
    assert!(
        out.status.success(),
        "tools/istio/moddir.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Istio's own `istio-cni` chart, in the module.
pub fn istio_chart() -> String {
    let chart = istio_moddir().join("manifests/charts/istio-cni");
    assert!(
        chart.join("Chart.yaml").is_file(),
        "no Istio cni chart at {}",
        chart.display()
    );
    chart.to_str().unwrap().to_string()
}

/// Istio's plugin binary as built from the pin (`tools/istio/build.sh`; cached, so instant after
/// `scripts/node-images` built Istio's image).
pub fn istio_plugin_binary() -> Vec<u8> {
    let out = Command::new(repo().join("tools/istio/build.sh"))
        .args(["install-cni", "istio-cni"])
        .output()
        .expect("tools/istio/build.sh");
    assert!(out.status.success(), "tools/istio/build.sh failed");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let dir = stdout.lines().last().expect("the cache dir").trim();
    std::fs::read(Path::new(dir).join("istio-cni")).expect("Istio's istio-cni")
}

/// The helm arguments after `<release> <chart>` for either chart on the real node, with the
/// iptables backend: the same values file as ours (`deploy/node/values-real-node.yaml`: paths,
/// host network, pull policy), Istio's `ambient` profile and, for Istio's, Istio's hub and the
/// profile's `distroless` variant, which the values file clears for our images' `dev` tag.
pub fn values_args(istio: bool) -> Vec<String> {
    let mut args: Vec<String> = ["-n", "istio-system", "-f"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(repo_path(VALUES));
    args.extend(
        [
            "--set",
            "profile=ambient",
            "--set",
            "global.nativeNftables=false",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    if istio {
        args.extend(
            [
                "--set",
                &format!("global.hub={ISTIO_HUB}"),
                "--set",
                "global.variant=distroless",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
    }
    args
}

/// `helm <verb> istio-cni <chart>` with [`values_args`], then waits for the rollout.
pub async fn helm_cni(node: &RealNode, verb: &str, istio: bool) {
    helm_cni_with(node, verb, istio, &[]).await;
}

/// [`helm_cni`] with `extra` helm arguments after the values (e.g. [`ON_DELETE`]), then waits
/// for the agents.
pub async fn helm_cni_with(node: &RealNode, verb: &str, istio: bool, extra: &[&str]) {
    helm_cni_run(node, verb, istio, extra);
    if extra
        .iter()
        .any(|a| a.ends_with("updateStrategy.type=OnDelete"))
    {
        // No rollout to wait for (kubectl's `rollout status` knows only RollingUpdate).
        wait_agents_ready(node).await;
    } else {
        node.rollout("istio-cni-node").await;
    }
}

/// `helm <verb> istio-cni <chart>` with [`values_args`] and then `extra` (more `--set`s, which
/// win over the values before them); returns helm's output and does not wait for the rollout.
pub fn helm_cni_run(node: &RealNode, verb: &str, istio: bool, extra: &[&str]) -> String {
    let chart = if istio {
        istio_chart()
    } else {
        repo_path(crate::real_node::CHART)
    };
    let mut args = vec![verb.to_string(), "istio-cni".into(), chart];
    if verb == "install" {
        args.push("--create-namespace".into());
    }
    args.extend(values_args(istio));
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    node.helm(&args)
}

/// Waits until the agent DaemonSet's controller saw its current spec and every scheduled agent
/// pod is ready (whatever its template: with [`ON_DELETE`], old pods count).
pub async fn wait_agents_ready(node: &RealNode) {
    node.eventually("every agent pod ready", Duration::from_secs(90), || {
        let out = node.try_script(&[
            "kubectl",
            "-n",
            "istio-system",
            "get",
            "ds",
            "istio-cni-node",
            "-o",
            "jsonpath={.metadata.generation} {.status.observedGeneration} \
             {.status.desiredNumberScheduled} {.status.numberReady}",
        ]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        async move {
            let n: Vec<&str> = text.split_whitespace().collect();
            (n.len() == 4 && n[0] == n[1] && n[2] == n[3] && n[2] != "0").then_some(())
        }
    })
    .await;
}

/// Helm arguments (either chart) for a DaemonSet that replaces a node's agent pod only when that
/// pod is deleted (`updateStrategy: OnDelete`): after a `helm upgrade` to the other chart, each
/// node keeps its agent until its pod is deleted, one node (pool) at a time.
pub const ON_DELETE: &[&str] = &[
    "--set",
    "updateStrategy.type=OnDelete",
    "--set",
    "updateStrategy.rollingUpdate=null",
];

/// `kubectl get pods` of the agent's DaemonSet (on node `on` only, if given) printed as
/// `output` (`-o`); the command's output, failures included (a step may be retried).
pub fn get_agent_pods(real: &RealNode, on: Option<&str>, output: &str) -> Output {
    let node_is = on.map(|name| format!("spec.nodeName={name}"));
    let mut args = vec![
        "kubectl",
        "-n",
        "istio-system",
        "get",
        "pods",
        "-l",
        "k8s-app=istio-cni-node",
        "-o",
        output,
    ];
    if let Some(node_is) = &node_is {
        args.extend(["--field-selector", node_is]);
    }
    real.try_script(&args)
}

/// [`get_agent_pods`] that must succeed: its stdout.
pub fn agent_pods(real: &RealNode, on: Option<&str>, output: &str) -> String {
    let out = get_agent_pods(real, on, output);
    assert!(
        out.status.success(),
        "kubectl get pods of the agent failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The agent pod (`istio-cni-node`) running on `node`, by name.
pub fn agent_pod<'a>(node: impl Into<Node<'a>>) -> String {
    let node = node.into();
    let name = node.name();
    agent_pods(
        node.cluster(),
        Some(&name),
        "jsonpath={.items[*].metadata.name}",
    )
    .split_whitespace()
    .next()
    .unwrap_or_else(|| panic!("no agent pod on {name}"))
    .to_string()
}

/// The image of the agent pod running on `node` (with [`ON_DELETE`], not the DaemonSet's).
pub fn agent_pod_image<'a>(node: impl Into<Node<'a>>) -> String {
    let node = node.into();
    node.cluster().kubectl(&[
        "-n",
        "istio-system",
        "get",
        "pod",
        &agent_pod(node),
        "-o",
        "jsonpath={.spec.containers[0].image}",
    ])
}

/// Deletes the agent pod on `node` and waits until the DaemonSet's replacement runs there (with
/// [`ON_DELETE`]: the node switches to the DaemonSet's current template).
pub async fn replace_agent_pod<'a>(node: impl Into<Node<'a>>) {
    let node = node.into();
    let old = agent_pod(node);
    let real = node.cluster();
    real.kubectl(&["-n", "istio-system", "delete", "pod", &old, "--wait=true"]);
    real.eventually(
        &format!("a new agent pod on {}", node.name()),
        Duration::from_secs(90),
        || async {
            let out = get_agent_pods(
                real,
                Some(&node.name()),
                "jsonpath={range .items[*]}{.metadata.name} {.status.containerStatuses[0].ready}{\"\\n\"}{end}",
            );
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.lines()
                .any(|l| !l.starts_with(&format!("{old} ")) && l.ends_with(" true"))
                .then_some(())
        },
    )
    .await;
}

/// The ztunnel-like peer (`deploy/node/ztunnel-peer.yaml`), rolled out.
pub async fn install_peer(node: &RealNode) {
    node.kubectl(&["apply", "-f", &repo_path(PEER)]);
    node.rollout("ztunnel").await;
}

/// The image of the agent's DaemonSet as it is now.
pub fn agent_image(node: &RealNode) -> String {
    node.kubectl(&[
        "-n",
        "istio-system",
        "get",
        "ds",
        "istio-cni-node",
        "-o",
        "jsonpath={.spec.template.spec.containers[0].image}",
    ])
}

/// The current agent pod's log.
pub fn agent_log(node: &RealNode) -> String {
    let out = node.try_script(&[
        "kubectl",
        "-n",
        "istio-system",
        "logs",
        "ds/istio-cni-node",
        "--tail=-1",
    ]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Lines of an agent log (Istio's format: time, level, scope, message) at `warn` or above.
pub fn loud_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| matches!(l.split('\t').nth(1), Some("warn" | "error" | "fatal")))
        .collect()
}

/// `GET /readyz` of the agent, at its pod's IP: the node's on the host network (our chart,
/// `ambient.shareHostNetworkNamespace`), its own otherwise (Istio's installers' default): its
/// body, empty when there is no answer.
pub fn agent_readyz(node: &RealNode) -> String {
    let ip = agent_pods(node, None, "jsonpath={.items[0].status.podIP}");
    let url = format!("http://{}:8000/readyz", ip.trim());
    let out = node.try_script(&["exec", "curl", "-s", "-m", "5", &url]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The witness again, now, in the running pod (`kubectl exec`): whether its outbound still lands
/// on a proxy listener.
pub fn redirected_now(node: &RealNode, ns: &str, name: &str) -> bool {
    let out = node.kubectl(&[
        "-n",
        ns,
        "exec",
        name,
        "-c",
        "app",
        "--",
        "sh",
        "-c",
        crate::real_node::WITNESS,
    ]);
    match out.trim() {
        "REDIRECTED" => true,
        "DIRECT" => false,
        other => panic!("{ns}/{name}: no witness in {other:?}"),
    }
}

/// The peer's workloads on `node` (a [`RealNode`] is its node 1): pod UID → proxied connections.
pub fn peer_workloads<'a>(node: impl Into<Node<'a>>) -> std::collections::BTreeMap<String, u64> {
    let Some(st) = node.into().peer_status() else {
        return Default::default();
    };
    st["workloads"]
        .as_object()
        .map(|w| {
            w.iter()
                .map(|(uid, v)| (uid.clone(), v["connections"].as_u64().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until the peer on `node` has workload `uid` (`present`) or not.
pub async fn wait_peer_has<'a>(node: impl Into<Node<'a>>, uid: &str, present: bool) {
    let node = node.into();
    node.cluster()
        .eventually(
            &format!("peer on {} has {uid}: {present}", node.name()),
            Duration::from_secs(60),
            || async { (peer_workloads(node).contains_key(uid) == present).then_some(()) },
        )
        .await
}

/// One connection the peer's in-pod listeners accepted for a workload (its status' `accepted`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAccepted {
    /// The listener: 15001 outbound, 15006 inbound plaintext, 15008 HBONE, 15053 DNS.
    pub port: u16,
    /// The client's address as the listener saw it.
    pub peer: String,
    /// Where the connection was going before it was redirected.
    pub original_dst: Option<String>,
}

/// What the peer on `node` accepted for workload `uid` so far (empty when it has no such
/// workload).
pub fn peer_accepted<'a>(node: impl Into<Node<'a>>, uid: &str) -> Vec<PeerAccepted> {
    let Some(st) = node.into().peer_status() else {
        return Vec::new();
    };
    st["workloads"][uid]["accepted"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| PeerAccepted {
            port: a["port"].as_u64().unwrap_or_default() as u16,
            peer: a["peer"].as_str().unwrap_or_default().to_string(),
            original_dst: a["original_dst"].as_str().map(str::to_string),
        })
        .collect()
}

/// `cmd args` from this machine's tools in network namespace `netns`; panics on failure.
pub fn netns_exec(netns: &Path, cmd: &str, args: &[&str]) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("nsenter {cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} in {} failed: {}",
        netns.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The iptables rules of a network namespace, in each variant.
#[derive(Debug)]
pub struct Rules {
    pub nft: String,
    pub legacy: String,
}

impl Rules {
    pub fn of(netns: &Path) -> Self {
        Rules {
            nft: normalized(&netns_exec(netns, "iptables-nft-save", &[])),
            legacy: normalized(&netns_exec(netns, "iptables-legacy-save", &[])),
        }
    }
}

/// iptables-save output without its comments and counters: the rules themselves.
pub fn normalized(save: &str) -> String {
    save.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match (l.starts_with(':'), l.rfind(" [")) {
            (true, Some(i)) => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The rules of pod `uid`'s network namespace (on `node`: a [`RealNode`] is its node 1).
pub fn pod_rules<'a>(node: impl Into<Node<'a>>, uid: &str) -> Rules {
    let netns = node
        .into()
        .pod_netns(uid)
        .unwrap_or_else(|| panic!("no process of pod {uid} on the node"));
    Rules::of(&netns)
}

/// The rules of the node's own network namespace (the agents' host rules, kubelet's chains; a
/// [`RealNode`] is its node 1).
pub fn node_rules<'a>(node: impl Into<Node<'a>>) -> Rules {
    Rules::of(Path::new(&format!(
        "/proc/{}/ns/net",
        node.into().holder_pid()
    )))
}

/// What of either agent is on the node besides the pods: host chains (both iptables variants),
/// nftables tables, ipsets, policy routing rules, and files.
pub fn host_state(node: Node<'_>) -> std::collections::BTreeMap<&'static str, String> {
    let ns = PathBuf::from(format!("/proc/{}/ns/net", node.holder_pid()));
    let rules = node_rules(node);
    let istio_lines = |s: &str| {
        s.lines()
            .filter(|l| l.contains("ISTIO") || l.contains("istio"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut out = std::collections::BTreeMap::new();
    out.insert("iptables-nft", istio_lines(&rules.nft));
    out.insert("iptables-legacy", istio_lines(&rules.legacy));
    out.insert(
        "nft tables",
        istio_lines(&netns_exec(&ns, "nft", &["list", "tables"])),
    );
    out.insert(
        "ipsets",
        istio_lines(&netns_exec(&ns, "ipset", &["list", "-n"])),
    );
    out.insert("ip rules", netns_exec(&ns, "ip", &["rule", "list"]));
    out.insert(
        "ip rules v6",
        netns_exec(&ns, "ip", &["-6", "rule", "list"]),
    );
    out.insert(
        "route table 100",
        netns_exec(&ns, "ip", &["route", "show", "table", "all"])
            .lines()
            .filter(|l| l.contains("table 100"))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    out.insert("/etc/cni/net.d", ls(node, "/etc/cni/net.d"));
    out.insert("/opt/cni/bin/istio-cni", ls(node, "/opt/cni/bin/istio-cni"));
    // Istio's plugin writes every record into istio-cni.log there and Istio's uninstall leaves
    // it; it is Istio's file (ours writes it only with records the agent could not take, and
    // never without Istio having written it first here), so it is not counted.
    out.insert(
        "/run/istio-cni",
        ls(node, "/run/istio-cni")
            .lines()
            .filter(|l| *l != "istio-cni.log")
            .collect::<Vec<_>>()
            .join("\n"),
    );
    out
}

/// `ls -A path` on the node (empty when there is no such path).
pub fn ls(node: Node<'_>, path: &str) -> String {
    let out = node.try_script(&["exec", "ls", "-A", path]);
    if out.status.success() {
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    } else {
        String::new()
    }
}

/// Makes the node a legacy-iptables one, as a distribution defaulting to legacy would have it:
/// the node's `iptables`/`ip6tables` alternatives set to legacy (in its own `/etc` and
/// `/var/lib`, not the machine's), kubelet's nft chains removed from the node's namespace, and
/// kubelet restarted, which writes its `KUBE-IPTABLES-HINT` and canaries with legacy.
pub async fn make_node_legacy(node: &RealNode) {
    node.script(&[
        "exec",
        "sh",
        "-c",
        "update-alternatives --set iptables /usr/sbin/iptables-legacy >/dev/null && \
         update-alternatives --set ip6tables /usr/sbin/ip6tables-legacy >/dev/null",
    ]);
    let netns = PathBuf::from(format!("/proc/{}/ns/net", node.holder_pid()));
    let tables = netns_exec(&netns, "nft", &["list", "tables"]);
    for t in tables.lines() {
        let words: Vec<&str> = t.split_whitespace().collect();
        if let ["table", family, name] = words[..] {
            netns_exec(&netns, "nft", &["delete", "table", family, name]);
        }
    }
    node.restart("kubelet").await;
    node.eventually(
        "kubelet's iptables hint in legacy",
        Duration::from_secs(30),
        || async {
            node_rules(node)
                .legacy
                .contains(":KUBE-IPTABLES-HINT")
                .then_some(())
        },
    )
    .await;
    assert!(!node_rules(node).nft.contains("KUBE-"));
}
