"""rsgl.Engine: the offline API over the scheduling loop.

import rsgl
with rsgl.Engine() as llm:                       # the embedded SmolLM2 by default
    out = llm.generate("The capital of France is", {"max_new_tokens": 16})
    print(out["text"], out["meta_info"]["finish_reason"])
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Self, cast

import torch

from rsgl._core import Scheduler
from rsgl.layers.sampling_params import SamplingParams
from rsgl.model_executor.kv_cache import KVCache, check_kv_cache_dtype, resolve_kv_cache_dtype
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.scheduler.loop import SchedulerLoop

Prompt = str | list[int]
Messages = list[dict[str, Any]]

# Share of physical memory the KV pool may take when neither max_total_tokens nor
# mem_fraction is given (CPU: the "device" memory is the machine's).
DEFAULT_MEM_FRACTION = 0.15
# Default pool cap, so a big machine does not pin tens of GB for a 135M model.
DEFAULT_MAX_TOTAL_TOKENS = 1 << 18


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
    seed: int = 0

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        for name in ("max_running_requests", "max_prefill_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def from_options(cls, model_path: str | None, options: dict[str, Any]) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model_path=model_path, **options)


# SGLang's sampling_params keys that map one-to-one onto SamplingParams fields.
_PARAM_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}
_ALIASES = {"logprobs": "return_logprob", "top_logprobs": "top_logprobs_num"}


def make_sampling_params(raw: dict[str, Any] | None) -> tuple[SamplingParams, int]:
    """SamplingParams from an SGLang-style dict, plus `n`; ValueError names a bad field."""
    raw = dict(raw or {})
    n = raw.pop("n", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"invalid sampling parameter n={n!r}: must be an integer >= 1")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        field = _ALIASES.get(key, key)
        if field not in _PARAM_KEYS:
            raise ValueError(f"unknown sampling parameter {key!r}")
        values[field] = value
    stop = values.get("stop")
    if isinstance(stop, str):
        values["stop"] = [stop]
    elif stop is None:
        values.pop("stop", None)
    if values.get("top_logprobs_num"):
        values["return_logprob"] = True
    try:
        return SamplingParams(**values), n
    except TypeError as exc:
        raise ValueError(f"invalid sampling parameters: {exc}") from exc


@dataclass(slots=True)
class ModelStack:
    """Everything a scheduling loop needs: tokenizer, core and runner, sized from the args."""

    tokenizer: Any
    core: Scheduler
    runner: ModelRunner
    context_length: int
    max_total_tokens: int


def build_stack(args: EngineArgs) -> ModelStack:
    """Loads the model and tokenizer and sizes the KV pool and the core from `args`."""
    from transformers import AutoTokenizer

    from rsgl.models.loader import load_model

    torch.manual_seed(args.seed)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    loaded = load_model(
        args.model_path, device=args.device, dtype=dtype, max_positions=args.context_length
    )
    context_length = args.context_length or loaded.config.max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or loaded.model_dir)
    max_total_tokens = args.max_total_tokens or _pool_tokens(args, loaded)
    core = Scheduler(
        max_total_tokens,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        context_len=context_length,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_policy=args.schedule_policy,
        schedule_conservativeness=args.schedule_conservativeness,
        disable_radix_cache=args.disable_radix_cache,
        enable_mixed_chunk=args.enable_mixed_chunk,
        eos_token_ids=list(loaded.config.eos_token_ids),
        seed=args.seed,
    )
    runner = ModelRunner(
        loaded,
        kv_buffer_size=core.kv_buffer_size,
        max_running_requests=args.max_running_requests,
        context_len=context_length,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
    )
    return ModelStack(tokenizer, core, runner, context_length, max_total_tokens)


def _pool_tokens(args: EngineArgs, loaded: Any) -> int:
    """KV pool size: `mem_fraction` of the device's memory (default share, capped)."""
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, loaded.dtype)
    per_token = KVCache.bytes_per_slot(loaded.config, kv_dtype)
    if args.device == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        total = torch.cuda.get_device_properties(torch.device(args.device)).total_memory
    tokens = int(total * (args.mem_fraction or DEFAULT_MEM_FRACTION) / per_token)
    cap = DEFAULT_MAX_TOTAL_TOKENS if args.mem_fraction is None else tokens
    return max(4 * args.page_size, min(tokens, cap))


