//! Request state: token ids, sampling limits, lifecycle and finish reasons.

use std::borrow::Cow;
use std::ops::Range;

use crate::drafter::NgramDrafter;
use crate::pool::Slot;
use crate::radix::{NodeId, ROOT};

/// Caller-chosen request id.
pub type Rid = u64;

/// Why a request finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` (or the context / pool room) reached.
    Length(usize),
    /// A stop or EOS token was sampled.
    StopToken(u32),
    /// A stop string was found in the detokenized text (reported by Python).
    StopString(String),
    /// Aborted by the caller or by the scheduler, with a message.
    Abort(String),
}

impl FinishReason {
    /// SGLang's finish type: "length", "stop" or "abort".
    pub fn kind(&self) -> &'static str {
        match self {
            FinishReason::Length(_) => "length",
            FinishReason::StopToken(_) | FinishReason::StopString(_) => "stop",
            FinishReason::Abort(_) => "abort",
        }
    }
}

/// Where a request is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReqState {
    /// In the waiting queue, never scheduled.
    Waiting,
    /// Being prefilled in chunks; resumed first by the next schedule.
    Chunked,
    /// In the running batch (decoding, or its last prefill step is in flight).
    Running,
    /// Evicted from the running batch under memory pressure; waits to re-prefill.
    Retracted,
    /// Finished; its slots are released once no in-flight step reads them.
    Finished,
}

/// The sampling limits the core enforces (the rest of sampling lives in Python).
#[derive(Debug, Clone, Default)]
pub struct SamplingLimits {
    /// Upper bound on output tokens (clamped on admission to the room the context and pool leave).
    pub max_new_tokens: usize,
    /// Stop tokens do not finish the request before this many outputs (the sampler masks them).
    pub min_new_tokens: usize,
    /// Extra stop tokens besides the model's EOS ids (both off under `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Ignore every token-based stop: the model's EOS ids and `stop_token_ids`.
    pub ignore_eos: bool,
    /// Larger is more important unless the scheduler is configured otherwise.
    pub priority: i64,
}

/// One request as the core tracks it.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller's id.
    pub rid: Rid,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Committed output token ids.
    pub output: Vec<u32>,
    /// Sampling limits.
    pub limits: SamplingLimits,
    /// Arrival order, for fcfs tie-breaks.
    pub arrival: u64,
    /// Lifecycle state.
    pub state: ReqState,
    /// Set once the request has finished (or was aborted).
    pub finish: Option<FinishReason>,
    /// Row of `req_to_token`, while the request holds one.
    pub req_slot: Option<u32>,
    /// The core's copy of the request's `req_to_token` row: KV slots of the tokens computed so
    /// far (or being computed by in-flight steps).
    pub kv_slots: Vec<Slot>,
    /// Leading tokens of `kv_slots` owned by the radix tree (locked through `last_node`).
    pub prefix_len: usize,
    /// Deepest tree node of the cached prefix; locked while the request holds it.
    pub last_node: NodeId,
    /// Positions of the request's `req_to_token` row whose slots the executor has not seen:
    /// the cached prefix of a row just taken, or positions whose duplicate slots caching
    /// swapped for the tree's. The next plan that computes the request writes them first.
    pub stale_row: Option<Range<usize>>,
    /// Tokens sampled by in-flight steps and not yet committed.
    pub pending_tokens: usize,
    /// In-flight (scheduled, uncommitted) steps that include this request.
    pub inflight_steps: usize,
    /// Cached tokens found at first admission (reported to users as `cached_tokens`).
    pub cached_tokens: usize,
    /// Leading KV positions computed by committed steps (a cached prefix counts). Only these
    /// may enter the prefix tree: a step in flight may still fail.
    pub computed_len: usize,
    /// Whether the request's KV may still go into the prefix tree. Cleared when a step that
    /// included it failed: that step may have written part of its KV, or none.
    pub cacheable: bool,
    /// N-gram index over the committed tokens (built on the first speculative decode).
    pub drafter: Option<NgramDrafter>,
    /// Drafts proposed for the step being planned; empty outside `schedule`.
    pub draft: Vec<u32>,
    /// Draft tokens of the in-flight speculative step (0: none). Such a request is not
    /// planned again before that step commits: its next position depends on the acceptance.
    pub drafts_in_flight: usize,
    /// Whether the request may speculate (false: a grammar decides its tokens one by one).
    pub may_speculate: bool,
    /// Decode steps left before the request drafts again, and the pause the next all-rejected
    /// verify sets (one step longer each time up to [`MAX_SPEC_PAUSE`], back to 0 once a
    /// draft is accepted).
    pub spec_pause_left: u32,
    pub spec_pause: u32,
    /// The most drafts the request proposes next: after a verify that accepted all of its
    /// `d` drafts at least `2d` (a run of copied text is followed ever further), after one
    /// that did not, one more than it accepted (where its text leaves what it copies, its
    /// next verifies stay short). Unbounded at first: the step's limit decides.
    pub spec_cap: usize,
    /// The draft a verify would have carried after one of the request's plain steps, being
    /// checked against the tokens plain steps commit instead (`Scheduler::take_shadow_accepts`).
    pub shadow: Option<ShadowDraft>,
}

