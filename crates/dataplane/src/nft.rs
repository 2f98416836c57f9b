//! The nftables backend, spoken over netlink: no `nft` binary on this path.
//!
//! Every change is one nf_tables batch (`BATCH_BEGIN … BATCH_END`), which the kernel commits
//! atomically, so a pod is either fully redirected or untouched. A re-apply deletes and recreates
//! our tables inside the same batch: idempotent, and it also replaces whatever drifted in them.
//! The socket is opened inside the pod namespace on a [`Netns::run`] thread and used only there.

mod bytes;
mod expr;
pub mod generations;
pub mod host;
pub mod wire;

use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};

use cni_core::redirect::ambient::InpodConfig;
use cni_core::redirect::ambient::nft::{INPOD_TABLES, inpod_ruleset};
use cni_core::redirect::nft::{Ruleset, diff};

use crate::inpod::{Drift, InpodRules, RuleError, RuleState};
use crate::netlink::{Encoded, NetlinkError, NetlinkSocket};
use crate::netns::Netns;
use generations::{Generations, Mark, fingerprint};
use wire::Batch;

const BACKEND: &str = "nftables";

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
    #[error("nftables over netlink: {0}")]
    Netlink(#[from] NetlinkError),
}

impl From<NftError> for RuleError {
    fn from(e: NftError) -> Self {
        match e {
            NftError::Netns(n) => RuleError::Netns(n),
            other => RuleError::Backend {
                backend: BACKEND,
                source: Box::new(other),
            },
        }
    }
}

thread_local! {
    /// The nfnetlink socket of the namespace a [`Netns::run`] thread or a detached worker
    /// entered: the steps of one pod operation (the previous backend's check, the read, the
    /// commit) share it. Closed through the reaper when the thread leaves the namespace.
    static ENTERED_SOCKET: std::cell::RefCell<Reaped> = const { std::cell::RefCell::new(Reaped(None)) };
}

/// A socket closed by [`close_later`] when dropped.
struct Reaped(Option<NetlinkSocket>);

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(sock) = self.0.take() {
            close_later(sock);
        }
    }
}

/// Runs `f` with an nfnetlink socket that lives in `netns`: on a thread that entered `netns`,
/// the thread's own (opened at first use), else a fresh one.
pub fn with_socket<T: Send>(
    netns: &Netns,
    f: impl FnOnce(&mut NetlinkSocket) -> Result<T, NetlinkError> + Send,
) -> Result<T, NftError> {
    if netns.entered_here() {
        let mut sock = match ENTERED_SOCKET.with_borrow_mut(|kept| kept.0.take()) {
            Some(sock) => sock,
            None => {
                let sock = NetlinkSocket::open(netlink_sys::constants::NETLINK_NETFILTER)?;
                // A worker's next job is another namespace's.
                crate::netns::when_leaving(|| {
                    if let Some(sock) = ENTERED_SOCKET.with_borrow_mut(|kept| kept.0.take()) {
                        close_later(sock);
                    }
                });
                sock
            }
        };
        let res = f(&mut sock);
        if matches!(res, Err(NetlinkError::Io(_) | NetlinkError::Decode(_))) {
            // Possibly unread replies: not for the next step.
            close_later(sock);
        } else {
            ENTERED_SOCKET.with_borrow_mut(|kept| kept.0 = Some(sock));
        }
        return Ok(res?);
    }
    let res = netns.run(|| {
        let mut sock = NetlinkSocket::open(netlink_sys::constants::NETLINK_NETFILTER)?;
        let res = f(&mut sock);
        close_later(sock);
        res
    })?;
    Ok(res?)
}

/// Where nftables requests go: a fresh socket in a namespace ([`Netns`]), or one kept open
/// ([`KeptSocket`]).
pub trait NftAccess {
    fn with_sock<T: Send>(
        &self,
        f: impl FnOnce(&mut NetlinkSocket) -> Result<T, NetlinkError> + Send,
    ) -> Result<T, NftError>;
}

impl NftAccess for Netns {
    fn with_sock<T: Send>(
        &self,
        f: impl FnOnce(&mut NetlinkSocket) -> Result<T, NetlinkError> + Send,
    ) -> Result<T, NftError> {
        with_socket(self, f)
    }
}

/// An nfnetlink socket opened once in a namespace and kept, for the namespace changed on every
/// pod add (the host's probe sets): no thread into the namespace and no socket set-up and close
/// per change. Requests take turns. A socket that failed below the kernel's answers (a lost or
/// undecodable reply) is replaced by a fresh one at the next request.
pub struct KeptSocket {
    netns: Netns,
    sock: Mutex<Option<NetlinkSocket>>,
}

