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
//! an arm64 kernel: `scripts/arm64-vm` boots Debian's arm64 kernel under qemu-system-aarch64 with
//! the arm64 image as its root, and there both backends apply, verify and remove their rules in
//! network namespaces; the rules read back must equal those the amd64 image programs here.
//! Nothing is timed here: qemu is slow by design.
//!
//! The same release's SBOMs list what went into it: each binary's every crate (as `cargo tree`
//! resolves it for the binary's target) and each image's every Debian package (each package
//! that owns a file of the image, by this machine's dpkg, with the version the image records).
//!
//! The release comes from `RELEASE_DIST` (a `scripts/release` output directory) or is built
//! here with `--allow-dirty` into a temp dir.

use std::collections::{BTreeMap, BTreeSet};
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

/// `(name, version)` of every component of CycloneDX SBOM `file` of `dist` whose purl starts
/// with `purl`.
fn sbom_components(dist: &Path, file: &str, purl: &str) -> BTreeSet<(String, String)> {
    let text = std::fs::read_to_string(dist.join(file))
        .unwrap_or_else(|e| panic!("{file}: {e} (scripts/release writes it)"));
    let bom: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(bom["bomFormat"], "CycloneDX", "{file}");
    bom["components"]
        .as_array()
        .unwrap_or_else(|| panic!("{file} has no components"))
        .iter()
        .filter(|c| c["purl"].as_str().is_some_and(|p| p.starts_with(purl)))
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap().to_string();
            (s("name"), s("version"))
        })
        .collect()
}

/// The crates linked into package `pkg` built for `target` (`cargo tree -e normal,no-proc-macro`:
/// a proc macro and its crates run in the compiler, on the build machine), as `(name, version)`.
fn cargo_tree(pkg: &str, target: &str) -> BTreeSet<(String, String)> {
    let out = ok(
        "cargo tree",
        Command::new(env!("CARGO"))
            .args([
                "tree",
                "--locked",
                "-e",
                "normal,no-proc-macro",
                "--prefix",
                "none",
                "--format",
                "{p}",
            ])
            .args(["-p", pkg, "--target", target])
            .current_dir(repo())
            .output()
            .unwrap(),
    );
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (name, version) = (w.next()?, w.next()?.strip_prefix('v')?);
            (name != pkg).then(|| (name.to_string(), version.to_string()))
        })
        .collect()
}

/// The Debian packages an image records (`/var/lib/dpkg/status.d`), as `(name, version)`.
fn recorded_packages(root: &Path) -> BTreeSet<(String, String)> {
    std::fs::read_dir(root.join("var/lib/dpkg/status.d"))
        .expect("the image records its Debian packages in /var/lib/dpkg/status.d")
        .map(|e| {
            let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
            let field = |k: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()))
                    .unwrap_or_else(|| panic!("a status.d entry without {k}\n{text}"))
            };
            (field("Package:"), field("Version:"))
        })
        .collect()
}

/// Every file of the image at `root` that is not ours nor a package record: what Debian's
/// packages put there.
fn debian_files(root: &Path) -> Vec<String> {
    let out = ok(
        "find",
        Command::new("find")
            .arg(root)
            .args(["-type", "f", "-printf", "/%P\\n"])
            .output()
            .unwrap(),
    );
    out.lines()
        .filter(|p| {
            ![
                "/usr/local/bin/",
                "/opt/cni/bin/",
                "/var/lib/dpkg/",
                "/usr/share/doc/",
            ]
            .iter()
            .any(|d| p.starts_with(d))
        })
        .map(str::to_string)
        .collect()
}

fn sboms_list_what_was_built(dist: &Path, roots: &BTreeMap<String, PathBuf>) {
    let version = std::fs::read_dir(dist)
        .unwrap()
        .find_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            Some(name.strip_prefix("cni-")?.strip_suffix(".tgz")?.to_string())
        })
        .expect("the release's chart cni-<version>.tgz");
    let mut names_per_arch = BTreeMap::new();
    for (arch, target) in [
        ("amd64", "x86_64-unknown-linux-musl"),
        ("arm64", "aarch64-unknown-linux-musl"),
    ] {
        for (bin, pkg) in [("install-cni", "cni-agent"), ("istio-cni", "cni-plugin")] {
            let file = format!("{bin}-{version}-linux-{arch}.cdx.json");
            let listed = sbom_components(dist, &file, "pkg:cargo/");
            let built = cargo_tree(pkg, target);
            let missing: Vec<_> = built.difference(&listed).collect();
            assert!(
                missing.is_empty(),
                "{file} lacks crates built into {bin}: {missing:?}"
            );
        }

        let file = format!("install-cni-{version}-image-linux-{arch}.cdx.json");
        let listed = sbom_components(dist, &file, "pkg:deb/");
        let recorded = recorded_packages(&roots[arch]);
        assert_eq!(
            listed, recorded,
            "{file} (left) and the image's records (right)"
        );
        names_per_arch.insert(
            arch,
            recorded
                .into_iter()
                .map(|(n, _)| n)
                .collect::<BTreeSet<_>>(),
        );
    }
    // Every Debian file of the amd64 image belongs to a recorded package, by this machine's dpkg
    // (the release downloads this machine's Debian's packages); arm64's are the same packages.
    let files = debian_files(&roots["amd64"]);
    assert!(
        files.iter().any(|f| f.ends_with("/xtables-nft-multi")),
        "{files:?}"
    );
    let owners = ok(
        "dpkg -S",
        Command::new("dpkg")
            .arg("-S")
            .args(&files)
            .output()
            .unwrap(),
    );
    for line in owners.lines() {
        let (pkgs, path) = line.split_once(": ").unwrap();
        assert!(
            pkgs.split(", ")
                .map(|p| p.split(':').next().unwrap())
                .any(|p| names_per_arch["amd64"].contains(p)),
            "{path} of the amd64 image belongs to {pkgs}, which its SBOM does not list"
        );
    }
    assert_eq!(names_per_arch["amd64"], names_per_arch["arm64"]);
}

