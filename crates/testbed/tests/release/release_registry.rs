//! `scripts/release --push` against a real registry (CNCF distribution's, on loopback): the
//! index is served under both tags with the digest the release printed, for both platforms, and
//! built twice the same (`--check-reproducible`); the chart comes back with `helm pull oci://…`
//! and renders the pushed image. Then a real node (`scripts/real-node`) gets the release as a
//! user's cluster does, from the registry alone: `helm install oci://…` with Istio's ambient
//! profile, its containerd pulling the `-distroless` tag; a manifest altered in the registry
//! fails the pod's pull and never runs. A push to a registry that is not there fails naming it.

use std::process::{Command, Output};
use std::time::Duration;

use serde_json::{Value, json};
use testbed::manifests::helm;
use testbed::real_node::{self, RealNode};
use testbed::registry::Registry;

fn release(args: &[&str], out: &std::path::Path) -> Output {
    Command::new(testbed::manifests::repo_file("scripts/release"))
        .arg("--allow-dirty")
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

// One release build for everything (it is the slow part): the registry's view, then a node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_pushed_to_a_registry_is_served_as_built_and_installs_on_a_node_from_there() {
    dataplane::enter_test_group!();
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start();
    let reg = registry.address();
    let dist = tmp.path().join("dist");
    let out = release(
        &["--push", &reg, "--plain-http", "--check-reproducible"],
        &dist,
    );
    assert!(
        out.status.success(),
        "scripts/release: {}",
        text(&out.stderr)
    );
    let stdout = text(&out.stdout);
    let (reference, digest) = stdout.lines().last().unwrap().split_once(' ').unwrap();
    let version = reference.rsplit_once(':').unwrap().1;
    assert_eq!(reference, format!("{reg}/install-cni:{version}"));
    assert!(text(&out.stderr).contains(&format!("two builds give index {digest}")));

    let mut amd64_manifest = String::new();
    for tag in [version.to_string(), format!("{version}-distroless")] {
        let raw = Command::new("skopeo")
            .args(["inspect", "--raw", "--tls-verify=false"])
            .arg(format!("docker://{reg}/install-cni:{tag}"))
            .output()
            .unwrap();
        assert!(
            raw.status.success(),
            "skopeo inspect {tag}: {}",
            text(&raw.stderr)
        );
        let index: Value = serde_json::from_slice(&raw.stdout).unwrap();
        let arches: Vec<_> = index["manifests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["platform"]["architecture"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(arches, ["amd64", "arm64"], "{tag}");
        amd64_manifest = index["manifests"][0]["digest"].as_str().unwrap().into();
        assert_eq!(
            index["annotations"]["org.opencontainers.image.version"],
            version
        );
        // The registry serves the very bytes the release wrote (the digest it printed).
        let served = sha256_of(&raw.stdout);
        assert_eq!(served, digest, "{tag}");
    }

    // The chart from the registry, its default image the pushed one.
    let pulled = tmp.path().join("pulled");
    std::fs::create_dir_all(&pulled).unwrap();
    let pull = Command::new(helm())
        .args([
            "pull",
            &format!("oci://{reg}/charts/cni"),
            "--version",
            version,
            "--plain-http",
        ])
        .arg("-d")
        .arg(&pulled)
        .output()
        .unwrap();
    assert!(pull.status.success(), "helm pull: {}", text(&pull.stderr));
    let rendered = Command::new(helm())
        .arg("template")
        .arg(pulled.join(format!("cni-{version}.tgz")))
        .output()
        .unwrap();
    assert!(
        rendered.status.success(),
        "helm template: {}",
        text(&rendered.stderr)
    );
    let image = format!("image: \"{reg}/install-cni:{version}\"");
    assert!(
        text(&rendered.stdout).contains(&image),
        "no {image} in the chart's output"
    );

    from_the_registry_onto_a_node(&registry, version, digest, &amd64_manifest, &dist).await;

    // The same push with nothing listening: an error that names the registry.
    drop(registry);
    let out = release(&["--push", &reg, "--plain-http"], &tmp.path().join("dist2"));
    assert!(
        !out.status.success(),
        "a push to a stopped registry succeeded"
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!("pushing install-cni:{version} to {reg} failed")),
        "{stderr}"
    );
}

