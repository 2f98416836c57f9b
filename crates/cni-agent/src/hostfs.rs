//! File I/O on host directories (CNI conf dir, CNI bin dir, agent run dir) that other programs
//! also write to. Every operation is relative to a directory fd and names a single path component;
//! files are opened with `O_NOFOLLOW`, so a symlink planted in the directory is never followed,
//! read through or overwritten. Replacement is temp file + fsync + rename in the same directory,
//! so the container runtime never sees a half-written config or binary.

use std::ffi::OsStr;
use std::fs::File;
use std::hash::{BuildHasher, RandomState};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{Mode, SFlag, fchmod, fstat, fstatat};
use nix::unistd::{UnlinkatFlags, fsync, unlinkat};

#[derive(Debug, thiserror::Error)]
pub enum HostFsError {
    #[error("opening directory {path}: {source}")]
    OpenDir { path: PathBuf, source: io::Error },
    #[error("{name:?} is not a plain file name")]
    BadName { name: String },
    #[error("{path} is a symlink; refusing to follow it")]
    Symlink { path: PathBuf },
    #[error("{path} is not a regular file")]
    NotRegular { path: PathBuf },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// How the mode of a replaced file is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileMode {
    /// Keep the mode of the file being replaced; use this one when creating it.
    KeepOr(u32),
    /// Always this mode.
    Exactly(u32),
}

/// What sits at a name in the directory, without following symlinks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// A directory opened once; all operations are relative to its fd.
#[derive(Debug)]
pub struct HostDir {
    path: PathBuf,
    fd: OwnedFd,
}

