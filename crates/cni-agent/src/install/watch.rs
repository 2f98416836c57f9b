//! File-change notification for the installer (inotify through the `notify` crate).

use std::path::{Path, PathBuf};

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;

#[derive(Debug, thiserror::Error)]
#[error("watching {path}: {source}")]
pub struct WatchError {
    pub path: PathBuf,
    #[source]
    pub source: notify::Error,
}

/// Watches a set of paths; existing paths only, as a missing one cannot be watched (the periodic
/// re-check of the caller covers it).
pub struct FileWatch {
    _watcher: notify::RecommendedWatcher,
    rx: mpsc::UnboundedReceiver<notify::Result<notify::Event>>,
}

/// Events that can change what the runtime or the plugin sees; access and metadata-only changes
/// (Istio ignores chmod too) do not.
fn relevant(kind: &EventKind) -> bool {
    !matches!(
        kind,
        EventKind::Access(_) | EventKind::Modify(notify::event::ModifyKind::Metadata(_))
    )
}

impl FileWatch {
    pub fn new<'a>(paths: impl IntoIterator<Item = &'a Path>) -> Result<Self, WatchError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut watcher = notify::recommended_watcher(move |ev| {
            let _ = tx.send(ev);
        })
        .map_err(|source| WatchError {
            path: PathBuf::new(),
            source,
        })?;
        for path in paths {
            if !path.exists() {
                continue;
            }
            watcher
                .watch(path, RecursiveMode::NonRecursive)
                .map_err(|source| WatchError {
                    path: path.to_path_buf(),
                    source,
                })?;
        }
        Ok(FileWatch {
            _watcher: watcher,
            rx,
        })
    }

    /// Waits for the next relevant change; returns the paths it touched.
    pub async fn changed(&mut self) -> Result<Vec<PathBuf>, WatchError> {
        loop {
            match self.rx.recv().await {
                Some(Ok(ev)) if relevant(&ev.kind) => return Ok(ev.paths),
                Some(Ok(_)) => continue,
                Some(Err(source)) => {
                    return Err(WatchError {
                        path: PathBuf::new(),
                        source,
                    });
                }
                None => std::future::pending().await,
            }
        }
    }

    /// Whether a relevant change is already queued (consumes queued events).
    pub fn pending(&mut self) -> bool {
        while let Ok(ev) = self.rx.try_recv() {
            if ev.map_or(true, |e| relevant(&e.kind)) {
                return true;
            }
        }
        false
    }
}
