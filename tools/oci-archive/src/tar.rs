//! A deterministic ustar writer for image layers and the archive around them. Entries are
//! sorted by path, every parent directory is written before its children, and nothing about the
//! build machine leaks in (mtime 0, owner 0:0, no user or group names), so the same inputs give
//! the same bytes, and so the same image digests, on every machine.

use std::collections::BTreeMap;

const BLOCK: usize = 512;
const NAME_LEN: usize = 100;
const PREFIX_LEN: usize = 155;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TreeError {
    #[error("path {0:?} must be absolute, without `.`, `..` or empty components")]
    BadPath(String),
    #[error("path {0:?} is added twice")]
    Duplicate(String),
    #[error("{path:?} needs {parent:?} to be a directory, but it was added as a file or symlink")]
    ParentNotDir { path: String, parent: String },
    #[error("path {0:?} is too long for a ustar header")]
    TooLong(String),
    #[error("symlink {path:?} has an empty target")]
    EmptyTarget { path: String },
    #[error("symlink target {0:?} is too long for a ustar header")]
    TargetTooLong(String),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReadError {
    #[error("not a tar archive: the entry at byte {0} is cut short or has a bad header")]
    Malformed(usize),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Dir { mode: u32 },
    File { mode: u32, data: Vec<u8> },
    Symlink { target: String },
}

/// A filesystem tree, keyed by path relative to `/` (`bin/sh`).
#[derive(Debug, Default, Clone)]
pub struct Tree {
    entries: BTreeMap<String, Entry>,
}

impl Tree {
    pub fn new() -> Tree {
        Tree::default()
    }

    /// Adds a regular file; missing parents become `0755` directories.
    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) -> Result<(), TreeError> {
        self.insert(
            path,
            Entry::File {
                mode: mode & 0o7777,
                data,
            },
        )
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> Result<(), TreeError> {
        if target.is_empty() {
            return Err(TreeError::EmptyTarget { path: path.into() });
        }
        if target.len() > NAME_LEN {
            return Err(TreeError::TargetTooLong(target.into()));
        }
        self.insert(
            path,
            Entry::Symlink {
                target: target.into(),
            },
        )
    }

    /// Adds a directory with this mode (an existing directory takes the new mode).
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<(), TreeError> {
        let key = self.parents(path)?;
        match self.entries.get(&key) {
            None | Some(Entry::Dir { .. }) => {
                self.entries.insert(
                    key,
                    Entry::Dir {
                        mode: mode & 0o7777,
                    },
                );
                Ok(())
            }
            Some(_) => Err(TreeError::Duplicate(path.into())),
        }
    }

    pub fn entries(&self) -> impl Iterator<Item = (&str, &Entry)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    fn insert(&mut self, path: &str, entry: Entry) -> Result<(), TreeError> {
        let key = self.parents(path)?;
        if self.entries.contains_key(&key) {
            return Err(TreeError::Duplicate(path.into()));
        }
        self.entries.insert(key, entry);
        Ok(())
    }

    /// Validates `path`, creates its missing parents and returns its key.
    fn parents(&mut self, path: &str) -> Result<String, TreeError> {
        let rel = path
            .strip_prefix('/')
            .ok_or_else(|| TreeError::BadPath(path.into()))?;
        let parts: Vec<&str> = rel.split('/').collect();
        if parts
            .iter()
            .any(|p| p.is_empty() || *p == "." || *p == "..")
        {
            return Err(TreeError::BadPath(path.into()));
        }
        // Every name this adds must fit a header (a directory's name carries a trailing slash).
        for i in 1..=parts.len() {
            split_name(&format!("{}/", parts[..i].join("/")))
                .ok_or_else(|| TreeError::TooLong(path.into()))?;
        }
        for i in 1..parts.len() {
            let parent = parts[..i].join("/");
            match self.entries.get(&parent) {
                Some(Entry::Dir { .. }) => {}
                Some(_) => {
                    return Err(TreeError::ParentNotDir {
                        path: path.into(),
                        parent: format!("/{parent}"),
                    });
                }
                None => {
                    self.entries.insert(parent, Entry::Dir { mode: 0o755 });
                }
            }
        }
        Ok(rel.to_string())
    }

    /// The tree as an uncompressed tar stream.
    pub fn to_tar(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (path, entry) in &self.entries {
            match entry {
                Entry::Dir { mode } => {
                    push_entry(&mut out, &format!("{path}/"), *mode, b'5', "", &[])
                }
                Entry::File { mode, data } => push_entry(&mut out, path, *mode, b'0', "", data),
                Entry::Symlink { target } => push_entry(&mut out, path, 0o777, b'2', target, &[]),
            }
        }
        out.resize(out.len() + 2 * BLOCK, 0);
        out
    }
}

/// The regular files of a ustar archive (as [`Tree::to_tar`] writes them), by path without the
/// leading `/`: how an image archive is read back to be put into an index with others.
pub fn read_files(tar: &[u8]) -> Result<BTreeMap<String, Vec<u8>>, ReadError> {
    let text = |b: &[u8]| {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        std::str::from_utf8(&b[..end]).ok().map(str::to_string)
    };
    let mut out = BTreeMap::new();
    let mut at = 0;
    loop {
        let h = tar.get(at..at + BLOCK).ok_or(ReadError::Malformed(at))?;
        if h.iter().all(|&b| b == 0) {
            return Ok(out);
        }
        let bad = || ReadError::Malformed(at);
        let size = text(&h[124..136])
            .and_then(|s| usize::from_str_radix(s.trim(), 8).ok())
            .ok_or_else(bad)?;
        let (prefix, name) = (
            text(&h[345..500]).ok_or_else(bad)?,
            text(&h[..100]).ok_or_else(bad)?,
        );
        let data = tar.get(at + BLOCK..at + BLOCK + size).ok_or_else(bad)?;
        if matches!(h[156], b'0' | 0) {
            let path = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            out.insert(path, data.to_vec());
        }
        at += BLOCK + size.next_multiple_of(BLOCK);
    }
}

/// Splits a header name into ustar's (prefix, name) fields, if it fits.
fn split_name(name: &str) -> Option<(&str, &str)> {
    if name.len() <= NAME_LEN {
        return Some(("", name));
    }
    // Split at a slash so that prefix ≤ 155 and the rest ≤ 100 (a trailing slash stays in name).
    let body = name.strip_suffix('/').unwrap_or(name);
    body.char_indices()
        .filter(|&(i, c)| c == '/' && i <= PREFIX_LEN && name.len() - i - 1 <= NAME_LEN)
        .map(|(i, _)| (&name[..i], &name[i + 1..]))
        .next()
}

fn octal(field: &mut [u8], value: u64) {
    // Zero-padded octal filling all but the last byte, which stays NUL.
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    field[..digits].copy_from_slice(text.as_bytes());
}

fn push_entry(out: &mut Vec<u8>, name: &str, mode: u32, kind: u8, link: &str, data: &[u8]) {
    let (prefix, name) = split_name(name).expect("paths are checked when added");
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name.as_bytes());
    octal(&mut h[100..108], u64::from(mode));
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], data.len() as u64);
    octal(&mut h[136..148], 0);
    h[156] = kind;
    h[157..157 + link.len()].copy_from_slice(link.as_bytes());
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], 0);
    octal(&mut h[337..345], 0);
    h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
    // The checksum is summed with its own field as spaces, then written as six digits, NUL, space.
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..154].copy_from_slice(format!("{sum:06o}").as_bytes());
    h[154] = 0;
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out.resize(out.len().next_multiple_of(BLOCK), 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads back (name, type, mode, size, link, data) of each entry, checking each checksum.
    fn parse(tar: &[u8]) -> Vec<(String, u8, u32, Vec<u8>, String)> {
        let field = |b: &[u8]| {
            let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
            String::from_utf8(b[..end].to_vec()).unwrap()
        };
        let num = |b: &[u8]| u64::from_str_radix(field(b).trim(), 8).unwrap();
        let mut out = Vec::new();
        let mut at = 0;
        while tar[at..at + BLOCK].iter().any(|&b| b != 0) {
            let h = &tar[at..at + BLOCK];
            let mut blank = h.to_vec();
            blank[148..156].fill(b' ');
            let sum: u64 = blank.iter().map(|&b| u64::from(b)).sum();
            assert_eq!(num(&h[148..156]), sum, "checksum of entry at {at}");
            assert_eq!(&h[257..265], b"ustar\x0000");
            let prefix = field(&h[345..500]);
            let name = field(&h[..100]);
            let name = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            let size = num(&h[124..136]) as usize;
            assert_eq!(num(&h[136..148]), 0, "mtime");
            assert_eq!((num(&h[108..116]), num(&h[116..124])), (0, 0), "owner");
            let data = tar[at + BLOCK..at + BLOCK + size].to_vec();
            out.push((
                name,
                h[156],
                num(&h[100..108]) as u32,
                data,
                field(&h[157..257]),
            ));
            at += BLOCK + size.next_multiple_of(BLOCK);
        }
        assert_eq!(tar.len(), at + 2 * BLOCK, "two zero blocks end the archive");
        out
    }

    #[test]
    fn parents_come_first_and_entries_are_sorted() {
        let mut t = Tree::new();
        t.symlink("/bin/sh", "busybox").unwrap();
        t.file("/bin/busybox", 0o100755, b"elf".to_vec()).unwrap();
        t.dir("/tmp", 0o1777).unwrap();
        let got = parse(&t.to_tar());
        let names: Vec<_> = got.iter().map(|e| (e.0.as_str(), e.1, e.2)).collect();
        assert_eq!(
            names,
            [
                ("bin/", b'5', 0o755),
                ("bin/busybox", b'0', 0o755),
                ("bin/sh", b'2', 0o777),
                ("tmp/", b'5', 0o1777)
            ]
        );
        assert_eq!(got[1].3, b"elf");
        assert_eq!(got[2].4, "busybox");
    }

    #[test]
    fn same_tree_in_any_order_gives_the_same_bytes() {
        let mut a = Tree::new();
        a.file("/a/x", 0o644, vec![1; 700]).unwrap();
        a.file("/b", 0o755, vec![2; 3]).unwrap();
        let mut b = Tree::new();
        b.file("/b", 0o755, vec![2; 3]).unwrap();
        b.file("/a/x", 0o644, vec![1; 700]).unwrap();
        assert_eq!(a.to_tar(), b.to_tar());
        // 700 bytes of data take two blocks.
        assert_eq!(a.to_tar().len(), BLOCK * (1 + 1 + 2 + 1 + 1 + 2));
    }

    #[test]
    fn files_read_back_as_written_and_bad_archives_are_refused() {
        let mut t = Tree::new();
        let deep = format!("/{}/{}/file", "a".repeat(60), "b".repeat(60));
        t.file(&deep, 0o644, vec![7; 700]).unwrap();
        t.file("/x", 0o755, b"x".to_vec()).unwrap();
        t.symlink("/l", "x").unwrap();
        let tar = t.to_tar();
        let files = read_files(&tar).unwrap();
        let names: Vec<_> = files.keys().cloned().collect();
        assert_eq!(names, [deep[1..].to_string(), "x".into()]);
        assert_eq!(files[&deep[1..]], vec![7; 700]);
        assert_eq!(read_files(&tar[..600]), Err(ReadError::Malformed(512)));
        assert_eq!(read_files(b"short"), Err(ReadError::Malformed(0)));
    }

    #[test]
    fn long_paths_use_the_prefix_field() {
        let (a, b) = ("a".repeat(60), "b".repeat(60));
        let mut t = Tree::new();
        t.file(&format!("/{a}/{b}/file"), 0o644, vec![]).unwrap();
        let got = parse(&t.to_tar());
        let names: Vec<_> = got.iter().map(|e| e.0.clone()).collect();
        assert_eq!(
            names,
            [
                format!("{a}/"),
                format!("{a}/{b}/"),
                format!("{a}/{b}/file")
            ]
        );
        for long in [
            format!("/{}", "x".repeat(120)),
            format!("/{}/file", "d".repeat(120)),
        ] {
            assert_eq!(
                t.file(&long, 0o644, vec![]),
                Err(TreeError::TooLong(long.clone()))
            );
        }
        assert_eq!(t.entries().count(), 3);
    }

    #[test]
    fn bad_input_is_refused_and_changes_nothing() {
        let mut t = Tree::new();
        t.file("/bin/busybox", 0o755, vec![]).unwrap();
        let before: Vec<_> = t
            .entries()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        assert_eq!(
            t.file("relative", 0o644, vec![]),
            Err(TreeError::BadPath("relative".into()))
        );
        assert_eq!(
            t.file("/a/../b", 0o644, vec![]),
            Err(TreeError::BadPath("/a/../b".into()))
        );
        assert_eq!(
            t.file("/a//b", 0o644, vec![]),
            Err(TreeError::BadPath("/a//b".into()))
        );
        assert_eq!(
            t.symlink("/bin/busybox", "x"),
            Err(TreeError::Duplicate("/bin/busybox".into()))
        );
        assert_eq!(
            t.file("/bin/busybox/x", 0o644, vec![]),
            Err(TreeError::ParentNotDir {
                path: "/bin/busybox/x".into(),
                parent: "/bin/busybox".into()
            })
        );
        assert_eq!(
            t.dir("/bin/busybox", 0o755),
            Err(TreeError::Duplicate("/bin/busybox".into()))
        );
        assert_eq!(
            t.symlink("/sh", ""),
            Err(TreeError::EmptyTarget { path: "/sh".into() })
        );
        let after: Vec<_> = t
            .entries()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        assert_eq!(before, after);
    }
}
