//! The release's arm64 image runs, not only builds: its root filesystem, taken from the OCI
//! index `scripts/release` writes, runs under Debian's qemu-user-static (binfmt_misc) in a
//! chroot, as the amd64 image from the same index runs natively, and prints the same: the
//! plugin's VERSION, `install-cni version`, and the rules of
//! `install-cni dataplane inpod apply|verify|remove --dry-run` (nftables backend).
//!
//! What qemu-user cannot show: programming a namespace for real, and the iptables backend even
//! dry (it probes the image's iptables). qemu-user refuses `NETLINK_NETFILTER` sockets
//! (EPROTONOSUPPORT: our nftables backend, iptables-nft), has no `IPT_SO_*` socket options
//! (iptables-legacy) and no `NS_GET_NSTYPE` ioctl (how the agent checks a netns file). That needs
//! an arm64 kernel: an arm64 machine, or qemu-system. Nothing is timed here: qemu is slow by
//! design.
//!
//! The release comes from `RELEASE_DIST` (a `scripts/release` output directory) or is built
//! here with `--allow-dirty` into a temp dir.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dataplane::require_root;
use serde_json::Value;

const QEMU_BINFMT: &str = "/usr/share/binfmts/qemu-aarch64";
const BINFMT: &str = "/proc/sys/fs/binfmt_misc";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ok(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// aarch64 ELF files run through qemu: registers Debian's qemu-aarch64 entry with the kernel
/// (as binfmt-support would at install) unless it is there. `F`: the interpreter is opened now,
/// so it runs inside the image's chroot too. False (SKIPPED) only when qemu-user-static is not
/// installed outside CI.
fn qemu_ready() -> bool {
    let Ok(spec) = std::fs::read_to_string(QEMU_BINFMT) else {
        if std::env::var_os("CI").is_some() {
            panic!("{QEMU_BINFMT} missing: scripts/setup installs qemu-user-static");
        }
        eprintln!("SKIPPED: qemu-user-static is not installed (apt-get install qemu-user-static)");
        return false;
    };
    if !Path::new(BINFMT).join("register").exists() {
        ok(
            "mount binfmt_misc",
            Command::new("mount")
                .args(["-t", "binfmt_misc", "binfmt_misc", BINFMT])
                .output()
                .unwrap(),
        );
    }
    let entry = Path::new(BINFMT).join("qemu-aarch64");
    if !entry.exists() {
        let field = |key: &str| {
            spec.lines()
                .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
                .unwrap_or_else(|| panic!("{QEMU_BINFMT} has no {key}"))
        };
        let line = format!(
            ":qemu-aarch64:M:{}:{}:{}:{}:PF",
            field("offset "),
            field("magic "),
            field("mask "),
            field("interpreter "),
        );
        std::fs::write(Path::new(BINFMT).join("register"), line)
            .unwrap_or_else(|e| panic!("registering qemu-aarch64 with binfmt_misc: {e}"));
    }
    let state = std::fs::read_to_string(&entry).unwrap();
    assert!(
        state.starts_with("enabled"),
        "binfmt_misc's qemu-aarch64 entry is not enabled:\n{state}"
    );
    true
}

/// The release directory: `RELEASE_DIST`, or a release built now (kept in `_build`).
fn release(build: &tempfile::TempDir) -> PathBuf {
    if let Some(dir) = std::env::var_os("RELEASE_DIST") {
        return dir.into();
    }
    let out = build.path().join("dist");
    ok(
        "scripts/release",
        Command::new(repo().join("scripts/release"))
            .args(["--allow-dirty", "--hub", "localhost/istio-cni-rs", "--out"])
            .arg(&out)
            .output()
            .unwrap(),
    );
    out
}

/// Each platform's root filesystem from the release's OCI index, unpacked under `dir`.
fn rootfs_per_platform(dist: &Path, dir: &Path) -> BTreeMap<String, PathBuf> {
    let oci = std::fs::read_dir(dist)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(".oci.tar"))
        .unwrap_or_else(|| panic!("no *.oci.tar in {}", dist.display()));
    let layout = dir.join("layout");
    std::fs::create_dir_all(&layout).unwrap();
    ok(
        "tar -x the OCI layout",
        Command::new("tar")
            .arg("-xf")
            .arg(&oci)
            .arg("-C")
            .arg(&layout)
            .output()
            .unwrap(),
    );
    let blob = |digest: &str| layout.join("blobs/sha256").join(&digest[7..]);
    let json = |digest: &str| -> Value {
        serde_json::from_slice(&std::fs::read(blob(digest)).unwrap()).unwrap()
    };
    let top: Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let index = json(top["manifests"][0]["digest"].as_str().unwrap());
    let mut out = BTreeMap::new();
    for m in index["manifests"].as_array().unwrap() {
        let arch = m["platform"]["architecture"].as_str().unwrap().to_string();
        let manifest = json(m["digest"].as_str().unwrap());
        let config = json(manifest["config"]["digest"].as_str().unwrap());
        assert_eq!(config["architecture"], arch.as_str());
        let root = dir.join(&arch);
        std::fs::create_dir_all(&root).unwrap();
        ok(
            "tar -x the layer",
            Command::new("tar")
                .arg("-xf")
                .arg(blob(manifest["layers"][0]["digest"].as_str().unwrap()))
                .arg("-C")
                .arg(&root)
                .output()
                .unwrap(),
        );
        // Mount points of the chroot.
        std::fs::create_dir_all(root.join("proc")).unwrap();
        std::fs::create_dir_all(root.join("dev")).unwrap();
        out.insert(arch, root);
    }
    let arches: Vec<_> = out.keys().map(String::as_str).collect();
    assert_eq!(arches, ["amd64", "arm64"]);
    out
}

