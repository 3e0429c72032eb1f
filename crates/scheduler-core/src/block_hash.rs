//! Chained hashes of a prompt's whole blocks: what the data-parallel dispatcher's prefix
//! records (`rsgl.server.dispatcher`) name a rank's cached prefixes by.
//!
//! Block `i`'s hash mixes block `i - 1`'s hash with its own tokens, so one hash stands for
//! the whole prefix up to the end of its block, as a node of a radix tree would. The mix is
//! fixed (no per-process seed): the same tokens hash alike in every process and run.

use crate::drafter::mix;

/// The chained hash of each whole `block` of `tokens` (a partial last block is left out).
/// `block` must be at least 1.
pub fn block_hashes(tokens: &[u32], block: usize) -> Vec<u64> {
    assert!(block >= 1, "block must be at least 1");
    let mut h = 0u64;
    tokens
        .chunks_exact(block)
        .map(|chunk| {
            h = chunk.iter().fold(mix(h, u32::MAX), |h, &t| mix(h, t));
            h
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_hash_names_the_whole_prefix_up_to_its_block() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[5] = 1000; // a change in block 0 changes every hash after it
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha.len(), 4);
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
        // The same block after a different prefix is a different block.
        let mut c = a.clone();
        c[..16].copy_from_slice(&b[..16]);
        assert_eq!(block_hashes(&c, 16)[0], hb[0]);
        assert_ne!(block_hashes(&c, 16)[1], ha[1]);
        // A prefix's hashes are the leading hashes of any longer prompt.
        assert_eq!(block_hashes(&a[..40], 16), ha[..2]);
        assert!(block_hashes(&a[..15], 16).is_empty());
        // Boundaries matter: one block of 32 is not two blocks of 16.
        assert_ne!(block_hashes(&a[..32], 32)[0], ha[1]);
    }
}
