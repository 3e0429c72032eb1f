//! Admission and prefill: which waiting requests join the next step (policy order,
//! budgets, priority preemption), their KV slots, and their extend layout in the plan.

use std::ops::Range;

use super::*;

impl Scheduler {
    /// SGLang's `cache_unfinished_req` for request `idx` whose first `committed` tokens have
    /// KV computed by committed steps: that prefix, floored to whole pages, goes into the
    /// tree (so that others can share it), the request's duplicates of what the tree already
    /// held are freed, its lock moves to the new deepest node, and its row now points at the
    /// tree's slots. SGLang calls it after each chunk and when a prefill completes; a step
    /// still in flight must not be cached (if it fails, its KV must not be shared), which is
    /// why only committed tokens count.
    ///
    /// Freeing the duplicates while a step that reads them is in flight is safe: steps run in
    /// order and only a plan made from now on can take those slots, so any new owner writes
    /// them after every step planned so far has finished reading them. Such a plan rewrites
    /// the changed positions of this request's row (`stale_row`) before it computes it.
    pub(super) fn cache_unfinished(&mut self, idx: usize, committed: usize) {
        if self.tree.is_disabled() {
            return;
        }
        let p = self.cfg.page_size;
        let mut req = self.reqs[idx].take().expect("live request");
        let aligned = committed.min(req.kv_len()) / p * p;
        debug_assert!(aligned >= req.prefix_len, "the cached prefix only grows");
        let key = req.fill_prefix(aligned);
        // The request's own prefix is in the tree and locked, so `present >= prefix_len`.
        let present = self.tree.insert(&key, &req.kv_slots[..aligned]);
        self.pool.free_run(&req.kv_slots[req.prefix_len..present]);
        self.scratch.clear();
        let (matched, node) = self.tree.match_prefix(&key, &mut self.scratch);
        debug_assert_eq!(matched, aligned);
        self.tree.lock(node);
        self.tree.unlock(req.last_node);
        if present > req.prefix_len {
            let changed = req.prefix_len..present;
            req.stale_row = Some(match req.stale_row.take() {
                Some(old) => old.start.min(changed.start)..old.end.max(changed.end),
                None => changed,
            });
        }
        req.kv_slots[..matched].copy_from_slice(&self.scratch[..matched]);
        req.prefix_len = matched;
        req.last_node = node;
        self.reqs[idx] = Some(req);
    }

    /// Reservation for running requests' future decode tokens.
    pub(super) fn running_reserve(&self) -> f64 {
        let ratio = self.ratio.get();
        self.running
            .iter()
            .map(|&i| self.req(i).remaining_new_tokens().min(CLIP_MAX_NEW_TOKENS) as f64 * ratio)
            .sum()
    }

    pub(super) fn available_and_evictable(&self) -> usize {
        self.pool.available() + self.tree.evictable_size()
    }

