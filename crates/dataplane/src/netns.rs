//! Network namespace handles and the one sanctioned way to run code inside one.
//!
//! `setns(CLONE_NEWNET)` changes the namespace of the calling *thread* only. Doing it on a pooled
//! thread (a tokio worker, `spawn_blocking`) would leak the pod's namespace into unrelated work, so
//! [`Netns::run`] always uses a fresh OS thread that exits when the closure returns. Child
//! processes are moved with [`Netns::enter_in_child`], a `setns` between fork and exec.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use nix::sched::{CloneFlags, setns};

/// Identity of a network namespace: the nsfs inode and device, as `stat` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NetnsId {
    pub dev: u64,
    pub ino: u64,
}

impl std::fmt::Display for NetnsId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.dev, self.ino)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("cannot open netns {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{path} is not a network namespace")]
    NotNetns { path: PathBuf },
    #[error("cannot enter netns {id}: {source}")]
    Enter { id: NetnsId, source: nix::Error },
    #[error("netns worker thread failed: {0}")]
    Thread(String),
}

thread_local! {
    /// The namespace a [`Netns::run`] thread entered; `None` on every other thread.
    static ENTERED: std::cell::Cell<Option<NetnsId>> = const { std::cell::Cell::new(None) };
}

/// An open network namespace. The fd keeps the namespace alive even after its bind mount is gone.
#[derive(Debug)]
pub struct Netns {
    fd: OwnedFd,
    id: NetnsId,
}

// From <linux/magic.h> and <linux/nsfs.h>.
const NSFS_MAGIC: u64 = 0x6e73_6673;
const PROC_SUPER_MAGIC: u64 = 0x9fa0;
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

impl Netns {
    /// Opens `path` and checks that it really is a network namespace (nsfs or a `/proc/<pid>/ns/net`
    /// link whose namespace type is `CLONE_NEWNET`): any other file is refused.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, NetnsError> {
        let path = path.as_ref();
        let open_err = |source| NetnsError::Open {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(open_err)?;
        let fs = nix::sys::statfs::fstatfs(&file).map_err(|e| open_err(e.into()))?;
        // `f_type` is i64 with glibc and u64 with musl (the static plugin); the magics are small
        // positive numbers, so the cast is exact on both.
        #[allow(
            clippy::unnecessary_cast,
            clippy::cast_sign_loss,
            reason = "f_type's integer type differs between libc targets"
        )]
        let magic = fs.filesystem_type().0 as u64;
        if magic != NSFS_MAGIC && magic != PROC_SUPER_MAGIC {
            return Err(NetnsError::NotNetns {
                path: path.to_owned(),
            });
        }
        // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd we own for this call.
        let nstype = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE as _) };
        if nstype != libc::CLONE_NEWNET {
            return Err(NetnsError::NotNetns {
                path: path.to_owned(),
            });
        }
        let meta = file.metadata().map_err(open_err)?;
        Ok(Netns {
            id: NetnsId {
                dev: meta.dev(),
                ino: meta.ino(),
            },
            fd: file.into(),
        })
    }

    /// The namespace of the calling thread (not `/proc/self`, which is the main thread's).
    pub fn current() -> Result<Self, NetnsError> {
        Self::open("/proc/thread-self/ns/net")
    }

    pub fn id(&self) -> NetnsId {
        self.id
    }

    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Netns {
            fd: self.fd.try_clone()?,
            id: self.id,
        })
    }

    /// Runs `f` inside this namespace on a fresh OS thread, which exits afterwards. Called again
    /// for the same namespace from inside `f`, it runs in place: an operation made of several
    /// steps enters the namespace once.
    pub fn run<T, F>(&self, f: F) -> Result<T, NetnsError>
    where
        T: Send,
        F: FnOnce() -> T + Send,
    {
        if ENTERED.get() == Some(self.id) {
            return Ok(f());
        }
        std::thread::scope(|scope| {
            let worker = scope.spawn(|| {
                setns(self.fd.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| {
                    NetnsError::Enter {
                        id: self.id,
                        source,
                    }
                })?;
                ENTERED.set(Some(self.id));
                Ok(f())
            });
            worker.join().map_err(|panic| {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panicked".to_string());
                NetnsError::Thread(msg)
            })?
        })
    }

    /// Makes `cmd` enter this namespace in the child, between fork and exec, so the parent thread
    /// never changes namespace. The fd must stay open until the command is spawned.
    pub fn enter_in_child(&self, cmd: &mut std::process::Command) {
        let raw = self.fd.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and only calls setns(2), which is
        // async-signal-safe; `raw` is an fd inherited from the parent, valid until exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(raw, libc::CLONE_NEWNET) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

impl AsFd for Netns {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl From<Netns> for OwnedFd {
    fn from(ns: Netns) -> OwnedFd {
        ns.fd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_netns_has_identity() {
        let a = Netns::current().expect("open own netns");
        let b = Netns::current().expect("open own netns");
        assert_eq!(a.id(), b.id());
    }

    #[test]
    fn refuses_a_regular_file() {
        let f = tempfile::NamedTempFile::new().unwrap();
        match Netns::open(f.path()) {
            Err(NetnsError::NotNetns { .. }) => {}
            other => panic!("expected NotNetns, got {other:?}"),
        }
    }

    #[test]
    fn refuses_a_mount_namespace() {
        match Netns::open("/proc/self/ns/mnt") {
            Err(NetnsError::NotNetns { .. }) => {}
            other => panic!("expected NotNetns, got {other:?}"),
        }
    }

    #[test]
    fn run_in_own_namespace_returns_value() {
        let ns = Netns::current().unwrap();
        let inner = ns.run(|| Netns::current().unwrap().id()).unwrap();
        assert_eq!(inner, ns.id());
    }

    #[test]
    fn a_run_inside_a_run_of_the_same_namespace_stays_on_its_thread() {
        let ns = Netns::current().unwrap();
        let (outer, inner) = ns
            .run(|| {
                let outer = std::thread::current().id();
                (outer, ns.run(|| std::thread::current().id()).unwrap())
            })
            .unwrap();
        assert_eq!(outer, inner);
        assert_ne!(outer, std::thread::current().id());
    }
}
