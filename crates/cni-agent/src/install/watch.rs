//! File-change notification for the installer (inotify).
//!
//! Only changes are asked for: creation, writes, deletion, renames. The plugin binary is one of
//! the watched files, and the runtime opens it on every CNI call; a watch that also reported
//! opens (as the `notify` crate's always does) woke the agent on every pod's ADD for an event it
//! then dropped. Access and metadata changes (Istio ignores chmod too) are not asked for either.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};

use futures::{FutureExt, StreamExt};
use inotify::{Event, EventMask, EventStream, Inotify, WatchDescriptor, WatchMask};

#[derive(Debug, thiserror::Error)]
#[error("watching {path}: {source}")]
pub struct WatchError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// What can change what the runtime or the plugin sees, in a watched directory or of a watched
/// file itself.
fn changes() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::CLOSE_WRITE
        | WatchMask::MODIFY
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF
}

/// Watches a set of paths; existing paths only, as a missing one cannot be watched (the periodic
/// re-check of the caller covers it).
pub struct FileWatch {
    events: EventStream<[u8; READ_LEN]>,
    paths: HashMap<WatchDescriptor, PathBuf>,
}

/// Room for a few events at once (each is 16 bytes and its name).
const READ_LEN: usize = 4096;

impl FileWatch {
    pub fn new<'a>(paths: impl IntoIterator<Item = &'a Path>) -> Result<Self, WatchError> {
        let failed = |path: &Path| {
            let path = path.to_path_buf();
            move |source| WatchError { path, source }
        };
        let inotify = Inotify::init().map_err(failed(Path::new("")))?;
        let mut watched = HashMap::new();
        for path in paths {
            if !path.exists() {
                continue;
            }
            let wd = inotify
                .watches()
                .add(path, changes())
                .map_err(failed(path))?;
            watched.insert(wd, path.to_path_buf());
        }
        Ok(FileWatch {
            events: inotify
                .into_event_stream([0; READ_LEN])
                .map_err(failed(Path::new("")))?,
            paths: watched,
        })
    }

    /// Waits for the next change; returns the paths it touched.
    pub async fn changed(&mut self) -> Result<Vec<PathBuf>, WatchError> {
        loop {
            let event = self.events.next().await;
            if let Some(path) = self.touched(event)? {
                return Ok(vec![path]);
            }
        }
    }

    /// Whether a change is already queued (consumes queued events).
    pub fn pending(&mut self) -> bool {
        let mut changed = false;
        while let Some(event) = self.events.next().now_or_never() {
            match self.touched(event) {
                Ok(path) => changed |= path.is_some(),
                // Ended or failed: the caller looks again, as after a change.
                Err(_) => return true,
            }
        }
        changed
    }

    /// The path an event names: the watched path, joined with the entry's name for one in a
    /// watched directory. A lost event queue (overflow) names nothing but counts as a change;
    /// a watch going away (`IGNORED`) follows the deletion that ended it and does not.
    fn touched(
        &self,
        event: Option<io::Result<Event<OsString>>>,
    ) -> Result<Option<PathBuf>, WatchError> {
        let event = event
            .unwrap_or_else(|| Err(io::ErrorKind::UnexpectedEof.into()))
            .map_err(|source| WatchError {
                path: PathBuf::new(),
                source,
            })?;
        if event.mask.contains(EventMask::Q_OVERFLOW) {
            return Ok(Some(PathBuf::new()));
        }
        let Some(watched) = self.paths.get(&event.wd) else {
            return Ok(None);
        };
        if event.mask == EventMask::IGNORED {
            return Ok(None);
        }
        Ok(Some(match event.name {
            Some(name) => watched.join(name),
            None => watched.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn opening_a_watched_file_is_no_change_and_writing_one_is() {
        let dir = tempfile::tempdir().unwrap();
        let (file, conf) = (dir.path().join("istio-cni"), dir.path().join("net.d"));
        std::fs::write(&file, b"plugin").unwrap();
        std::fs::create_dir(&conf).unwrap();
        let mut watch = FileWatch::new([file.as_path(), conf.as_path()]).unwrap();

        // What the runtime does with the plugin on every call: open and read it. Not even an
        // event to drop is queued: nothing wakes the agent.
        std::fs::read(&file).unwrap();
        std::fs::metadata(&file).unwrap();
        assert!(watch.events.next().now_or_never().is_none());
        assert!(!watch.pending());

        std::fs::write(conf.join("10-bridge.conflist"), b"{}").unwrap();
        let changed = tokio::time::timeout(std::time::Duration::from_secs(5), watch.changed())
            .await
            .expect("a change within 5 s")
            .unwrap();
        assert!(
            changed.contains(&conf.join("10-bridge.conflist")),
            "{changed:?}"
        );

        std::fs::write(&file, b"another plugin").unwrap();
        assert!(watch.pending());
    }

    #[tokio::test]
    async fn a_missing_path_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut watch = FileWatch::new([dir.path().join("absent").as_path()]).unwrap();
        assert!(!watch.pending());
    }
}
