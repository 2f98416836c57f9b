//! The difference of two rule lists as multisets, for drift reports of either syntax.

use std::collections::HashMap;
use std::hash::Hash;

/// `want` items not in `have` (in `want`'s order) and `have` items not in `want` (in `have`'s
/// order): an item counts as often as it occurs, and of one repeated in `have` the last copies
/// are the spare ones. Counted, not searched: one pod's annotations can ask for tens of
/// thousands of rules in a chain, and a search and removal per item took a second for a
/// drifted chain of 41 000.
pub fn diff<T: Eq + Hash>(want: Vec<T>, have: Vec<T>) -> (Vec<T>, Vec<T>) {
    let mut missing = Vec::new();
    let spare: Vec<bool> = {
        let mut unmatched: HashMap<&T, usize> = HashMap::new();
        for h in &have {
            *unmatched.entry(h).or_default() += 1;
        }
        for item in want {
            match unmatched.get_mut(&item) {
                Some(n) if *n > 0 => *n -= 1,
                _ => missing.push(item),
            }
        }
        let mut spare: Vec<bool> = have
            .iter()
            .rev()
            .map(|h| {
                let n = unmatched.get_mut(h).expect("every item of have is counted");
                let left = *n > 0;
                *n = n.saturating_sub(1);
                left
            })
            .collect();
        spare.reverse();
        spare
    };
    let unexpected = have
        .into_iter()
        .zip(spare)
        .filter_map(|(item, spare)| spare.then_some(item))
        .collect();
    (missing, unexpected)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_count_as_often_as_they_occur_and_each_side_keeps_its_order() {
        let (missing, unexpected) = diff(
            vec!["a", "a", "b", "d", "e", "d"],
            vec!["b", "a", "c", "a", "a", "d"],
        );
        assert_eq!(missing, ["e", "d"]);
        assert_eq!(unexpected, ["c", "a"]);
    }
}