    /// Chooses this round's extends (the PrefillAdder loop). Prefixes are matched and locked
    /// here; slots are allocated afterwards so that `available` stays fixed during the round.
    pub(super) fn select_prefill(&mut self, mixed_decodes: usize, plan: &mut Plan) -> Vec<Extend> {
        let mut extends = Vec::new();
        if self.chunked.is_none() && self.waiting.is_empty() {
            return extends;
        }
        let mut adder = PrefillAdder::new(
            self.cfg.page_size,
            self.running_reserve(),
            self.cfg.max_prefill_tokens,
            self.cfg.chunked_prefill_size,
            mixed_decodes,
        );
        if let Some(idx) = self.chunked {
            let req = self.req(idx);
            let remaining = req.fill_len() - req.kv_len();
            let room = self.available_and_evictable() / self.cfg.page_size * self.cfg.page_size;
            let (len, whole) = match adder.fit_chunked(remaining, room) {
                Admission::Whole => (remaining, true),
                Admission::Chunk(n) => (n, false),
            };
            if len > 0 {
                adder.consume(len, if whole { req.remaining_new_tokens() } else { 0 });
                extends.push(Extend { idx, len, whole });
            }
            if !whole {
                return extends; // one chunked request at a time
            }
        }
        if self.waiting.is_empty()
            || adder.state(self.available_and_evictable()) != AddResult::Continue
        {
            return extends;
        }
        let order = self.order_waiting();
        let mut admitted = vec![false; self.reqs.len()];
        let mut free_req_slots = self.req_slots.available();
        for idx in order {
            if free_req_slots == 0 {
                break;
            }
            if self.req(idx).inflight_steps > 0 {
                continue; // retracted with a token still in flight: wait for it to land
            }
            let key = {
                let req = self.req(idx);
                let fill = req.fill_ids();
                fill[..fill.len() - 1].to_vec()
            };
            self.scratch.clear();
            let (matched, node) = self.tree.match_prefix(&key, &mut self.scratch);
            let extend_len = key.len() + 1 - matched;
            let max_new = self.req(idx).remaining_new_tokens();
            let mut verdict = adder.check_new(extend_len, max_new, self.available_and_evictable());
            // Preempt only for a request that passes the other budgets, or victims go for nothing.
            let preemptible = self.cfg.policy == Policy::Priority
                && adder.check_input(extend_len).is_ok()
                && adder.fit_new(extend_len).is_some();
            if verdict == Err(AddResult::NoToken)
                && preemptible
                && self.preempt_for(idx, extend_len, max_new, &mut adder, plan)
            {
                verdict = adder.check_new(extend_len, max_new, self.available_and_evictable());
            }
            if verdict.is_err() {
                break;
            }
            self.tree.lock(node);
            let admission = adder
                .check_new(extend_len, max_new, self.available_and_evictable())
                .ok()
                .and_then(|()| adder.fit_new(extend_len));
            let Some(admission) = admission else {
                self.tree.unlock(node);
                break;
            };
            let (len, whole) = match admission {
                Admission::Whole => (extend_len, true),
                Admission::Chunk(n) => (n, false),
            };
            adder.consume(len, if whole { max_new } else { 0 });
            free_req_slots -= 1;
            let values = std::mem::take(&mut self.scratch);
            let req = self.req_mut(idx);
            req.prefix_len = matched;
            req.computed_len = matched;
            req.last_node = node;
            req.kv_slots = values;
            // A row just taken: the executor has none of the cached prefix yet.
            req.stale_row = (matched > 0).then_some(0..matched);
            if req.state == ReqState::Waiting {
                req.cached_tokens = matched;
                self.counters.prompt_tokens += req.prompt.len() as u64;
                self.counters.cached_tokens += matched as u64;
            }
            admitted[idx] = true;
            extends.push(Extend { idx, len, whole });
            if !whole || adder.state(self.available_and_evictable()) != AddResult::Continue {
                break;
            }
        }
        self.waiting.retain(|&i| !admitted[i]);
        extends
    }

    /// The waiting queue in this round's order (lpm's in-batch duplicates left out).
    pub(super) fn order_waiting(&mut self) -> Vec<usize> {
        let policy = self
            .cfg
            .policy
            .effective(self.waiting.len(), self.tree.is_disabled());
        if policy == Policy::Fcfs {
            return self.waiting.clone();
        }
        let needs_keys = policy.needs_prefix_match();
        let keys: Vec<Vec<u32>> = self
            .waiting
            .iter()
            .map(|&i| {
                if !needs_keys {
                    return Vec::new();
                }
                let fill = self.req(i).fill_ids();
                fill[..fill.len() - 1].to_vec()
            })
            .collect();
        let mut matches = vec![(0, ROOT); keys.len()];
        if needs_keys {
            for (m, key) in matches.iter_mut().zip(&keys) {
                self.scratch.clear();
                *m = self.tree.match_prefix(key, &mut self.scratch);
            }
        }
        let cands = self
            .waiting
            .iter()
            .zip(&keys)
            .zip(&matches)
            .map(|((&idx, key), &(prefix_len, last_node))| {
                let req = self.req(idx);
                Candidate {
                    idx,
                    key,
                    prefix_len,
                    last_node,
                    max_new_tokens: req.limits.max_new_tokens,
                    priority: req.limits.priority,
                    arrival: req.arrival,
                }
            })
            .collect();
        let order = policy::order(
            policy,
            cands,
            &self.tree,
            &mut self.rng,
            self.cfg.low_priority_values_first,
        );
        // Sorting persists in the queue (as SGLang sorts its waiting list in place); deferred
        // lpm duplicates keep their place at the back.
        let mut in_order = vec![false; self.reqs.len()];
        order.iter().for_each(|&i| in_order[i] = true);
        let rest = self.waiting.iter().copied().filter(|&i| !in_order[i]);
        self.waiting = order.iter().copied().chain(rest).collect();
        order
    }

