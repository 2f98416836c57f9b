//! Issue #36, "keep your installer": Istio installed on the real node by Istio's own installers,
//! `istioctl install` (built from the pin) and the `ambient` umbrella chart (read from the
//! pinned module), with only the CNI image pointed at ours. Istio's `cni` chart alone is
//! `tests/istio_on_real_node/istio_agent.rs`.
//!
//! Each route on a node of its own, started once: istiod from the project's pilot build, our
//! agent under Istio's DaemonSet, ConfigMap and RBAC, and as ztunnel the test kit's ZDS peer run
//! by Istio's ztunnel chart (`deploy/node/*-ztunnel-peer.yaml`), or the real ztunnel under the
//! chart's own image name when the images carry it (`ZTUNNEL_BIN`). Checked for each: ambient
//! pods enrolled and redirected, istiod lists exactly our enrolled pods as HBONE, the agent's
//! `/readyz` is plain `ok` and its log has no warning; the installer run again with a changed
//! CNI image (an upgrade: the DaemonSet rolls) keeps the running pod redirected and enrolls new
//! ones; the installer's uninstall leaves the node as before the install (the CNI config byte
//! for byte, no chain, table, set, rule or file of ours).
//!
//! Needs root, the node binaries, istiod's and istioctl's builds (`tools/istio/build.sh`,
//! cached) and the images.

use std::process::Output;
use std::time::{Duration, Instant};

use testbed::istio_mesh::{Mesh, SYSTEM_NAMESPACE, ambient_chart, istioctl};
use testbed::migrate::{
    agent_image, agent_log, agent_readyz, host_state, loud_lines, peer_workloads, redirected_now,
    repo_path, wait_peer_has,
};
use testbed::real_node::{
    CONFLIST, RealNode, create, images_dir, wait_redirection, wait_running, witness, witness_pod,
};

/// One node at a time: a node with istiod is most of a core and a GB to start.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Our agent's image under each of the names Istio's installers render for it
/// (`scripts/node-images` tags it both ways).
const OURS: &str = "localhost/istio-cni-rs/install-cni:dev";
const OURS_DISTROLESS: &str = "localhost/istio-cni-rs/install-cni:dev-distroless";

/// One of Istio's installers, as a user runs it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Installer {
    /// `istioctl install -f deploy/node/istioctl-real-node.yaml`: our image by
    /// `values.cni.hub`/`tag`, so `…:dev-distroless` (the ambient profile's variant); the
    /// upgrade sets `values.cni.image` (verbatim) instead.
    Istioctl,
    /// `helm install` of Istio's `ambient` chart with `deploy/node/ambient-real-node.yaml`: our
    /// image by `cni.image` (verbatim); the upgrade names it by `cni.hub`/`tag`/`image` instead,
    /// so `…:dev-distroless`.
    AmbientChart,
}

/// What a run of the installer is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Run {
    /// The first install.
    Install,
    /// The install again with the CNI image named the other way (the DaemonSet rolls).
    Upgrade,
    /// [`Run::Upgrade`] plus a log level our agent refuses at start (a scope Istio's agent
    /// skips): the rollout must fail, with a short wait.
    Refused,
}

/// The log level of [`Run::Refused`].
const REFUSED_LEVEL: &str = "nosuchscope:debug";

impl Installer {
    /// The image the install renders, and the one the upgrade renders.
    fn images(self) -> (&'static str, &'static str) {
        match self {
            Installer::Istioctl => (OURS_DISTROLESS, OURS),
            Installer::AmbientChart => (OURS, OURS_DISTROLESS),
        }
    }

    /// The CNI values of `run` beyond the values files, as `cni.KEY=VALUE` (the umbrella chart's
    /// names; istioctl's are under `values.`).
    fn cni_values(self, run: Run) -> Vec<String> {
        let image = match (self, run) {
            (_, Run::Install) => vec![],
            (Installer::Istioctl, _) => vec![format!("cni.image={OURS}")],
            (Installer::AmbientChart, _) => vec![
                "cni.hub=localhost/istio-cni-rs".to_string(),
                "cni.tag=dev".to_string(),
                "cni.image=install-cni".to_string(),
            ],
        };
        let refused = (run == Run::Refused).then(|| format!("cni.logging.level={REFUSED_LEVEL}"));
        let prefix = match self {
            Installer::Istioctl => "values.",
            Installer::AmbientChart => "",
        };
        image
            .into_iter()
            .chain(refused)
            .map(|v| format!("{prefix}{v}"))
            .collect()
    }

