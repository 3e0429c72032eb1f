//! Decode and retraction: one token per running request, and making room for it by
//! retracting requests when the pool runs short.

use super::admission::{push_request_arrays, write_stale_row};
use super::*;

impl Scheduler {
    /// Appends one request's decode to the plan: its next token, or, when `schedule` gave it
    /// drafts (`Request::draft`), its last committed token followed by the drafts.
    pub(super) fn plan_decode(&mut self, idx: usize, plan: &mut Plan, entries: &mut Vec<Entry>) {
        let draft = std::mem::take(&mut self.req_mut(idx).draft);
        if !draft.is_empty() {
            self.plan_speculative_decode(idx, draft, plan, entries);
            return;
        }
        let slot = self.alloc_one(idx);
        let req = self.reqs[idx].as_mut().expect("live request");
        // Caching the prompt when its prefill committed may have moved part of the row to
        // the tree's slots (see `cache_unfinished`).
        write_stale_row(req, plan);
        let pos = req.kv_len();
        let row = req.req_slot.expect("running request holds a slot") as i64;
        let input = if pos < req.fill_len() {
            req.token_at(pos) as i64
        } else {
            FUTURE_TOKEN
        };
        plan.input_ids.push(input);
        plan.positions.push(pos as i64);
        plan.out_cache_loc.push(slot as i64);
        plan.write_rows.push(row);
        plan.write_cols.push(pos as i64);
        plan.write_slots.push(slot as i64);
        push_request_arrays(plan, req, pos, 1, true, 0);
        req.kv_slots.push(slot);
        req.pending_tokens += 1;
        entries.push(Entry {
            idx,
            sample: true,
            completes_prefill: false,
            kv_end: req.kv_len(),
            draft_len: 0,
        });
    }

    /// A decode that verifies `draft`: its last committed token, then the drafts, at
    /// consecutive positions, each with its own KV slot.
    fn plan_speculative_decode(
        &mut self,
        idx: usize,
        draft: Vec<u32>,
        plan: &mut Plan,
        entries: &mut Vec<Entry>,
    ) {
        let k = draft.len();
        let slots = self.alloc_for(idx, 1 + k);
        let req = self.reqs[idx].as_mut().expect("live request");
        write_stale_row(req, plan);
        let pos = req.kv_len();
        debug_assert_eq!(pos + 1, req.fill_len(), "drafts follow a committed token");
        let row = req.req_slot.expect("running request holds a slot") as i64;
        let inputs = std::iter::once(req.token_at(pos)).chain(draft.iter().copied());
        for (i, (token, &slot)) in inputs.zip(&slots).enumerate() {
            plan.input_ids.push(token as i64);
            plan.positions.push((pos + i) as i64);
            plan.out_cache_loc.push(slot as i64);
            plan.write_rows.push(row);
            plan.write_cols.push((pos + i) as i64);
            plan.write_slots.push(slot as i64);
        }
        push_request_arrays(plan, req, pos, 1 + k, true, k);
        req.kv_slots.extend_from_slice(&slots);
        req.pending_tokens += 1 + k;
        req.drafts_in_flight = k;
        entries.push(Entry {
            idx,
            sample: true,
            completes_prefill: false,
            kv_end: req.kv_len(),
            draft_len: k,
        });
        self.counters.draft_tokens += k as u64;
    }

    /// New pages the decode of `reqs` needs: one per request sitting on a page boundary, and
    /// for a request with drafts, the pages its `1 + k` tokens reach beyond its last one.
    pub(super) fn decode_pages(&self, reqs: &[usize]) -> usize {
        let p = self.cfg.page_size;
        reqs.iter()
            .map(|&i| {
                let r = self.req(i);
                let kv = r.kv_len();
                let in_page = (p - kv % p) % p;
                (1 + r.draft.len()).saturating_sub(in_page).div_ceil(p)
            })
            .sum()
    }

    /// Decode tokens `reqs` compute this step (drafts included).
    pub(super) fn decode_tokens(&self, reqs: &[usize]) -> usize {
        reqs.iter().map(|&i| 1 + self.req(i).draft.len()).sum()
    }

    /// Drops drafts (the longest first) until the decode of `reqs` fits in `room` tokens or
    /// none is left. Returns whether it fits.
    pub(super) fn drop_drafts_to_fit(&mut self, reqs: &[usize], room: usize) -> bool {
        let p = self.cfg.page_size;
        loop {
            if self.decode_pages(reqs) * p <= room {
                return true;
            }
            let longest = reqs
                .iter()
                .copied()
                .max_by_key(|&i| self.req(i).draft.len());
            match longest {
                Some(i) if !self.req(i).draft.is_empty() => self.req_mut(i).draft.clear(),
                _ => return false,
            }
        }
    }

