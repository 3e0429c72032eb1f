//! Waiting-queue policies: the order in which a prefill round considers waiting requests.

use std::str::FromStr;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::radix::{NodeId, RadixTree, ROOT};

/// Above this many waiting requests, lpm costs more than it saves and falls back to fcfs.
pub const LPM_FALLBACK_QUEUE_LEN: usize = 128;
/// In-batch dedup applies to requests whose cached prefix is at most this long ...
pub const IN_BATCH_CHECK_THRESHOLD: usize = 32;
/// ... and that share at least this many tokens with an earlier request of the same round.
pub const IN_BATCH_DEPRIORITIZE_THRESHOLD: usize = 32;

/// A scheduling policy, named as SGLang's `--schedule-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served (retracted requests go back to the front).
    Fcfs,
    /// Longest cached prefix first, with in-batch prefix dedup.
    Lpm,
    /// Depth-first over the radix tree, heaviest subtrees first, so siblings run together.
    DfsWeight,
    /// Longest output (`max_new_tokens`) first.
    Lof,
    /// Seeded shuffle.
    Random,
    /// By request priority, then arrival; lower-priority running requests can be preempted.
    Priority,
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "fcfs" => Policy::Fcfs,
            "lpm" => Policy::Lpm,
            "dfs-weight" => Policy::DfsWeight,
            "lof" => Policy::Lof,
            "random" => Policy::Random,
            "priority" => Policy::Priority,
            _ => {
                return Err(format!(
                    "unknown schedule_policy {s:?}; expected one of fcfs, lpm, dfs-weight, lof, random, priority"
                ))
            }
        })
    }
}

impl Policy {
    /// The name `from_str` reads.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Lpm => "lpm",
            Policy::DfsWeight => "dfs-weight",
            Policy::Lof => "lof",
            Policy::Random => "random",
            Policy::Priority => "priority",
        }
    }

    /// The policy in effect for a queue of `waiting` requests. The cache-aware policies fall
    /// back to fcfs without a cache (every prefix would be empty) and lpm above 128 waiting.
    pub fn effective(self, waiting: usize, cache_disabled: bool) -> Policy {
        let cache_aware = matches!(self, Policy::Lpm | Policy::DfsWeight);
        let long_queue = self == Policy::Lpm && waiting > LPM_FALLBACK_QUEUE_LEN;
        if (cache_aware && cache_disabled) || long_queue {
            Policy::Fcfs
        } else {
            self
        }
    }

    /// Whether ordering needs every waiting request's cached prefix.
    pub fn needs_prefix_match(self) -> bool {
        matches!(self, Policy::Lpm | Policy::DfsWeight)
    }
}

/// What the policies know of one waiting request.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    /// Index of the request in the scheduler's table.
    pub idx: usize,
    /// Tokens it would prefill from (prompt + output, the last token excluded).
    pub key: &'a [u32],
    /// Cached prefix length (lpm, dfs-weight only).
    pub prefix_len: usize,
    /// Deepest node of the cached prefix (lpm, dfs-weight only).
    pub last_node: NodeId,
    /// Requested output length.
    pub max_new_tokens: usize,
    /// Request priority.
    pub priority: i64,
    /// Arrival order.
    pub arrival: u64,
}

/// SplitMix64: a tiny seeded generator, so the random policy is reproducible across ranks.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform value in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Orders `cands` for a prefill round. Returns the indices (into the scheduler's table) in
/// order, with lpm's in-batch duplicates removed: they wait a round so that they can hit the
/// cache their group's first request fills.
pub fn order(
    policy: Policy,
    mut cands: Vec<Candidate<'_>>,
    tree: &RadixTree,
    rng: &mut SplitMix64,
    low_priority_first: bool,
) -> Vec<usize> {
    match policy {
        Policy::Fcfs => {}
        Policy::Lpm => {
            let deferred = in_batch_duplicates(&cands, tree.page_size());
            cands.retain(|c| !deferred.contains(&c.idx));
            cands.sort_by_key(|c| std::cmp::Reverse(c.prefix_len));
        }
        Policy::DfsWeight => return dfs_weight_order(&cands, tree),
        Policy::Lof => cands.sort_by_key(|c| std::cmp::Reverse(c.max_new_tokens)),
        Policy::Random => {
            for i in (1..cands.len()).rev() {
                cands.swap(i, rng.below(i + 1));
            }
        }
        Policy::Priority => {
            let sign = if low_priority_first { 1 } else { -1 };
            cands.sort_by_key(|c| (c.priority * sign, c.arrival));
        }
    }
    cands.into_iter().map(|c| c.idx).collect()
}