/// A real node given nothing but the registry (reachable inside it at the same address): first a
/// pod of the release's image while the registry serves an altered amd64 manifest under its
/// digest (same size, one digit of the config's digest changed: an image we did not build), then,
/// the registry's bytes restored, our chart as a user installs it: `helm install oci://…` with
/// Istio's ambient profile, so the agent's image is `<hub>/install-cni:<version>-distroless`.
async fn from_the_registry_onto_a_node(
    registry: &Registry,
    version: &str,
    index_digest: &str,
    amd64_manifest: &str,
    dist: &std::path::Path,
) {
    let reg = registry.address();
    let node = RealNode::up().await;
    let _forward = node.forward_loopback(registry.port());

    let stored = registry.blob_path(amd64_manifest);
    let good = std::fs::read(&stored).unwrap();
    let text = String::from_utf8(good.clone()).unwrap();
    let at = text.find("\"sha256:").unwrap() + "\"sha256:".len();
    let mut altered = good.clone();
    altered[at] = if altered[at] == b'0' { b'1' } else { b'0' };
    std::fs::write(&stored, &altered).unwrap();

    let image = format!("{reg}/install-cni:{version}");
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "altered", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "agent", "image": image, "args": ["version"]}]
        }
    });
    real_node::create(&node, "default", pod).await;
    let failed = node
        .eventually(
            "the altered manifest's pull failing",
            Duration::from_secs(90),
            || {
                let events = node.kubectl(&[
                    "-n",
                    "default",
                    "get",
                    "events",
                    "-o",
                    "json",
                    "--field-selector",
                    "involvedObject.name=altered,reason=Failed",
                ]);
                let events: Value = serde_json::from_str(&events).unwrap();
                let message = events["items"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|e| e["message"].as_str())
                    .find(|m| m.contains("ailed to pull"))
                    .map(str::to_string);
                async move { message }
            },
        )
        .await;
    assert!(
        failed.contains(amd64_manifest) && failed.contains("digest"),
        "the pull failed for another reason than the manifest's digest: {failed}"
    );
    let pod = real_node::get(&node, "default", "altered").await.unwrap();
    let status = pod.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Pending"));
    for c in status.container_statuses.unwrap_or_default() {
        let state = c.state.unwrap_or_default();
        assert!(
            state.running.is_none()
                && state.terminated.is_none()
                && c.last_state.is_none_or(|s| s.terminated.is_none()),
            "the container of an altered image ran: {state:?}"
        );
    }
    node.kubectl(&["-n", "default", "delete", "pod", "altered", "--wait"]);
    std::fs::write(&stored, &good).unwrap();

    // What a user runs: the chart from the registry, the image from the registry.
    node.helm(&[
        "install",
        "istio-cni",
        &format!("oci://{reg}/charts/cni"),
        "--version",
        version,
        "--plain-http",
        "-n",
        "istio-system",
        "--create-namespace",
        "--set",
        "profile=ambient",
    ]);
    node.rollout("istio-cni-node").await;
    let pods = testbed::migrate::agent_pods(&node, None, "json");
    let pods: Value = serde_json::from_str(&pods).unwrap();
    let status = &pods["items"][0]["status"]["containerStatuses"][0];
    assert_eq!(
        status["image"],
        format!("{reg}/install-cni:{version}-distroless"),
        "{status}"
    );
    // The index the release built, found by the tag Istio's profile asks for.
    assert_eq!(
        status["imageID"],
        format!("{reg}/install-cni@{index_digest}"),
        "{status}"
    );
    // The plugin the agent installed on the node is the release's amd64 binary.
    let on_node = node.script(&["exec", "sha256sum", "/opt/cni/bin/istio-cni"]);
    let released = std::fs::read(dist.join(format!("istio-cni-{version}-linux-amd64"))).unwrap();
    assert_eq!(
        on_node.split(' ').next().unwrap(),
        sha256_of(&released).strip_prefix("sha256:").unwrap()
    );
}

fn sha256_of(bytes: &[u8]) -> String {
    use std::io::Write as _;
    let mut child = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    format!("sha256:{}", text(&out.stdout).split(' ').next().unwrap())
}
