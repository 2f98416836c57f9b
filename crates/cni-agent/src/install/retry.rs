//! A failed install pass is retried in place instead of ending the agent.
//!
//! Istio's `install-cni` returns the installer's first error and exits; the kubelet restarts the
//! pod with a growing crash-loop backoff, and everything the agent held in memory (its watch
//! caches, enrolled pods' namespaces, ztunnel's connection) is rebuilt from scratch. A full or
//! failing host disk (ENOSPC or EIO on the CNI conf, bin or run dir, seen in the churn runs) is
//! usually transient, so the pass is tried again after a delay that doubles up to a bound, while
//! the agent's ambient work (enrollment, drift repair) goes on. A failure that persists shows: the
//! installer's readiness condition is false with the error, which names the file; one log line
//! when a failure starts or changes, one when it ends; `istio_cni_installs_total{result}` counts
//! each failed pass by its step and `istio_cni_install_ready` is 0. Only an error a retry cannot
//! fix (the agent's own configuration) still ends the run.

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::watch;

/// Delays between failed passes: `first`, doubled after each failure, at most `max`.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

/// The installer's: a full disk freed is noticed within 5 s, the spacing of reinstalls.
pub const BACKOFF: Backoff = Backoff {
    first: Duration::from_millis(200),
    max: Duration::from_secs(5),
};

/// One pass over `S` (boxed: an async closure borrowing the installer would not be `Send`).
pub type Pass<'a, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'a>>;

/// Runs `pass` on `state` until it succeeds, or fails with an error `fatal` picks (returned as
/// is). While it fails, `failing` holds the error's text; `None` again once a pass succeeded.
pub async fn until_done<S, T, E: Display>(
    state: &mut S,
    failing: &watch::Sender<Option<String>>,
    backoff: Backoff,
    fatal: impl Fn(&E) -> bool,
    mut pass: impl for<'a> FnMut(&'a mut S) -> Pass<'a, T, E>,
) -> Result<T, E> {
    let mut delay = backoff.first;
    loop {
        match pass(state).await {
            Ok(done) => {
                report(failing, None);
                return Ok(done);
            }
            Err(e) if fatal(&e) => return Err(e),
            Err(e) => {
                report(failing, Some(e.to_string()));
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(backoff.max);
            }
        }
    }
}

/// Publishes the state and logs it only when it changed, so a failure retried every few seconds
/// for hours is one line, not thousands.
fn report(failing: &watch::Sender<Option<String>>, now: Option<String>) {
    failing.send_if_modified(|current| {
        if *current == now {
            return false;
        }
        match &now {
            Some(e) => tracing::error!("install failed, retrying in place (not ready): {e}"),
            None => tracing::info!("install succeeded after failing; ready again"),
        }
        *current = now;
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hostfs::HostFsError;
    use crate::install::InstallError;
    use crate::install::kubeconfig::KubeconfigError;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    const FAST: Backoff = Backoff {
        first: Duration::from_millis(1),
        max: Duration::from_millis(4),
    };
    const KUBECONFIG: &str = "/var/run/istio-cni/istio-cni-kubeconfig";

    /// The kubeconfig write as the installer does it, on a disk the test fills and frees.
    struct FakeDisk {
        full: AtomicBool,
        writes: AtomicU32,
    }

    impl FakeDisk {
        fn write_kubeconfig(&self) -> Result<(), InstallError> {
            self.writes.fetch_add(1, Ordering::SeqCst);
            if !self.full.load(Ordering::SeqCst) {
                return Ok(());
            }
            Err(InstallError::Kubeconfig(KubeconfigError::HostFs(
                HostFsError::Io {
                    op: "write",
                    path: KUBECONFIG.into(),
                    source: std::io::Error::from_raw_os_error(libc::ENOSPC),
                },
            )))
        }
    }

    #[tokio::test]
    async fn a_failing_write_is_retried_and_reported_once_until_it_succeeds() {
        let disk = FakeDisk {
            full: AtomicBool::new(true),
            writes: AtomicU32::new(0),
        };
        let (failing, mut seen) = watch::channel(None);
        let mut writer = &disk;
        let retried = until_done(&mut writer, &failing, FAST, InstallError::is_fatal, |d| {
            let d: &FakeDisk = d;
            Box::pin(async move { d.write_kubeconfig() })
        });
        let disk_freed = async {
            seen.changed().await.unwrap();
            let reason = seen.borrow_and_update().clone().expect("failing");
            assert!(
                reason.contains(KUBECONFIG) && reason.contains("No space left on device"),
                "{reason}"
            );
            // Retried in place: more writes, the same state, no new report.
            while disk.writes.load(Ordering::SeqCst) < 10 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            assert!(
                !seen.has_changed().unwrap(),
                "reported again while unchanged"
            );
            disk.full.store(false, Ordering::SeqCst);
        };
        let (result, ()) = tokio::join!(retried, disk_freed);
        result.unwrap();
        assert!(seen.has_changed().unwrap());
        assert_eq!(*seen.borrow_and_update(), None);
    }

    #[tokio::test]
    async fn a_configuration_error_ends_the_run_at_once() {
        let (failing, seen) = watch::channel(None);
        let mut passes = 0;
        let result: Result<(), _> = until_done(
            &mut passes,
            &failing,
            FAST,
            InstallError::is_fatal,
            |passes| {
                *passes += 1;
                Box::pin(async { Err(InstallError::Kubeconfig(KubeconfigError::MissingHost)) })
            },
        )
        .await;
        assert!(matches!(
            result,
            Err(InstallError::Kubeconfig(KubeconfigError::MissingHost))
        ));
        assert_eq!(passes, 1);
        assert_eq!(*seen.borrow(), None);
    }
}