    /// Runs the installer inside the node (it returns once it finds everything ready, or fails):
    /// its output.
    fn install(self, node: &RealNode, peer: bool, chart: &std::path::Path, run: Run) -> Output {
        let wait = if run == Run::Refused { "40s" } else { "5m" };
        let mut args: Vec<String> = match self {
            Installer::Istioctl => {
                let mut a: Vec<String> = vec![
                    "exec".into(),
                    istioctl().to_str().unwrap().into(),
                    "install".into(),
                    "-y".into(),
                    format!("--readiness-timeout={wait}"),
                    "-f".into(),
                    repo_path("deploy/node/istioctl-real-node.yaml"),
                ];
                if peer {
                    a.extend([
                        "-f".into(),
                        repo_path("deploy/node/istioctl-ztunnel-peer.yaml"),
                    ]);
                }
                a
            }
            Installer::AmbientChart => {
                let verb = if run == Run::Install {
                    "install"
                } else {
                    "upgrade"
                };
                let mut a: Vec<String> = vec![
                    "helm".into(),
                    verb.into(),
                    "ambient".into(),
                    chart.join("ambient").to_str().unwrap().into(),
                    "-n".into(),
                    SYSTEM_NAMESPACE.into(),
                    "--wait".into(),
                    format!("--timeout={wait}"),
                    "-f".into(),
                    repo_path("deploy/node/ambient-real-node.yaml"),
                ];
                if peer {
                    a.extend([
                        "-f".into(),
                        repo_path("deploy/node/ambient-ztunnel-peer.yaml"),
                    ]);
                }
                if run == Run::Install {
                    a.push("--create-namespace".into());
                }
                a
            }
        };
        for v in self.cni_values(run) {
            args.extend(["--set".into(), v]);
        }
        // istioctl runs inside the node (`exec`), helm as `scripts/real-node helm`.
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        node.try_script(&args)
    }

    fn uninstall(self, node: &RealNode) -> Output {
        let istioctl = istioctl();
        let args = match self {
            Installer::Istioctl => vec![
                "exec",
                istioctl.to_str().unwrap(),
                "uninstall",
                "--purge",
                "-y",
            ],
            Installer::AmbientChart => {
                vec![
                    "helm",
                    "uninstall",
                    "ambient",
                    "-n",
                    SYSTEM_NAMESPACE,
                    "--wait",
                ]
            }
        };
        node.try_script(&args)
    }
}

/// `out` of a command that must have succeeded.
fn ok(what: &str, out: Output) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Creates ambient pod `mesh/name` and checks it was enrolled: annotated, redirected from its
/// first connection, and known to the peer (when the peer is ztunnel). Returns its UID.
async fn enrolled(mesh: &Mesh, name: &str, peer: bool) -> String {
    let node = &mesh.node;
    let uid = create(node, "mesh", witness_pod(name, "sleep 3600")).await;
    wait_running(node, "mesh", name).await;
    wait_redirection(node, "mesh", name, Some("enabled")).await;
    assert_eq!(
        witness(node, "mesh", name),
        "REDIRECTED",
        "{name} started unredirected\n{}",
        agent_log(node)
    );
    if peer {
        wait_peer_has(node, &uid, true).await;
    }
    uid
}

/// Our agent is the one running, under the name `image`, ready with nothing to report, and has
/// logged no warning.
async fn agent_is_ours_and_quiet(node: &RealNode, image: &str, installer: Installer) {
    assert_eq!(agent_image(node), image, "{installer:?}");
    node.eventually(
        "the agent's /readyz ok",
        Duration::from_secs(30),
        || async { (agent_readyz(node) == "ok\n").then_some(()) },
    )
    .await;
    let log = agent_log(node);
    assert!(
        loud_lines(&log).is_empty(),
        "our agent under {installer:?} logged warnings a correct install has not:\n{log}"
    );
}