impl KeptSocket {
    pub fn new(netns: &Netns) -> std::io::Result<Self> {
        Ok(KeptSocket {
            netns: netns.try_clone()?,
            sock: Mutex::new(None),
        })
    }
}

impl NftAccess for KeptSocket {
    fn with_sock<T: Send>(
        &self,
        f: impl FnOnce(&mut NetlinkSocket) -> Result<T, NetlinkError> + Send,
    ) -> Result<T, NftError> {
        let mut kept = self.sock.lock().unwrap_or_else(PoisonError::into_inner);
        let sock = match kept.take() {
            Some(sock) => kept.insert(sock),
            None => kept.insert(
                self.netns
                    .run(|| NetlinkSocket::open(netlink_sys::constants::NETLINK_NETFILTER))??,
            ),
        };
        let result = f(sock);
        if matches!(result, Err(NetlinkError::Io(_) | NetlinkError::Decode(_)))
            && let Some(sock) = kept.take()
        {
            close_later(sock);
        }
        Ok(result?)
    }
}

/// Closing an nfnetlink socket makes the kernel first finish freeing whatever earlier commits
/// deleted (an RCU grace period: ~15 ms here, against ~0.25 ms for the commit itself). Every
/// reply has been read by then, so the close is handed to one background thread and the caller
/// returns at once.
fn close_later(sock: NetlinkSocket) {
    static REAPER: OnceLock<Option<mpsc::Sender<NetlinkSocket>>> = OnceLock::new();
    let reaper = REAPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<NetlinkSocket>();
        std::thread::Builder::new()
            .name("nft-socket-close".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .ok()
            .map(|_| tx)
    });
    match reaper {
        // If the thread is gone the socket comes back in the error and is closed right here.
        Some(tx) => drop(tx.send(sock)),
        None => drop(sock),
    }
}

/// Programs ambient in-pod redirection with native nftables. Each call uses a socket of its
/// own and the desired rules its thread keeps (`with_desired`), so concurrent calls for
/// different pods never meet. The one state it may hold is shared by all of them: the
/// namespaces found in sync, by generation ([`generations`]).
#[derive(Clone, Default)]
pub struct NftablesBackend {
    generations: Option<Arc<Generations>>,
}

impl NftablesBackend {
    /// A backend that reads every pod's tables back at every check.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend whose check skips the read of a namespace that `generations` proves unchanged
    /// since it was last found in sync.
    pub fn remembering(generations: Arc<Generations>) -> Self {
        NftablesBackend {
            generations: Some(generations),
        }
    }

    /// The batch `apply` sends: our tables replaced by `desired`, and any of our tables that
    /// `desired` lacks (the raw table once DNS capture is off) deleted.
    pub fn apply_batch(desired: &Ruleset) -> Batch {
        let mut batch = Batch::default();
        batch.replace_tables(desired);
        for name in INPOD_TABLES {
            if desired.table(name).is_none() {
                batch.ensure_no_table(name);
            }
        }
        batch
    }

    /// Our tables as the kernel has them in `netns`.
    pub fn read(&self, netns: &Netns) -> Result<Ruleset, NftError> {
        with_socket(netns, |sock| wire::read_tables(sock, &INPOD_TABLES))
    }

    /// Commits an arbitrary batch in `netns` (all or nothing).
    pub fn commit(&self, netns: &Netns, batch: Batch) -> Result<(), NftError> {
        with_socket(netns, move |sock| batch.commit(sock))
    }

    /// [`InpodRules::verify`] on a socket in the pod's namespace: skipped when the namespace is
    /// remembered in sync at its current generation; remembered when found in sync and the
    /// generation did not move while the tables were read.
    fn check(
        &self,
        sock: &mut NetlinkSocket,
        desired: &Desired,
    ) -> Result<RuleState, NetlinkError> {
        let mark = self
            .generations
            .as_ref()
            .and_then(|g| Some((g, mark_now(sock, desired.fingerprint())?)));
        if let Some((generations, mark)) = mark
            && generations.holds(mark)
        {
            return Ok(RuleState::InSync);
        }
        let actual = wire::read_tables(sock, &INPOD_TABLES)?;
        let state = state_of(&desired.ruleset, &actual);
        if state != RuleState::InSync {
            return Ok(state);
        }
        if let Some((generations, mark)) = mark
            && wire::generation(sock).ok() == Some(mark.generation)
        {
            generations.remember(mark);
        }
        Ok(RuleState::InSync)
    }
}