fn errno(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

impl HostDir {
    /// Opens `path` (the configured directory itself may be reached through symlinks; that is
    /// the operator's choice, not something a CNI plugin can plant).
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, HostFsError> {
        let path = path.into();
        let fd = nix::fcntl::open(
            &path,
            OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| HostFsError::OpenDir {
            path: path.clone(),
            source: errno(e),
        })?;
        Ok(HostDir { path, fd })
    }

    /// Like [`HostDir::open`], creating the directory (and parents) first when missing.
    pub fn open_or_create(path: impl Into<PathBuf>) -> Result<Self, HostFsError> {
        let path = path.into();
        std::fs::create_dir_all(&path).map_err(|source| HostFsError::OpenDir {
            path: path.clone(),
            source,
        })?;
        Self::open(path)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The full path of `name`, for messages and for callers that report what they wrote.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    fn check_name<'a>(&self, name: &'a str) -> Result<&'a str, HostFsError> {
        if name.is_empty()
            || name == "."
            || name == ".."
            || name.contains('/')
            || name.contains('\0')
        {
            return Err(HostFsError::BadName { name: name.into() });
        }
        Ok(name)
    }

    fn io(&self, op: &'static str, name: &str, e: Errno) -> HostFsError {
        HostFsError::Io {
            op,
            path: self.join(name),
            source: errno(e),
        }
    }

    /// Kind and permission bits of `name`, `None` when absent.
    pub fn lstat(&self, name: &str) -> Result<Option<(EntryKind, u32)>, HostFsError> {
        let name = self.check_name(name)?;
        match fstatat(self.fd.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some((kind_of(st.st_mode), st.st_mode & 0o7777))),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(self.io("stat", name, e)),
        }
    }

    /// Contents of the regular file `name`, `None` when absent. A symlink is an error.
    pub fn read(&self, name: &str) -> Result<Option<Vec<u8>>, HostFsError> {
        let name = self.check_name(name)?;
        // O_NONBLOCK: a FIFO planted under a config name must not hang the installer.
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
        let fd = match openat(self.fd.as_fd(), name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(None),
            Err(Errno::ELOOP) => {
                return Err(HostFsError::Symlink {
                    path: self.join(name),
                });
            }
            Err(e) => return Err(self.io("open", name, e)),
        };
        let st = fstat(fd.as_fd()).map_err(|e| self.io("stat", name, e))?;
        if kind_of(st.st_mode) != EntryKind::File {
            return Err(HostFsError::NotRegular {
                path: self.join(name),
            });
        }
        let mut out = Vec::new();
        File::from(fd)
            .read_to_end(&mut out)
            .map_err(|source| HostFsError::Io {
                op: "read",
                path: self.join(name),
                source,
            })?;
        Ok(Some(out))
    }

    /// Atomically replaces (or creates) `name` with `contents`.
    pub fn write_atomic(
        &self,
        name: &str,
        contents: &[u8],
        mode: FileMode,
    ) -> Result<(), HostFsError> {
        self.replace_with(name, mode, |f| f.write_all(contents))
    }

    /// Atomically replaces (or creates) `name` with everything read from `src`.
    pub fn copy_atomic(
        &self,
        name: &str,
        src: &mut impl Read,
        mode: FileMode,
    ) -> Result<(), HostFsError> {
        self.replace_with(name, mode, |f| io::copy(src, f).map(drop))
    }

    fn replace_with(
        &self,
        name: &str,
        mode: FileMode,
        fill: impl FnOnce(&mut File) -> io::Result<()>,
    ) -> Result<(), HostFsError> {
        let name = self.check_name(name)?;
        let existing = self.lstat(name)?;
        let mode = match (existing, mode) {
            (Some((EntryKind::Symlink, _)), _) => {
                return Err(HostFsError::Symlink {
                    path: self.join(name),
                });
            }
            (Some((EntryKind::File, _)), FileMode::Exactly(m))
            | (None, FileMode::Exactly(m) | FileMode::KeepOr(m)) => m,
            (Some((EntryKind::File, current)), FileMode::KeepOr(_)) => current,
            (Some(_), _) => {
                return Err(HostFsError::NotRegular {
                    path: self.join(name),
                });
            }
        };
        // Errors name the file being replaced, not the temp file: its random suffix would make
        // every retry's message differ, and the operator looks for the file they know.
        let (tmp_name, fd) = self.create_temp(name)?;
        let result = (|| {
            fchmod(fd.as_fd(), Mode::from_bits_truncate(mode))
                .map_err(|e| self.io("chmod", name, e))?;
            let mut file = File::from(fd);
            let io_err = |source| HostFsError::Io {
                op: "write",
                path: self.join(name),
                source,
            };
            fill(&mut file).map_err(io_err)?;
            file.sync_all().map_err(io_err)?;
            renameat(self.fd.as_fd(), tmp_name.as_str(), self.fd.as_fd(), name)
                .map_err(|e| self.io("rename", name, e))
        })();
        if result.is_err() {
            let _ = unlinkat(
                self.fd.as_fd(),
                tmp_name.as_str(),
                UnlinkatFlags::NoRemoveDir,
            );
            return result;
        }
        // Persist the rename itself; the data was synced above.
        fsync(self.fd.as_fd()).map_err(|e| self.io("fsync", ".", e))
    }

    /// Creates `<name>.tmp.<random>` exclusively; the random part only avoids collisions with a
    /// concurrent writer, `O_EXCL` is what guarantees we never open someone else's file.
    fn create_temp(&self, name: &str) -> Result<(String, OwnedFd), HostFsError> {
        let flags =
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mut last = Errno::EEXIST;
        for _ in 0..16 {
            let tmp = format!(
                "{name}.tmp.{}",
                RandomState::new().hash_one(std::time::SystemTime::now())
            );
            match openat(
                self.fd.as_fd(),
                tmp.as_str(),
                flags,
                Mode::from_bits_truncate(0o600),
            ) {
                Ok(fd) => return Ok((tmp, fd)),
                Err(Errno::EEXIST) => last = Errno::EEXIST,
                Err(e) => return Err(self.io("create", name, e)),
            }
        }
        Err(self.io("create", name, last))
    }

    /// Removes `name` (a symlink is removed itself, never its target). Returns whether it existed.
    pub fn remove(&self, name: &str) -> Result<bool, HostFsError> {
        let name = self.check_name(name)?;
        match unlinkat(self.fd.as_fd(), name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(self.io("remove", name, e)),
        }
    }

    /// Renames `from` to `to` within the directory.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), HostFsError> {
        let (from, to) = (self.check_name(from)?, self.check_name(to)?);
        renameat(self.fd.as_fd(), from, self.fd.as_fd(), to)
            .map_err(|e| self.io("rename", from, e))?;
        fsync(self.fd.as_fd()).map_err(|e| self.io("fsync", ".", e))
    }

    /// Names and kinds of the directory's entries (unsorted). Listed through the fd we hold, so
    /// it is the same directory the other operations act on.
    pub fn list(&self) -> Result<Vec<(String, EntryKind)>, HostFsError> {
        let proc_path = PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()));
        let io_err = |source| HostFsError::Io {
            op: "list",
            path: self.path.clone(),
            source,
        };
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&proc_path).map_err(io_err)? {
            let entry = entry.map_err(io_err)?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let kind = match entry.file_type().map_err(io_err)? {
                t if t.is_symlink() => EntryKind::Symlink,
                t if t.is_file() => EntryKind::File,
                t if t.is_dir() => EntryKind::Dir,
                _ => EntryKind::Other,
            };
            out.push((name, kind));
        }
        Ok(out)
    }

    /// Deletes leftovers `<name>.tmp.*` of interrupted writes. Returns how many were removed.
    pub fn remove_stale_temps(&self, name: &str) -> Result<usize, HostFsError> {
        let prefix = format!("{name}.tmp.");
        let mut removed = 0;
        for (entry, _) in self.list()? {
            if entry.starts_with(&prefix) && self.remove(&entry)? {
                removed += 1;
            }
        }
        Ok(removed)
    }
}

