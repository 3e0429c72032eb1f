//! The core's options and errors.

use super::*;

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
    /// Speculative decoding (SGLang's `--speculative-num-draft-tokens`): tokens verified per
    /// speculating request and step, the root (last committed) token included, so up to
    /// `spec_num_draft_tokens - 1` drafts. 0 or 1 turns speculation off.
    pub spec_num_draft_tokens: usize,
    /// Shortest suffix the n-gram drafter matches (`--speculative-ngram-min-match-window-size`).
    pub spec_ngram_min_window: usize,
    /// Longest suffix the n-gram drafter matches (`--speculative-ngram-max-match-window-size`).
    pub spec_ngram_max_window: usize,
    /// Drafts come from a draft model the runner runs (SGLang's STANDALONE): the core reserves
    /// each speculating request's draft positions with placeholder tokens (id 0) that the
    /// runner overwrites before the verify forward, instead of drafting from n-grams.
    pub spec_draft_model: bool,
}

impl SchedulerConfig {
    /// Most drafts a request may verify in one step (0: speculation off).
    pub fn max_drafts(&self) -> usize {
        self.spec_num_draft_tokens.saturating_sub(1)
    }
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
            spec_num_draft_tokens: 0,
            spec_ngram_min_window: 1,
            spec_ngram_max_window: 12,
            spec_draft_model: false,
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
