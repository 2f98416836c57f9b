//! Tests of one group at a time inside one test binary.
//!
//! `cargo test` runs test binaries one after another and the tests inside one binary in
//! parallel. The integration tests are grouped into a few binaries per crate (by tier, so a clean
//! build links fewer of them), but each former file keeps its own terms: it may bring up a real
//! node, or a mesh, that must not share the machine with another file's. So each test enters the
//! gate first with its group (its former file, `module_path!()`): any number of tests of the group
//! inside may be in together, as they were in their own binary; a test of another group waits
//! until the gate is empty. A blocking wait is fine at the start of a `#[tokio::test]` too:
//! nothing else runs on that test's runtime yet.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// The gate of this test process.
static GATE: GroupGate = GroupGate::new();

/// Enters this process's gate with `group`, waiting while another group is inside; the returned
/// pass keeps the group inside until it is dropped (also when its test panics).
pub fn enter(group: &'static str) -> GroupPass<'static> {
    GATE.enter(group)
}

/// Enters the gate with the calling module as the group, for the rest of the enclosing block:
/// the first line of every integration test of a shared test binary.
#[macro_export]
macro_rules! enter_test_group {
    () => {
        let _group_pass = $crate::test_support::group_gate::enter(module_path!());
    };
}

/// The group inside and how many of its tests are in.
#[derive(Debug, Default, PartialEq, Eq)]
struct Inside {
    group: Option<&'static str>,
    tests: usize,
}

/// Admits the tests of one group at a time.
pub struct GroupGate {
    inside: Mutex<Inside>,
    emptied: Condvar,
}

/// A test's place inside the gate; leaving is dropping it.
#[must_use = "the group leaves the gate when the pass is dropped"]
pub struct GroupPass<'a> {
    gate: &'a GroupGate,
}

impl GroupGate {
    const fn new() -> Self {
        Self {
            inside: Mutex::new(Inside {
                group: None,
                tests: 0,
            }),
            emptied: Condvar::new(),
        }
    }

    // A test that panicked inside has left through its pass's drop: the state stays exact,
    // so a poisoned lock is taken as it is.
    fn lock(&self) -> MutexGuard<'_, Inside> {
        self.inside.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn enter(&self, group: &'static str) -> GroupPass<'_> {
        let mut inside = self.lock();
        while inside.group.is_some_and(|g| g != group) {
            inside = self
                .emptied
                .wait(inside)
                .unwrap_or_else(PoisonError::into_inner);
        }
        inside.group = Some(group);
        inside.tests += 1;
        GroupPass { gate: self }
    }
}

impl Drop for GroupPass<'_> {
    fn drop(&mut self) {
        let mut inside = self.gate.lock();
        inside.tests -= 1;
        if inside.tests == 0 {
            inside.group = None;
            self.gate.emptied.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::sync::mpsc;

    fn inside(gate: &GroupGate) -> (Option<&'static str>, usize) {
        let inside = gate.lock();
        (inside.group, inside.tests)
    }

    #[test]
    fn tests_of_one_group_are_inside_together() {
        let gate = GroupGate::new();
        let first = gate.enter("real_node");
        let second = gate.enter("real_node");
        assert_eq!(inside(&gate), (Some("real_node"), 2));
        drop(first);
        assert_eq!(inside(&gate), (Some("real_node"), 1));
        drop(second);
        assert_eq!(
            inside(&gate),
            (None, 0),
            "the last one out empties the gate"
        );
    }

    #[test]
    fn another_group_enters_once_the_gate_is_empty() {
        let gate: &'static GroupGate = Box::leak(Box::new(GroupGate::new()));
        let held = gate.enter("istio_agent");
        let (entered, seen) = mpsc::channel();
        let other = std::thread::spawn(move || {
            let _pass = gate.enter("migration");
            entered.send(inside(gate)).unwrap();
        });
        drop(held);
        // Whenever it got in, it was alone: the first group had left entirely.
        assert_eq!(seen.recv().unwrap(), (Some("migration"), 1));
        other.join().unwrap();
        assert_eq!(inside(gate), (None, 0));
    }

    /// Many threads of four groups entering and leaving at once: every thread, while inside,
    /// sees only its own group's tests inside (a count of groups inside never above one).
    #[test]
    fn never_two_groups_inside_at_once() {
        const GROUPS: [&str; 4] = ["a", "b", "c", "d"];
        let gate = Arc::new(GroupGate::new());
        let counts = Arc::new(Mutex::new(BTreeMap::<&str, usize>::new()));
        let threads: Vec<_> = (0..16)
            .map(|i| {
                let (gate, counts) = (gate.clone(), counts.clone());
                std::thread::spawn(move || {
                    let group = GROUPS[i % GROUPS.len()];
                    for _ in 0..200 {
                        let _pass = gate.enter(group);
                        let groups_inside = {
                            let mut counts = counts.lock().unwrap();
                            *counts.entry(group).or_default() += 1;
                            counts.values().filter(|n| **n > 0).count()
                        };
                        assert_eq!(groups_inside, 1, "{group} inside beside another group");
                        std::thread::yield_now();
                        *counts.lock().unwrap().get_mut(group).unwrap() -= 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(inside(&gate), (None, 0));
    }
}
