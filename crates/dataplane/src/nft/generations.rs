//! Pods found in sync, remembered by their namespace's nftables generation, so that checking a
//! pod again while nothing changed costs one request instead of four dumps.
//!
//! The kernel counts the commits of each network namespace's nftables (the generation id that
//! `nft monitor` prints): every batch that changes anything in any table of the namespace, ours
//! or anyone's, moves it. A namespace is named by its cookie (`SO_NETNS_COOKIE`), which the
//! kernel gives to no other namespace until it reboots; an inode number is reused at once. A
//! full check takes the generation before and after reading our tables. When it did not move
//! and the tables matched the desired rules (named by a fingerprint of their rendering), the
//! three are remembered ([`Mark`]). A later check that finds the same namespace at the same
//! generation, against the same desired rules, has nothing to read: no commit happened since.
//!
//! What a generation does not count cannot make a remembered pod wrong: counters are not in the
//! model; our in-pod tables have no sets for the packet path to fill; and the kernel drops the
//! tables of an exiting owner process without a commit, but an owned table is drift
//! (`Table::flags`), so it was never remembered as in sync.
//!
//! The marks are kept in a journal file as well, so that a restarted agent starts from them. The
//! file opens with the kernel's boot id: cookies start again with the kernel, so another boot's
//! marks are dropped.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::sync::{Mutex, PoisonError};

/// A namespace's nftables found in sync with the desired rules at one generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark {
    pub cookie: u64,
    pub generation: u32,
    /// [`fingerprint`] of the desired rules' rendering.
    pub desired: u64,
}

/// How many namespaces are remembered. Cookies only grow, so when the memory is full the
/// smallest half (the oldest namespaces, most of them gone with their pods) is forgotten.
const CAPACITY: usize = 16_384;
const HEADER: &str = "istio-cni-rs nftables generations v1";
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// The remembered marks, one per namespace cookie, and the journal they are kept in.
#[derive(Default)]
pub struct Generations {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    marks: HashMap<u64, (u32, u64)>,
    journal: Option<Journal>,
}

struct Journal {
    file: File,
    boot_id: String,
    /// Lines written since the file was last rewritten: it is compacted when most are stale.
    lines: usize,
}

impl Generations {
    /// Marks kept in memory only.
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// Marks kept in `file` too, which the caller opened for reading and appending (symlink-safe:
    /// it lives on the host). The marks it holds from this boot are loaded and the file is
    /// rewritten with them alone; a file that cannot be read or written is not used, and only
    /// the memory is.
    pub fn journaled(file: File) -> Self {
        let generations = Self::default();
        match std::fs::read_to_string(BOOT_ID) {
            Ok(boot_id) => {
                let mut inner = generations.lock();
                let mut journal = Journal {
                    file,
                    boot_id: boot_id.trim().to_string(),
                    lines: 0,
                };
                let mut text = String::new();
                match journal.file.read_to_string(&mut text) {
                    Ok(_) => inner.marks = journal.parse(&text),
                    Err(e) => tracing::warn!(error = %e, "cannot read the nftables generations"),
                }
                inner.evict_if_full();
                if journal.rewrite(&inner.marks) {
                    inner.journal = Some(journal);
                }
            }
            Err(e) => tracing::warn!(error = %e, "no boot id: nftables generations kept in memory"),
        }
        generations
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `mark` was remembered: its namespace was in sync at its generation.
    pub fn holds(&self, mark: Mark) -> bool {
        self.lock().marks.get(&mark.cookie) == Some(&(mark.generation, mark.desired))
    }

    pub fn remember(&self, mark: Mark) {
        let mut inner = self.lock();
        let value = (mark.generation, mark.desired);
        if inner.marks.insert(mark.cookie, value) == Some(value) {
            return;
        }
        inner.evict_if_full();
        let line = format!("{} {} {:x}\n", mark.cookie, mark.generation, mark.desired);
        inner.append(&line);
    }

    /// Forgets the namespace `cookie` (its pod's rules were removed).
    pub fn forget(&self, cookie: u64) {
        let mut inner = self.lock();
        if inner.marks.remove(&cookie).is_some() {
            inner.append(&format!("{cookie} -\n"));
        }
    }

    pub fn len(&self) -> usize {
        self.lock().marks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    fn evict_if_full(&mut self) {
        if self.marks.len() <= CAPACITY {
            return;
        }
        let mut cookies: Vec<u64> = self.marks.keys().copied().collect();
        cookies.sort_unstable();
        for cookie in &cookies[..cookies.len() / 2] {
            self.marks.remove(cookie);
        }
    }

    /// Writes `line` to the journal; a journal mostly made of stale lines is rewritten instead,
    /// and one that fails a write is given up (the memory still serves this agent).
    fn append(&mut self, line: &str) {
        let Some(journal) = &mut self.journal else {
            return;
        };
        let ok = if journal.lines > 2 * self.marks.len() + 256 {
            journal.rewrite(&self.marks)
        } else {
            journal.lines += 1;
            journal.write(line.as_bytes())
        };
        if !ok {
            self.journal = None;
        }
    }
}

impl Journal {
    /// The marks of this boot in `text`; later lines win.
    fn parse(&self, text: &str) -> HashMap<u64, (u32, u64)> {
        let mut lines = text.lines();
        let mut marks = HashMap::new();
        if lines.next() != Some(&format!("{HEADER} {}", self.boot_id)) {
            return marks;
        }
        for line in lines {
            let mut fields = line.split(' ');
            let Some(Ok(cookie)) = fields.next().map(str::parse::<u64>) else {
                continue;
            };
            match (fields.next(), fields.next()) {
                (Some("-"), None) => {
                    marks.remove(&cookie);
                }
                (Some(generation), Some(desired)) => {
                    if let (Ok(generation), Ok(desired)) =
                        (generation.parse(), u64::from_str_radix(desired, 16))
                    {
                        marks.insert(cookie, (generation, desired));
                    }
                }
                _ => {}
            }
        }
        marks
    }

    /// Replaces the file's contents with the header and `marks`.
    fn rewrite(&mut self, marks: &HashMap<u64, (u32, u64)>) -> bool {
        let mut text = format!("{HEADER} {}\n", self.boot_id);
        for (cookie, (generation, desired)) in marks {
            text.push_str(&format!("{cookie} {generation} {desired:x}\n"));
        }
        self.lines = marks.len();
        // The file is in append mode: after the truncation every write lands at its start.
        if let Err(e) = self.file.set_len(0) {
            tracing::warn!(error = %e, "cannot rewrite the nftables generations");
            return false;
        }
        self.write(text.as_bytes())
    }

    fn write(&mut self, bytes: &[u8]) -> bool {
        match self.file.write_all(bytes) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "cannot write the nftables generations; keeping them in memory only");
                false
            }
        }
    }
}

