//! The radix tree against a naive reference: a list of inserted (key, slots) pairs. A match
//! must be the longest page-aligned prefix shared with any inserted key, and its slots the
//! ones the first inserter of each page stored. Locks and eviction are cross-checked too.

use proptest::prelude::*;
use scheduler_core::RadixTree;

/// Naive prefix cache: every insert kept whole, in order.
#[derive(Default)]
struct Reference {
    entries: Vec<(Vec<u32>, Vec<u32>)>,
}

impl Reference {
    fn common(a: &[u32], b: &[u32]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    fn match_prefix(&self, key: &[u32], page: usize) -> (usize, Vec<u32>) {
        let limit = key.len() / page * page;
        let mut values = Vec::new();
        // Page by page: the slots of the first entry that covers this page of `key`.
        let mut pos = 0;
        while pos < limit {
            let owner = self
                .entries
                .iter()
                .find(|(k, _)| Self::common(k, key) / page * page >= pos + page);
            match owner {
                Some((_, v)) => values.extend_from_slice(&v[pos..pos + page]),
                None => break,
            }
            pos += page;
        }
        (pos, values)
    }

    fn insert(&mut self, key: &[u32], values: &[u32], page: usize) -> usize {
        let present = self.match_prefix(key, page).0;
        self.entries.push((key.to_vec(), values.to_vec()));
        present
    }
}

fn key_strategy() -> impl Strategy<Value = Vec<u32>> {
    // A 3-letter alphabet makes shared prefixes and partial-page mismatches common.
    prop::collection::vec(0u32..3, 0..40)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn matches_and_inserts_agree_with_the_naive_reference(
        page in prop_oneof![Just(1usize), Just(2usize), Just(4usize)],
        ops in prop::collection::vec((any::<bool>(), key_strategy()), 1..60),
    ) {
        let mut tree = RadixTree::new(page, false);
        let mut reference = Reference::default();
        let mut next_slot = 1u32;
        for (is_insert, key) in ops {
            if is_insert {
                let aligned = &key[..key.len() / page * page];
                let values: Vec<u32> = (next_slot..next_slot + aligned.len() as u32).collect();
                next_slot += aligned.len() as u32;
                let expected = reference.insert(aligned, &values, page);
                prop_assert_eq!(tree.insert(aligned, &values), expected);
            } else {
                // The read-only peek agrees, and leaves the tree as it was (no split).
                let nodes = tree.node_count();
                let (expected_n, expected_values) = reference.match_prefix(&key, page);
                prop_assert_eq!(tree.cached_len(&key), expected_n);
                prop_assert_eq!(tree.node_count(), nodes);
                let mut values = Vec::new();
                let (n, node) = tree.match_prefix(&key, &mut values);
                prop_assert_eq!(n, expected_n);
                prop_assert_eq!(values, expected_values);
                // A lock protects exactly the matched path.
                tree.lock(node);
                prop_assert_eq!(tree.protected_size(), n);
                tree.unlock(node);
            }
            prop_assert!(tree.check().is_ok(), "{:?}", tree.check());
        }
        let total: usize = reference.entries.iter().map(|(k, _)| k.len()).sum();
        prop_assert!(tree.total_size() <= total);
    }

    #[test]
    fn eviction_frees_unlocked_leaves_only_and_everything_eventually(
        keys in prop::collection::vec(key_strategy(), 1..30),
        lock_pick in 0usize..30,
    ) {
        let mut tree = RadixTree::new(1, false);
        let mut next = 1u32;
        for key in &keys {
            let values: Vec<u32> = (next..next + key.len() as u32).collect();
            next += key.len() as u32;
            tree.insert(key, &values);
        }
        let held = tree.total_size();
        let mut scratch = Vec::new();
        let (locked_len, node) = tree.match_prefix(&keys[lock_pick % keys.len()], &mut scratch);
        tree.lock(node);
        let mut freed = Vec::new();
        let evicted = tree.evict(usize::MAX, &mut freed);
        prop_assert_eq!(evicted, held - locked_len);
        prop_assert_eq!(freed.len(), evicted);
        // The locked path survives with its slots.
        let mut again = Vec::new();
        prop_assert_eq!(tree.match_prefix(&keys[lock_pick % keys.len()], &mut again).0, locked_len);
        prop_assert_eq!(&again, &scratch);
        prop_assert!(!freed.iter().any(|s| scratch.contains(s)));
        tree.unlock(node);
        prop_assert_eq!(tree.evict(usize::MAX, &mut freed), locked_len);
        prop_assert_eq!(tree.total_size(), 0);
        prop_assert!(tree.check().is_ok());
    }
}
