"""Engine options, with SGLang's names: the one place they and their defaults live.

Torch-free, so that the server's frontend process can read them without loading torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rsgl.validation import RequestLimits

# kv_cache_dtype values -> the torch dtype's name (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "float32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

LOAD_FORMATS = ("auto", "null")


def check_kv_cache_dtype(name: str) -> None:
    """ValueError naming the field unless `name` is a kv_cache_dtype value."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"invalid kv_cache_dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
        )


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Engine options, with SGLang's names."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    context_length: int | None = None
    mem_fraction: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 2048
    page_size: int = 1
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    enable_mixed_chunk: bool = False
    attention_backend: str = "torch_native"
    # "null": no weights and no math, seeded-random tokens (rsgl.model_executor.null_runner),
    # after `null_step_ms` per step; measures everything but the forward.
    load_format: str = "auto"
    null_step_ms: float = 0.0
    seed: int = 0
    # Request limits (see rsgl.validation.RequestLimits).
    allow_auto_truncate: bool = False
    max_n: int = 128
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_string_len: int = 1024

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"invalid load_format {self.load_format!r}: expected one of {', '.join(LOAD_FORMATS)}"
            )
        if not 0 <= self.null_step_ms < float("inf"):
            raise ValueError(f"null_step_ms must be finite and >= 0, got {self.null_step_ms}")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        limits = ("max_n", "max_stop_strings", "max_stop_string_len")
        for name in ("max_running_requests", "max_prefill_tokens", "page_size", *limits):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def from_options(cls, model_path: str | None, options: dict[str, Any]) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model_path=model_path, **options)

    def request_limits(
        self, vocab_size: int, context_length: int, max_prompt_len: int
    ) -> RequestLimits:
        """The limits requests are validated against, for a model of these sizes."""
        return RequestLimits(
            vocab_size=vocab_size,
            context_length=context_length,
            max_prompt_len=max_prompt_len,
            allow_auto_truncate=self.allow_auto_truncate,
            max_n=self.max_n,
            max_logprobs=self.max_logprobs,
            max_stop_strings=self.max_stop_strings,
            max_stop_string_len=self.max_stop_string_len,
        )
