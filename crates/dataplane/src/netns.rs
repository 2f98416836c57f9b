//! Network namespace handles and the one sanctioned way to run code inside one.
//!
//! `setns(CLONE_NEWNET)` changes the namespace of the calling *thread* only. Doing it on a pooled
//! thread (a tokio worker, `spawn_blocking`) would leak the pod's namespace into unrelated work, so
//! [`Netns::run`] always uses a fresh OS thread that exits when the closure returns, and
//! [`Netns::run_detached`] a worker of its own that goes back to the process's namespace after
//! each job. Child processes are started by [`Netns::spawn`] from such a thread, and inherit its
//! namespace.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

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
    /// The namespace a [`Netns::run`] thread or a detached worker entered; `None` on every
    /// other thread.
    static ENTERED: std::cell::Cell<Option<NetnsId>> = const { std::cell::Cell::new(None) };
    /// What to undo when this thread leaves the namespace it entered (see [`when_leaving`]).
    static ON_LEAVE: std::cell::RefCell<Vec<Box<dyn FnOnce()>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` when the calling thread leaves the namespace it entered: at once on a
/// [`Netns::run_detached`] worker, before it takes its next job elsewhere; never on a
/// [`Netns::run`] thread, which exits instead (its thread-locals are dropped then). For
/// per-namespace state a step keeps on its thread, such as a socket opened inside: it must
/// neither serve the next namespace nor keep this one alive.
pub fn when_leaving(f: impl FnOnce() + 'static) {
    ON_LEAVE.with_borrow_mut(|hooks| hooks.push(Box::new(f)));
}

/// An open network namespace. The fd keeps the namespace alive even after its bind mount is gone.
#[derive(Debug)]
pub struct Netns {
    fd: OwnedFd,
    id: NetnsId,
    /// Tools started by [`command`](Self::command) join the owning user namespace too.
    in_owner_userns: bool,
    /// Where it was opened: a file the pod's own root can open (the iptables lock there).
    path: Option<PathBuf>,
}

// From <linux/magic.h> and <linux/nsfs.h>.
const NSFS_MAGIC: u64 = 0x6e73_6673;
const PROC_SUPER_MAGIC: u64 = 0x9fa0;
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
const NS_GET_USERNS: libc::c_ulong = 0xb701;

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
            in_owner_userns: false,
            path: Some(path.to_owned()),
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
            in_owner_userns: self.in_owner_userns,
            path: self.path.clone(),
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

    /// [`run`](Self::run) without waiting for it: `f` runs inside this namespace on a worker
    /// thread, which hands the result to `done` and goes back to the process's own namespace
    /// for the next job. For async callers: a `spawn_blocking` around [`run`](Self::run) would
    /// hold a pooled thread (the agent has two) only to wait for this one, so concurrent pod
    /// operations queued behind each other. If `f` panics, `done` is dropped uncalled.
    pub fn run_detached<T, F, D>(self: std::sync::Arc<Self>, f: F, done: D) -> io::Result<()>
    where
        F: FnOnce(&Netns) -> T + Send + 'static,
        D: FnOnce(Result<T, NetnsError>) + Send + 'static,
    {
        workers::submit(Box::new(move || {
            let entered =
                workers::enter(self.fd.as_fd(), self.id).map_err(|source| NetnsError::Enter {
                    id: self.id,
                    source,
                });
            done(entered.map(|()| {
                ENTERED.set(Some(self.id));
                f(&self)
            }));
        }))
    }

    /// Whether the calling thread is a [`run`](Self::run) thread inside this namespace (where a
    /// nested `run` runs in place).
    pub fn entered_here(&self) -> bool {
        ENTERED.get() == Some(self.id)
    }

    /// The user namespace that owns this network namespace, when it is not the caller's (a pod
    /// with `hostUsers: false`).
    pub fn foreign_owner(&self) -> io::Result<Option<OwnedFd>> {
        // SAFETY: NS_GET_USERNS takes no argument and returns a new fd or -1.
        let raw = unsafe { libc::ioctl(self.fd.as_raw_fd(), NS_GET_USERNS as _) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the ioctl just returned this fd, owned by nobody else.
        let owner = File::from(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) });
        let (theirs, ours) = (owner.metadata()?, std::fs::metadata("/proc/self/ns/user")?);
        Ok(((theirs.dev(), theirs.ino()) != (ours.dev(), ours.ino())).then(|| owner.into()))
    }

    /// The same namespace, whose [`command`](Self::command)s also join the user namespace that
    /// owns it when that is not the caller's (a pod with `hostUsers: false`): the kernel only
    /// accepts iptables owner matches (`-m owner --uid-owner`) from a writer in the network
    /// namespace's own user namespace, whose UIDs they name. Istio runs its tools the same way,
    /// through `nsenter`. nftables' `meta skuid` needs nothing of the kind: the kernel reads a
    /// socket's UID in the socket's network namespace's user namespace.
    pub fn for_owner_matches(&self) -> io::Result<Netns> {
        let mut ns = self.try_clone()?;
        ns.in_owner_userns = true;
        Ok(ns)
    }

    /// A command running `program` in this namespace once [`spawn`](Self::spawn)ed, through
    /// `nsenter` into the owning user namespace for a handle from
    /// [`for_owner_matches`](Self::for_owner_matches) of a user-namespaced pod.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> io::Result<NsCommand> {
        let owner = if self.in_owner_userns {
            self.foreign_owner()?
        } else {
            None
        };
        let Some(owner) = owner else {
            return Ok(NsCommand {
                cmd: Command::new(program),
                _owner: None,
            });
        };
        let path_var = std::env::var_os("PATH").unwrap_or_default();
        let Some(nsenter) = find_in_path("nsenter", &path_var) else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "nsenter (util-linux) is needed for a pod with its own user namespace \
                 (hostUsers: false) and is not on PATH",
            ));
        };
        let fd_path = |fd: i32| format!("/proc/{}/fd/{fd}", std::process::id());
        let mut cmd = Command::new(nsenter);
        cmd.arg(format!("--user={}", fd_path(owner.as_raw_fd())))
            .arg(format!("--net={}", fd_path(self.fd.as_raw_fd())))
            .arg("--");
        // The pod's root is not the host's: the agent's lock directory is closed to it, so legacy
        // iptables locks the namespace file itself, as Istio's always does.
        if let Some(path) = &self.path {
            let mut lock = std::ffi::OsString::from("XTABLES_LOCKFILE=");
            lock.push(path);
            cmd.arg("env").arg(lock);
        }
        cmd.arg(program);
        Ok(NsCommand {
            cmd,
            _owner: Some(owner),
        })
    }

    /// Starts `cmd` inside this namespace. The child is spawned from a thread that has entered
    /// the namespace (a child inherits its creator's), not moved by a `setns` between fork and
    /// exec: a `pre_exec` hook makes std fork the whole parent, page tables and all, where
    /// without one it uses `posix_spawn` (a vfork). In a busy agent or test harness the fork
    /// costs milliseconds per child.
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<Child> {
        self.run(|| cmd.spawn())
            .map_err(|e| io::Error::other(e.to_string()))?
    }

    /// Like [`Netns::spawn`], but always from a fresh thread that, once inside the namespace,
    /// runs `isolate` first: it may change what only that thread and its child share (its mount
    /// namespace), because the thread exits right after the spawn, even when called inside a
    /// [`Netns::run`] of this namespace.
    pub fn spawn_isolated(
        &self,
        cmd: &mut Command,
        isolate: impl FnOnce() -> io::Result<()> + Send,
    ) -> Result<Child, SpawnError> {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    setns(self.fd.as_fd(), CloneFlags::CLONE_NEWNET)
                        .map_err(|e| SpawnError::Spawn(e.into()))?;
                    isolate().map_err(SpawnError::Isolate)?;
                    cmd.spawn().map_err(SpawnError::Spawn)
                })
                .join()
                .unwrap_or_else(|_| {
                    Err(SpawnError::Spawn(io::Error::other("spawn thread panicked")))
                })
        })
    }
}

/// Why [`Netns::spawn_isolated`] started nothing.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("cannot isolate the child: {0}")]
    Isolate(io::Error),
    #[error(transparent)]
    Spawn(io::Error),
}

/// The first `name` among the directories of a `PATH` value.
fn find_in_path(name: &str, path_var: &std::ffi::OsStr) -> Option<PathBuf> {
    std::env::split_paths(path_var)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// A [`Command`] from [`Netns::command`], holding open what `nsenter` opens by path until the
/// command is dropped (after its child has been waited for).
#[derive(Debug)]
pub struct NsCommand {
    cmd: Command,
    _owner: Option<OwnedFd>,
}

impl std::ops::Deref for NsCommand {
    type Target = Command;
    fn deref(&self) -> &Command {
        &self.cmd
    }
}

impl std::ops::DerefMut for NsCommand {
    fn deref_mut(&mut self) -> &mut Command {
        &mut self.cmd
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

/// The threads of [`Netns::run_detached`], kept between jobs: a fresh thread per pod operation
/// cost more than the operation (a profile of an agent restart with 250 pods: a fifth of its CPU
/// in unmapping thread stacks and the TLB shootdowns that go with it). After each job a worker
/// goes back to the process's namespace, so no pod's namespace is kept alive by an idle thread;
/// a worker that cannot go back ends. Idle workers end after [`IDLE`]. Callers bound how many
/// jobs run at once; there are never more workers than jobs in flight.
mod workers {
    use std::collections::VecDeque;
    use std::os::fd::{AsFd, OwnedFd};
    use std::sync::{Condvar, Mutex, OnceLock};
    use std::time::Duration;

    use nix::sched::{CloneFlags, setns};

    use super::{ENTERED, NetnsId};

    thread_local! {
        /// The namespace this worker is in, where known. A job for that namespace needs no
        /// `setns`, which asks for CAP_SYS_ADMIN even when it changes nothing: the agent's
        /// pipelines then run unprivileged in tests whose pods live in the test's own namespace.
        static IN: std::cell::Cell<Option<NetnsId>> = const { std::cell::Cell::new(None) };
    }

    pub type Job = Box<dyn FnOnce() + Send>;

    const IDLE: Duration = Duration::from_secs(10);

    struct Pool {
        /// The process's own namespace (its main thread's), where workers wait.
        home: Option<(OwnedFd, NetnsId)>,
        state: Mutex<State>,
        wake: Condvar,
    }

    #[derive(Default)]
    struct State {
        queue: VecDeque<Job>,
        idle: usize,
    }

    fn pool() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| Pool {
            home: opened_ns("/proc/self/ns/net"),
            state: Mutex::default(),
            wake: Condvar::new(),
        })
    }

    fn opened_ns(path: &str) -> Option<(OwnedFd, NetnsId)> {
        use std::os::unix::fs::MetadataExt;
        let file = std::fs::File::open(path).ok()?;
        let meta = file.metadata().ok()?;
        let id = NetnsId {
            dev: meta.dev(),
            ino: meta.ino(),
        };
        Some((file.into(), id))
    }

    /// Moves the calling worker into the namespace `fd` (`id`), unless it is there already.
    pub fn enter(fd: std::os::fd::BorrowedFd<'_>, id: NetnsId) -> nix::Result<()> {
        if IN.get() == Some(id) {
            return Ok(());
        }
        setns(fd, CloneFlags::CLONE_NEWNET)?;
        IN.set(Some(id));
        Ok(())
    }

    pub fn submit(job: Job) -> std::io::Result<()> {
        let pool = pool();
        let mut state = pool.state.lock().unwrap();
        state.queue.push_back(job);
        if state.idle >= state.queue.len() {
            pool.wake.notify_one();
            return Ok(());
        }
        drop(state);
        let spawned = std::thread::Builder::new()
            .name("netns".into())
            .spawn(|| work(pool));
        if let Err(e) = spawned {
            // Nobody may run it: the job is taken back (the newest is ours).
            pool.state.lock().unwrap().queue.pop_back();
            return Err(e);
        }
        Ok(())
    }

    fn work(pool: &'static Pool) {
        // Spawned in the namespace of the thread that submitted the first job.
        IN.set(opened_ns("/proc/thread-self/ns/net").map(|(_, id)| id));
        let mut state = pool.state.lock().unwrap();
        loop {
            if let Some(job) = state.queue.pop_front() {
                drop(state);
                job();
                for hook in super::ON_LEAVE.take() {
                    hook();
                }
                ENTERED.set(None);
                let home = pool.home.as_ref().map(|(fd, id)| enter(fd.as_fd(), *id));
                if !matches!(home, Some(Ok(()))) {
                    // Still inside the last job's namespace: this thread must not wait anywhere.
                    return;
                }
                state = pool.state.lock().unwrap();
                continue;
            }
            state.idle += 1;
            let (next, waited) = pool.wake.wait_timeout(state, IDLE).unwrap();
            state = next;
            state.idle -= 1;
            if waited.timed_out() && state.queue.is_empty() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nsenter_is_looked_up_on_the_given_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("nsenter"), "").unwrap();
        let path = std::env::join_paths(["/nonexistent".into(), dir.path().to_path_buf()]).unwrap();
        assert_eq!(
            find_in_path("nsenter", &path),
            Some(dir.path().join("nsenter"))
        );
        assert_eq!(
            find_in_path("nsenter", std::ffi::OsStr::new("/nonexistent")),
            None
        );
    }

    #[test]
    fn own_namespaces_have_no_foreign_owner_and_plain_commands() {
        let ns = Netns::current().unwrap().for_owner_matches().unwrap();
        assert!(ns.foreign_owner().unwrap().is_none());
        assert_eq!(
            ns.command("iptables-save").unwrap().get_program(),
            "iptables-save"
        );
    }

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

    #[test]
    fn spawn_starts_the_child_in_the_namespace_and_leaves_the_caller_where_it_was() {
        crate::require_root!();
        let pod = crate::test_support::TestNetns::new("spawn");
        let ns = pod.open();
        let before = Netns::current().unwrap().id();
        let mut cmd = Command::new("readlink");
        cmd.arg("/proc/self/ns/net")
            .stdout(std::process::Stdio::piped());
        let out = ns.spawn(&mut cmd).unwrap().wait_with_output().unwrap();
        assert!(out.status.success());
        // `net:[<inode>]`: the nsfs inode is the namespace's identity.
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("net:[{}]", ns.id().ino)
        );
        assert_eq!(Netns::current().unwrap().id(), before);
    }

    /// Detached jobs reuse their threads, and an idle worker holds no pod namespace: a deleted
    /// namespace is freed (here: its veth pair goes from the host) although its last job's
    /// thread lives on.
    #[test]
    fn detached_jobs_share_threads_and_let_namespaces_go() {
        crate::require_root!();
        let run = |ns: &std::sync::Arc<Netns>| {
            let (tx, rx) = std::sync::mpsc::channel();
            ns.clone()
                .run_detached(
                    |_| (std::thread::current().id(), Netns::current().unwrap().id()),
                    move |r| tx.send(r.unwrap()).unwrap(),
                )
                .unwrap();
            rx.recv().unwrap()
        };
        let pod = crate::test_support::TestNetns::new("detach");
        let ns = std::sync::Arc::new(pod.open());
        let (first, inside) = run(&ns);
        assert_eq!(inside, ns.id());
        // The worker is back home and idle before the next job is handed out.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (second, _) = run(&ns);
        assert_eq!(first, second, "a second job got a fresh thread");

        let host_end = format!("dt{}", std::process::id() % 100_000);
        let ip = |args: &[&str]| {
            std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap()
                .success()
        };
        assert!(ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns", &pod.name,
        ]));
        drop(ns);
        drop(pod);
        // A namespace is destroyed in the background once nothing holds it.
        let gone = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            !std::path::Path::new(&format!("/sys/class/net/{host_end}")).exists()
        });
        if !gone {
            ip(&["link", "del", &host_end]);
        }
        assert!(
            gone,
            "the deleted namespace was kept alive (its veth is still on the host)"
        );
    }
}
