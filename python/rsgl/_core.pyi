"""Type stubs for rsgl._core, the Rust scheduling core (crates/scheduler-core).

Checked against the built module by `mypy.stubtest` in `make lint`.
"""

from collections.abc import Iterable, Sequence
from typing import Any, Literal, TypeAlias, final, overload

import numpy as np
import numpy.typing as npt

__all__ = [
    "FUTURE_TOKEN",
    "Detokenizer",
    "FinishReason",
    "Finished",
    "NgramDrafter",
    "Outcome",
    "Plan",
    "RadixTree",
    "Scheduler",
    "TokenPool",
    "block_hashes",
    "default_config",
]

_I64: TypeAlias = npt.NDArray[np.int64]
_U32: TypeAlias = npt.NDArray[np.uint32]
_Ints: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
_Mode: TypeAlias = Literal["extend", "decode", "mixed", "idle"]

FUTURE_TOKEN: int
"""The input id of a decode whose previous token a step still in flight is computing."""

def block_hashes(tokens: _Ints, block: int) -> list[int]:
    """The chained hash of each whole `block` of `tokens` (a partial last block is left
    out): block i's hash stands for the prefix up to its end. The same in every process."""

def default_config() -> dict[str, Any]:
    """`SchedulerConfig::default()`: what `Scheduler()` runs with for each option not
    given, keyed by the constructor's keyword names (`chunked_prefill_size` -1: off)."""

@final
class FinishReason:
    """Why a request finished, typed.

    `kind` is "stop" (by `matched_token` or `matched_str`), "length" (after `length`
    tokens) or "abort" (`message`, and `status_code` when the server rather than the client
    ended it). `to_dict()` is SGLang's `finish_reason` dict; `from_dict` reads it back.
    """

    kind: Literal["stop", "length", "abort"]
    matched_token: int | None
    matched_str: str | None
    length: int | None
    message: str | None
    status_code: int | None
    @staticmethod
    def stop_token(token: int) -> FinishReason:
        """Stopped by `token` (EOS or one of the request's stop_token_ids)."""
    @staticmethod
    def stop_str(matched: str) -> FinishReason:
        """Stopped by the stop string `matched`."""
    @staticmethod
    def max_length(length: int) -> FinishReason:
        """Reached its length limit after `length` output tokens."""
    @staticmethod
    def abort(message: str, status_code: int | None = None) -> FinishReason:
        """Aborted; `status_code` when the server ended it (the API answers an error)."""
    def to_dict(self) -> dict[str, Any]:
        """`{"type": "stop", "matched": id or str}`, `{"type": "length", "length": n}` or
        `{"type": "abort", "message": str[, "status_code": int]}`."""
    @staticmethod
    def from_dict(d: dict[str, Any]) -> FinishReason:
        """The inverse of `to_dict`; ValueError for any other dict."""
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Finished:
    """A request a commit (or an abort) finished."""

    rid: int
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

@final
class Plan:
    """One step's work: per-request arrays (`rids` ... `sample`, extends first), per-token
    arrays (`input_ids`, `positions`, `out_cache_loc`), the `req_to_token` writes to apply
    first, and the requests that took (`admitted`) or gave back (`retracted`) a slot.

    `Scheduler.schedule()` makes them; the constructor builds one by hand (tests,
    benchmarks) and checks that the arrays of each group agree in length.
    """

    id: int
    forward_mode: _Mode
    batch_size: int
    num_extends: int
    num_tokens: int
    rids: _I64
    req_slots: _I64
    prefix_lens: _I64
    extend_lens: _I64
    seq_lens: _I64
    draft_lens: _I64
    """Drafts verified per request (0 unless it speculates; then `extend_lens = 1 +
    draft_lens`, its inputs being its last committed token and the drafts)."""
    sample: npt.NDArray[np.bool_]
    input_ids: _I64
    positions: _I64
    out_cache_loc: _I64
    write_rows: _I64
    write_cols: _I64
    write_slots: _I64
    admitted: _I64
    retracted: _I64
    def __new__(
        cls,
        *,
        id: int = 0,
        forward_mode: _Mode = "extend",
        rids: _Ints | None = None,
        req_slots: _Ints | None = None,
        prefix_lens: _Ints | None = None,
        extend_lens: _Ints | None = None,
        seq_lens: _Ints | None = None,
        sample: Sequence[bool] | None = None,
        input_ids: _Ints | None = None,
        positions: _Ints | None = None,
        out_cache_loc: _Ints | None = None,
        write_rows: _Ints | None = None,
        write_cols: _Ints | None = None,
        write_slots: _Ints | None = None,
        admitted: _Ints | None = None,
        retracted: _Ints | None = None,
        num_extends: int | None = None,
        draft_lens: _Ints | None = None,
    ) -> Plan: ...

