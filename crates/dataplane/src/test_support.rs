//! Helpers for tests that need root and real network namespaces (used by this crate's tests and
//! by the agent's test kit).

pub mod group_gate;

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

    /// [`TestNetns::exec`] with `stdin` written to the command (`iptables-restore` input).
    pub fn exec_stdin(&self, program: &str, args: &[&str], stdin: &str) -> String {
        use std::io::Write as _;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, program])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        let mut pipe = child.stdin.take().expect("stdin piped");
        pipe.write_all(stdin.as_bytes())
            .unwrap_or_else(|e| panic!("{program}: cannot write stdin: {e}"));
        drop(pipe);
        let out = child.wait_with_output().expect("wait");
        assert!(
            out.status.success(),
            "{program} {args:?} in {} failed: {}\ninput:\n{stdin}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// The iptables backend of each variant (`nft`, then `legacy`), forced and detected in a
/// throwaway namespace standing in for the host's, so no test reads or writes this machine's
/// own tables.
pub fn iptables_backends() -> Vec<(&'static str, crate::iptables::IptablesBackend)> {
    let host = TestNetns::new("ipt-host");
    ["nft", "legacy"]
        .into_iter()
        .map(|v| {
            let b = host
                .open()
                .run(|| crate::iptables::IptablesBackend::detect(Some(v), true))
                .expect("enter the host stand-in");
            (v, b.unwrap_or_else(|e| panic!("detect {v}: {e}")))
        })
        .collect()
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

/// Runs `f` on a fresh thread whose credentials are `uid`/`gid` (real, effective, saved and
/// filesystem), and returns what it returned. The process keeps root: the raw `setresgid` /
/// `setresuid` syscalls change only the calling thread (glibc's wrappers, and so nix's, would
/// change every thread of the test process), and the thread ends afterwards. A socket connected
/// from `f` carries these credentials (`SO_PEERCRED`) for its whole life, so a test can play an
/// unprivileged local process without forking.
pub fn as_user<T: Send + 'static>(
    uid: u32,
    gid: u32,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<T> {
    std::thread::spawn(move || {
        // Groups first: after dropping the uid the thread may no longer change them.
        // SAFETY: plain syscalls with integer arguments; they touch only this thread's creds.
        let rc = unsafe { libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::syscall(libc::SYS_setresgid, gid, gid, gid) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::syscall(libc::SYS_setresuid, uid, uid, uid) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(f())
    })
    .join()
    .map_err(|_| std::io::Error::other("as_user closure panicked"))?
}

/// The CPU time process `pid` has used so far: all its threads, those that have exited included,
/// in nanoseconds (the kernel's process CPU clock, `clock_getcpuclockid` + `clock_gettime`).
/// Benches read it around a burst of ADDs, a few tens of milliseconds of the agent's CPU, which
/// `/proc/<pid>/stat`'s 10 ms ticks resolve too coarsely.
pub fn process_cpu_time(pid: u32) -> std::io::Result<std::time::Duration> {
    let named = |e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("CPU clock of process {pid}: {e}"))
    };
    let raw = libc::pid_t::try_from(pid).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{pid} is not a process ID"),
        )
    })?;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `clock` is a valid place for the clock's id; the call writes nothing else.
    let err = unsafe { libc::clock_getcpuclockid(raw, &mut clock) };
    if err != 0 {
        return Err(named(std::io::Error::from_raw_os_error(err)));
    }
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to write.
    if unsafe { libc::clock_gettime(clock, &mut now) } != 0 {
        return Err(named(std::io::Error::last_os_error()));
    }
    let (secs, nanos) = (u64::try_from(now.tv_sec), u32::try_from(now.tv_nsec));
    match (secs, nanos) {
        (Ok(secs), Ok(nanos)) => Ok(std::time::Duration::new(secs, nanos)),
        _ => Err(named(std::io::Error::other("negative CPU time"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread's CPU stays in the process's clock after the thread has exited (a per-thread sum
    /// over `/proc/<pid>/task` would lose it), and a process that does not exist is named.
    #[test]
    fn the_process_cpu_clock_keeps_exited_threads() {
        let pid = std::process::id();
        let before = process_cpu_time(pid).unwrap();
        let seen_by_the_thread = std::thread::spawn(move || {
            loop {
                let now = process_cpu_time(pid).unwrap();
                if now - before >= std::time::Duration::from_millis(30) {
                    return now;
                }
            }
        })
        .join()
        .unwrap();
        let after = process_cpu_time(pid).unwrap();
        assert!(
            after >= seen_by_the_thread,
            "{after:?} after the thread exited, {seen_by_the_thread:?} before"
        );
        let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let err = process_cpu_time(pid_max).unwrap_err().to_string();
        assert!(err.contains(&format!("process {pid_max}")), "{err}");
    }

    #[test]
    fn as_user_changes_only_its_own_thread() {
        crate::require_root!();
        let inside = as_user(65534, 65534, || {
            (
                nix::unistd::geteuid().as_raw(),
                nix::unistd::getegid().as_raw(),
            )
        })
        .unwrap();
        assert_eq!(inside, (65534, 65534));
        assert!(
            nix::unistd::geteuid().is_root(),
            "the test process stays root"
        );
        assert!(nix::unistd::getegid().as_raw() == 0);
    }
}
