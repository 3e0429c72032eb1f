//! A simulated executor for driving the scheduler in tests: it does with a plan what the real
//! one does (applies the `req_to_token` writes, resolves FutureMap placeholders, writes each
//! computed token's KV into its slot) and checks what every request of the plan reads.
//!
//! A slot's KV is modelled as a hash of the token ids up to and including its position, which
//! is what real KV depends on: slots shared through the prefix tree hold equal values, while
//! a slot another request has overwritten (or one never written) reads differently. Besides
//! the values, each row the step reads must be exactly the core's own view of the request
//! (`Request::kv_slots`): a row still naming a freed duplicate slot is a bug even before
//! another request overwrites that slot.

use std::collections::HashMap;

use scheduler_core::{Plan, Scheduler, FUTURE_TOKEN};

/// The simulated executor's state: `req_to_token`, the KV pool and the FutureMap.
pub struct Executor {
    rows: Vec<Vec<i64>>,
    /// Per KV slot: the prefix hash its token's KV stands for (0: never written).
    kv: Vec<u64>,
    future: Vec<i64>,
    prompts: HashMap<u64, Vec<u32>>,
    /// Per request: the prefix hash at each position, extended on demand.
    hashes: HashMap<u64, Vec<u64>>,
    output_token: fn(u64, usize) -> u32,
}

fn mix(h: u64, token: u32) -> u64 {
    let mut z = h ^ (u64::from(token) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) | 1
}

impl Executor {
    /// An executor for `s`, whose fake model's output number `k` of request `rid` is
    /// `output_token(rid, k)` whatever the batch.
    pub fn new(s: &Scheduler, output_token: fn(u64, usize) -> u32) -> Self {
        let cfg = s.config();
        Self {
            rows: vec![vec![-1; cfg.context_len + 1]; cfg.max_running_requests],
            kv: vec![0; s.kv_buffer_size()],
            future: vec![FUTURE_TOKEN; cfg.max_running_requests],
            prompts: HashMap::new(),
            hashes: HashMap::new(),
            output_token,
        }
    }

    /// Registers a request's prompt (before its first step).
    pub fn add(&mut self, rid: u64, prompt: &[u32]) {
        self.prompts.insert(rid, prompt.to_vec());
    }

    fn token(&self, rid: u64, pos: usize) -> u32 {
        let prompt = &self.prompts[&rid];
        match prompt.get(pos) {
            Some(&t) => t,
            None => (self.output_token)(rid, pos - prompt.len()),
        }
    }

    fn kv_hash(&mut self, rid: u64, pos: usize) -> u64 {
        let mut hashes = self.hashes.remove(&rid).unwrap_or_default();
        while hashes.len() <= pos {
            let prev = hashes.last().copied().unwrap_or(0);
            hashes.push(mix(prev, self.token(rid, hashes.len())));
        }
        let h = hashes[pos];
        self.hashes.insert(rid, hashes);
        h
    }

    /// Runs `plan`, whose sampled tokens are `sampled` (one per request, plan order), on the
    /// state `s` planned it from; panics if a request reads anything but its own sequence.
    pub fn execute(&mut self, s: &Scheduler, plan: &Plan, sampled: &[i64]) {
        for ((&row, &col), &slot) in plan
            .write_rows
            .iter()
            .zip(&plan.write_cols)
            .zip(&plan.write_slots)
        {
            self.rows[row as usize][col as usize] = slot;
        }
        let mut offset = 0;
        for i in 0..plan.rids.len() {
            let (rid, row) = (plan.rids[i] as u64, plan.req_slots[i] as usize);
            for pos in plan.prefix_lens[i] as usize..plan.seq_lens[i] as usize {
                let input = match plan.input_ids[offset] {
                    FUTURE_TOKEN => self.future[row],
                    id => id,
                };
                assert_eq!(
                    input,
                    i64::from(self.token(rid, pos)),
                    "request {rid}: wrong input at {pos}"
                );
                let slot = plan.out_cache_loc[offset];
                assert_eq!(
                    self.rows[row][pos], slot,
                    "request {rid}: row not written at {pos}"
                );
                self.kv[slot as usize] = self.kv_hash(rid, pos);
                offset += 1;
            }
        }
        // Attention reads after every write of the step (as each layer's does).
        for (i, &token) in sampled.iter().enumerate() {
            let (rid, row) = (plan.rids[i] as u64, plan.req_slots[i] as usize);
            let seq_len = plan.seq_lens[i] as usize;
            let core = &s.request(rid).expect("a planned request is live").kv_slots;
            for (pos, &own) in core[..seq_len].iter().enumerate() {
                let slot = self.rows[row][pos];
                assert_eq!(
                    slot,
                    i64::from(own),
                    "request {rid}: row position {pos} is stale"
                );
                let want = self.kv_hash(rid, pos);
                assert_eq!(
                    self.kv[slot as usize], want,
                    "request {rid}: slot {slot} at position {pos} holds other KV"
                );
            }
            self.future[row] = token;
        }
    }
}