/// A would-be verify of a request that decodes without drafts: the drafts proposed after
/// a commit, and how many of them the tokens committed since have matched.
#[derive(Debug, Clone)]
pub struct ShadowDraft {
    pub draft: Vec<u32>,
    pub matched: usize,
}

/// Longest pause, in decode steps, after verifies whose drafts were all rejected.
pub const MAX_SPEC_PAUSE: u32 = 16;

impl Request {
    /// A new waiting request.
    pub fn new(rid: Rid, prompt: Vec<u32>, limits: SamplingLimits, arrival: u64) -> Self {
        Self {
            rid,
            prompt,
            output: Vec::new(),
            limits,
            arrival,
            state: ReqState::Waiting,
            finish: None,
            req_slot: None,
            kv_slots: Vec::new(),
            prefix_len: 0,
            last_node: ROOT,
            stale_row: None,
            pending_tokens: 0,
            inflight_steps: 0,
            cached_tokens: 0,
            computed_len: 0,
            cacheable: true,
            drafter: None,
            draft: Vec::new(),
            drafts_in_flight: 0,
            may_speculate: true,
            spec_pause_left: 0,
            spec_pause: 0,
            spec_cap: usize::MAX,
            shadow: None,
        }
    }

    /// After a verify of `drafts` drafts that accepted `accepted`: drafts that keep failing
    /// cost a verify each, so an all-rejected verify pauses the request's drafting, longer
    /// each time until one is accepted again; and its next drafts are capped
    /// ([`spec_cap`](Self::spec_cap)).
    pub fn verified(&mut self, drafts: usize, accepted: usize) {
        if accepted == 0 {
            self.spec_pause = (self.spec_pause + 1).min(MAX_SPEC_PAUSE);
            self.spec_pause_left = self.spec_pause;
        } else {
            self.spec_pause = 0;
        }
        self.spec_cap = if accepted == drafts {
            self.spec_cap.max(2 * drafts)
        } else {
            accepted + 1
        };
    }

    /// The most drafts a verify after the committed tokens may carry: at most `k_max` and
    /// the request's cap, and few enough that the `1 + k` tokens it may commit stay within
    /// `max_new_tokens` and a context of `context` tokens.
    pub fn draft_room(&self, k_max: usize, context: usize) -> usize {
        k_max
            .min(self.spec_cap)
            .min(
                self.limits
                    .max_new_tokens
                    .saturating_sub(self.output.len() + 1),
            )
            .min(context.saturating_sub(self.fill_len() + 1))
    }

    /// The n-gram drafter over the committed tokens, brought up to date (built on first
    /// use with windows `min..=max`); the caller puts it back in `drafter`.
    pub fn updated_drafter(&mut self, min: usize, max: usize) -> NgramDrafter {
        let mut drafter = self
            .drafter
            .take()
            .unwrap_or_else(|| NgramDrafter::new(min, max));
        drafter.extend((drafter.len()..self.fill_len()).map(|i| self.token_at(i)));
        drafter
    }

