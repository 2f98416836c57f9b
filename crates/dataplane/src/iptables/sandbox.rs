//! The sandbox every iptables tool we start runs in (what Istio's `runInSandbox` does): a
//! private mount namespace, shared only by the spawning thread and the child, in which
//!
//! - `/etc/nsswitch.conf` is `/dev/null`. `-m owner --uid-owner 1337` makes iptables call
//!   `getpwnam("1337")` before it parses the number, so the host's NSS modules (LDAP, sssd,
//!   systemd) would be asked, over a network a new pod's namespace may not reach yet
//!   (istio#48416). glibc's built-in default (`files`) still answers; we only ever use numeric IDs.
//! - for legacy iptables below 1.8.6, which cannot be pointed at another lock file, the pod's
//!   lock file is bound over `/run/xtables.lock`, so pod commands never queue behind kube-proxy
//!   on the node's lock.
//!
//! When the kernel refuses the sandbox (SELinux, seccomp), the tool runs as is, as in Istio, with
//! one warning: the rules are the same, only lock scope and NSS isolation are lost.

use std::io;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Once;

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};

use crate::netns::{Netns, SpawnError};

/// The lock file legacy iptables takes when `XTABLES_LOCKFILE` is not honoured.
pub const GLOBAL_LOCK: &str = "/run/xtables.lock";
const NSSWITCH: &str = "/etc/nsswitch.conf";

/// Starts `cmd` inside `netns` in the sandbox; `lock`: the file to bind over [`GLOBAL_LOCK`].
pub fn spawn(netns: &Netns, cmd: &mut Command, lock: Option<&Path>) -> io::Result<Child> {
    match netns.spawn_isolated(cmd, || enter(lock)) {
        Ok(child) => Ok(child),
        Err(SpawnError::Spawn(e)) => Err(e),
        Err(SpawnError::Isolate(e)) => {
            static WARNED: Once = Once::new();
            WARNED.call_once(|| {
                tracing::warn!(error = %e, "cannot sandbox iptables in a private mount namespace; \
                    running it without (node-wide xtables lock, host NSS)");
            });
            netns.spawn(cmd)
        }
    }
}

/// Turns the calling thread's mount namespace into the sandbox. Only for a thread that exits
/// afterwards: the namespace cannot be left again.
fn enter(lock: Option<&Path>) -> io::Result<()> {
    let ctx = |what: &str, e: nix::Error| io::Error::other(format!("{what}: {e}"));
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| ctx("unshare(CLONE_NEWNS)", e))?;
    // A shared `/` (systemd's default) would propagate our bind mounts to the host; where
    // policy forbids MS_PRIVATE (Bottlerocket), MS_SLAVE still stops propagation outwards.
    let none = None::<&str>;
    mount(none, "/", none, MsFlags::MS_PRIVATE | MsFlags::MS_REC, none)
        .or_else(|_| mount(none, "/", none, MsFlags::MS_SLAVE | MsFlags::MS_REC, none))
        .map_err(|e| ctx("making / private", e))?;
    if let Some(lock) = lock {
        // Both ends of a bind mount must exist; legacy iptables creates either on first use.
        for file in [lock, Path::new(GLOBAL_LOCK)] {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(file)?;
        }
        bind(lock, Path::new(GLOBAL_LOCK)).map_err(|e| ctx("binding the pod's lock", e))?;
    }
    // Without the file glibc uses its built-in default already.
    if Path::new(NSSWITCH).exists() {
        bind(Path::new("/dev/null"), Path::new(NSSWITCH))
            .map_err(|e| ctx("hiding nsswitch.conf", e))?;
    }
    Ok(())
}

fn bind(src: &Path, dst: &Path) -> nix::Result<()> {
    mount(Some(src), dst, None::<&str>, MsFlags::MS_BIND, None::<&str>)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::TestNetns;
    use std::os::unix::fs::MetadataExt;
    use std::process::Stdio;

    fn output(child: Child) -> String {
        let out = child.wait_with_output().unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    #[test]
    fn the_child_sees_no_nsswitch_and_the_pods_lock_and_the_host_sees_nothing() {
        crate::require_root!();
        let pod = TestNetns::new("sandbox-view");
        let dir = tempfile::tempdir().unwrap();
        let lock = dir.path().join("pod.lock");
        let script = "wc -c < /etc/nsswitch.conf; stat -L -c %d:%i /run/xtables.lock; \
                      readlink /proc/self/ns/net";
        let seen = output(spawn(&pod.open(), &mut sh(script), Some(&lock)).unwrap());
        let meta = std::fs::metadata(&lock).unwrap();
        let want = format!(
            "0\n{}:{}\nnet:[{}]\n",
            meta.dev(),
            meta.ino(),
            pod.open().id().ino
        );
        assert_eq!(seen, want);

        // Nothing of it reached this process's mount namespace.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !mounts.contains(" /etc/nsswitch.conf ") && !mounts.contains(" /run/xtables.lock "),
            "{mounts}"
        );
        let host_lock = std::fs::metadata(GLOBAL_LOCK).unwrap();
        assert_ne!((host_lock.dev(), host_lock.ino()), (meta.dev(), meta.ino()));
    }

    #[test]
    fn without_a_lock_only_nsswitch_is_hidden() {
        crate::require_root!();
        let pod = TestNetns::new("sandbox-nolock");
        let script =
            "wc -c < /etc/nsswitch.conf; grep -c ' /run/xtables.lock ' /proc/self/mountinfo";
        let seen = output(spawn(&pod.open(), &mut sh(script), None).unwrap());
        assert_eq!(seen, "0\n0\n");
    }

    /// The real thing: `--uid-owner` makes iptables look the user up through NSS. In a mount
    /// namespace of this test whose nsswitch.conf names a module `istiotest`, an unsandboxed
    /// iptables goes looking for `libnss_istiotest.so.2`; a sandboxed one never does.
    #[test]
    fn owner_matches_never_reach_the_hosts_nss_modules() {
        crate::require_root!();
        let pod = TestNetns::new("sandbox-nss");
        let conf = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(conf.path(), "passwd: files istiotest\n").unwrap();
        let ns = pod.open();
        let conf_path = conf.path().to_owned();
        let (plain, sandboxed) = std::thread::spawn(move || {
            // This thread's own mount namespace plays the host's; it dies with the thread.
            unshare(CloneFlags::CLONE_NEWNS).unwrap();
            let none = None::<&str>;
            mount(none, "/", none, MsFlags::MS_PRIVATE | MsFlags::MS_REC, none).unwrap();
            bind(&conf_path, Path::new(NSSWITCH)).unwrap();
            let cmd = || {
                let mut c = Command::new("iptables-legacy");
                c.args([
                    "-w",
                    "-A",
                    "OUTPUT",
                    "-m",
                    "owner",
                    "--uid-owner",
                    "1337",
                    "-j",
                    "ACCEPT",
                ])
                .env("LD_DEBUG", "libs")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
                c
            };
            let plain = output(ns.spawn(&mut cmd()).unwrap());
            let sandboxed = output(spawn(&ns, &mut cmd(), None).unwrap());
            (plain, sandboxed)
        })
        .join()
        .unwrap();
        assert!(plain.contains("libnss_istiotest"), "{plain}");
        assert!(!sandboxed.contains("libnss_istiotest"), "{sandboxed}");
        let rules = pod.exec("iptables-legacy-save", &["-t", "filter"]);
        assert_eq!(
            rules.matches("--uid-owner 1337 -j ACCEPT").count(),
            2,
            "both runs must add the rule: {rules}"
        );
    }
}
