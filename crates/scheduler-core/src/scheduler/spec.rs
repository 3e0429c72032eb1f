//! Speculative decoding's bookkeeping: n-gram drafts for decoding requests (over committed
//! tokens only) and giving back the KV of rejected drafts on commit.

use super::*;
use crate::drafter::NgramDrafter;

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
            let k = k_max
                .min(req.spec_cap)
                .min(req.remaining_new_tokens().saturating_sub(1))
                .min(context.saturating_sub(req.fill_len() + 1));
            if k == 0 {
                continue;
            }
            if model_drafts {
                req.draft.resize(k, 0); // the runner's draft model fills them
                continue;
            }
            let mut drafter = req
                .drafter
                .take()
                .unwrap_or_else(|| NgramDrafter::new(min, max));
            drafter.extend((drafter.len()..req.fill_len()).map(|i| req.token_at(i)));
            req.draft.extend_from_slice(drafter.propose(k));
            req.drafter = Some(drafter);
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
