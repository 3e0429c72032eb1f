//! What a step plans (`Plan`), what a commit reports (`Outcome`, `Finished`), the
//! counters and statistics, and the in-flight bookkeeping behind them.

use super::*;

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
    /// Drafts verified per request (0 unless it speculates): such a decode computes its last
    /// committed token then `draft_lens[i]` drafted ones, `extend_lens[i] = 1 + draft_lens[i]`,
    /// and commits 1 to `1 + draft_lens[i]` tokens (`Scheduler::commit_spec`).
    pub draft_lens: Vec<i64>,
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
    /// Requests that received a token (aligned with `tokens`); a request that accepted
    /// drafts appears once per token, its tokens in order.
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
    /// Draft tokens planned for verification.
    pub draft_tokens: u64,
    /// Of those, drafts accepted by commits.
    pub accepted_draft_tokens: u64,
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
pub(super) struct Entry {
    pub(super) idx: usize,
    pub(super) sample: bool,
    /// Whether this step computes the last of the request's prefill (its whole extend or
    /// its last chunk): once committed, the prompt goes into the prefix tree.
    pub(super) completes_prefill: bool,
    /// The request's KV length once this step has run (drafts included).
    pub(super) kv_end: usize,
    /// Drafts this step verifies for the request.
    pub(super) draft_len: usize,
}

#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) id: u64,
    pub(super) entries: Vec<Entry>,
    /// Planned with drafting allowed but a draft limit of 0: its commits check shadow drafts.
    pub(super) shadow: bool,
}

/// A request chosen for this round's prefill, before its slots are allocated.
#[derive(Debug, Clone, Copy)]
pub(super) struct Extend {
    pub(super) idx: usize,
    pub(super) len: usize,
    pub(super) whole: bool,
}
