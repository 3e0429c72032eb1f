//! The scheduling state machine: `add_request`, `schedule` → [`Plan`], `commit` → [`Outcome`],
//! `abort`, `finish`, retraction and the integrity check.
//!
//! Pipelining (the overlap loop) needs no mode switch: every plan is recorded as in flight
//! until it is committed, a request counts the tokens its in-flight steps will produce
//! (`pending_tokens`) and the steps that still read its slots (`inflight_steps`). A decode
//! whose input token is not committed yet gets the placeholder [`FUTURE_TOKEN`], which the
//! executor resolves from its FutureMap. A finished or aborted request keeps its KV slots and
//! request slot until the last in-flight step that includes it has been committed.

use std::collections::VecDeque;
use std::fmt;

use rustc_hash::FxHashMap;

use crate::budget::{AddResult, Admission, NewTokenRatio, PrefillAdder, CLIP_MAX_NEW_TOKENS};
use crate::policy::{self, Candidate, Policy, SplitMix64};
use crate::pool::{ReqSlotPool, Slot, TokenPool};
use crate::radix::{NodeId, RadixTree, ROOT};
use crate::request::{FinishReason, ReqState, Request, Rid, SamplingLimits};

/// Input-token placeholder: "the token most recently sampled for this request slot".
pub const FUTURE_TOKEN: i64 = -1;

/// Scheduler configuration (SGLang's server-argument names).
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens in the KV pool.
    pub max_total_tokens: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Request slots (rows of `req_to_token`).
    pub max_running_requests: usize,
    /// The model's context length.
    pub context_len: usize,
    /// Input-token budget of one prefill round.
    pub max_prefill_tokens: usize,
    /// Chunk size for long prefills; `None` disables chunking.
    pub chunked_prefill_size: Option<usize>,
    /// Waiting-queue policy.
    pub policy: Policy,
    /// Scales the initial `new_token_ratio` (higher reserves more for decoding).
    pub schedule_conservativeness: f64,
    /// Disable the radix prefix cache.
    pub disable_radix_cache: bool,
    /// Put decodes into the same step as a prefill.
    pub enable_mixed_chunk: bool,
    /// Minimum priority gap for preempting a running request (priority policy).
    pub priority_preemption_threshold: i64,
    /// Lower priority values are more important (default: higher values are).
    pub low_priority_values_first: bool,
    /// The model's EOS token ids.
    pub eos_token_ids: Vec<u32>,
    /// Seed of the random policy.
    pub seed: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_total_tokens: 1 << 16,
            page_size: 1,
            max_running_requests: 256,
            context_len: 8192,
            max_prefill_tokens: 16384,
            // SGLang's size for small devices; larger chunks stall decoding longer on a CPU.
            chunked_prefill_size: Some(2048),
            policy: Policy::Fcfs,
            schedule_conservativeness: 1.0,
            disable_radix_cache: false,
            enable_mixed_chunk: false,
            priority_preemption_threshold: 10,
            low_priority_values_first: false,
            eos_token_ids: Vec::new(),
            seed: 0,
        }
    }
}

/// Errors the core reports to its caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A request or argument is invalid; nothing was changed.
    InvalidRequest(String),
    /// A call broke the schedule/commit protocol (wrong plan id, wrong token count).
    Protocol(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidRequest(m) | CoreError::Protocol(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for CoreError {}

/// What a step computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardMode {
    /// Prefill (extend) only.
    Extend,
    /// One token per running request.
    Decode,
    /// Extends followed by decodes in one step.
    Mixed,
    /// Nothing to run.
    #[default]
    Idle,
}

impl ForwardMode {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ForwardMode::Extend => "extend",
            ForwardMode::Decode => "decode",
            ForwardMode::Mixed => "mixed",
            ForwardMode::Idle => "idle",
        }
    }
}

