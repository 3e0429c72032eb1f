//! The integrity check: every invariant of the pool, the tree and the request table.

use super::*;

impl Scheduler {
    /// Verifies that every KV page is owned exactly once (free list, tree, or one request),
    /// that `free + evictable + protected + held == capacity`, that request slots and tree
    /// locks match the requests holding them, that a request's cached prefix was computed by
    /// committed steps and covers the positions of its row the executor has not seen, and
    /// the queues' consistency.
    pub fn check(&self) -> Result<(), String> {
        self.tree.check()?;
        let p = self.cfg.page_size;
        let mut owners = vec![0u8; self.pool.num_pages() + 1];
        let mut claim = |run: &[Slot], what: &str| -> Result<(), String> {
            for (i, &slot) in run.iter().enumerate() {
                let page = slot as usize / p;
                if page == 0 || page > self.pool.num_pages() {
                    return Err(format!("{what}: slot {slot} is outside the pool"));
                }
                if i % p != slot as usize % p || (i % p != 0 && slot != run[i - 1] + 1) {
                    return Err(format!("{what}: slot {slot} breaks page alignment at {i}"));
                }
                if i % p == 0 {
                    owners[page] += 1;
                }
            }
            Ok(())
        };
        for &page in self.pool.free_page_ids() {
            claim(&[page * p as u32], "free list")?;
        }
        let mut tree_err = Ok(());
        self.tree.for_each_value(|v| {
            if tree_err.is_ok() {
                tree_err = claim(v, "radix tree");
            }
        });
        tree_err?;
        let mut expected_locks: FxHashMap<NodeId, u32> = FxHashMap::default();
        let mut slot_owner = vec![false; self.req_slots.size()];
        for req in self.reqs.iter().flatten() {
            let what = format!("request {}", req.rid);
            claim(&req.kv_slots[req.prefix_len..], &what)?;
            if req.prefix_len % p != 0 || req.prefix_len > req.kv_len() {
                return Err(format!(
                    "{what}: prefix {} of {} slots",
                    req.prefix_len,
                    req.kv_len()
                ));
            }
            if req.kv_len() > req.fill_len() + req.pending_tokens {
                return Err(format!(
                    "{what}: KV for {} tokens of {}",
                    req.kv_len(),
                    req.fill_len()
                ));
            }
            if !req.draft.is_empty() || (req.drafts_in_flight > 0 && req.inflight_steps == 0) {
                return Err(format!(
                    "{what}: {} drafts left from planning, {} in flight with {} steps",
                    req.draft.len(),
                    req.drafts_in_flight,
                    req.inflight_steps
                ));
            }
            // Only KV of committed steps may be shared: a step in flight may still fail.
            if req.prefix_len > req.computed_len {
                return Err(format!(
                    "{what}: {} tokens in the tree but only {} computed by committed steps",
                    req.prefix_len, req.computed_len
                ));
            }
            // Positions of the row the executor has not seen must hold tree slots this request
            // locks: those cannot be freed (and taken by another request) before it sees them.
            if let Some(stale) = &req.stale_row {
                let queued = matches!(req.state, ReqState::Waiting | ReqState::Retracted);
                if stale.is_empty() || stale.end > req.prefix_len || queued {
                    return Err(format!(
                        "{what}: stale row positions {stale:?} with prefix {} in state {:?}",
                        req.prefix_len, req.state
                    ));
                }
            }
            let mut node = req.last_node;
            let mut path_len = 0;
            while node != ROOT {
                *expected_locks.entry(node).or_default() += 1;
                path_len += self.tree.node_len(node);
                node = self.tree.parent(node);
            }
            if path_len != req.prefix_len {
                return Err(format!(
                    "{what}: locked path holds {path_len}, prefix is {}",
                    req.prefix_len
                ));
            }
            if let Some(slot) = req.req_slot {
                if std::mem::replace(&mut slot_owner[slot as usize], true) {
                    return Err(format!("request slot {slot} is held twice"));
                }
            }
            let holds = req.req_slot.is_some();
            let ok = match req.state {
                ReqState::Waiting => !holds && req.kv_slots.is_empty(),
                ReqState::Retracted => {
                    (!holds || req.inflight_steps > 0) && req.kv_slots.is_empty()
                }
                ReqState::Chunked | ReqState::Running => holds,
                ReqState::Finished => req.inflight_steps > 0,
            };
            if !ok {
                return Err(format!(
                    "{what}: state {:?} with slots {:?}",
                    req.state, req.req_slot
                ));
            }
        }
        if let Some(bad) = owners.iter().skip(1).position(|&c| c != 1) {
            return Err(format!(
                "KV page {} is owned {} times",
                bad + 1,
                owners[bad + 1]
            ));
        }
        if slot_owner.iter().filter(|&&h| h).count() + self.req_slots.available()
            != self.req_slots.size()
        {
            return Err("request slots: held + free != max_running_requests".into());
        }
        let total = self.pool.available() + self.tree.total_size() + self.held_tokens();
        if total != self.pool.capacity() {
            return Err(format!(
                "free {} + evictable {} + protected {} + held {} != pool {}",
                self.pool.available(),
                self.tree.evictable_size(),
                self.tree.protected_size(),
                self.held_tokens(),
                self.pool.capacity()
            ));
        }
        for (node, count) in &expected_locks {
            if self.tree.lock_ref(*node) != *count {
                return Err(format!(
                    "radix node {node} is locked {} times, expected {count}",
                    self.tree.lock_ref(*node)
                ));
            }
        }
        if self.tree.locked_nodes() != expected_locks.len() {
            return Err("radix: locked nodes that no request holds".into());
        }
        let queued = self.waiting.len() + self.running.len() + self.chunked.is_some() as usize;
        let finished = self
            .reqs
            .iter()
            .flatten()
            .filter(|r| r.state == ReqState::Finished)
            .count();
        if queued + finished != self.live_requests() {
            return Err(format!(
                "{} live requests but {queued} queued and {finished} finished",
                self.live_requests()
            ));
        }
        Ok(())
    }
}