/// FNV-1a of `text`: stable across builds and processes (std's hasher promises neither), so a
/// restarted agent, or a newer one, recognises the desired rules it remembered only if they
/// render the same.
pub fn fingerprint(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn journal_file(dir: &std::path::Path) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(dir.join("journal"))
            .unwrap()
    }

    const A: Mark = Mark {
        cookie: 7,
        generation: 3,
        desired: 0xabc,
    };

    #[test]
    fn a_mark_holds_only_at_its_generation_and_desired_rules() {
        let g = Generations::in_memory();
        assert!(!g.holds(A));
        g.remember(A);
        assert!(g.holds(A));
        assert!(!g.holds(Mark { generation: 4, ..A }));
        assert!(!g.holds(Mark { desired: 1, ..A }));
        assert!(!g.holds(Mark { cookie: 8, ..A }));
        g.forget(A.cookie);
        assert!(!g.holds(A));
    }

    #[test]
    fn a_restarted_agent_reads_the_journal_of_its_boot_only() {
        let dir = tempfile::tempdir().unwrap();
        let first = Generations::journaled(journal_file(dir.path()));
        first.remember(A);
        first.remember(Mark { cookie: 9, ..A });
        first.remember(Mark { generation: 5, ..A });
        first.forget(9);
        drop(first);

        let next = Generations::journaled(journal_file(dir.path()));
        assert!(next.holds(Mark { generation: 5, ..A }));
        assert_eq!(next.len(), 1);
        // Compacted at load: the header and the one mark.
        let text = std::fs::read_to_string(dir.path().join("journal")).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");

        // Another boot's cookies mean other namespaces.
        let header = text.lines().next().unwrap();
        let other_boot = text.replace(header, &format!("{HEADER} 00000000-0000"));
        std::fs::write(dir.path().join("journal"), other_boot).unwrap();
        assert!(Generations::journaled(journal_file(dir.path())).is_empty());
    }

    #[test]
    fn a_garbled_journal_costs_its_marks_only() {
        let dir = tempfile::tempdir().unwrap();
        drop(Generations::journaled(journal_file(dir.path())));
        let mut text = std::fs::read_to_string(dir.path().join("journal")).unwrap();
        text.push_str("7 3 abc\nnonsense\n8 x 1\n9 4\n\u{0}\n");
        std::fs::write(dir.path().join("journal"), text).unwrap();
        let g = Generations::journaled(journal_file(dir.path()));
        assert!(g.holds(A));
        assert_eq!(g.len(), 1);
    }

    #[test]
    fn a_full_memory_forgets_the_oldest_namespaces() {
        let g = Generations::in_memory();
        for cookie in 1..=CAPACITY as u64 + 1 {
            g.remember(Mark { cookie, ..A });
        }
        assert!(g.len() <= CAPACITY / 2 + 1);
        assert!(g.holds(Mark {
            cookie: CAPACITY as u64 + 1,
            ..A
        }));
        assert!(!g.holds(Mark { cookie: 1, ..A }));
    }

    #[test]
    fn the_fingerprint_is_fnv1a() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(fingerprint(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fingerprint("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fingerprint("foobar"), 0x8594_4171_f739_67e8);
    }
}
