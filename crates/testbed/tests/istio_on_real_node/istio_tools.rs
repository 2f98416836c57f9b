//! Istio's own sidecar injection and istioctl's tools against our agent, on the real node with
//! Istio's mesh around it (`scripts/real-node mesh`, [`Mesh`]): istiod from the pin, installed
//! with Istio's charts with CNI on (`pilot.cni.enabled`), our chart as the node agent (issue #36).
//!
//! Sidecar mode is the larger installed base of istio-cni: istiod's webhook injects a pod of a
//! namespace labelled `istio-injection=enabled`, and with CNI on its `istio-validation` init
//! container (Istio's `pilot-agent` from the pin, in the proxyv2 image `scripts/node-images`
//! builds) only checks the redirection the node agent's plugin programmed from the injected
//! annotations. Envoy is not built here: in the image, pilot-agent starts a stand-in on Envoy's
//! ports (`deploy/node/envoy-stand-in`), whose capture ports answer with their own number.
//! The API server reaches istiod's webhook as on any cluster: it runs in the node's network
//! namespace, where kube-proxy sends the `istiod` Service's IP to istiod's pod, and istiod puts
//! its CA into its webhook configuration itself.
//!
//! istioctl (`tools/istio/build.sh istioctl`) runs inside the node as a user runs it against
//! the cluster. `istioctl ztunnel-config` needs the real ztunnel (`ZTUNNEL_BIN`); without it that
//! test prints `SKIPPED`.
//!
//! Needs root, the node binaries, istiod's and pilot-agent's builds (cached) and the images.

use std::process::Output;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use testbed::istio_mesh::{Mesh, istioctl};
use testbed::migrate::{agent_log, agent_pod, netns_exec};
use testbed::real_node::{GATEWAY, RealNode, busybox_pod, create, get, wait_running};

/// A node with a mesh at a time: each is several hundred MB of processes.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The namespace istiod's injector watches in these tests.
const INJECTED: &str = "injected";

/// The proxy image istiod's injector names with the mesh's `global.hub`/`global.tag` and the
/// ambient profile's `distroless` variant.
const PROXY_IMAGE: &str = "localhost/istio-cni-rs/proxyv2:dev-distroless";

/// `istioctl ARGS` inside the node (the cluster admin's kubeconfig): its output, whatever it is.
fn run_istioctl(node: &RealNode, args: &[&str]) -> Output {
    let bin = istioctl();
    let mut all = vec!["exec", bin.to_str().unwrap()];
    all.extend_from_slice(args);
    node.try_script(&all)
}

/// [`run_istioctl`] that must succeed: stdout and stderr together, as a user reads them.
fn istioctl_ok(node: &RealNode, args: &[&str]) -> String {
    let out = run_istioctl(node, args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "istioctl {args:?} failed:\n{text}");
    text
}

/// An app that connects out to a closed port on the node (the bridge gateway) until something
/// answers, then prints what answered: redirected, the stand-in's outbound port says `15001`.
fn injected_app(name: &str) -> serde_json::Value {
    let script = format!(
        "for i in $(seq 1 40); do out=$(nc -w 2 {GATEWAY} 9 </dev/null) && [ -n \"$out\" ] && break; \
         sleep 0.5; done; echo \"outbound: $out\"; sleep 3600"
    );
    busybox_pod(name, &["sh", "-c", &script])
}

/// Chain `name` of an `nft list table` output: its lines up to its closing brace.
fn chain<'a>(table: &'a str, name: &str) -> &'a str {
    let start = table
        .find(&format!("chain {name} {{"))
        .unwrap_or_else(|| panic!("no chain {name} in\n{table}"));
    let body = &table[start..];
    &body[..body.find('}').unwrap_or(body.len())]
}

/// The names of a pod's init containers, and its containers.
fn container_names(p: &Pod) -> (Vec<String>, Vec<String>) {
    let spec = p.spec.as_ref().expect("a pod spec");
    let names = |cs: &[k8s_openapi::api::core::v1::Container]| -> Vec<String> {
        cs.iter().map(|c| c.name.clone()).collect()
    };
    (
        names(spec.init_containers.as_deref().unwrap_or_default()),
        names(&spec.containers),
    )
}