/// Each backend in a network namespace of its own under `$NS`: apply, verify, remove, the
/// namespace's rules read back after each (comment lines carry the time; `nft -n`: the image has
/// no /etc/protocols to name protocol 6 `tcp` by, this machine has).
const RULES_SCRIPT: &str = r#"
for b in nftables iptables; do
  touch "$NS/$b" && unshare --net="$NS/$b" true
  for a in apply verify remove; do
    install-cni dataplane inpod $a --netns "$NS/$b" --backend $b >"$NS/out" 2>&1
    echo "== $b $a: exit $?"
    [ $a = verify ] && cat "$NS/out"
    if [ $b = nftables ]; then
      nsenter --net="$NS/$b" nft -n list ruleset
    else
      nsenter --net="$NS/$b" iptables-nft-save | grep -v '^#'
      nsenter --net="$NS/$b" iptables-legacy-save | grep -v '^#'
    fi
  done
done
echo "== rules end"
"#;

/// The output of [`RULES_SCRIPT`] between its first `==` line and its end, kernel messages left out.
fn rules_part(console: &str) -> String {
    let start = console
        .find("== nftables apply")
        .unwrap_or_else(|| panic!("no rules in:\n{console}"));
    let end = console
        .find("== rules end")
        .unwrap_or_else(|| panic!("rules cut short:\n{console}"));
    console[start..end]
        .lines()
        .filter(|l| !l.trim_start().starts_with('['))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The rules both backends program, read back on an arm64 kernel (`scripts/arm64-vm`:
/// qemu-system-aarch64 booting Debian's arm64 kernel with the arm64 image as its root), equal
/// to those the amd64 image's agent programs here, in namespaces of this test's own.
fn arm64_kernel_gets_the_amd64_rules(roots: &BTreeMap<String, PathBuf>) {
    if Command::new("qemu-system-aarch64")
        .arg("--version")
        .output()
        .is_err()
    {
        if std::env::var_os("CI").is_some() {
            panic!("qemu-system-aarch64 missing: scripts/setup installs qemu-system-arm");
        }
        eprintln!(
            "SKIPPED: qemu-system-aarch64 is not installed (apt-get install qemu-system-arm)"
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("rules.sh");
    std::fs::write(&script, format!("NS=/run/netns\n{RULES_SCRIPT}")).unwrap();
    let vm = ok(
        "scripts/arm64-vm",
        Command::new(repo().join("scripts/arm64-vm"))
            .arg(&roots["arm64"])
            .arg(&script)
            .output()
            .unwrap(),
    );
    assert!(vm.contains("arm64-vm: aarch64 "), "{vm}");

    // Here: the namespaces' files on a tmpfs of a private mount namespace, gone with it.
    let ns = tmp.path().join("netns");
    std::fs::create_dir(&ns).unwrap();
    let path = format!(
        "{}:{}",
        roots["amd64"].join("usr/local/bin").display(),
        std::env::var("PATH").unwrap()
    );
    let here = ok(
        "the rules script here",
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!("mount -t tmpfs netns \"$NS\" && {RULES_SCRIPT}"))
            .env("NS", &ns)
            .env("PATH", path)
            .output()
            .unwrap(),
    );
    assert!(here.contains("table inet istio-ambient-nat"), "{here}");
    assert!(here.contains("-j REDIRECT --to-ports 15001"), "{here}");
    assert_eq!(
        rules_part(&vm),
        rules_part(&here),
        "the arm64 kernel's rules (left) and this machine's (right) differ"
    );
}

#[test]
fn release_sboms_list_what_was_built_and_its_arm64_image_runs_as_its_amd64_image_does() {
    dataplane::enter_test_group!();
    require_root!();
    let build = tempfile::tempdir().unwrap();
    let dist = release(&build);
    let roots = rootfs_per_platform(&dist, build.path());
    sboms_list_what_was_built(&dist, &roots);
    arm64_kernel_gets_the_amd64_rules(&roots);
    if !qemu_ready() {
        return;
    }
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
