//! Speculative decoding's bookkeeping: n-gram drafts for decoding requests (over committed
//! tokens only) and giving back the KV of rejected drafts on commit.

use super::*;
use crate::request::ShadowDraft;

impl Scheduler {
    /// Proposes drafts (`Request::draft`) for the requests of `reqs` whose last token is
    /// committed, capped so that the `1 + k` tokens a step may commit stay within the
    /// request's `max_new_tokens` and the context. Speculation off: nothing.
    /// Caps the drafts per request of the steps planned from now on (0: none; values above
    /// the configured `spec_num_draft_tokens - 1` mean that).
    pub fn set_draft_limit(&mut self, limit: usize) {
        self.draft_limit = limit;
    }

    /// The drafts per request a step may carry now.
    pub fn draft_limit(&self) -> usize {
        self.cfg.max_drafts().min(self.draft_limit)
    }

    /// Stops request `rid` from speculating (its tokens must be checked one at a time, as a
    /// grammar does); false when no such live request.
    pub fn disable_speculation(&mut self, rid: Rid) -> bool {
        let Some(&idx) = self.by_rid.get(&rid) else {
            return false;
        };
        self.req_mut(idx).may_speculate = false;
        true
    }

    pub(super) fn propose_drafts(&mut self, reqs: &[usize]) {
        let k_max = self.cfg.max_drafts().min(self.draft_limit);
        if k_max == 0 {
            return;
        }
        let model_drafts = self.cfg.spec_draft_model;
        let (min, max, context) = (
            self.cfg.spec_ngram_min_window,
            self.cfg.spec_ngram_max_window,
            self.cfg.context_len,
        );
        for &idx in reqs {
            let req = self.req_mut(idx);
            req.draft.clear();
            if req.pending_tokens > 0 || req.kv_len() + 1 != req.fill_len() {
                continue; // its last token is still in flight
            }
            if !req.may_speculate {
                continue;
            }
            if req.spec_pause_left > 0 {
                req.spec_pause_left -= 1; // its recent drafts were all rejected
                continue;
            }
            let k = req.draft_room(k_max, context);
            if k == 0 {
                continue;
            }
            if model_drafts {
                req.draft.resize(k, 0); // the runner's draft model fills them
                continue;
            }
            let drafter = req.updated_drafter(min, max);
            req.draft.extend_from_slice(drafter.propose(k));
            req.drafter = Some(drafter);
        }
    }

    /// How many would-be verifies of plain steps accepted each number of drafts (index 0:
    /// none, up to the configured most) since the last call; then zeroes them. Steps planned
    /// with n-gram drafting allowed but a draft limit of 0 (see `check_shadow`) count them,
    /// so that a caller choosing the limit knows what drafting would accept while it runs
    /// none.
    pub fn take_shadow_accepts(&mut self) -> Vec<u64> {
        let counts = self.shadow_accepts.clone();
        self.shadow_accepts.fill(0);
        counts
    }

    /// A step planned with a draft limit of 0 committed `token` for request `idx`: the
    /// token checks the request's shadow draft, the drafts a verify would have carried
    /// (proposed after an earlier commit, as `propose_drafts` would have: pauses and caps
    /// included). A shadow is resolved by the first token that differs from its next draft
    /// (the verify's bonus token) or by the token after its last draft, and counts its
    /// matched drafts in `shadow_accepts`: exactly the drafts the verify would have
    /// accepted, for greedy requests (it compares them with the same argmax tokens), and
    /// with the same probability for sampled ones (a sampled token equals a deterministic
    /// draft with the probability that the exact rule accepts the draft with). The token
    /// that resolves one starts the next; a request that would not draft (paused,
    /// constrained, no match) counts a verify that accepts none. `finished`: the token ends
    /// the request, and resolves its shadow with what it matched.
    pub(super) fn check_shadow(&mut self, idx: usize, token: u32, finished: bool) {
        let (min, max, context) = (
            self.cfg.spec_ngram_min_window,
            self.cfg.spec_ngram_max_window,
            self.cfg.context_len,
        );
        let k_max = self.cfg.max_drafts();
        let req = self.reqs[idx]
            .as_mut()
            .expect("committed requests stay live");
        if let Some(shadow) = req.shadow.as_mut() {
            let drafts = shadow.draft.len();
            let hit = shadow.matched < drafts && shadow.draft[shadow.matched] == token;
            shadow.matched += usize::from(hit);
            if hit && !finished {
                return;
            }
            let matched = shadow.matched;
            req.shadow = None;
            req.verified(drafts, matched);
            self.shadow_accepts[matched] += 1;
        }
        if finished {
            return;
        }
        if !req.may_speculate {
            self.shadow_accepts[0] += 1;
            return;
        }
        if req.spec_pause_left > 0 {
            req.spec_pause_left -= 1;
            self.shadow_accepts[0] += 1;
            return;
        }
        let k = req.draft_room(k_max, context);
        let drafter = req.updated_drafter(min, max);
        let draft = drafter.propose(k).to_vec();
        req.drafter = Some(drafter);
        if draft.is_empty() {
            self.shadow_accepts[0] += 1;
        } else {
            req.shadow = Some(ShadowDraft { draft, matched: 0 });
        }
    }

    /// After a speculative step of request `idx` kept `kept` of its `1 + draft_len` computed
    /// positions (ending at `kv_end`): the rest of its row is dropped, and the pages wholly
    /// beyond the new length return to the pool. A partly used last page stays the request's:
    /// the next step overwrites its tail. Nothing to do for a request retracted meanwhile.
    pub(super) fn drop_rejected_kv(
        &mut self,
        idx: usize,
        kv_end: usize,
        draft_len: usize,
        kept: usize,
    ) {
        let p = self.cfg.page_size;
        let req = self.reqs[idx]
            .as_mut()
            .expect("in-flight requests stay live");
        if req.kv_len() != kv_end {
            return;
        }
        let new_len = kv_end - (1 + draft_len - kept);
        let first_free = new_len.div_ceil(p) * p;
        if first_free < kv_end {
            self.pool.free_run(&req.kv_slots[first_free..kv_end]);
        }
        req.kv_slots.truncate(new_len);
    }
}
