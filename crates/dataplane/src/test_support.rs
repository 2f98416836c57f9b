//! Helpers for tests that need root and real network namespaces (used by this crate's tests and
//! by the agent's test kit).

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// True when privileged tests can run. Without root they are skipped locally, but under `CI`
/// a missing privilege is a failure: coverage must never vanish silently.
pub fn can_run_privileged() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("CI runs privileged tests: run the suite as root");
    }
    eprintln!("skipping privileged test: not root");
    false
}

/// Returns early from a test when privileged tests cannot run (see [`can_run_privileged`]).
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::test_support::can_run_privileged() {
            return;
        }
    };
}

/// A named network namespace (`ip netns add`), with `lo` up, deleted on drop.
pub struct TestNetns {
    pub name: String,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl TestNetns {
    /// Creates `<prefix>-<pid>-<n>` so parallel tests and processes never collide.
    pub fn new(prefix: &str) -> Self {
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        run("ip", &["netns", "add", &name]);
        run("ip", &["-n", &name, "link", "set", "lo", "up"]);
        TestNetns { name }
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.name)
    }

    pub fn open(&self) -> crate::netns::Netns {
        crate::netns::Netns::open(self.path()).expect("open test netns")
    }

    /// Runs a command inside the namespace (`ip netns exec`) and returns its stdout; panics with
    /// its stderr when it fails.
    pub fn exec(&self, program: &str, args: &[&str]) -> String {
        let mut all = vec!["netns", "exec", self.name.as_str(), program];
        all.extend_from_slice(args);
        run("ip", &all)
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Runs a command and returns stdout, panicking with stderr on failure.
pub fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