/// One step's work as flat arrays (int64, so they become index tensors without conversion).
///
/// Per request (extends first, then decodes): `rids`, `req_slots`, `prefix_lens`,
/// `extend_lens`, `seq_lens`, `sample` (whether the sampled token is kept: false for a
/// non-final prefill chunk). Per token, requests laid out contiguously: `input_ids`
/// ([`FUTURE_TOKEN`] for a decode input still in flight), `positions`, `out_cache_loc`.
/// `req_to_token[write_rows, write_cols] = write_slots` brings the executor's table up to date.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Sequence number; commit plans in this order.
    pub id: u64,
    /// What the step computes.
    pub mode: ForwardMode,
    /// Request ids.
    pub rids: Vec<i64>,
    /// Rows of `req_to_token`.
    pub req_slots: Vec<i64>,
    /// Tokens holding KV before this step.
    pub prefix_lens: Vec<i64>,
    /// Tokens computed this step.
    pub extend_lens: Vec<i64>,
    /// `prefix_lens + extend_lens`.
    pub seq_lens: Vec<i64>,
    /// Whether each request's sampled token will be kept.
    pub sample: Vec<bool>,
    /// Token ids to compute.
    pub input_ids: Vec<i64>,
    /// Their positions.
    pub positions: Vec<i64>,
    /// KV slots they write.
    pub out_cache_loc: Vec<i64>,
    /// `req_to_token` rows to write.
    pub write_rows: Vec<i64>,
    /// `req_to_token` columns to write.
    pub write_cols: Vec<i64>,
    /// KV slots to write there.
    pub write_slots: Vec<i64>,
    /// Requests that got a request slot this step (first chunk, or re-prefill after retraction).
    pub admitted: Vec<i64>,
    /// Requests retracted or preempted back to the waiting queue while planning this step.
    pub retracted: Vec<i64>,
    /// The first `num_extends` requests extend; the rest decode.
    pub num_extends: usize,
}

/// A request that finished, as reported by a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// Request id.
    pub rid: Rid,
    /// Why it finished.
    pub reason: FinishReason,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Output tokens committed.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
}

/// The result of committing a step.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Requests that received a token (aligned with `tokens`).
    pub rids: Vec<i64>,
    /// The tokens they received.
    pub tokens: Vec<i64>,
    /// Requests that finished with this commit, or whose deferred abort completed.
    pub finished: Vec<Finished>,
}

/// What `abort` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortStatus {
    /// Released now; the caller reports the abort itself.
    Removed,
    /// An in-flight step still reads its slots: a later commit releases and reports it.
    Deferred,
    /// No such live request.
    Unknown,
}

/// Counters since start.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// Requests accepted by `add_request`.
    pub requests: u64,
    /// Prompt tokens of admitted requests (first admission).
    pub prompt_tokens: u64,
    /// Of those, tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Output tokens committed.
    pub generated_tokens: u64,
    /// Requests retracted under memory pressure.
    pub retractions: u64,
    /// Requests preempted by higher-priority ones.
    pub preemptions: u64,
    /// Requests aborted.
    pub aborts: u64,
    /// Requests finished (any reason).
    pub finished: u64,
    /// Steps planned, by mode.
    pub extend_steps: u64,
    /// Decode steps planned.
    pub decode_steps: u64,
    /// Mixed steps planned.
    pub mixed_steps: u64,
}

/// A snapshot of the scheduler's load.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Requests in the waiting queue.
    pub waiting: usize,
    /// Requests in the running batch.
    pub running: usize,
    /// 1 if a request is being prefilled in chunks.
    pub chunked: usize,
    /// Live requests (any state, including finished ones awaiting release).
    pub live: usize,
    /// Uncommitted plans.
    pub inflight_plans: usize,
    /// KV pool tokens.
    pub capacity: usize,
    /// Free KV tokens.
    pub available: usize,
    /// Tokens in unlocked tree nodes.
    pub evictable: usize,
    /// Tokens in locked tree nodes.
    pub protected: usize,
    /// Tokens owned by requests (whole pages).
    pub held: usize,
    /// Free request slots.
    pub free_req_slots: usize,
    /// Current `new_token_ratio`.
    pub new_token_ratio: f64,
    /// Counters since start.
    pub counters: Counters,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    idx: usize,
    sample: bool,
    /// The request's KV length once this step has run.
    kv_end: usize,
}