    /// Priority preemption: retract running requests at least `threshold` less important than
    /// the waiting request `idx` (least important, then newest, first) if that frees enough.
    pub(super) fn preempt_for(
        &mut self,
        idx: usize,
        extend_len: usize,
        max_new: usize,
        adder: &mut PrefillAdder,
        plan: &mut Plan,
    ) -> bool {
        let sign = if self.cfg.low_priority_values_first {
            -1
        } else {
            1
        };
        let importance = |r: &Request| r.limits.priority * sign;
        let mine = importance(self.req(idx));
        let mut victims: Vec<usize> = self
            .running
            .iter()
            .copied()
            .filter(|&i| mine - importance(self.req(i)) > self.cfg.priority_preemption_threshold)
            .collect();
        victims.sort_by_key(|&i| {
            (
                importance(self.req(i)),
                std::cmp::Reverse(self.req(i).arrival),
            )
        });
        let need = adder.need(extend_len, max_new) as f64;
        let mut rem = adder.rem_total(self.available_and_evictable());
        let ratio = self.ratio.get();
        let mut chosen = Vec::new();
        for v in victims {
            if rem >= need {
                break;
            }
            let r = self.req(v);
            let own = (r.kv_len() - r.prefix_len).div_ceil(self.cfg.page_size) * self.cfg.page_size;
            // Its cached prompt becomes evictable too, where no other request locks it.
            let freed = own + self.sole_locked_prefix(v);
            rem += freed as f64 + r.remaining_new_tokens().min(CLIP_MAX_NEW_TOKENS) as f64 * ratio;
            chosen.push(v);
        }
        if rem < need || chosen.is_empty() {
            return false;
        }
        for v in chosen {
            let refund = self.req(v).remaining_new_tokens().min(CLIP_MAX_NEW_TOKENS) as f64 * ratio;
            adder.refund(refund);
            self.retract(v, plan);
            self.counters.preemptions += 1;
        }
        true
    }

    /// Tokens of request `idx`'s cached prefix that no other request locks: releasing it
    /// makes them evictable. Lock counts only grow towards the root, so the walk stops at the
    /// first node another request holds too.
    pub(super) fn sole_locked_prefix(&self, idx: usize) -> usize {
        let mut node = self.req(idx).last_node;
        let mut tokens = 0;
        while node != ROOT && self.tree.lock_ref(node) == 1 {
            tokens += self.tree.node_len(node);
            node = self.tree.parent(node);
        }
        tokens
    }

    /// Allocates `n` KV slots continuing request `idx`'s last page, evicting from the tree
    /// when the pool is short.
    pub(super) fn alloc_for(&mut self, idx: usize, n: usize) -> Vec<Slot> {
        let p = self.cfg.page_size;
        let req = self.req(idx);
        let kv = req.kv_len();
        let in_page = if kv.is_multiple_of(p) {
            0
        } else {
            (p - kv % p).min(n)
        };
        let mut slots = Vec::with_capacity(n);
        if in_page > 0 {
            let last = req.kv_slots[kv - 1];
            slots.extend(last + 1..=last + in_page as Slot);
        }
        let rest = n - in_page;
        let ok = self.ensure_free(rest.div_ceil(p) * p);
        assert!(
            ok,
            "KV pool exhausted after admission checks: a scheduler accounting bug"
        );
        slots.extend(
            self.pool
                .alloc_tokens(rest)
                .expect("pool has room after eviction"),
        );
        slots
    }

    /// One KV slot for request `idx`'s next token (the decode fast path of
    /// [`alloc_for`](Self::alloc_for): no vector per request).
    pub(super) fn alloc_one(&mut self, idx: usize) -> Slot {
        let p = self.cfg.page_size;
        let req = self.req(idx);
        let kv = req.kv_len();
        if !kv.is_multiple_of(p) {
            return req.kv_slots[kv - 1] + 1;
        }
        let ok = self.ensure_free(p);
        assert!(
            ok,
            "KV pool exhausted after the decode memory check: a scheduler bug"
        );
        self.pool
            .alloc_page()
            .expect("pool has a page after eviction")
    }