    /// Forgets the drafts proposed for `reqs` (a step that does not decode them).
    pub(super) fn clear_drafts(&mut self, reqs: &[usize]) {
        for &i in reqs {
            self.req_mut(i).draft.clear();
        }
    }

    /// Retracts decoding requests (fewest outputs first; ties: longest prompt) until the rest
    /// can get their next slots, always keeping one. Returns the requests that decode.
    pub(super) fn make_room_for_decode(
        &mut self,
        mut reqs: Vec<usize>,
        plan: &mut Plan,
    ) -> Vec<usize> {
        let p = self.cfg.page_size;
        let mut retracted = false;
        // Drafts go before anyone is retracted.
        self.drop_drafts_to_fit(&reqs, self.available_and_evictable());
        while self.available_and_evictable() < self.decode_pages(&reqs) * p && reqs.len() > 1 {
            let (pos, _) = reqs
                .iter()
                .enumerate()
                .min_by_key(|&(_, &i)| {
                    let r = self.req(i);
                    (
                        r.output.len(),
                        std::cmp::Reverse(r.prompt.len()),
                        std::cmp::Reverse(r.arrival),
                    )
                })
                .expect("at least two requests");
            let victim = reqs.remove(pos);
            self.retract(victim, plan);
            self.counters.retractions += 1;
            retracted = true;
        }
        if !self.ensure_free(self.decode_pages(&reqs) * p) {
            // A lone request that cannot get a page: the memory is held by a chunked prefill,
            // by requests whose last token is in flight, or by finished requests whose release
            // waits for an in-flight step. Requeue it; it fits once they are gone, because
            // admission clamps every request to what an otherwise empty pool holds.
            let idx = reqs.pop().expect("one request left");
            self.retract(idx, plan);
            self.counters.retractions += 1;
            retracted = true;
        }
        if retracted && !reqs.is_empty() {
            let (decoded, max_new) = reqs.iter().fold((0, 0), |(d, m), &i| {
                let r = self.req(i);
                (d + r.output.len(), m + r.limits.max_new_tokens)
            });
            self.ratio.after_retraction(decoded, max_new, reqs.len());
        } else {
            self.ratio.decay_step();
        }
        reqs
    }

    pub(super) fn live_requests(&self) -> usize {
        self.by_rid.len()
    }

    /// Sends a running request back to the front of the waiting queue, freeing its KV without
    /// caching it. Its outputs are kept; it re-prefills prompt + outputs later. Freeing while a
    /// step that includes it is in flight is safe: steps execute in order, so any new owner
    /// writes a slot after that step has finished with it.
    /// Its request slot is kept until no in-flight step includes it (the executor still
    /// writes per-slot state for it, such as the FutureMap entry).
    pub(super) fn retract(&mut self, idx: usize, plan: &mut Plan) {
        self.running.retain(|&i| i != idx);
        self.release_memory(idx, false);
        let req = self.req_mut(idx);
        req.draft.clear();
        req.state = ReqState::Retracted;
        plan.retracted.push(req.rid as i64);
        self.waiting.insert(0, idx);
    }

    /// Frees a request's KV slots (caching them in the tree when `cache` is set), unlocks its
    /// prefix and returns its request slot.
    pub(super) fn release_memory(&mut self, idx: usize, cache: bool) {
        let mut req = self.reqs[idx].take().expect("live request");
        if cache {
            let p = self.cfg.page_size;
            let n = req.kv_len().min(req.fill_len());
            let aligned = n / p * p;
            let key = req.fill_ids();
            let present = self.tree.insert(&key[..aligned], &req.kv_slots[..aligned]);
            self.pool.free_run(&req.kv_slots[req.prefix_len..present]);
            self.pool.free_run(&req.kv_slots[aligned..]);
        } else {
            self.pool.free_run(&req.kv_slots[req.prefix_len..]);
        }
        self.tree.unlock(req.last_node);
        if req.inflight_steps == 0 {
            if let Some(slot) = req.req_slot.take() {
                self.req_slots.free(slot);
            }
        }
        req.kv_slots.clear();
        req.stale_row = None;
        req.prefix_len = 0;
        req.computed_len = 0;
        req.last_node = ROOT;
        self.reqs[idx] = Some(req);
    }

    // ----------------------------------------------------------------------------------------
    // commit, finish, abort
}