    /// Committed tokens: prompt then output.
    pub fn fill_len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    /// The `i`-th committed token of prompt + output.
    pub fn token_at(&self, i: usize) -> u32 {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.output[i - self.prompt.len()]
        }
    }

    /// Prompt + output as one vector (for prefix matching and re-prefill).
    pub fn fill_ids(&self) -> Vec<u32> {
        let mut ids = Vec::with_capacity(self.fill_len());
        ids.extend_from_slice(&self.prompt);
        ids.extend_from_slice(&self.output);
        ids
    }

    /// The first `n` tokens of prompt + output (borrowed when they are all prompt tokens).
    pub fn fill_prefix(&self, n: usize) -> Cow<'_, [u32]> {
        match self.prompt.get(..n) {
            Some(head) => Cow::Borrowed(head),
            None => {
                let mut ids = self.fill_ids();
                ids.truncate(n);
                Cow::Owned(ids)
            }
        }
    }

    /// Tokens with KV computed or in flight.
    pub fn kv_len(&self) -> usize {
        self.kv_slots.len()
    }

    /// Outputs committed plus those still in flight.
    pub fn produced(&self) -> usize {
        self.output.len() + self.pending_tokens
    }

    /// Output tokens still allowed.
    pub fn remaining_new_tokens(&self) -> usize {
        self.limits.max_new_tokens.saturating_sub(self.produced())
    }

    /// Whether the request has reached its length limit once in-flight tokens land.
    pub fn will_hit_length(&self) -> bool {
        self.produced() >= self.limits.max_new_tokens
    }

    /// Checks a newly committed output token (already appended) against the finish rules in
    /// order: length, then stop token / EOS. Stop strings are Python's; aborts are set directly.
    pub fn check_finished(&self, eos_token_ids: &[u32]) -> Option<FinishReason> {
        let last = *self.output.last()?;
        if self.output.len() >= self.limits.max_new_tokens {
            return Some(FinishReason::Length(self.limits.max_new_tokens));
        }
        // The sampler masks stop tokens while fewer than min_new_tokens outputs exist, so a stop
        // counts only at output index >= min_new_tokens.
        if self.output.len() > self.limits.min_new_tokens {
            // As SGLang: ignore_eos turns off every token-based stop, stop_token_ids included.
            let stop = !self.limits.ignore_eos
                && (self.limits.stop_token_ids.contains(&last) || eos_token_ids.contains(&last));
            if stop {
                return Some(FinishReason::StopToken(last));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(max_new: usize, min_new: usize, ignore_eos: bool) -> Request {
        let limits = SamplingLimits {
            max_new_tokens: max_new,
            min_new_tokens: min_new,
            stop_token_ids: vec![7],
            ignore_eos,
            priority: 0,
        };
        Request::new(1, vec![1, 2, 3], limits, 0)
    }

    #[test]
    fn length_is_checked_before_stop_tokens() {
        let mut r = req(2, 0, false);
        r.output = vec![5, 2];
        assert_eq!(r.check_finished(&[2]), Some(FinishReason::Length(2)));
    }

    #[test]
    fn eos_and_stop_ids_stop_unless_ignore_eos() {
        let mut r = req(10, 0, false);
        r.output = vec![2];
        assert_eq!(r.check_finished(&[2]), Some(FinishReason::StopToken(2)));
        r.output = vec![7];
        assert_eq!(r.check_finished(&[2]), Some(FinishReason::StopToken(7)));
        let mut r = req(10, 0, true);
        r.output = vec![2, 7];
        assert_eq!(r.check_finished(&[2]), None);
    }

    #[test]
    fn min_new_tokens_suppresses_stops() {
        let mut r = req(10, 3, false);
        r.output = vec![7];
        assert_eq!(r.check_finished(&[]), None);
        r.output = vec![1, 1, 7];
        assert_eq!(r.check_finished(&[]), None);
        r.output = vec![1, 1, 1, 7];
        assert_eq!(r.check_finished(&[]), Some(FinishReason::StopToken(7)));
    }

    #[test]
    fn fill_concatenates_prompt_and_output() {
        let mut r = req(10, 0, false);
        r.output = vec![9];
        assert_eq!(r.fill_ids(), vec![1, 2, 3, 9]);
        assert_eq!(r.token_at(3), 9);
        assert_eq!(&*r.fill_prefix(2), &[1, 2]);
        assert_eq!(&*r.fill_prefix(4), &[1, 2, 3, 9]);
    }
}