@final
class Outcome:
    """What a commit produced: the requests that got a token (`rids`, aligned with
    `tokens`; after `commit_spec` a request appears once per committed token, in order) and
    those that finished."""

    rids: _I64
    tokens: _I64
    finished: list[Finished]

@final
class Scheduler:
    """The scheduling core of one model replica: waiting queue, running batch, radix prefix
    cache, KV and request-slot allocators, prefill budgets, retraction and finish checks.

    Every option is optional and keeps `default_config()`'s value when not given.
    """

    def __new__(
        cls,
        max_total_tokens: int | None = None,
        *,
        page_size: int | None = None,
        max_running_requests: int | None = None,
        context_len: int | None = None,
        max_prefill_tokens: int | None = None,
        chunked_prefill_size: int | None = None,
        schedule_policy: str | None = None,
        schedule_conservativeness: float | None = None,
        disable_radix_cache: bool | None = None,
        enable_mixed_chunk: bool | None = None,
        priority_preemption_threshold: int | None = None,
        low_priority_values_first: bool | None = None,
        eos_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        spec_num_draft_tokens: int | None = None,
        spec_ngram_min_window: int | None = None,
        spec_ngram_max_window: int | None = None,
        spec_draft_model: bool | None = None,
    ) -> Scheduler: ...
    @property
    def config(self) -> dict[str, Any]:
        """The options this core runs with (as `default_config()`)."""
    def add_request(
        self,
        rid: int,
        input_ids: _Ints,
        max_new_tokens: int = 128,
        *,
        min_new_tokens: int = 0,
        stop_token_ids: Sequence[int] = ...,
        ignore_eos: bool = False,
        priority: int = 0,
    ) -> None:
        """Queues a request; ValueError (nothing queued) for one that can never run."""
    def schedule(self) -> Plan:
        """Plans the next step (an "idle" plan when there is nothing to do)."""
    def commit(self, plan_id: int, next_token_ids: Sequence[int] | _I64) -> Outcome:
        """Applies a step's sampled tokens (one per request of the plan, in plan order)."""
    def set_draft_limit(self, limit: int) -> None:
        """Caps the drafts per request of the steps planned from now on (0: no speculation)."""
    @property
    def draft_limit(self) -> int:
        """The drafts per request a step may carry now (configured and `set_draft_limit`)."""
    def take_shadow_accepts(self) -> list[int]:
        """How many would-be verifies of the steps planned with a draft limit of 0 accepted
        each number of drafts (index 0: none) since the last call; zeroed by the call."""
    def disable_speculation(self, rid: int) -> bool:
        """Stops a request from speculating; false when there is no such live request."""
    def commit_spec(
        self, plan_id: int, tokens: Sequence[int] | _I64, accept_lens: Sequence[int] | _I64
    ) -> Outcome:
        """Applies a speculative step: per request in plan order, `accept_lens[i]` tokens
        (accepted drafts then the bonus token; 1 to `1 + draft_lens[i]`, exactly 1 where
        `sample` is false) laid out one request after another in `tokens`. Tokens after a
        finish are dropped; the KV of rejected drafts is given back."""
    def decode_run(
        self, max_steps: int, token: int
    ) -> tuple[int, _I64, _I64, list[tuple[int, Finished]], _I64, _I64, _I64, Plan | None]:
        """Up to `max_steps` times, as the overlap loop when its oldest step ends: commits
        the oldest plan in flight with `token` for every request, then plans the next step.
        Returns `(committed, tokens_per_step, rids, finished, plan_ids, batch_sizes,
        context_tokens, other)`: the steps committed, how many requests each gave a token
        and their ids, `(step, Finished)` for what they finished, each plain decode plan made
        (id, batch size, KV read), and the plan that ended the run by not being one."""
    def abort(self, rid: int, message: str = ...) -> Literal["removed", "deferred", "unknown"]:
        """Aborts a request: "removed" now, "deferred" until the steps reading it commit."""
    def fail(self, rid: int, message: str) -> Literal["removed", "deferred", "unknown"]:
        """As `abort`, for a request of a failed step: none of its KV is cached from now on
        (what committed steps already shared, such as its prompt, stays)."""
    def finish(self, rid: int, matched: str) -> bool:
        """Finishes a request whose stop string Python found; False if unknown or over."""
    def flush_cache(self) -> bool:
        """Empties the prefix cache; False while anything is queued, running or in flight."""
    def check(self) -> None:
        """Raises RuntimeError naming the first broken invariant, if any."""
    @property
    def commit_moves_rows(self) -> bool:
        """Whether committing the steps in flight would swap slots in some request's row (a
        prefill over a prompt the tree holds): the overlap loop commits before planning then."""
    @property
    def has_work(self) -> bool:
        """Whether anything is queued, running or in flight."""
    @property
    def kv_buffer_size(self) -> int:
        """Rows the executor's K/V buffers need (slots 0..page_size are padding)."""
    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
    @property
    def max_prompt_len(self) -> int:
        """Longest prompt that leaves room for one output token."""
    def max_new_tokens_room(self, prompt_len: int) -> int:
        """Output tokens a prompt of this length leaves room for (0: it would be refused)."""
    def stats(self) -> dict[str, int | float]:
        """Load and counters."""
    def request_info(self, rid: int) -> dict[str, Any] | None:
        """A live request's state (for tests and debugging), or None."""

