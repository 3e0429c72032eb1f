//! The scheduling state machine: `add_request`, `schedule` → [`Plan`], `commit` → [`Outcome`],
//! `abort`, `finish`, retraction and the integrity check.
//!
//! Pipelining (the overlap loop) needs no mode switch: every plan is recorded as in flight
//! until it is committed, a request counts the tokens its in-flight steps will produce
//! (`pending_tokens`) and the steps that still read its slots (`inflight_steps`). A decode
//! whose input token is not committed yet gets the placeholder [`FUTURE_TOKEN`], which the
//! executor resolves from its FutureMap. A finished or aborted request keeps its KV slots and
//! request slot until the last in-flight step that includes it has been committed.
//!
//! A prompt enters the prefix tree as in SGLang: the chunked request's computed prefix at the
//! next `schedule`, every other request's prompt when the step that completes its prefill
//! is committed (so requests arriving while it decodes share it), and what is left when it
//! finishes. Only committed steps' KV is ever inserted: a step in flight may still fail.
//!
//! Speculative decoding (`spec_num_draft_tokens` > 1, chains of n-gram drafts): a decoding
//! request whose last token is committed (no step of it in flight) gets drafts from its
//! [`NgramDrafter`](crate::drafter::NgramDrafter) and computes `1 + k` tokens; the memory
//! check and the mixed step's prefill budget count them, and drafts are dropped before anyone
//! is retracted. Until that step commits the request is not planned again. `commit_spec`
//! appends the accepted tokens one at a time with the finish checks, and gives back the KV of
//! rejected positions (whole pages beyond the new length; a partly used last page stays).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::fmt;

use rustc_hash::FxHashMap;

use crate::budget::{AddResult, Admission, NewTokenRatio, PrefillAdder, CLIP_MAX_NEW_TOKENS};
use crate::drafter::MAX_WINDOW;
use crate::policy::{self, Candidate, Policy, SplitMix64};
use crate::pool::{ReqSlotPool, Slot, TokenPool};
use crate::radix::{NodeId, RadixTree, ROOT};
use crate::request::{FinishReason, ReqState, Request, Rid, SamplingLimits};

/// Input-token placeholder: "the token most recently sampled for this request slot".
pub const FUTURE_TOKEN: i64 = -1;

mod admission;
mod check;
mod commit;
mod config;
mod decode;
mod fast_forward;
mod plan;
mod spec;

pub use config::{CoreError, SchedulerConfig};
pub use fast_forward::DecodeRun;
pub use plan::{AbortStatus, Counters, Finished, ForwardMode, Outcome, Plan, Stats};
use plan::{Entry, Extend, InFlight};

/// The scheduling core. Deterministic: the same calls give the same plans.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: TokenPool,
    req_slots: ReqSlotPool,
    tree: RadixTree,
    /// Request table; `None` marks a reusable entry.
    reqs: Vec<Option<Request>>,
    free_entries: Vec<usize>,
    by_rid: FxHashMap<Rid, usize>,
    waiting: Vec<usize>,
    running: Vec<usize>,
    chunked: Option<usize>,
    inflight: VecDeque<InFlight>,
    /// Aborts of requests an in-flight step still reads, reported by the next commit.
    pending_reports: Vec<Finished>,
    ratio: NewTokenRatio,
    rng: SplitMix64,
    next_plan_id: u64,
    arrivals: u64,
    counters: Counters,
    scratch: Vec<Slot>,
    /// Most drafts per request the caller allows now (`set_draft_limit`; at most the
    /// configured `max_drafts`): how an adaptive caller turns speculation down or off.
    draft_limit: usize,
    /// How many would-be verifies of plain steps accepted each number of drafts
    /// (`take_shadow_accepts`).
    shadow_accepts: Vec<u64>,
}