class _Collector:
    """Receives one request's updates from the loop thread (sync or asyncio consumer)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.aio_loop = loop
        self.sync_queue: queue.SimpleQueue[tuple[str, list[int], dict[str, Any] | None]] = (
            queue.SimpleQueue()
        )
        self.aio_queue: asyncio.Queue[tuple[str, list[int], dict[str, Any] | None]] | None = (
            asyncio.Queue() if loop is not None else None
        )

    def deliver(self, text: str, ids: list[int], meta: dict[str, Any] | None) -> None:
        if self.aio_loop is not None and self.aio_queue is not None:
            self.aio_loop.call_soon_threadsafe(self.aio_queue.put_nowait, (text, ids, meta))
        else:
            self.sync_queue.put((text, ids, meta))

    def chunks(self) -> Iterator[dict[str, Any]]:
        while True:
            text, ids, meta = self.sync_queue.get()
            yield _chunk(text, ids, meta)
            if meta is not None:
                return

    async def achunks(self) -> AsyncIterator[dict[str, Any]]:
        assert self.aio_queue is not None
        while True:
            text, ids, meta = await self.aio_queue.get()
            yield _chunk(text, ids, meta)
            if meta is not None:
                return


def _chunk(text: str, ids: list[int], meta: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"text": text, "output_ids": ids}
    if meta is not None:
        out["meta_info"] = meta
    return out


def _merge(chunks: Iterator[dict[str, Any]]) -> dict[str, Any]:
    text, ids, meta = [], [], None
    for c in chunks:
        text.append(c["text"])
        ids.extend(c["output_ids"])
        meta = c.get("meta_info")
    return {"text": "".join(text), "output_ids": ids, "meta_info": meta}


class Engine:
    """An LLM engine in this process: continuous batching over a paged KV cache with a
    radix prefix cache, chunked prefill, retraction and overlap scheduling.

    `Engine(model_path=None, **options)` loads the model (None: the embedded SmolLM2) with
    SGLang's option names (see `EngineArgs`). The loop thread starts with the first request.
    Results are dicts: `{"text", "output_ids", "meta_info": {"id", "finish_reason",
    "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}`.
    """

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        self.args = EngineArgs.from_options(model_path, options)
        stack = build_stack(self.args)
        self.tokenizer = stack.tokenizer
        self.core = stack.core
        self.runner = stack.runner
        self.context_length = stack.context_length
        self.max_total_tokens = stack.max_total_tokens
        self._loop = SchedulerLoop(
            self.core, self.runner, self.tokenizer, overlap=not self.args.disable_overlap_schedule
        )

    # ------------------------------------------------------------------ requests

    def _prompt_ids(self, prompt: Prompt | None, messages: Messages | None) -> list[int]:
        if messages is not None:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return [int(t) for t in cast(list[int], ids)]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return [int(t) for t in self.tokenizer.encode(prompt)]
        if prompt is None or len(prompt) == 0:
            raise ValueError("the prompt is empty: give text, input_ids or messages")
        if not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise ValueError("input_ids must be a list of non-negative token ids")
        return list(prompt)

    def _start_requests(
        self,
        prompts: list[list[int]],
        params: list[tuple[SamplingParams, int]],
        rids: list[str] | None,
        aio_loop: asyncio.AbstractEventLoop | None,
    ) -> list[_Collector]:
        """Validates everything first, then queues; nothing is queued if any input is bad."""
        jobs = []
        for i, (ids, (p, n)) in enumerate(zip(prompts, params)):
            room = self.core.max_new_tokens_room(len(ids))
            if len(ids) >= self.context_length:
                raise ValueError(
                    f"the prompt has {len(ids)} tokens, but this model's maximum context "
                    f"length is {self.context_length} tokens"
                )
            if room == 0:
                raise ValueError(
                    f"the prompt has {len(ids)} tokens, but the KV cache pool holds only "
                    f"{self.max_total_tokens} tokens"
                )
            base = rids[i] if rids else uuid.uuid4().hex
            for k in range(n):
                jobs.append((base if n == 1 else f"{base}-{k}", ids, p))
        self._loop.start()
        collectors = []
        batch = []
        for rid, ids, p in jobs:
            c = _Collector(aio_loop)
            if p.max_new_tokens == 0:
                meta = {
                    "id": rid,
                    "finish_reason": {"type": "length", "length": 0},
                    "prompt_tokens": len(ids),
                    "completion_tokens": 0,
                    "cached_tokens": 0,
                    "e2e_latency": 0.0,
                }
                c.deliver("", [], meta)
            else:
                batch.append((rid, ids, p, c.deliver))
            collectors.append(c)
        # One command for the whole call, so its prompts are prefilled together.
        self._loop.submit_many(batch)
        return collectors

    def _normalize(
        self,
        prompt: Prompt | list[Prompt] | None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        input_ids: list[int] | list[list[int]] | None,
        messages: Messages | list[Messages] | None,
    ) -> tuple[list[list[int]], list[tuple[SamplingParams, int]], bool]:
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        if messages is not None:
            batch = bool(messages) and isinstance(messages[0], list)
            items: list[Any] = list(messages) if batch else [messages]
            ids = [self._prompt_ids(None, m) for m in items]
        elif input_ids is not None:
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            items = list(input_ids) if batch else [input_ids]
            ids = [self._prompt_ids(p, None) for p in items]
        else:
            batch = isinstance(prompt, list) and not (
                prompt and all(isinstance(t, int) for t in prompt)
            )
            items = list(prompt) if batch else [prompt]  # type: ignore[arg-type]
            ids = [self._prompt_ids(p, None) for p in items]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids)} prompts")
            params = [make_sampling_params(p) for p in sampling_params]
        else:
            params = [make_sampling_params(sampling_params)] * len(ids)
        return ids, params, batch or any(n > 1 for _, n in params)

    def generate(
        self,
        prompt: Prompt | list[Prompt] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        messages: Messages | list[Messages] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        use_tqdm: bool = True,
    ) -> Any:
        """Generates for one prompt (a dict) or a list of prompts (a list of dicts, with
        `n` outputs per prompt). With `stream=True` (one prompt) returns an iterator of
        chunks whose `text` fields concatenate to the full text."""
        ids, params, batch = self._normalize(prompt, sampling_params, input_ids, messages)
        rids = [rid] if isinstance(rid, str) else rid
        collectors = self._start_requests(ids, params, rids, None)
        if stream:
            if len(collectors) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return collectors[0].chunks()
        if not batch:
            return _merge(collectors[0].chunks())
        from tqdm import tqdm

        show = use_tqdm and len(collectors) > 1 and sys.stderr.isatty()
        return [_merge(c.chunks()) for c in tqdm(collectors, disable=not show, desc="generate")]

    async def async_generate(
        self,
        prompt: Prompt | list[Prompt] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        messages: Messages | list[Messages] | None = None,
        stream: bool = False,
        rid: str | None = None,
    ) -> Any:
        """Async `generate`: awaits the result, or (stream=True) returns an async iterator."""
        ids, params, batch = self._normalize(prompt, sampling_params, input_ids, messages)
        loop = asyncio.get_running_loop()
        collectors = await loop.run_in_executor(
            None, self._start_requests, ids, params, [rid] if rid else None, loop
        )
        if stream:
            if len(collectors) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return collectors[0].achunks()

        async def merged(c: _Collector) -> dict[str, Any]:
            text, out_ids, meta = [], [], None
            async for chunk in c.achunks():
                text.append(chunk["text"])
                out_ids.extend(chunk["output_ids"])
                meta = chunk.get("meta_info")
            return {"text": "".join(text), "output_ids": out_ids, "meta_info": meta}

        results = await asyncio.gather(*(merged(c) for c in collectors))
        return list(results) if batch else results[0]

    def chat(
        self, messages: Messages | list[Messages], sampling_params: dict[str, Any] | None = None
    ) -> Any:
        """`generate` on chat messages, formatted with the model's chat template."""
        return self.generate(messages=messages, sampling_params=sampling_params)

    # ------------------------------------------------------------------ control

    def abort(self, rid: str) -> bool:
        """Aborts a queued or running request; False if it is unknown or finished."""
        return self._loop.abort(rid) if self._loop_running else False

    @property
    def _loop_running(self) -> bool:
        return self._loop._thread is not None

    def flush_cache(self) -> bool:
        """Empties the prefix cache; only possible when no request is in the engine."""
        if not self._loop_running:
            return self.core.flush_cache()
        return bool(self._loop.call(self.core.flush_cache))

    def check_integrity(self) -> None:
        """Runs the core's integrity check (raises RuntimeError naming what is broken)."""
        if not self._loop_running:
            self.core.check()
        else:
            self._loop.call(self.core.check)

    def get_server_info(self) -> dict[str, Any]:
        """Options, derived sizes and the core's live statistics."""
        info = dataclasses.asdict(self.args)
        info.update(
            context_length=self.context_length,
            max_total_tokens=self.max_total_tokens,
            kv_buffer_size=self.core.kv_buffer_size,
            kv_cache_storage_dtype=str(self.runner.kv_cache.dtype).removeprefix("torch."),
            model_dir=str(self.runner.loaded.model_dir),
            stats=self.core.stats(),
            steps=self._loop.steps,
        )
        return info

    def shutdown(self) -> None:
        """Stops the loop (aborting what is left) and its stream."""
        self._loop.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
