//! What one agent hands to the next on the same node. The DaemonSet controller creates the new
//! agent pod as soon as the old one is marked for deletion, so for a while both run: the new one
//! binds the sockets and restores the node while the old one may still be serving its last ADDs
//! and deciding, with an API call, whether it is being upgraded or uninstalled.

use std::fs::File;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

/// A socket file this agent bound. Removed on the way out only while it is still this agent's:
/// by then the next agent may have bound its own at the same path, and removing that one would
/// leave the node without a reachable agent (the plugin would fail every ambient pod, ztunnel
/// would never reconnect) until the new agent restarted.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
}

impl SocketFile {
    /// The socket just bound at `path`.
    pub fn bound(path: &Path) -> io::Result<SocketFile> {
        let m = std::fs::symlink_metadata(path)?;
        Ok(SocketFile {
            path: path.to_path_buf(),
            id: (m.dev(), m.ino()),
        })
    }

    /// Removes the file unless another socket replaced it since it was bound; returns whether it
    /// was removed.
    pub fn remove(&self) -> bool {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == self.id => std::fs::remove_file(&self.path).is_ok(),
            _ => false,
        }
    }
}

/// The node's agent lock (`agent.lock` in the run dir), held for the agent's whole life, its
/// shutdown included (it serves ADDs until the end): the kernel releases it when the process
/// ends, however it ends, so the next agent learns exactly when the previous one can no longer
/// touch a pod. The holder removes the file on its way out ([`release`]), so nothing of ours stays
/// on a node switched back to Istio's agent; an agent waiting on the removed file then takes the
/// lock again at the path.
pub struct AgentLock {
    _held: Flock<File>,
    path: PathBuf,
}

/// The lock as found at startup.
pub enum Taken {
    /// No other agent runs.
    Free(AgentLock),
    /// The previous agent still runs; [`Waiting::wait`] returns once it has exited.
    Held(Waiting),
}

pub struct Waiting {
    file: File,
    path: PathBuf,
}

pub const LOCK_FILE: &str = "agent.lock";

impl AgentLock {
    pub fn take(run_dir: &Path) -> io::Result<Taken> {
        Self::take_at(run_dir.join(LOCK_FILE))
    }

    fn take_at(path: PathBuf) -> io::Result<Taken> {
        loop {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| named(&path, e))?;
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(held) => {
                    if let Some(lock) = AgentLock::still_at(held, &path)? {
                        return Ok(Taken::Free(lock));
                    }
                }
                Err((file, nix::errno::Errno::EWOULDBLOCK)) => {
                    return Ok(Taken::Held(Waiting { file, path }));
                }
                Err((_, e)) => return Err(named(&path, e.into())),
            }
        }
    }

    /// The lock on `held`, if `held` is still the file at `path`: the previous holder removes it
    /// on its way out, and a lock on a removed file excludes nobody.
    fn still_at(held: Flock<File>, path: &Path) -> io::Result<Option<AgentLock>> {
        let ours = held.metadata()?;
        Ok(match std::fs::symlink_metadata(path) {
            Ok(m) if (m.dev(), m.ino()) == (ours.dev(), ours.ino()) => Some(AgentLock {
                _held: held,
                path: path.to_path_buf(),
            }),
            Ok(_) => None,
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(named(path, e)),
        })
    }

    fn remove_file(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// Keeps the lock until the process exits; [`release`] removes its file then.
    pub fn hold_until_exit(self) {
        let _ = HELD.set(self);
    }
}

static HELD: std::sync::OnceLock<AgentLock> = std::sync::OnceLock::new();

/// Removes the lock file this process holds, when all its work has stopped (the runtime is gone):
/// the lock itself goes with the process right after.
pub fn release() {
    if let Some(lock) = HELD.get() {
        lock.remove_file();
    }
}

fn named(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

impl Waiting {
    /// Blocks until the previous agent has exited (and any other agent that took the lock
    /// meanwhile), then holds the lock.
    pub fn wait(self) -> io::Result<AgentLock> {
        let mut waiting = self;
        loop {
            let held = Flock::lock(waiting.file, FlockArg::LockExclusive)
                .map_err(|(_, e)| named(&waiting.path, e.into()))?;
            if let Some(lock) = AgentLock::still_at(held, &waiting.path)? {
                return Ok(lock);
            }
            match AgentLock::take_at(waiting.path)? {
                Taken::Free(lock) => return Ok(lock),
                Taken::Held(next) => waiting = next,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_socket_is_left_to_its_new_owner() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pluginevent.sock");
        let _old = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let old = SocketFile::bound(&path).unwrap();
        // The next agent replaces the file, as every agent does at startup.
        std::fs::remove_file(&path).unwrap();
        let _new = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert!(
            !old.remove(),
            "the old agent removed the new agent's socket"
        );
        assert!(path.exists());
        let new = SocketFile::bound(&path).unwrap();
        assert!(new.remove());
        assert!(!path.exists());
    }

    /// A running agent's lock, and the next agent's wait for it.
    fn previous_and_next(run_dir: &Path) -> (AgentLock, Waiting) {
        let Taken::Free(previous) = AgentLock::take(run_dir).unwrap() else {
            panic!("a lock nobody holds was taken");
        };
        let Taken::Held(waiting) = AgentLock::take(run_dir).unwrap() else {
            panic!("a held lock was free");
        };
        (previous, waiting)
    }

    #[test]
    fn the_next_agent_waits_for_the_previous_one_to_exit() {
        let dir = tempfile::tempdir().unwrap();
        let (previous, waiting) = previous_and_next(dir.path());
        let (tx, rx) = std::sync::mpsc::channel();
        let next = std::thread::spawn(move || {
            let lock = waiting.wait().unwrap();
            tx.send(()).unwrap();
            lock
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(200))
                .is_err(),
            "the lock was handed over while the previous agent ran"
        );
        drop(previous);
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the lock was not handed over after the previous agent exited");
        let _held = next.join().unwrap();
        assert!(matches!(
            AgentLock::take(dir.path()).unwrap(),
            Taken::Held(_)
        ));
    }

    #[test]
    fn a_lock_file_removed_on_the_way_out_is_taken_again_at_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let (previous, waiting) = previous_and_next(dir.path());
        let next = std::thread::spawn(move || waiting.wait().unwrap());
        previous.remove_file();
        drop(previous);
        let _next = next.join().unwrap();
        // The lock the next agent holds is the file at the path: a third agent waits for it.
        assert!(dir.path().join(LOCK_FILE).exists());
        assert!(matches!(
            AgentLock::take(dir.path()).unwrap(),
            Taken::Held(_)
        ));
    }

    #[test]
    fn a_symlink_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, dir.path().join(LOCK_FILE)).unwrap();
        let err = AgentLock::take(dir.path())
            .err()
            .expect("took a symlinked lock");
        assert!(err.to_string().contains(LOCK_FILE), "{err}");
        assert!(!target.exists());
    }
}