@final
class RadixTree:
    """SGLang's radix prefix tree on its own (benchmarks and reference tests)."""

    def __new__(cls, page_size: int = 1, disabled: bool = False) -> RadixTree: ...
    def match_prefix(self, key: _U32, out: _U32 | None = None) -> tuple[int, int, _U32]:
        """`(length, node, slots)` of the longest cached page-aligned prefix of `key`."""
    def insert(self, key: _U32, values: _U32) -> int:
        """Inserts `key` (whole pages) with `values`; returns the length already present."""
    def lock(self, node: int) -> None:
        """Protects `node` and its ancestors from eviction."""
    def unlock(self, node: int) -> None:
        """Undoes one `lock`."""
    @overload
    def evict(self, num_tokens: int, pool: None = None) -> _U32:
        """Evicts least recently used leaves until `num_tokens` are freed; their slots."""
    @overload
    def evict(self, num_tokens: int, pool: TokenPool) -> int:
        """As above, the slots going straight back to `pool`; how many there were."""
    def live(self, node: int) -> None:
        """Raises ValueError unless `node` is a node of the tree."""
    @property
    def evictable_size(self) -> int: ...
    @property
    def protected_size(self) -> int: ...
    def check(self) -> None:
        """Raises RuntimeError naming the first broken invariant, if any."""

@final
class TokenPool:
    """The KV slot allocator on its own: `num_tokens` slots in pages of `page_size`."""

    def __new__(cls, num_tokens: int, page_size: int = 1) -> TokenPool: ...
    def alloc(self, n: int, out: _U32 | None = None) -> _U32 | None:
        """`n` slots (whole pages), or None when the pool has too few."""
    def free(self, slots: _U32) -> None:
        """Returns slots (whole pages) to the pool."""
    @property
    def available(self) -> int: ...

@final
class Detokenizer:
    """Incremental detokenization of byte-level BPE output for every running request: one
    step's text deltas and stop strings in one call.

    Built once from every token's bytes (`token_bytes[i]` is token `i`'s) and the special
    ids. `add` starts a request's text and returns its handle; `step` takes one step's new
    tokens of many requests; `finish` returns what is held back once a request is over;
    `remove` forgets it. Streamed text concatenates to the tokenizer's `decode` (invalid
    UTF-8 as `bytes.decode("utf-8", "replace")` shows it, an incomplete character at the
    end dropped), cut where the first stop string starts (after it with `no_stop_trim`).
    """

    def __new__(
        cls, token_bytes: Sequence[bytes], special: Iterable[int] | None = None
    ) -> Detokenizer: ...
    def add(
        self,
        stop: Sequence[str] = ...,
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> int:
        """Starts a request's text; returns its handle."""
    def step(
        self, handles: Sequence[int], token_ids: Sequence[Sequence[int]]
    ) -> tuple[list[str], list[tuple[int, int, str]]]:
        """`token_ids[i]` are request `handles[i]`'s new tokens. Returns each one's newly
        final text, and `(i, tokens, stop)` for each whose text reached stop string `stop`
        with its `tokens`-th new token (the later ones are not its text). An id beyond the
        table has no text. KeyError, taking nothing, if a handle is unknown."""
    def matched_stop(self, handle: int) -> str | None:
        """The stop string that ended a request's text, or None."""
    def finish(self, handle: int) -> str:
        """The rest of a request's text once it is over (what was held back)."""
    def remove(self, handle: int) -> None:
        """Forgets a request; its handle becomes unknown."""
    @property
    def vocab_size(self) -> int:
        """Tokens in the table."""
    def __len__(self) -> int:
        """Requests added and not yet removed."""

@final
class NgramDrafter:
    """The scheduler's n-gram drafter over one token sequence (`crate::drafter`): `propose(k)`
    returns up to `k` tokens that followed the most recent earlier occurrence of the longest
    suffix of `min_window..=max_window` tokens that occurred before (empty if none did)."""

    def __new__(cls, min_window: int = 1, max_window: int = 12) -> NgramDrafter: ...
    def extend(self, tokens: _Ints) -> None:
        """Appends committed tokens in order."""
    def propose(self, k: int) -> list[int]:
        """Up to `k` drafts: what the scheduler would propose after these tokens."""
    def __len__(self) -> int: ...