#[derive(Debug)]
struct InFlight {
    id: u64,
    entries: Vec<Entry>,
}

/// A request chosen for this round's prefill, before its slots are allocated.
#[derive(Debug, Clone, Copy)]
struct Extend {
    idx: usize,
    len: usize,
    whole: bool,
}

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
            self.cache_unfinished(idx);
        }
        let decodable: Vec<usize> = self
            .running
            .iter()
            .copied()
            .filter(|&i| !self.req(i).will_hit_length())
            .collect();
        let mixed_decodes = if self.cfg.enable_mixed_chunk {
            decodable.len()
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
                && self.ensure_free(self.decode_pages(&decodable) * self.cfg.page_size);
            if mixed {
                for &idx in &decodable {
                    self.plan_decode(idx, &mut plan, &mut entries);
                }
                plan.mode = ForwardMode::Mixed;
                self.counters.mixed_steps += 1;
            } else {
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
            self.inflight.push_back(InFlight {
                id: plan.id,
                entries,
            });
        }
        plan
    }

    /// After a chunk, SGLang's `cache_unfinished_req`: the computed, page-aligned prefix goes
    /// into the tree (so others can share it), duplicates are freed, and the request's lock
    /// moves to the new deepest node. Unlike SGLang, a chunk whose step is still in flight
    /// waits for the next call: if that step failed, its KV must not be in the tree.
    fn cache_unfinished(&mut self, idx: usize) {
        if self.tree.is_disabled() {
            return;
        }
        let computed = self.req(idx).computed_len.min(self.req(idx).kv_len());
        if computed <= self.req(idx).prefix_len {
            return; // nothing committed since the last call
        }
        let mut req = self.reqs[idx].take().expect("live request");
        let kv = computed;
        let fill = req.fill_ids();
        let key = &fill[..kv];
        debug_assert!(
            kv.is_multiple_of(self.cfg.page_size),
            "chunks end on page boundaries"
        );
        let present = self.tree.insert(key, &req.kv_slots[..kv]);
        self.pool.free(&req.kv_slots[req.prefix_len..present]);
        self.scratch.clear();
        let (matched, node) = self.tree.match_prefix(key, &mut self.scratch);
        debug_assert_eq!(matched, kv);
        self.tree.lock(node);
        self.tree.unlock(req.last_node);
        // Positions prefix_len..present now use the tree's slots; the executor's row is
        // rewritten by the next plan that computes this request (see `plan_extend`).
        if present > req.prefix_len {
            req.stale_row_from = Some(req.stale_row_from.unwrap_or(req.prefix_len));
        }
        req.kv_slots[..kv].copy_from_slice(&self.scratch[..kv]);
        req.prefix_len = matched;
        req.last_node = node;
        self.reqs[idx] = Some(req);
    }

    /// Reservation for running requests' future decode tokens.
    fn running_reserve(&self) -> f64 {
        let ratio = self.ratio.get();
        self.running
            .iter()
            .map(|&i| self.req(i).remaining_new_tokens().min(CLIP_MAX_NEW_TOKENS) as f64 * ratio)
            .sum()
    }

    fn available_and_evictable(&self) -> usize {
        self.pool.available() + self.tree.evictable_size()
    }

    /// Chooses this round's extends (the PrefillAdder loop). Prefixes are matched and locked
    /// here; slots are allocated afterwards so that `available` stays fixed during the round.
    fn select_prefill(&mut self, mixed_decodes: usize, plan: &mut Plan) -> Vec<Extend> {
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
    fn order_waiting(&mut self) -> Vec<usize> {
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
    fn preempt_for(
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
            rem += own as f64 + r.remaining_new_tokens().min(CLIP_MAX_NEW_TOKENS) as f64 * ratio;
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

    /// Allocates `n` KV slots continuing request `idx`'s last page, evicting from the tree
    /// when the pool is short.
    fn alloc_for(&mut self, idx: usize, n: usize) -> Vec<Slot> {
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
    fn alloc_one(&mut self, idx: usize) -> Slot {
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
    fn ensure_free(&mut self, tokens: usize) -> bool {
        let available = self.pool.available();
        if available >= tokens {
            return true;
        }
        self.scratch.clear();
        self.tree.evict(tokens - available, &mut self.scratch);
        self.pool.free(&self.scratch);
        self.pool.available() >= tokens
    }

    /// Appends one request's extend to the plan.
    fn plan_extend(&mut self, ext: Extend, plan: &mut Plan, entries: &mut Vec<Entry>) {
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
        let req = self.req(idx);
        let row = req.req_slot.expect("slot assigned") as i64;
        // A new row gets the cached prefix; a chunked request's row gets the positions that
        // caching its last chunk moved to the tree's slots.
        let stale_from = if newly_admitted {
            Some(0)
        } else {
            req.stale_row_from
        };
        if let Some(from) = stale_from {
            for (pos, &slot) in req.kv_slots.iter().enumerate().skip(from) {
                plan.write_rows.push(row);
                plan.write_cols.push(pos as i64);
                plan.write_slots.push(slot as i64);
            }
        }
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
        self.push_request_arrays(plan, idx, start, len, whole);
        let was_chunked = self.chunked == Some(idx);
        let req = self.req_mut(idx);
        req.kv_slots.extend_from_slice(&slots);
        req.stale_row_from = None;
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
            kv_end: req.kv_len(),
        });
    }

    fn push_request_arrays(
        &self,
        plan: &mut Plan,
        idx: usize,
        start: usize,
        len: usize,
        sample: bool,
    ) {
        let req = self.req(idx);
        plan.rids.push(req.rid as i64);
        plan.req_slots
            .push(req.req_slot.expect("slot assigned") as i64);
        plan.prefix_lens.push(start as i64);
        plan.extend_lens.push(len as i64);
        plan.seq_lens.push((start + len) as i64);
        plan.sample.push(sample);
    }

    /// Appends one request's decode token to the plan.
    fn plan_decode(&mut self, idx: usize, plan: &mut Plan, entries: &mut Vec<Entry>) {
        let slot = self.alloc_one(idx);
        let req = self.req(idx);
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
        self.push_request_arrays(plan, idx, pos, 1, true);
        let req = self.req_mut(idx);
        req.kv_slots.push(slot);
        req.pending_tokens += 1;
        let req = self.req(idx);
        entries.push(Entry {
            idx,
            sample: true,
            kv_end: req.kv_len(),
        });
    }

    /// New pages the decode of `reqs` needs (one per request sitting on a page boundary).
    fn decode_pages(&self, reqs: &[usize]) -> usize {
        let p = self.cfg.page_size;
        reqs.iter()
            .filter(|&&i| self.req(i).kv_len().is_multiple_of(p))
            .count()
    }

    /// Retracts decoding requests (fewest outputs first; ties: longest prompt) until the rest
    /// can get their next slots, always keeping one. Returns the requests that decode.
    fn make_room_for_decode(&mut self, mut reqs: Vec<usize>, plan: &mut Plan) -> Vec<usize> {
        let p = self.cfg.page_size;
        let mut retracted = false;
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

    fn live_requests(&self) -> usize {
        self.by_rid.len()
    }

    /// Sends a running request back to the front of the waiting queue, freeing its KV without
    /// caching it. Its outputs are kept; it re-prefills prompt + outputs later. Freeing while a
    /// step that includes it is in flight is safe: steps execute in order, so any new owner
    /// writes a slot after that step has finished with it.
    /// Its request slot is kept until no in-flight step includes it (the executor still
    /// writes per-slot state for it, such as the FutureMap entry).
    fn retract(&mut self, idx: usize, plan: &mut Plan) {
        self.running.retain(|&i| i != idx);
        self.release_memory(idx, false);
        let req = self.req_mut(idx);
        req.state = ReqState::Retracted;
        plan.retracted.push(req.rid as i64);
        self.waiting.insert(0, idx);
    }

    /// Frees a request's KV slots (caching them in the tree when `cache` is set), unlocks its
    /// prefix and returns its request slot.
    fn release_memory(&mut self, idx: usize, cache: bool) {
        let mut req = self.reqs[idx].take().expect("live request");
        if cache {
            let p = self.cfg.page_size;
            let n = req.kv_len().min(req.fill_len());
            let aligned = n / p * p;
            let key = req.fill_ids();
            let present = self.tree.insert(&key[..aligned], &req.kv_slots[..aligned]);
            self.pool.free(&req.kv_slots[req.prefix_len..present]);
            self.pool.free(&req.kv_slots[aligned..]);
        } else {
            self.pool.free(&req.kv_slots[req.prefix_len..]);
        }
        self.tree.unlock(req.last_node);
        if req.inflight_steps == 0 {
            if let Some(slot) = req.req_slot.take() {
                self.req_slots.free(slot);
            }
        }
        req.kv_slots.clear();
        req.prefix_len = 0;
        req.computed_len = 0;
        req.last_node = ROOT;
        self.reqs[idx] = Some(req);
    }

    // ----------------------------------------------------------------------------------------
    // commit, finish, abort

    /// Applies a step's sampled tokens (one per request of the plan, in plan order; values for
    /// requests whose `sample` flag is false are ignored). Plans commit in the order planned.
    pub fn commit(&mut self, plan_id: u64, next_token_ids: &[i64]) -> Result<Outcome, CoreError> {
        let front = self.inflight.front().ok_or_else(|| {
            CoreError::Protocol(format!(
                "commit of plan {plan_id}, but no plan is in flight"
            ))
        })?;
        if front.id != plan_id {
            return Err(CoreError::Protocol(format!(
                "commit of plan {plan_id}, but plan {} is the oldest in flight (commit in order)",
                front.id
            )));
        }
        if front.entries.len() != next_token_ids.len() {
            return Err(CoreError::Protocol(format!(
                "plan {plan_id} has {} requests but {} next tokens were given",
                front.entries.len(),
                next_token_ids.len()
            )));
        }
        if let Some(bad) = front
            .entries
            .iter()
            .zip(next_token_ids)
            .find(|(e, &t)| e.sample && !(0..=u32::MAX as i64).contains(&t))
        {
            return Err(CoreError::Protocol(format!(
                "invalid token id {} in commit",
                bad.1
            )));
        }
        let flight = self.inflight.pop_front().expect("checked above");
        let mut out = Outcome {
            finished: std::mem::take(&mut self.pending_reports),
            ..Outcome::default()
        };
        for (e, &token) in flight.entries.iter().zip(next_token_ids) {
            let req = self.reqs[e.idx]
                .as_mut()
                .expect("in-flight requests stay live");
            req.inflight_steps -= 1;
            // A retracted request's stale value is harmless: it is readmitted only once no
            // step of it is in flight, and readmission restarts `computed_len`.
            req.computed_len = req.computed_len.max(e.kv_end);
            if !e.sample {
                continue;
            }
            req.pending_tokens -= 1;
            if req.finish.is_some() {
                continue; // finished or aborted while this step was in flight: drop the token
            }
            req.output.push(token as u32);
            out.rids.push(req.rid as i64);
            out.tokens.push(token);
            self.counters.generated_tokens += 1;
            if let Some(reason) = req.check_finished(&self.cfg.eos_token_ids) {
                out.finished.push(self.mark_finished(e.idx, reason));
            }
        }
        for e in &flight.entries {
            let Some(req) = self.reqs[e.idx].as_mut() else {
                continue;
            };
            if req.inflight_steps > 0 {
                continue;
            }
            if req.finish.is_some() {
                self.release(e.idx);
            } else if req.state == ReqState::Retracted {
                // Retracted while this step was in flight: its request slot is free only now.
                if let Some(slot) = req.req_slot.take() {
                    self.req_slots.free(slot);
                }
            }
        }
        Ok(out)
    }

    fn report(&self, req: &Request) -> Finished {
        Finished {
            rid: req.rid,
            reason: req.finish.clone().expect("finished"),
            prompt_tokens: req.prompt.len(),
            completion_tokens: req.output.len(),
            cached_tokens: req.cached_tokens,
        }
    }

    /// Marks a request finished and takes it out of the queues; releases it now unless an
    /// in-flight step still reads its slots. Returns its report.
    fn mark_finished(&mut self, idx: usize, reason: FinishReason) -> Finished {
        if matches!(reason, FinishReason::Abort(_)) {
            self.counters.aborts += 1;
        }
        self.counters.finished += 1;
        let req = self.req_mut(idx);
        let state = req.state;
        req.finish = Some(reason);
        req.state = ReqState::Finished;
        let inflight = req.inflight_steps;
        match state {
            ReqState::Running => self.running.retain(|&i| i != idx),
            ReqState::Waiting | ReqState::Retracted => self.waiting.retain(|&i| i != idx),
            ReqState::Chunked => self.chunked = None,
            ReqState::Finished => unreachable!("finished twice"),
        }
        let report = self.report(self.req(idx));
        if inflight == 0 {
            self.release(idx);
        }
        report
    }

    /// Releases a finished request: caches its KV in the tree, frees the rest, forgets it.
    fn release(&mut self, idx: usize) {
        let cache = self.req(idx).cacheable;
        self.release_memory(idx, cache);
        let req = self.reqs[idx].take().expect("live request");
        self.by_rid.remove(&req.rid);
        self.free_entries.push(idx);
    }

    /// Finishes a request whose stop string Python found. Returns false for an unknown or
    /// already finished request.
    pub fn finish(&mut self, rid: Rid, matched: String) -> bool {
        match self.by_rid.get(&rid) {
            Some(&idx) if self.req(idx).finish.is_none() => {
                self.mark_finished(idx, FinishReason::StopString(matched));
                true
            }
            _ => false,
        }
    }

    /// Aborts a request: a waiting one leaves at once; one an in-flight step still reads is
    /// released (and reported) by the commit that completes that step.
    pub fn abort(&mut self, rid: Rid, message: String) -> AbortStatus {
        let Some(&idx) = self.by_rid.get(&rid) else {
            return AbortStatus::Unknown;
        };
        if self.req(idx).finish.is_some() {
            return AbortStatus::Unknown;
        }
        let deferred = self.req(idx).inflight_steps > 0;
        let report = self.mark_finished(idx, FinishReason::Abort(message));
        if deferred {
            self.pending_reports.push(report);
            AbortStatus::Deferred
        } else {
            AbortStatus::Removed
        }
    }

    /// Aborts a request that was in a step whose execution failed. As `abort`, except that
    /// none of its KV is ever inserted into the prefix tree: the failed step may have written
    /// some of it, or none, so other requests must not reuse it. Idempotent; a request that
    /// already finished but is still held by an in-flight step loses its caching too.
    pub fn fail(&mut self, rid: Rid, message: String) -> AbortStatus {
        let Some(&idx) = self.by_rid.get(&rid) else {
            return AbortStatus::Unknown;
        };
        self.req_mut(idx).cacheable = false;
        self.abort(rid, message)
    }

    /// Empties the prefix cache. Only when nothing is queued, running or in flight.
    pub fn flush_cache(&mut self) -> bool {
        if self.live_requests() > 0 || !self.inflight.is_empty() {
            return false;
        }
        self.scratch.clear();
        self.tree.reset(&mut self.scratch);
        self.pool.free(&self.scratch);
        true
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

    /// Verifies that every KV page is owned exactly once (free list, tree, or one request),
    /// that `free + evictable + protected + held == capacity`, that request slots and tree
    /// locks match the requests holding them, and the queues' consistency.
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
