//! The archives `scripts/node-images` writes are what containerd takes: imported with `ctr`,
//! tagged with our refs, unpacked, and run by runc. containerd runs in its own mount and network
//! namespace (`unshare`, /run a private tmpfs for its shims and fifos), with its own root, state
//! and socket in a temp dir; containers run without cgroups, so nothing on the host changes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const PAUSE: &str = "localhost/istio-cni-rs/pause:dev";
const BUSYBOX: &str = "localhost/istio-cni-rs/busybox:dev";
const ZTUNNEL: &str = "localhost/istio-cni-rs/ztunnel:dev";
const TOOLS: [&str; 7] = [
    "containerd",
    "ctr",
    "runc",
    "catatonit",
    "readelf",
    "unshare",
    "nsenter",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Locally a missing tool skips the test; under CI it fails (scripts/setup installs them).
fn tools_present() -> bool {
    let missing: Vec<_> = TOOLS
        .iter()
        .filter(|t| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .output()
                .unwrap()
                .status
                .success()
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("missing {missing:?}: run scripts/setup");
    }
    eprintln!("skipping: missing {missing:?} (scripts/setup installs them)");
    false
}

fn node_images(args: &[&str]) -> Output {
    node_images_with(args, None)
}

/// With `ZTUNNEL_BIN` set to `ztunnel`, or removed from the environment.
fn node_images_with(args: &[&str], ztunnel: Option<&str>) -> Output {
    let mut cmd = Command::new(repo().join("scripts/node-images"));
    cmd.args(args)
        .env("OCI_ARCHIVE", env!("CARGO_BIN_EXE_oci-archive"));
    match ztunnel {
        Some(bin) => cmd.env("ZTUNNEL_BIN", bin),
        None => cmd.env_remove("ZTUNNEL_BIN"),
    };
    cmd.output().unwrap()
}

/// containerd in its own namespaces; killed (with its tasks) on drop.
struct Containerd {
    dir: tempfile::TempDir,
    child: Child,
}

impl Containerd {
    fn start() -> Containerd {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let config = format!(
            "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
             disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
             [grpc]\n  address = \"{d}/containerd.sock\"\n[ttrpc]\n  address = \"{d}/containerd.sock.ttrpc\"\n"
        );
        std::fs::write(dir.path().join("config.toml"), config).unwrap();
        let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
        let child = Command::new("unshare")
            .args(["--mount", "--net", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "mount -t tmpfs tmpfs /run && exec containerd --config {d}/config.toml"
            ))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let c = Containerd { dir, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !c.socket().exists() {
            assert!(
                Instant::now() < deadline,
                "containerd did not start:\n{}",
                c.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// `ctr` inside containerd's namespaces (its fifos live under the private /run).
    fn ctr(&self, args: &[&str]) -> Output {
        let pid = self.child.id().to_string();
        let socket = self.socket();
        Command::new("nsenter")
            .args(["-t", &pid, "-m", "-n", "ctr", "-a"])
            .arg(&socket)
            .args(["-n", "k8s.io"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(
            out.status.success(),
            "ctr {args:?}: {}\ncontainerd log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs `argv` in a container of `image` on the host network, without cgroups; its stdout.
    fn run_once(&self, image: &str, argv: &[&str]) -> String {
        let mut args = vec![
            "run",
            "--rm",
            "--net-host",
            "--cgroup",
            "",
            image,
            "run-once",
        ];
        args.extend_from_slice(argv);
        self.ctr_ok(&args)
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Shims outlive containerd: stop every task first.
        let tasks = String::from_utf8(self.ctr(&["task", "ls", "-q"]).stdout).unwrap_or_default();
        for id in tasks.lines() {
            self.ctr(&["task", "delete", "--force", id]);
        }
        let containers =
            String::from_utf8(self.ctr(&["container", "ls", "-q"]).stdout).unwrap_or_default();
        for id in containers.lines() {
            self.ctr(&["container", "delete", id]);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn images_import_into_containerd_and_run() {
    dataplane::require_root!();
    if !tools_present() {
        return;
    }
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().to_str().unwrap();
    // The ztunnel image from a dynamically linked binary (coreutils' echo stands in for a
    // ztunnel): it must carry the loader and libraries it links.
    let dynamic = "/usr/bin/echo";
    let built = node_images_with(
        &["build", out, "pause", "busybox", "ztunnel"],
        Some(dynamic),
    );
    assert!(
        built.status.success(),
        "build: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    assert_eq!(
        String::from_utf8(built.stdout).unwrap(),
        format!(
            "{PAUSE} {out}/pause.tar\n{BUSYBOX} {out}/busybox.tar\n{ZTUNNEL} {out}/ztunnel.tar\n\
             {ZTUNNEL}-distroless {out}/ztunnel.tar\n"
        )
    );

    let ctd = Containerd::start();
    let socket = ctd.socket();
    let imported = node_images(&["import", socket.to_str().unwrap(), out]);
    assert!(
        imported.status.success(),
        "import: {}",
        String::from_utf8_lossy(&imported.stderr)
    );
    let refs = ctd.ctr_ok(&["images", "ls", "-q"]);
    // One archive, two names: Istio's ztunnel chart asks for `-distroless` with profile ambient.
    let distroless = format!("{ZTUNNEL}-distroless");
    assert_eq!(
        refs.lines().collect::<Vec<_>>(),
        [BUSYBOX, PAUSE, ZTUNNEL, distroless.as_str()]
    );

    // The image has nothing but the binary and what it links, and that is enough to run it.
    assert_eq!(ctd.run_once(ZTUNNEL, &["ztunnel", "linked"]), "linked\n");

    // The applet links resolve, the environment is the image's, /tmp is sticky.
    let run = ctd.run_once(
        BUSYBOX,
        &[
            "sh",
            "-c",
            "echo $((6*7)) $(readlink /usr/bin/wget) $PATH; stat -c %a /tmp",
        ],
    );
    assert_eq!(
        run,
        "42 /bin/busybox /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n1777\n"
    );

    // The sandbox image's entrypoint is catatonit in pause mode.
    ctd.ctr_ok(&["run", "-d", "--net-host", "--cgroup", "", PAUSE, "pause"]);
    let tasks = ctd.ctr_ok(&["task", "ls"]);
    let pid = tasks
        .lines()
        .find_map(|l| {
            l.strip_prefix("pause")
                .map(|rest| rest.split_whitespace().next().unwrap().to_string())
        })
        .unwrap_or_else(|| panic!("no pause task in:\n{tasks}"));
    // `ctr run -d` returns once the task is started, which can be before runc's init process has
    // exec'd the entrypoint: until then the task's pid is still `runc init`.
    let read = || std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut cmdline = read();
    while cmdline == b"runc\0init\0" && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        cmdline = read();
    }
    assert_eq!(cmdline, b"/catatonit\0-P\0");
}

#[test]
fn bad_input_names_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let check = |args: &[&str], code: i32, text: &str| {
        let out = node_images(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(
            stderr.contains(text),
            "{args:?}: {stderr:?} should contain {text:?}"
        );
    };
    check(&[], 2, "usage: scripts/node-images build");
    check(&["build"], 2, "usage:");
    check(
        &["build", d, "nginx"],
        2,
        "unknown image nginx (one of: pause busybox install-cni ztunnel-peer ztunnel istio-install-cni pilot proxyv2)",
    );
    check(
        &["build", d, "ztunnel"],
        2,
        "the ztunnel image needs ZTUNNEL_BIN",
    );
    let bad = |bin: &str, text: &str| {
        let out = node_images_with(&["build", d, "ztunnel"], Some(bin));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bin}: {stderr}");
        assert!(
            stderr.contains(text),
            "{bin}: {stderr:?} should contain {text:?}"
        );
    };
    bad(
        "/nonexistent/ztunnel",
        "ZTUNNEL_BIN=/nonexistent/ztunnel is not an executable file",
    );
    check(
        &["import", "/nonexistent.sock", d],
        1,
        "/nonexistent.sock is not a containerd socket",
    );
    let sock = std::os::unix::net::UnixListener::bind(format!("{d}/x.sock")).unwrap();
    check(
        &["import", &format!("{d}/x.sock"), d],
        1,
        &format!("no *.tar in {d}"),
    );
    drop(sock);
    assert_eq!(
        std::fs::read_dir(d).unwrap().count(),
        1,
        "nothing written but the test's socket"
    );
}
