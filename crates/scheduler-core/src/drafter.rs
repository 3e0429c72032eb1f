//! N-gram drafting for speculative decoding (vLLM's prompt lookup): the longest suffix of a
//! request's committed tokens, of length `min..=max`, that also occurs earlier proposes the
//! tokens that followed its most recent earlier occurrence.
//!
//! The index is incremental: each pushed token adds one n-gram per length to a hash map
//! (hash → where its continuation starts), so a proposal costs `O(max + k)` whatever the
//! sequence length. It only ever sees what the caller pushes: the scheduler pushes committed
//! prompt and output tokens, never drafts.

use rustc_hash::FxHashMap;

/// Longest suffix the drafter matches.
pub const MAX_WINDOW: usize = 64;

/// Per-request n-gram index over committed tokens.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    min: usize,
    max: usize,
    tokens: Vec<u32>,
    /// Per length `n` (index `n - min`): n-gram hash → the position just after its most
    /// recent occurrence that has a token after it.
    next_after: Vec<FxHashMap<u64, usize>>,
}

/// One step of the n-gram hash, extended backwards by `token` (splitmix64's finalizer; also
/// the block hashes' step).
pub(crate) fn mix(h: u64, token: u32) -> u64 {
    let mut z = h ^ (u64::from(token) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl NgramDrafter {
    /// An empty index matching suffixes of `min..=max` tokens (`min` is raised to 1, then
    /// `max` clamped to `min..=MAX_WINDOW`).
    pub fn new(min: usize, max: usize) -> Self {
        let min = min.clamp(1, MAX_WINDOW);
        let max = max.clamp(min, MAX_WINDOW);
        Self {
            min,
            max,
            tokens: Vec::new(),
            next_after: vec![FxHashMap::default(); max - min + 1],
        }
    }

    /// Tokens indexed so far.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether no token has been indexed.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Appends one committed token. The n-grams that end just before it now have a
    /// continuation, so they become matchable.
    pub fn push(&mut self, token: u32) {
        let end = self.tokens.len();
        let mut h = 0;
        for n in 1..=self.max.min(end) {
            h = mix(h, self.tokens[end - n]);
            if n >= self.min {
                self.next_after[n - self.min].insert(h, end);
            }
        }
        self.tokens.push(token);
    }

    /// Appends committed tokens in order.
    pub fn extend(&mut self, tokens: impl IntoIterator<Item = u32>) {
        for t in tokens {
            self.push(t);
        }
    }

    /// Up to `k` tokens that followed the most recent earlier occurrence of the longest
    /// matching suffix; empty when no suffix of `min..=max` tokens occurred before.
    pub fn propose(&self, k: usize) -> &[u32] {
        let len = self.tokens.len();
        if k == 0 {
            return &[];
        }
        let mut hashes = [0u64; MAX_WINDOW];
        let longest = self.max.min(len);
        let mut h = 0;
        for n in 1..=longest {
            h = mix(h, self.tokens[len - n]);
            hashes[n - 1] = h;
        }
        for n in (self.min..=longest).rev() {
            let Some(&start) = self.next_after[n - self.min].get(&hashes[n - 1]) else {
                continue;
            };
            // Hashes may collide: compare the tokens themselves.
            if self.tokens[start - n..start] == self.tokens[len - n..] {
                return &self.tokens[start..(start + k).min(len)];
            }
        }
        &[]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafter(min: usize, max: usize, tokens: &[u32]) -> NgramDrafter {
        let mut d = NgramDrafter::new(min, max);
        d.extend(tokens.iter().copied());
        d
    }

    #[test]
    fn no_match_no_draft() {
        assert!(drafter(1, 4, &[1, 2, 3, 4]).propose(3).is_empty());
        assert!(drafter(1, 4, &[]).propose(3).is_empty());
        assert!(drafter(1, 4, &[7]).propose(3).is_empty());
        assert!(drafter(1, 4, &[1, 2, 1]).propose(0).is_empty());
    }

    #[test]
    fn longest_suffix_wins() {
        // Suffix [2, 3] occurred at 1..3 (followed by 9); [3] alone last occurred at 5
        // (followed by 8). The longer match wins.
        let d = drafter(1, 4, &[1, 2, 3, 9, 5, 3, 8, 2, 3]);
        assert_eq!(d.propose(2), &[9, 5]);
        // With max = 1 only the single-token suffix can match: its latest occurrence.
        let d = drafter(1, 1, &[1, 2, 3, 9, 5, 3, 8, 2, 3]);
        assert_eq!(d.propose(2), &[8, 2]);
    }

    #[test]
    fn most_recent_occurrence_wins() {
        let d = drafter(2, 3, &[4, 5, 1, 4, 5, 2, 4, 5]);
        assert_eq!(d.propose(1), &[2]);
        assert_eq!(d.propose(5), &[2, 4, 5]);
    }

    #[test]
    fn min_window_bounds_matches() {
        // Only a 1-token suffix repeats: min = 2 finds nothing.
        let d = drafter(2, 5, &[1, 9, 2, 9]);
        assert!(d.propose(3).is_empty());
        assert_eq!(drafter(1, 5, &[1, 9, 2, 9]).propose(3), &[2, 9]);
    }

    #[test]
    fn draft_is_capped_by_the_sequence_end() {
        // A repeated token: the suffix [7, 7] last occurred just before, so one token follows.
        let d = drafter(1, 3, &[7, 7, 7]);
        assert_eq!(d.propose(4), &[7]);
    }

    #[test]
    fn incremental_equals_rebuilt() {
        let seq: Vec<u32> = (0..300u32).map(|i| (i * 7 + i / 13) % 5).collect();
        let mut inc = NgramDrafter::new(1, 6);
        for (i, &t) in seq.iter().enumerate() {
            inc.push(t);
            let fresh = drafter(1, 6, &seq[..=i]);
            assert_eq!(inc.propose(4), fresh.propose(4));
            assert_eq!(inc.propose(4), brute(&seq[..=i], 1, 6, 4));
        }
    }

    /// The definition, by brute force.
    fn brute(seq: &[u32], min: usize, max: usize, k: usize) -> &[u32] {
        let len = seq.len();
        for n in (min..=max.min(len)).rev() {
            let suffix = &seq[len - n..];
            if let Some(start) = (0..len - n).rev().find(|&s| &seq[s..s + n] == suffix) {
                return &seq[start + n..(start + n + k).min(len)];
            }
        }
        &[]
    }
}