    /// Evicts from the tree until `tokens` are free; false if even that is not enough.
    pub(super) fn ensure_free(&mut self, tokens: usize) -> bool {
        let available = self.pool.available();
        if available >= tokens {
            return true;
        }
        self.scratch.clear();
        self.tree.evict(tokens - available, &mut self.scratch);
        self.pool.free_run(&self.scratch);
        self.pool.available() >= tokens
    }

    /// Appends one request's extend to the plan.
    pub(super) fn plan_extend(&mut self, ext: Extend, plan: &mut Plan, entries: &mut Vec<Entry>) {
        let Extend { idx, len, whole } = ext;
        let newly_admitted = self.req(idx).req_slot.is_none();
        if newly_admitted {
            let slot = self
                .req_slots
                .alloc()
                .expect("request slot checked at admission");
            self.req_mut(idx).req_slot = Some(slot);
            plan.admitted.push(self.req(idx).rid as i64);
        }
        let slots = self.alloc_for(idx, len);
        write_stale_row(self.req_mut(idx), plan);
        let req = self.req(idx);
        let row = req.req_slot.expect("slot assigned") as i64;
        let start = req.kv_len();
        for (i, &slot) in slots.iter().enumerate() {
            let pos = start + i;
            plan.input_ids.push(req.token_at(pos) as i64);
            plan.positions.push(pos as i64);
            plan.out_cache_loc.push(slot as i64);
            plan.write_rows.push(row);
            plan.write_cols.push(pos as i64);
            plan.write_slots.push(slot as i64);
        }
        push_request_arrays(plan, req, start, len, whole, 0);
        let was_chunked = self.chunked == Some(idx);
        let req = self.req_mut(idx);
        req.kv_slots.extend_from_slice(&slots);
        if whole {
            req.state = ReqState::Running;
            req.pending_tokens += 1;
            self.running.push(idx);
            if was_chunked {
                self.chunked = None;
            }
        } else {
            req.state = ReqState::Chunked;
            self.chunked = Some(idx);
        }
        let req = self.req(idx);
        entries.push(Entry {
            idx,
            sample: whole,
            completes_prefill: whole,
            kv_end: req.kv_len(),
            draft_len: 0,
        });
    }
}

/// Appends the `req_to_token` writes for the positions of `req`'s row that the executor has
/// not seen (`stale_row`). Every plan that computes a request calls this before it reads the
/// row: a position left stale could point at a duplicate slot that was freed and that this
/// very step may fill with another request's KV.
#[inline]
pub(super) fn write_stale_row(req: &mut Request, plan: &mut Plan) {
    if let Some(stale) = req.stale_row.take() {
        write_row(req, stale, plan);
    }
}

/// `req_to_token[row, positions] = kv_slots[positions]` for `req`'s row; out of line, as most
/// plans of a request have nothing stale to write.
#[cold]
#[inline(never)]
fn write_row(req: &Request, positions: Range<usize>, plan: &mut Plan) {
    let row = req.req_slot.expect("a planned request holds a slot") as i64;
    for pos in positions {
        plan.write_rows.push(row);
        plan.write_cols.push(pos as i64);
        plan.write_slots.push(req.kv_slots[pos] as i64);
    }
}

/// Appends `req`'s per-request arrays: `len` tokens computed from position `start`, the last
/// `drafts` of them drafted.
#[inline]
pub(super) fn push_request_arrays(
    plan: &mut Plan,
    req: &Request,
    start: usize,
    len: usize,
    sample: bool,
    drafts: usize,
) {
    plan.rids.push(req.rid as i64);
    plan.req_slots
        .push(req.req_slot.expect("slot assigned") as i64);
    plan.prefix_lens.push(start as i64);
    plan.extend_lens.push(len as i64);
    plan.seq_lens.push((start + len) as i64);
    plan.sample.push(sample);
    plan.draft_lens.push(drafts as i64);
}