impl Scheduler {
    /// A scheduler with an empty pool and tree.
    pub fn new(cfg: SchedulerConfig) -> Result<Self, CoreError> {
        let invalid = |m: String| Err(CoreError::InvalidRequest(m));
        if cfg.page_size == 0 {
            return invalid("page_size must be at least 1".into());
        }
        if cfg.max_total_tokens < 4 * cfg.page_size {
            return invalid(format!(
                "max_total_tokens ({}) must hold at least four pages of {} tokens",
                cfg.max_total_tokens, cfg.page_size
            ));
        }
        if cfg.max_running_requests == 0 {
            return invalid("max_running_requests must be at least 1".into());
        }
        if cfg.context_len < 2 {
            return invalid("context_len must be at least 2".into());
        }
        if cfg.chunked_prefill_size.is_some_and(|c| c < cfg.page_size) {
            return invalid(format!(
                "chunked_prefill_size must be at least page_size ({})",
                cfg.page_size
            ));
        }
        let (min, max) = (cfg.spec_ngram_min_window, cfg.spec_ngram_max_window);
        if cfg.max_drafts() > 0 && !(1 <= min && min <= max && max <= MAX_WINDOW) {
            return invalid(format!(
                "the n-gram match window must satisfy 1 <= min ({min}) <= max ({max}) <= \
                 {MAX_WINDOW}"
            ));
        }
        if cfg.schedule_conservativeness.is_nan() || cfg.schedule_conservativeness <= 0.0 {
            return invalid("schedule_conservativeness must be positive".into());
        }
        Ok(Self {
            pool: TokenPool::new(cfg.max_total_tokens, cfg.page_size),
            req_slots: ReqSlotPool::new(cfg.max_running_requests),
            tree: RadixTree::new(cfg.page_size, cfg.disable_radix_cache),
            reqs: Vec::new(),
            free_entries: Vec::new(),
            by_rid: FxHashMap::default(),
            waiting: Vec::new(),
            running: Vec::new(),
            chunked: None,
            inflight: VecDeque::new(),
            pending_reports: Vec::new(),
            ratio: NewTokenRatio::new(cfg.schedule_conservativeness),
            rng: SplitMix64::new(cfg.seed),
            next_plan_id: 0,
            arrivals: 0,
            counters: Counters::default(),
            scratch: Vec::new(),
            draft_limit: usize::MAX,
            shadow_accepts: vec![0; cfg.max_drafts() + 1],
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Rows the executor's K/V buffers need (usable pages plus the padding page).
    pub fn kv_buffer_size(&self) -> usize {
        self.pool.kv_buffer_size()
    }

    /// Output tokens a prompt of `prompt_len` tokens leaves room for; 0 means it can never
    /// run. The context bounds prompt + output. The pool must hold what admission asks for (the
    /// prompt in whole pages, the output reservation and a page of slack) plus one more page,
    /// which covers a retracted request re-prefilling prompt + output rounded up to pages.
    pub fn max_new_tokens_room(&self, prompt_len: usize) -> usize {
        let p = self.cfg.page_size;
        let context_room = self.cfg.context_len.saturating_sub(prompt_len);
        let pool_room = self
            .pool
            .capacity()
            .saturating_sub(prompt_len.div_ceil(p) * p + 2 * p);
        context_room.min(pool_room)
    }

    /// Longest prompt that leaves room for one output token.
    pub fn max_prompt_len(&self) -> usize {
        let p = self.cfg.page_size;
        let pool_max = (self.pool.capacity() - 2 * p - 1) / p * p;
        (self.cfg.context_len - 1).min(pool_max)
    }

    fn req(&self, idx: usize) -> &Request {
        self.reqs[idx].as_ref().expect("live request")
    }

    fn req_mut(&mut self, idx: usize) -> &mut Request {
        self.reqs[idx].as_mut().expect("live request")
    }

    /// A live request by id.
    pub fn request(&self, rid: Rid) -> Option<&Request> {
        self.by_rid.get(&rid).map(|&i| self.req(i))
    }

    /// Queues a request. Prompts that can never run (empty, at least the context length, or
    /// more than the pool holds) are rejected here; `max_new_tokens` is clamped to the room
    /// the context and pool leave.
    pub fn add_request(
        &mut self,
        rid: Rid,
        prompt: Vec<u32>,
        mut limits: SamplingLimits,
    ) -> Result<(), CoreError> {
        let invalid = |m: String| Err(CoreError::InvalidRequest(m));
        if self.by_rid.contains_key(&rid) {
            return invalid(format!("request id {rid} is already in use"));
        }
        if prompt.is_empty() {
            return invalid("the prompt is empty: at least one input token is required".into());
        }
        if limits.max_new_tokens == 0 {
            return invalid("max_new_tokens must be at least 1".into());
        }
        let n = prompt.len();
        if n >= self.cfg.context_len {
            return invalid(format!(
                "the prompt has {n} tokens, but the context length is {} tokens: at most {} prompt \
                 tokens leave room for one output token",
                self.cfg.context_len,
                self.cfg.context_len - 1
            ));
        }
        let room = self.max_new_tokens_room(n);
        if room == 0 {
            return invalid(format!(
                "the prompt has {n} tokens, but the KV cache pool holds only {} tokens: at most {} \
                 prompt tokens fit with room for one output token",
                self.pool.capacity(),
                self.max_prompt_len()
            ));
        }
        limits.max_new_tokens = limits.max_new_tokens.min(room);
        let entry = Request::new(rid, prompt, limits, self.arrivals);
        self.arrivals += 1;
        let idx = match self.free_entries.pop() {
            Some(i) => {
                self.reqs[i] = Some(entry);
                i
            }
            None => {
                self.reqs.push(Some(entry));
                self.reqs.len() - 1
            }
        };
        self.by_rid.insert(rid, idx);
        self.waiting.push(idx);
        self.counters.requests += 1;
        Ok(())
    }

    // ----------------------------------------------------------------------------------------
    // schedule

    /// Plans the next step: prefill has priority over decode; the chunked request resumes
    /// first; decode retracts requests when the pool cannot hold the next tokens.
    pub fn schedule(&mut self) -> Plan {
        let mut plan = Plan {
            id: self.next_plan_id,
            ..Plan::default()
        };
        self.next_plan_id += 1;
        if let Some(idx) = self.chunked {
            // Its chunks committed since the last call (none while the last is in flight).
            let req = self.req(idx);
            let committed = req.computed_len.min(req.kv_len());
            if committed > req.prefix_len {
                self.cache_unfinished(idx, committed);
            }
        }
        let decodable: Vec<usize> = self
            .running
            .iter()
            .copied()
            .filter(|&i| {
                let r = self.req(i);
                !r.will_hit_length() && r.drafts_in_flight == 0
            })
            .collect();
        self.propose_drafts(&decodable);
        let mixed_decodes = if self.cfg.enable_mixed_chunk {
            self.decode_tokens(&decodable)
        } else {
            0
        };
        let extends = self.select_prefill(mixed_decodes, &mut plan);
        // Priority preemption may have retracted some of them.
        let decodable: Vec<usize> = decodable
            .into_iter()
            .filter(|&i| self.req(i).state == ReqState::Running)
            .collect();
        let mut entries = Vec::new();
        if !extends.is_empty() {
            for ext in &extends {
                self.plan_extend(*ext, &mut plan, &mut entries);
            }
            plan.num_extends = entries.len();
            let mixed = self.cfg.enable_mixed_chunk
                && !decodable.is_empty()
                && self.drop_drafts_to_fit(&decodable, self.available_and_evictable())
                && self.ensure_free(self.decode_pages(&decodable) * self.cfg.page_size);
            if mixed {
                for &idx in &decodable {
                    self.plan_decode(idx, &mut plan, &mut entries);
                }
                plan.mode = ForwardMode::Mixed;
                self.counters.mixed_steps += 1;
            } else {
                self.clear_drafts(&decodable);
                plan.mode = ForwardMode::Extend;
                self.counters.extend_steps += 1;
            }
        } else if !decodable.is_empty() {
            let decodable = self.make_room_for_decode(decodable, &mut plan);
            for &idx in &decodable {
                self.plan_decode(idx, &mut plan, &mut entries);
            }
            if !decodable.is_empty() {
                plan.mode = ForwardMode::Decode;
                self.counters.decode_steps += 1;
            }
        }
        if entries.is_empty() {
            if self.waiting.is_empty() && self.running.is_empty() && self.chunked.is_none() {
                self.ratio.reset();
            }
        } else {
            for e in &entries {
                self.req_mut(e.idx).inflight_steps += 1;
            }
            let shadow =
                self.cfg.max_drafts() > 0 && self.draft_limit() == 0 && !self.cfg.spec_draft_model;
            self.inflight.push_back(InFlight {
                id: plan.id,
                entries,
                shadow,
            });
        }
        plan
    }

    /// The prefix cache's contents: every root-to-leaf path's tokens and KV slots (for tests).
    pub fn cached_paths(&self) -> Vec<(Vec<u32>, Vec<Slot>)> {
        self.tree.paths()
    }

    /// Whether committing the steps in flight would point some request's row at other
    /// slots: a prefill completing over tokens that the tree will hold beyond the request's
    /// own prefix by then (a prompt cached whole, whose last token the extend computed again
    /// for its logits; a prompt that another request's commit caches first, in an earlier
    /// step or earlier in the same one). The commit frees the request's duplicates for the
    /// tree's copies (`cache_unfinished`), and the steps planned after it read those. A step
    /// planned before it, as the overlap loop plans, would read the duplicates: the same
    /// values up to rounding, not always the same bits, so the request could decode other
    /// tokens than without overlap. The loop commits first when this is true (rarely: some
    /// prompt must be computed twice).
    pub fn commit_moves_rows(&self) -> bool {
        let p = self.cfg.page_size;
        let mut cached_first: Vec<Cow<'_, [u32]>> = Vec::new();
        for e in self.inflight.iter().flat_map(|f| &f.entries) {
            let Some(req) = self.reqs[e.idx].as_ref() else {
                continue;
            };
            if !e.completes_prefill
                || req.finish.is_some()
                || req.state != ReqState::Running
                || !req.cacheable
            {
                continue;
            }
            let aligned = e.kv_end.min(req.kv_len()).min(req.fill_len()) / p * p;
            if aligned <= req.prefix_len {
                continue;
            }
            let key = req.fill_prefix(aligned);
            let shared = |other: &Cow<'_, [u32]>| {
                let n = key
                    .iter()
                    .zip(other.iter())
                    .take_while(|(a, b)| a == b)
                    .count();
                n / p * p > req.prefix_len
            };
            if self.tree.cached_len(&key) > req.prefix_len || cached_first.iter().any(shared) {
                return true;
            }
            cached_first.push(key);
        }
        false
    }

    /// Whether anything is queued, running or in flight.
    pub fn has_work(&self) -> bool {
        self.live_requests() > 0 || !self.inflight.is_empty()
    }

    /// A snapshot of load and counters.
    pub fn stats(&self) -> Stats {
        Stats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            chunked: self.chunked.is_some() as usize,
            live: self.live_requests(),
            inflight_plans: self.inflight.len(),
            capacity: self.pool.capacity(),
            available: self.pool.available(),
            evictable: self.tree.evictable_size(),
            protected: self.tree.protected_size(),
            held: self.held_tokens(),
            free_req_slots: self.req_slots.available(),
            new_token_ratio: self.ratio.get(),
            counters: self.counters.clone(),
        }
    }

    fn held_tokens(&self) -> usize {
        let p = self.cfg.page_size;
        self.reqs
            .iter()
            .flatten()
            .map(|r| (r.kv_len() - r.prefix_len).div_ceil(p) * p)
            .sum()
    }

    // ----------------------------------------------------------------------------------------
    // integrity
}