fn kind_of(st_mode: u32) -> EntryKind {
    match SFlag::from_bits_truncate(st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => EntryKind::File,
        SFlag::S_IFDIR => EntryKind::Dir,
        SFlag::S_IFLNK => EntryKind::Symlink,
        _ => EntryKind::Other,
    }
}

/// Whether `name` is a plain file name (no directory part), as CNI config and binary names are.
pub fn is_plain_name(name: &OsStr) -> bool {
    let b = name.as_bytes();
    !b.is_empty() && b != b"." && b != b".." && !b.contains(&b'/')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn mode_of(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn write_replaces_atomically_and_keeps_mode() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = HostDir::open(tmp.path()).unwrap();
        dir.write_atomic("a.conflist", b"one", FileMode::KeepOr(0o600))
            .unwrap();
        assert_eq!(mode_of(&tmp.path().join("a.conflist")), 0o600);
        std::fs::set_permissions(
            tmp.path().join("a.conflist"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        dir.write_atomic("a.conflist", b"two", FileMode::KeepOr(0o600))
            .unwrap();
        assert_eq!(
            std::fs::read(tmp.path().join("a.conflist")).unwrap(),
            b"two"
        );
        assert_eq!(mode_of(&tmp.path().join("a.conflist")), 0o644);
        dir.write_atomic("a.conflist", b"three", FileMode::Exactly(0o640))
            .unwrap();
        assert_eq!(mode_of(&tmp.path().join("a.conflist")), 0o640);
        let names: Vec<_> = dir.list().unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a.conflist"], "no temp files left behind");
    }

    #[test]
    fn symlink_pointing_outside_is_never_followed() {
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("secret");
        std::fs::write(&target, b"outside").unwrap();
        let tmp = tempfile::tempdir().unwrap();
        symlink(&target, tmp.path().join("10-evil.conflist")).unwrap();
        let dir = HostDir::open(tmp.path()).unwrap();

        assert!(matches!(
            dir.read("10-evil.conflist"),
            Err(HostFsError::Symlink { .. })
        ));
        let err = dir
            .write_atomic("10-evil.conflist", b"pwned", FileMode::KeepOr(0o600))
            .unwrap_err();
        assert!(matches!(err, HostFsError::Symlink { .. }), "{err}");
        assert_eq!(
            dir.lstat("10-evil.conflist").unwrap().map(|(k, _)| k),
            Some(EntryKind::Symlink)
        );
        assert!(dir.remove("10-evil.conflist").unwrap());
        assert_eq!(std::fs::read(&target).unwrap(), b"outside");
        for bad in ["../secret", "a/b", "", ".", ".."] {
            assert!(
                matches!(dir.read(bad), Err(HostFsError::BadName { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn directories_and_fifos_are_not_files() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("sub.conf")).unwrap();
        nix::unistd::mkfifo(
            &tmp.path().join("fifo.conf"),
            Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let dir = HostDir::open(tmp.path()).unwrap();
        assert!(matches!(
            dir.read("sub.conf"),
            Err(HostFsError::NotRegular { .. })
        ));
        assert!(matches!(
            dir.read("fifo.conf"),
            Err(HostFsError::NotRegular { .. })
        ));
        assert!(
            dir.write_atomic("sub.conf", b"x", FileMode::KeepOr(0o600))
                .is_err()
        );
        assert_eq!(dir.read("missing.conf").unwrap(), None);
    }

    #[test]
    fn stale_temps_are_removed_and_copies_stream() {
        let tmp = tempfile::tempdir().unwrap();
        for n in [
            "istio-cni.tmp.123",
            "istio-cni.tmp.x",
            "other.tmp.1",
            "istio-cni",
        ] {
            std::fs::write(tmp.path().join(n), b"old").unwrap();
        }
        let dir = HostDir::open(tmp.path()).unwrap();
        assert_eq!(dir.remove_stale_temps("istio-cni").unwrap(), 2);
        dir.copy_atomic("istio-cni", &mut &b"binary"[..], FileMode::Exactly(0o755))
            .unwrap();
        let mut names: Vec<_> = dir.list().unwrap().into_iter().map(|(n, _)| n).collect();
        names.sort();
        assert_eq!(names, ["istio-cni", "other.tmp.1"]);
        assert_eq!(mode_of(&tmp.path().join("istio-cni")), 0o755);
        dir.rename("istio-cni", "moved").unwrap();
        assert_eq!(std::fs::read(tmp.path().join("moved")).unwrap(), b"binary");
    }
}
