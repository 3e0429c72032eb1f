"""Type stubs for rsgl._core, the Rust scheduling core (crates/scheduler-core)."""

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

FUTURE_TOKEN: int

I64: TypeAlias = npt.NDArray[np.int64]
U32: TypeAlias = npt.NDArray[np.uint32]

class FinishReason:
    """Why a request finished: "stop" (by a token or a string), "length" or "abort"."""

    kind: Literal["stop", "length", "abort"]
    matched_token: int | None
    matched_str: str | None
    length: int | None
    message: str | None
    status_code: int | None
    @staticmethod
    def stop_token(token: int) -> FinishReason: ...
    @staticmethod
    def stop_str(matched: str) -> FinishReason: ...
    @staticmethod
    def max_length(length: int) -> FinishReason: ...
    @staticmethod
    def abort(message: str, status_code: int | None = None) -> FinishReason: ...
    def to_dict(self) -> dict[str, Any]: ...
    @staticmethod
    def from_dict(d: dict[str, Any]) -> FinishReason: ...

class Finished:
    rid: int
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

class Plan:
    id: int
    forward_mode: Literal["extend", "decode", "mixed", "idle"]
    batch_size: int
    num_extends: int
    num_tokens: int
    rids: I64
    req_slots: I64
    prefix_lens: I64
    extend_lens: I64
    seq_lens: I64
    sample: npt.NDArray[np.bool_]
    input_ids: I64
    positions: I64
    out_cache_loc: I64
    write_rows: I64
    write_cols: I64
    write_slots: I64
    admitted: I64
    retracted: I64

class Outcome:
    rids: I64
    tokens: I64
    finished: list[Finished]

class Scheduler:
    def __init__(
        self,
        max_total_tokens: int,
        *,
        page_size: int = 1,
        max_running_requests: int = 256,
        context_len: int = 8192,
        max_prefill_tokens: int = 16384,
        chunked_prefill_size: int | None = 8192,
        schedule_policy: str = "fcfs",
        schedule_conservativeness: float = 1.0,
        disable_radix_cache: bool = False,
        enable_mixed_chunk: bool = False,
        priority_preemption_threshold: int = 10,
        low_priority_values_first: bool = False,
        eos_token_ids: Sequence[int] = (),
        seed: int = 0,
    ) -> None: ...
    def add_request(
        self,
        rid: int,
        input_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        max_new_tokens: int = 128,
        *,
        min_new_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        priority: int = 0,
    ) -> None: ...
    def schedule(self) -> Plan: ...
    def commit(self, plan_id: int, next_token_ids: Sequence[int] | I64) -> Outcome: ...
    def abort(self, rid: int, message: str = ...) -> Literal["removed", "deferred", "unknown"]: ...
    def fail(self, rid: int, message: str) -> Literal["removed", "deferred", "unknown"]: ...
    def finish(self, rid: int, matched: str) -> bool: ...
    def flush_cache(self) -> bool: ...
    def check(self) -> None: ...
    @property
    def has_work(self) -> bool: ...
    @property
    def kv_buffer_size(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def max_prompt_len(self) -> int: ...
    def max_new_tokens_room(self, prompt_len: int) -> int: ...
    def stats(self) -> dict[str, int | float]: ...
    def request_info(self, rid: int) -> dict[str, Any] | None: ...

class RadixTree:
    def __init__(self, page_size: int = 1, disabled: bool = False) -> None: ...
    def match_prefix(self, key: U32, out: U32 | None = None) -> tuple[int, int, U32]: ...
    def insert(self, key: U32, values: U32) -> int: ...
    def lock(self, node: int) -> None: ...
    def unlock(self, node: int) -> None: ...
    def evict(self, num_tokens: int) -> U32: ...
    @property
    def evictable_size(self) -> int: ...
    @property
    def protected_size(self) -> int: ...
    def check(self) -> None: ...

class TokenPool:
    def __init__(self, num_tokens: int, page_size: int = 1) -> None: ...
    def alloc(self, n: int, out: U32 | None = None) -> U32 | None: ...
    def free(self, slots: U32) -> None: ...
    @property
    def available(self) -> int: ...