async fn drop_in(installer: Installer) {
    let started = Instant::now();
    let real_ztunnel = images_dir().join("ztunnel.tar").is_file();
    let mesh = Mesh::bare(real_ztunnel).await;
    let node = &mesh.node;
    let peer = !mesh.ztunnel;
    let chart = ambient_chart();
    let bare_conflist = node.read(CONFLIST).unwrap();
    let bare_host = host_state(node.into());
    let (first, second) = installer.images();

    ok(
        "the install",
        installer.install(node, peer, chart.path(), Run::Install),
    );
    let installed = started.elapsed();
    agent_is_ours_and_quiet(node, first, installer).await;
    node.namespace("mesh", true).await;
    node.namespace("plain", false).await;
    let before = enrolled(&mesh, "before", peer).await;
    create(node, "plain", witness_pod("plain", "sleep 3600")).await;
    wait_running(node, "plain", "plain").await;
    assert_eq!(witness(node, "plain", "plain"), "DIRECT");
    mesh.assert_istiod_agrees_with_the_agent().await;
    agent_is_ours_and_quiet(node, first, installer).await;

    // The same installer again with the CNI image named another way: the DaemonSet rolls, the
    // old agent takes the upgrade path, the new one adopts the running pod.
    ok(
        "the upgrade",
        installer.install(node, peer, chart.path(), Run::Upgrade),
    );
    node.rollout("istio-cni-node").await;
    agent_is_ours_and_quiet(node, second, installer).await;
    assert!(
        redirected_now(node, "mesh", "before"),
        "the running pod lost its redirection across the upgrade"
    );
    if peer {
        assert!(
            peer_workloads(node).contains_key(&before),
            "ztunnel lost the running pod across the upgrade"
        );
    }
    enrolled(&mesh, "after", peer).await;
    mesh.assert_istiod_agrees_with_the_agent().await;
    agent_is_ours_and_quiet(node, second, installer).await;

    // Bad input: a log level our agent refuses (Istio's skips an unknown scope). The rollout
    // fails, and the installer says so; the agent's log names the value. Running pods keep their
    // redirection, and an ambient pod created meanwhile does not start unredirected: once the
    // installer is run again without it, that pod starts redirected from its first connection.
    let refused = installer.install(node, peer, chart.path(), Run::Refused);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&refused.stdout),
        String::from_utf8_lossy(&refused.stderr)
    );
    // istioctl waits for every agent ready and fails. Helm's `--wait` counts a DaemonSet ready
    // with `maxUnavailable` (1) agents missing, so on this one node it reports success; the
    // rollout itself never completes, which `kubectl rollout status` shows for both.
    if installer == Installer::Istioctl {
        assert!(
            !refused.status.success(),
            "{installer:?} reported success for an agent that cannot start:\n{said}"
        );
    }
    let rollout = node.try_script(&[
        "kubectl",
        "-n",
        SYSTEM_NAMESPACE,
        "rollout",
        "status",
        "ds/istio-cni-node",
        "--timeout=20s",
    ]);
    assert!(
        !rollout.status.success(),
        "the rollout of an agent that cannot start completed"
    );
    eprintln!("{installer:?} on the refused value:\n{said}");
    let refused_log = node
        .eventually(
            "the agent's refusal in its log",
            Duration::from_secs(30),
            || async {
                let out = node.try_script(&[
                    "kubectl",
                    "-n",
                    SYSTEM_NAMESPACE,
                    "logs",
                    "ds/istio-cni-node",
                    "--tail=20",
                ]);
                let log = String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr);
                log.contains("nosuchscope").then_some(log)
            },
        )
        .await;
    assert!(refused_log.contains("unknown scope"), "{refused_log}");
    assert!(redirected_now(node, "mesh", "before"));
    create(node, "mesh", witness_pod("during", "sleep 3600")).await;
    ok(
        "the install again",
        installer.install(node, peer, chart.path(), Run::Upgrade),
    );
    node.rollout("istio-cni-node").await;
    wait_running(node, "mesh", "during").await;
    wait_redirection(node, "mesh", "during", Some("enabled")).await;
    assert_eq!(
        witness(node, "mesh", "during"),
        "REDIRECTED",
        "an ambient pod created while the agent could not start ran unredirected"
    );
    mesh.assert_istiod_agrees_with_the_agent().await;

    // Uninstall: the agent sees its DaemonSet gone and takes everything of ours off the node.
    ok("the uninstall", installer.uninstall(node));
    node.eventually(
        "the node's CNI config as before the install, byte for byte",
        Duration::from_secs(60),
        || async { (node.read(CONFLIST)? == bare_conflist).then_some(()) },
    )
    .await;
    node.eventually(
        "nothing of ours left on the node",
        Duration::from_secs(60),
        || async { (host_state(node.into()) == bare_host).then_some(()) },
    )
    .await;
    eprintln!(
        "{installer:?}: installed {:.0?} after the node's start, whole test {:.0?}",
        installed,
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istioctl_install_with_our_cni_image_enrolls_upgrades_and_uninstalls_cleanly() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    drop_in(Installer::Istioctl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istios_ambient_chart_with_our_cni_image_enrolls_upgrades_and_uninstalls_cleanly() {
    dataplane::enter_test_group!();
    dataplane::require_root!();
    let _one = ONE_NODE.lock().await;
    drop_in(Installer::AmbientChart).await;
}
