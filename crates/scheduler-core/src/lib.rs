//! rsgl's scheduling core: all CPU-side bookkeeping of an SGLang-style LLM scheduler, and
//! the per-step work on its output that Python would do per request (batched incremental
//! detokenization with stop strings, [`detokenize`]).
//!
//! Pure Rust; the PyO3 bindings live in [`python`] behind the `python` feature, so
//! `cargo test` and `cargo bench` need no Python.

pub mod block_hash;
pub mod budget;
pub mod detokenize;
pub mod drafter;
pub mod policy;
pub mod pool;
pub mod radix;
pub mod request;
pub mod scheduler;

#[cfg(feature = "python")]
mod python;

pub use block_hash::block_hashes;
pub use detokenize::{
    ByteTable, Delta, DetokenizeError, Detokenizer, StopMatch, TextHandle, TextOptions,
};
pub use drafter::NgramDrafter;
pub use policy::Policy;
pub use pool::{ReqSlotPool, Slot, TokenPool};
pub use radix::{NodeId, RadixTree, ROOT};
pub use request::{FinishReason, ReqState, Request, Rid, SamplingLimits};
pub use scheduler::{
    AbortStatus, CoreError, Finished, ForwardMode, Outcome, Plan, Scheduler, SchedulerConfig,
    Stats, FUTURE_TOKEN,
};