/// Sidecar mode through istiod's injector, then istioctl's tools on the same mesh: `x precheck`
/// and `analyze` find nothing to complain about, and `bug-report` collects our agent's pod, log
/// (the plugin's lines for the injected pod included), DaemonSet and ConfigMap where it looks
/// for Istio's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiods_injector_and_istioctls_tools_work_with_our_agent() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    let started = Instant::now();
    let mesh = Mesh::up(false).await;
    eprintln!("mesh up in {:.1}s", started.elapsed().as_secs_f64());
    let node = &mesh.node;
    node.kubectl(&["create", "namespace", INJECTED]);
    node.kubectl(&["label", "namespace", INJECTED, "istio-injection=enabled"]);

    // istiod's webhook injects the pod: with CNI on, istio-validation and no istio-init.
    let uid = create(node, INJECTED, injected_app("app")).await;
    let pod = get(node, INJECTED, "app").await.expect("the injected pod");
    let (inits, containers) = container_names(&pod);
    assert!(
        inits.contains(&"istio-validation".to_string()) && !inits.contains(&"istio-init".into()),
        "istiod did not inject the CNI variant: init containers {inits:?}"
    );
    assert!(
        inits.contains(&"istio-proxy".to_string()) || containers.contains(&"istio-proxy".into()),
        "no istio-proxy injected: {inits:?} {containers:?}"
    );
    let spec = pod.spec.as_ref().unwrap();
    let validation = spec
        .init_containers
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|c| c.name == "istio-validation")
        .unwrap();
    assert_eq!(validation.image.as_deref(), Some(PROXY_IMAGE));
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    assert!(
        annotations.contains_key("sidecar.istio.io/status"),
        "{annotations:?}"
    );
    assert_eq!(
        annotations
            .get("traffic.sidecar.istio.io/excludeInboundPorts")
            .map(String::as_str),
        Some("15020"),
        "istiod's injected exclusion (checked in the rules below)"
    );

    // Every container runs and is ready: istio-validation passed on the rules our plugin wrote.
    let running = wait_running(node, INJECTED, "app").await;
    let validated = node.kubectl(&["-n", INJECTED, "logs", "app", "-c", "istio-validation"]);
    assert!(
        validated.contains("Validation passed, iptables rules established"),
        "istio-validation:\n{validated}"
    );
    // The mesh's agent programs nftables: its table in the pod, the capture ports and, in the
    // inbound chain, the exclusion from the injected annotation.
    let netns = node.pod_netns(&uid).expect("the injected pod's netns");
    let rules = netns_exec(&netns, "nft", &["list", "table", "inet", "istio-proxy-nat"]);
    let inbound = chain(&rules, "istio-inbound");
    for (want, within) in [
        ("redirect to :15001", rules.as_str()),
        ("redirect to :15006", rules.as_str()),
        ("tcp dport 15020 ", inbound),
    ] {
        assert!(
            within.contains(want),
            "no {want:?} in the injected pod's rules\n{rules}\n{}",
            agent_log(node)
        );
    }

    // The app's traffic lands on the proxy's ports: its outbound on 15001, and a connection to
    // it from the node on 15006.
    let printed = node
        .eventually(
            "the app's outbound witness",
            Duration::from_secs(60),
            || {
                let logs = node.kubectl(&["-n", INJECTED, "logs", "app", "-c", "app"]);
                async move {
                    logs.lines()
                        .find_map(|l| l.strip_prefix("outbound: "))
                        .map(str::to_string)
                }
            },
        )
        .await;
    assert_eq!(printed, "15001", "the app's outbound did not land on 15001");
    let ip = running
        .status
        .and_then(|s| s.pod_ip)
        .expect("a running pod's IP");
    let answered = node.try_script(&["exec", "busybox", "nc", "-w", "2", &ip, "8080"]);
    assert_eq!(
        String::from_utf8_lossy(&answered.stdout).trim(),
        "15006",
        "a connection to the app's port 8080 did not land on 15006"
    );

    // istioctl x precheck: nothing to fix before an install or upgrade.
    let precheck = istioctl_ok(node, &["x", "precheck"]);
    assert!(
        precheck.contains("No issues found when checking the cluster"),
        "{precheck}"
    );

    // istioctl analyze: no warning or error anywhere (an info about the `default` namespace's
    // missing injection label is expected).
    let analyze = istioctl_ok(node, &["analyze", "--all-namespaces"]);
    let loud: Vec<&str> = analyze
        .lines()
        .filter(|l| l.starts_with("Error") || l.starts_with("Warning"))
        .collect();
    assert!(loud.is_empty(), "istioctl analyze:\n{analyze}");

    // istioctl bug-report: it takes the pods labelled k8s-app=istio-cni-node for the CNI agent
    // and archives each one's log as cni/<pod>/cni.log, with the cluster's resources.
    let out_dir = node.dir().join("bug-report");
    std::fs::create_dir_all(&out_dir).unwrap();
    let report = istioctl_ok(
        node,
        &[
            "bug-report",
            "--output-dir",
            out_dir.to_str().unwrap(),
            "--timeout",
            "3m",
        ],
    );
    assert!(
        report.contains("Fetching CNI logs from cluster"),
        "{report}"
    );
    let unpacked = out_dir.join("unpacked");
    std::fs::create_dir_all(&unpacked).unwrap();
    let tar = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(out_dir.join("bug-report.tar.gz"))
        .arg("-C")
        .arg(&unpacked)
        .status()
        .expect("tar");
    assert!(tar.success(), "bug-report.tar.gz does not unpack");
    let root = unpacked.join("bug-report");
    let agent_pod = agent_pod(node);
    let cni_log = std::fs::read_to_string(root.join("cni").join(&agent_pod).join("cni.log"))
        .unwrap_or_else(|e| panic!("no cni/{agent_pod}/cni.log in the bug report: {e}"));
    for want in [
        "\tinfo\tcni-agent\tagent configuration",
        "\tinfo\tcni-plugin\tsidecar redirection programmed",
        &format!("pod={INJECTED}/app"),
    ] {
        assert!(
            cni_log.contains(want),
            "the bug report's agent log lacks {want:?}:\n{cni_log}"
        );
    }
    let resources = std::fs::read_to_string(root.join("cluster/k8s-resources")).unwrap();
    for want in ["name: istio-cni-node", "name: istio-cni-config"] {
        assert!(
            resources.contains(want),
            "the bug report's resources lack {want:?}"
        );
    }
    eprintln!(
        "injection and istioctl's tools checked in {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

/// `istioctl ztunnel-config workloads` against the real ztunnel fed by our agent: an ambient
/// pod is HBONE, a pod of a namespace outside the mesh is TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istioctl_ztunnel_config_lists_our_enrolled_pods_hbone() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    if std::env::var_os("ZTUNNEL_BIN").is_none() {
        println!("SKIPPED: istioctl ztunnel-config needs the real ztunnel (set ZTUNNEL_BIN)");
        return;
    }
    let _one = ONE_NODE.lock().await;
    let mesh = Mesh::up(true).await;
    let node = &mesh.node;
    assert!(
        node.has_real_ztunnel(),
        "ZTUNNEL_BIN is set but the node's images have no ztunnel.tar"
    );
    node.namespace("mesh", true).await;
    node.namespace("plain", false).await;
    create(node, "mesh", busybox_pod("enrolled", &["sleep", "3600"])).await;
    create(node, "plain", busybox_pod("outside", &["sleep", "3600"])).await;
    wait_running(node, "mesh", "enrolled").await;
    wait_running(node, "plain", "outside").await;
    let protocol = |table: &str, ns: &str, name: &str| -> Option<String> {
        table
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() >= 3 && f[0] == ns && f[1] == name)
            .and_then(|f| f.last().map(|p| p.to_string()))
    };
    let table = node
        .eventually("ztunnel lists both pods", Duration::from_secs(60), || {
            // ztunnel's admin port answers once ztunnel is up: until then, retried.
            let out = run_istioctl(node, &["ztunnel-config", "workloads"]);
            let table = String::from_utf8_lossy(&out.stdout).into_owned();
            async move {
                (protocol(&table, "mesh", "enrolled").is_some()
                    && protocol(&table, "plain", "outside").is_some())
                .then_some(table)
            }
        })
        .await;
    assert_eq!(
        protocol(&table, "mesh", "enrolled").as_deref(),
        Some("HBONE"),
        "{table}"
    );
    assert_eq!(
        protocol(&table, "plain", "outside").as_deref(),
        Some("TCP"),
        "{table}"
    );
}
