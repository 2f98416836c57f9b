//! A size-capped, rotating, append-only log file shared by concurrent writers: the plugin's
//! node-local `istio-cni.log` (many short-lived plugin processes) and the agent's `--log_rotate`
//! file. It lives here because it is a host side effect both binaries need and this is the one
//! crate with side effects they both link.
//!
//! Safe on a directory other programs can see: the file is opened with `O_NOFOLLOW` and must be a
//! regular file with one link owned by us, so a planted symlink or hard link never redirects our
//! writes. Writers serialise on `flock` only around "rotate if full, then append one record", and
//! each record is a single `write(2)` with `O_APPEND`, so lines never interleave.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::fcntl::{Flock, FlockArg};

/// Size and retention of a [`RotatingFile`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    /// The file is rotated before a write would take it past this many bytes.
    pub max_bytes: u64,
    /// Rotated files kept (`<path>.1` is the newest); 0 keeps none.
    pub max_backups: u32,
    /// Rotated files older than this are deleted at rotation; `None` keeps them regardless of age.
    pub max_age: Option<Duration>,
}

#[derive(Debug, thiserror::Error)]
pub enum LogFileError {
    #[error("log file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "log file {path} is not a regular file with a single link owned by us; not writing to it"
    )]
    Unsafe { path: PathBuf },
}

/// An append-only log file rotated by size.
pub struct RotatingFile {
    path: PathBuf,
    rotation: Rotation,
    file: Option<File>,
}

impl RotatingFile {
    /// Nothing is opened until the first write, so an unused log costs nothing.
    pub fn new(path: impl Into<PathBuf>, rotation: Rotation) -> Self {
        RotatingFile {
            path: path.into(),
            rotation,
            file: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `record` (a newline is added when missing) as one write.
    pub fn append(&mut self, record: &[u8]) -> Result<(), LogFileError> {
        let mut line = Vec::with_capacity(record.len() + 1);
        line.extend_from_slice(record);
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        let io = |source| LogFileError::Io {
            path: self.path.clone(),
            source,
        };
        let file = match self.file.take() {
            Some(f) => f,
            None => open_checked(&self.path)?,
        };
        let mut locked = Flock::lock(file, FlockArg::LockExclusive)
            .map_err(|(_, e)| io(std::io::Error::from(e)))?;
        // Another writer may have rotated while we waited: follow the name to the new file.
        if !same_file(&locked, &self.path) {
            let fresh = open_checked(&self.path)?;
            drop(locked);
            locked = Flock::lock(fresh, FlockArg::LockExclusive)
                .map_err(|(_, e)| io(std::io::Error::from(e)))?;
        }
        let size = locked.metadata().map_err(io)?.len();
        if size > 0 && size + line.len() as u64 > self.rotation.max_bytes {
            self.rotate().map_err(io)?;
            let fresh = open_checked(&self.path)?;
            drop(locked);
            locked = Flock::lock(fresh, FlockArg::LockExclusive)
                .map_err(|(_, e)| io(std::io::Error::from(e)))?;
        }
        let written = locked.write_all(&line).map_err(io);
        self.file = locked.unlock().ok();
        written
    }

    /// `<path>.N` → `<path>.N+1` for the backups that exist (the oldest beyond the kept count
    /// goes), then `<path>` → `<path>.1`. Only existing backups are visited, so a huge count
    /// ("no limit") costs nothing.
    fn rotate(&self) -> std::io::Result<()> {
        let backup = |n: u32| {
            let mut p = self.path.clone().into_os_string();
            p.push(format!(".{n}"));
            PathBuf::from(p)
        };
        let keep = self.rotation.max_backups;
        if keep == 0 {
            return std::fs::remove_file(&self.path).or_else(not_found_ok);
        }
        let mut existing = 0;
        while existing < keep && std::fs::symlink_metadata(backup(existing + 1)).is_ok() {
            existing += 1;
        }
        if existing == keep {
            std::fs::remove_file(backup(keep)).or_else(not_found_ok)?;
            existing -= 1;
        }
        for n in (1..=existing).rev() {
            std::fs::rename(backup(n), backup(n + 1)).or_else(not_found_ok)?;
        }
        std::fs::rename(&self.path, backup(1)).or_else(not_found_ok)?;
        if let Some(age) = self.rotation.max_age {
            let now = SystemTime::now();
            for n in 2..=existing + 1 {
                let old = std::fs::symlink_metadata(backup(n))
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > age);
                if old {
                    let _ = std::fs::remove_file(backup(n));
                }
            }
        }
        Ok(())
    }
}

fn not_found_ok(e: std::io::Error) -> std::io::Result<()> {
    if e.kind() == std::io::ErrorKind::NotFound {
        Ok(())
    } else {
        Err(e)
    }
}

fn open_checked(path: &Path) -> Result<File, LogFileError> {
    let file = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| {
            // ELOOP: the name is a symlink.
            if source.raw_os_error() == Some(libc::ELOOP) {
                LogFileError::Unsafe {
                    path: path.to_owned(),
                }
            } else {
                LogFileError::Io {
                    path: path.to_owned(),
                    source,
                }
            }
        })?;
    let meta = file.metadata().map_err(|source| LogFileError::Io {
        path: path.to_owned(),
        source,
    })?;
    if !meta.file_type().is_file()
        || meta.nlink() != 1
        || meta.uid() != nix::unistd::geteuid().as_raw()
    {
        return Err(LogFileError::Unsafe {
            path: path.to_owned(),
        });
    }
    Ok(file)
}

fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rotation(max_bytes: u64, max_backups: u32) -> Rotation {
        Rotation {
            max_bytes,
            max_backups,
            max_age: None,
        }
    }

    fn read(p: &Path) -> String {
        std::fs::read_to_string(p).unwrap_or_default()
    }

    #[test]
    fn rotates_by_size_and_keeps_the_configured_backups() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("istio-cni.log");
        let mut log = RotatingFile::new(&path, rotation(20, 2));
        for i in 0..5 {
            log.append(format!("record {i} xxxxx").as_bytes()).unwrap();
        }
        assert_eq!(read(&path), "record 4 xxxxx\n");
        assert_eq!(
            read(&dir.path().join("istio-cni.log.1")),
            "record 3 xxxxx\n"
        );
        assert_eq!(
            read(&dir.path().join("istio-cni.log.2")),
            "record 2 xxxxx\n"
        );
        assert!(!dir.path().join("istio-cni.log.3").exists());
        let mode = std::fs::metadata(&path).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn an_unlimited_backup_count_keeps_every_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.log");
        let mut log = RotatingFile::new(&path, rotation(10, u32::MAX));
        for i in 0..4 {
            log.append(format!("record {i} xx").as_bytes()).unwrap();
        }
        for (n, i) in [(1, 2), (2, 1), (3, 0)] {
            let backup = dir.path().join(format!("agent.log.{n}"));
            assert_eq!(read(&backup), format!("record {i} xx\n"));
        }
        assert!(!dir.path().join("agent.log.4").exists());
    }

    #[test]
    fn concurrent_writers_never_lose_or_split_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.log");
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let path = path.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        // A fresh writer each time, like one plugin process per record.
                        let mut log = RotatingFile::new(&path, rotation(1 << 20, 1));
                        log.append(format!("writer {t} record {i}").as_bytes())
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let text = read(&path);
        assert_eq!(text.lines().count(), 200);
        assert!(text.lines().all(|l| l.starts_with("writer ")));
    }

    #[test]
    fn symlinks_and_hard_links_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "precious\n").unwrap();
        let link = dir.path().join("sym.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = RotatingFile::new(&link, rotation(100, 1))
            .append(b"x")
            .unwrap_err();
        assert!(matches!(err, LogFileError::Unsafe { .. }), "{err}");
        let hard = dir.path().join("hard.log");
        std::fs::hard_link(&target, &hard).unwrap();
        let err = RotatingFile::new(&hard, rotation(100, 1))
            .append(b"x")
            .unwrap_err();
        assert!(matches!(err, LogFileError::Unsafe { .. }), "{err}");
        assert_eq!(read(&target), "precious\n");
    }
}