/// Runs `argv` in the image at `root`, as its container would (the image's PATH, its own
/// binaries and libraries, /proc and /dev), in a mount namespace of its own; `env` adds to the
/// environment.
fn in_image(root: &Path, env: &[(&str, &str)], argv: &[&str]) -> Output {
    let script = "set -e; mount -t proc proc \"$1/proc\"; mount --rbind /dev \"$1/dev\"; \
                  root=$1; shift; exec chroot \"$root\" \"$@\"";
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
    ])
    .arg(root)
    .args(argv)
    .env_clear()
    .env(
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin",
    );
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn arm64_image_runs_the_agent_and_plugin_as_the_amd64_image_does() {
    require_root!();
    if !qemu_ready() {
        return;
    }
    let build = tempfile::tempdir().unwrap();
    let dist = release(&build);
    let roots = rootfs_per_platform(&dist, build.path());
    let run = |arch: &str, env: &[(&str, &str)], argv: &[&str]| {
        ok(
            &format!("{arch}: {argv:?}"),
            in_image(&roots[arch], env, argv),
        )
    };

    // The arm64 files are arm64 (not the host's run natively).
    let elf = std::fs::read(roots["arm64"].join("usr/local/bin/install-cni")).unwrap();
    assert_eq!(
        u16::from_le_bytes([elf[18], elf[19]]),
        183,
        "e_machine EM_AARCH64"
    );

    let per_arch = |env: &[(&str, &str)], argv: &[&str]| {
        let a = run("amd64", env, argv);
        let b = run("arm64", env, argv);
        assert_eq!(a, b, "{argv:?}: amd64 and arm64 differ");
        a
    };
    let version = per_arch(&[("CNI_COMMAND", "VERSION")], &["/opt/cni/bin/istio-cni"]);
    let version: Value = serde_json::from_str(&version).unwrap();
    assert!(
        version["supportedVersions"]
            .as_array()
            .is_some_and(|v| !v.is_empty())
    );
    let agent = per_arch(&[], &["install-cni", "version"]);
    assert!(agent.contains(env!("CARGO_PKG_VERSION")), "{agent}");

    for action in ["apply", "verify", "remove"] {
        let argv = [
            "install-cni",
            "dataplane",
            "inpod",
            action,
            "--netns",
            "/pod-netns",
            "--backend",
            "nftables",
            "--dry-run",
        ];
        let rules = per_arch(&[], &argv);
        assert!(
            rules.contains("add table inet istio-ambient-nat"),
            "{action}: the dry run printed no ruleset:\n{rules}"
        );
    }
}