/// Requests (in queue order) that barely hit the cache but share a long prefix with an earlier
/// request of this round.
fn in_batch_duplicates(cands: &[Candidate<'_>], page_size: usize) -> FxHashSet<usize> {
    let mut batch_tree = RadixTree::new(page_size, false);
    let mut deferred = FxHashSet::default();
    let mut scratch = Vec::new();
    let mut dummy_values = Vec::new();
    for c in cands {
        if c.prefix_len > IN_BATCH_CHECK_THRESHOLD {
            continue;
        }
        scratch.clear();
        let (shared, _) = batch_tree.match_prefix(c.key, &mut scratch);
        if shared >= IN_BATCH_DEPRIORITIZE_THRESHOLD {
            deferred.insert(c.idx);
        } else {
            let aligned = c.key.len() / page_size * page_size;
            dummy_values.resize(aligned, 0);
            batch_tree.insert(&c.key[..aligned], &dummy_values);
        }
    }
    deferred
}

/// SGLang's dfs-weight: a node's weight is the number of waiting requests whose prefix ends
/// in its subtree; visit children heaviest first and emit each node's requests after its
/// subtree.
fn dfs_weight_order(cands: &[Candidate<'_>], tree: &RadixTree) -> Vec<usize> {
    let mut at_node: FxHashMap<NodeId, Vec<usize>> = FxHashMap::default();
    let mut weight: FxHashMap<NodeId, usize> = FxHashMap::default();
    for c in cands {
        at_node.entry(c.last_node).or_default().push(c.idx);
        let mut n = c.last_node;
        loop {
            *weight.entry(n).or_default() += 1;
            if n == ROOT {
                break;
            }
            n = tree.parent(n);
        }
    }
    let mut out = Vec::with_capacity(cands.len());
    // Iterative post-order DFS over the weighted part of the tree.
    let mut stack: Vec<(NodeId, bool)> = vec![(ROOT, false)];
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            out.extend(at_node.get(&node).into_iter().flatten());
            continue;
        }
        stack.push((node, true));
        let mut children: Vec<(usize, NodeId)> = tree
            .children(node)
            .into_iter()
            .filter_map(|c| weight.get(&c).map(|&w| (w, c)))
            .collect();
        // Heaviest first: push lightest first so the heaviest pops first.
        children.sort_by_key(|&(w, c)| (w, std::cmp::Reverse(c)));
        stack.extend(children.into_iter().map(|(_, c)| (c, false)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(idx: usize, key: &[u32], prefix_len: usize) -> Candidate<'_> {
        Candidate {
            idx,
            key,
            prefix_len,
            last_node: ROOT,
            max_new_tokens: idx * 10,
            priority: 0,
            arrival: idx as u64,
        }
    }

    #[test]
    fn policy_names_parse_and_unknown_names_are_listed() {
        assert_eq!("dfs-weight".parse::<Policy>(), Ok(Policy::DfsWeight));
        let err = "best".parse::<Policy>().unwrap_err();
        assert!(err.contains("best") && err.contains("fcfs"));
    }

    #[test]
    fn lpm_falls_back_to_fcfs_on_long_queues() {
        assert_eq!(Policy::Lpm.effective(128, false), Policy::Lpm);
        assert_eq!(Policy::Lpm.effective(129, false), Policy::Fcfs);
        assert_eq!(Policy::DfsWeight.effective(3, true), Policy::Fcfs);
        assert_eq!(Policy::Lof.effective(300, true), Policy::Lof);
    }

    #[test]
    fn lpm_orders_by_prefix_and_defers_in_batch_duplicates() {
        let tree = RadixTree::new(1, false);
        let shared: Vec<u32> = (0..40).collect();
        let mut other = shared.clone();
        other.push(99);
        let fresh: Vec<u32> = (100..140).collect();
        let cands = vec![
            cand(0, &shared, 0),
            cand(1, &other, 0),
            cand(2, &fresh, 0),
            {
                let mut c = cand(3, &fresh, 50);
                c.key = &fresh[..];
                c
            },
        ];
        let mut rng = SplitMix64::new(0);
        // 1 shares 40 tokens with 0 and waits; 3 has a long cached prefix and goes first.
        assert_eq!(
            order(Policy::Lpm, cands, &tree, &mut rng, false),
            vec![3, 0, 2]
        );
    }

    #[test]
    fn lof_and_priority_sort_stably() {
        let tree = RadixTree::new(1, false);
        let mut rng = SplitMix64::new(0);
        let keys: Vec<Vec<u32>> = (0..3).map(|i| vec![i]).collect();
        let cands: Vec<_> = (0..3).map(|i| cand(i, &keys[i], 0)).collect();
        assert_eq!(
            order(Policy::Lof, cands.clone(), &tree, &mut rng, false),
            vec![2, 1, 0]
        );
        let mut pri = cands.clone();
        pri[1].priority = 5;
        assert_eq!(
            order(Policy::Priority, pri.clone(), &tree, &mut rng, false),
            vec![1, 0, 2]
        );
        assert_eq!(
            order(Policy::Priority, pri, &tree, &mut rng, true),
            vec![0, 2, 1]
        );
    }

    #[test]
    fn random_is_a_seeded_permutation() {
        let tree = RadixTree::new(1, false);
        let keys: Vec<Vec<u32>> = (0..20).map(|i| vec![i]).collect();
        let cands: Vec<_> = (0..20)
            .map(|i| cand(i as usize, &keys[i as usize], 0))
            .collect();
        let a = order(
            Policy::Random,
            cands.clone(),
            &tree,
            &mut SplitMix64::new(7),
            false,
        );
        let b = order(Policy::Random, cands, &tree, &mut SplitMix64::new(7), false);
        assert_eq!(a, b);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
        assert_ne!(a, (0..20).collect::<Vec<_>>());
    }

    #[test]
    fn dfs_weight_groups_requests_under_heavier_subtrees_first() {
        let mut tree = RadixTree::new(1, false);
        tree.insert(&[1, 2, 3], &[1, 2, 3]);
        tree.insert(&[1, 2, 4], &[4, 5, 6]);
        tree.insert(&[7], &[7]);
        let mut v = Vec::new();
        let (_, a) = tree.match_prefix(&[1, 2, 3], &mut v);
        let (_, b) = tree.match_prefix(&[1, 2, 4], &mut v);
        let (_, c) = tree.match_prefix(&[7], &mut v);
        let key = [0u32];
        let mk = |idx, node| Candidate {
            last_node: node,
            ..cand(idx, &key, 0)
        };
        let cands = vec![mk(0, c), mk(1, a), mk(2, b), mk(3, a)];
        let got = order(
            Policy::DfsWeight,
            cands,
            &tree,
            &mut SplitMix64::new(0),
            false,
        );
        assert_eq!(got, vec![1, 3, 2, 0]);
    }
}
