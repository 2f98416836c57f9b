//! `scripts/release --push` against a real registry (CNCF distribution's, on loopback): the
//! index is served under both tags with the digest the release printed, for both platforms, and
//! built twice the same (`--check-reproducible`); the chart comes back with `helm pull oci://…`
//! and renders the pushed image. A push to a registry that is not there fails naming it.

use std::process::{Command, Output};

use serde_json::Value;
use testbed::manifests::helm;
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

#[test]
fn a_release_pushed_to_a_registry_is_served_as_built() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start();
    let reg = registry.address();
    let out = release(
        &["--push", &reg, "--plain-http", "--check-reproducible"],
        &tmp.path().join("dist"),
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