/// How `actual` (our tables as read back) stands against `desired`.
fn state_of(desired: &Ruleset, actual: &Ruleset) -> RuleState {
    if actual.tables.is_empty() {
        return RuleState::Absent;
    }
    let (missing, unexpected) = diff(desired, actual);
    if missing.is_empty() && unexpected.is_empty() {
        RuleState::InSync
    } else {
        RuleState::Drifted(Drift {
            missing,
            unexpected,
        })
    }
}

/// The namespace of `sock` (its cookie) at its current generation, against `desired`; `None`
/// where the kernel cannot tell (`SO_NETNS_COOKIE` is Linux 5.14+), and then every check reads.
fn mark_now(sock: &mut NetlinkSocket, desired: u64) -> Option<Mark> {
    let cookie = netns_cookie(sock)?;
    let generation = wire::generation(sock).ok()?;
    Some(Mark {
        cookie,
        generation,
        desired,
    })
}

fn netns_cookie(sock: &NetlinkSocket) -> Option<u64> {
    use std::os::fd::AsRawFd;
    // <asm-generic/socket.h>, as on x86-64 and arm64.
    const SO_NETNS_COOKIE: libc::c_int = 71;
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `cookie`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    (rc == 0 && len as usize == std::mem::size_of::<u64>()).then_some(cookie)
}

/// The in-pod rule set of one configuration, the fingerprint of its rendering and the batch
/// that applies it, each made when first asked for (only a backend remembering generations
/// needs the fingerprint, and a restart with nothing to repair applies nothing).
struct Desired {
    ruleset: Ruleset,
    fingerprint: std::cell::OnceCell<u64>,
    batch: std::cell::OnceCell<std::cell::RefCell<Encoded>>,
}

impl Desired {
    fn new(cfg: &InpodConfig) -> Self {
        Desired {
            ruleset: inpod_ruleset(cfg),
            fingerprint: Default::default(),
            batch: Default::default(),
        }
    }

    fn fingerprint(&self) -> u64 {
        *self
            .fingerprint
            .get_or_init(|| fingerprint(&self.ruleset.render()))
    }

    /// Commits [`NftablesBackend::apply_batch`] of these rules, serialized once.
    fn commit(&self, sock: &mut NetlinkSocket) -> Result<(), NetlinkError> {
        let batch = self
            .batch
            .get_or_init(|| NftablesBackend::apply_batch(&self.ruleset).encode().into());
        sock.transact_encoded(&mut batch.borrow_mut())
    }
}

/// Calls `f` with the in-pod rule set of `cfg`, built once per thread for the settings last
/// asked for there: enrollments, a restart and a drift pass all work against the node's
/// settings for nearly every pod, and building the model costs as many allocations as half of
/// reading the pod's tables back.
fn with_desired<T>(cfg: &InpodConfig, f: impl FnOnce(&Desired) -> T) -> T {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(InpodConfig, Desired)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| {
        if last.as_ref().is_none_or(|(for_cfg, _)| for_cfg != cfg) {
            *last = Some((cfg.clone(), Desired::new(cfg)));
        }
        let (_, desired) = last.as_ref().expect("just set");
        f(desired)
    })
}

impl InpodRules for NftablesBackend {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn render(&self, cfg: &InpodConfig) -> String {
        inpod_ruleset(cfg).render()
    }

    /// With generations remembered, the commit is remembered as in sync when it was the only
    /// one between the generations taken before and after it: our batch replaced all of our
    /// tables, so they hold exactly the desired rules.
    fn apply(&self, netns: &Netns, cfg: &InpodConfig) -> Result<(), RuleError> {
        Ok(with_socket(netns, |sock| {
            with_desired(cfg, |desired| {
                let before = self.generations.as_ref().and_then(|generations| {
                    Some((generations, mark_now(sock, desired.fingerprint())?))
                });
                desired.commit(sock)?;
                if let Some((generations, before)) = before
                    && let Ok(after) = wire::generation(sock)
                    && after == before.generation.wrapping_add(1)
                {
                    generations.remember(Mark {
                        generation: after,
                        ..before
                    });
                }
                Ok(())
            })
        })?)
    }

    fn verify(&self, netns: &Netns, cfg: &InpodConfig) -> Result<RuleState, RuleError> {
        Ok(with_socket(netns, |sock| {
            with_desired(cfg, |desired| self.check(sock, desired))
        })?)
    }

    fn remove(&self, netns: &Netns, _cfg: &InpodConfig) -> Result<(), RuleError> {
        let mut batch = Batch::default();
        for name in INPOD_TABLES {
            batch.ensure_no_table(name);
        }
        Ok(with_socket(netns, |sock| {
            if let Some(generations) = &self.generations
                && let Some(cookie) = netns_cookie(sock)
            {
                generations.forget(cookie);
            }
            batch.commit(sock)
        })?)
    }
}
