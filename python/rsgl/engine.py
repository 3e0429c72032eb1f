"""rsgl.Engine: the offline API over the scheduling loop.

import rsgl
with rsgl.Engine() as llm:                       # the embedded SmolLM2 by default
    out = llm.generate("The capital of France is", {"max_new_tokens": 16})
    print(out["text"], out["meta_info"]["finish_reason"])
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Self

from rsgl._core import Scheduler
from rsgl.args import EngineArgs
from rsgl.errors import InvalidRequest
from rsgl.gc_tuning import freeze_startup_objects
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.model_executor.null_runner import NullRunner
from rsgl.outputs import merge
from rsgl.reasoning import reasoning_end_ids
from rsgl.sampling_params import SamplingParams
from rsgl.stack import ModelStack, build_loop, build_stack
from rsgl.tokenizer.output_processor import OutputProcessor, OutputQueue, RequestRecord
from rsgl.validation import expand_requests, make_sampling_params, tokenize_prompt

if TYPE_CHECKING:
    from rsgl.server.threaded_frontend import ThreadedFrontend

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class Engine:
    """An LLM engine: continuous batching over a paged KV cache with a radix prefix cache,
    chunked prefill, retraction and overlap scheduling.

    `Engine(model_path=None, **options)` loads the model (None: the embedded SmolLM2) with
    SGLang's option names (see `EngineArgs`). The loop thread starts with the first request.
    Results are dicts: `{"text", "output_ids", "meta_info": {"id", "finish_reason",
    "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}`.

    With `dp_size=N > 1` the model runs in N scheduler processes (data-parallel replicas),
    driven through the server's frontend and dispatcher (`load_balance_method`) on a thread
    of their own: the same requests, outputs and errors, one request path. `core`, `runner`
    and `stack` then do not exist in this process; `shutdown` stops the processes. They are
    spawned, so a script creates such an Engine under `if __name__ == "__main__":` (the
    children import the main module, as with any multiprocessing spawn).
    """

    core: Scheduler
    runner: ModelRunner | NullRunner
    stack: ModelStack

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        self.args = EngineArgs.from_options(model_path, options)
        self._replicas: ThreadedFrontend | None = None
        if self.args.dp_size > 1:
            self._start_replicas()
            return
        self.stack = stack = build_stack(self.args)
        self.tokenizer = stack.tokenizer
        self.core = stack.core
        self.runner = stack.runner
        self.context_length = stack.context_length
        self.max_total_tokens = stack.max_total_tokens
        self.limits = self.args.request_limits(
            stack.config.vocab_size, self.context_length, self.core.max_prompt_len
        )
        # The loop emits token ids on its thread; the processor makes text of them there,
        # overlapped with the next step's forward.
        self.processor = OutputProcessor(
            self.tokenizer,
            on_stop=lambda rid, matched: self._loop.finish(rid, matched),
            reasoning_end_ids=reasoning_end_ids(self.tokenizer, self.args.reasoning_parser),
        )
        self._loop = build_loop(stack, self.args, self.processor.process)
        freeze_startup_objects()

    def _start_replicas(self) -> None:
        """dp_size > 1: start the scheduler processes (every rank loads the model) and
        take the request limits from what they report."""
        from rsgl.server.threaded_frontend import ThreadedFrontend

        self._replicas = replicas = ThreadedFrontend(self.args)
        info = replicas.live.info
        self.tokenizer = replicas.tokenizer
        self.context_length = int(info["context_length"])
        self.max_total_tokens = int(info["max_total_tokens"])
        self.limits = self.args.request_limits(
            int(info["vocab_size"]), self.context_length, int(info["max_prompt_len"])
        )

    # ------------------------------------------------------------------ requests

    def _prompt_ids(self, prompt: Prompt | None, messages: Messages | None) -> list[int]:
        if messages is not None:
            return tokenize_prompt(self.tokenizer, self.limits, messages=messages)
        if isinstance(prompt, str):
            return tokenize_prompt(self.tokenizer, self.limits, text=prompt, param="prompt")
        return tokenize_prompt(self.tokenizer, self.limits, input_ids=prompt, param="input_ids")

    def _start_requests(
        self,
        prompts: list[list[int]],
        params: list[tuple[SamplingParams, int]],
        rid: str | Sequence[str] | None,
        aio_loop: asyncio.AbstractEventLoop | None,
        stream: bool,
    ) -> list[OutputQueue]:
        """Queues validated requests in one loop command, so they are prefilled together.
        Without `stream`, each queue yields one merged output."""
        jobs = expand_requests(prompts, params, rid)
        if self._replicas is not None:
            queues = [
                OutputQueue(aio_loop, stream=stream, interval=self.args.stream_interval)
                for _ in jobs
            ]
            self._replicas.submit(jobs, queues, stream)
            return queues
        records = [
            RequestRecord(
                j.rid,
                j.prompt_ids,
                j.params,
                OutputQueue(aio_loop, stream=stream, interval=self.args.stream_interval),
                j.group,
            )
            for j in jobs
        ]

        def start() -> None:
            added = []
            try:
                for record in records:
                    self.processor.add(record)
                    added.append(record.rid)
                self._loop.add_many([(j.rid, j.prompt_ids, j.params) for j in jobs])
            except BaseException:
                for name in added:
                    self.processor.records.pop(name, None)
                raise

        self._loop.start()
        self._loop.call(start)
        return [r.queue for r in records]

    def _normalize(
        self,
        prompt: Prompt | list[Prompt] | None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        input_ids: list[int] | list[list[int]] | None,
        messages: Messages | list[Messages] | None,
    ) -> tuple[list[list[int]], list[tuple[SamplingParams, int]], bool]:
        """Validates a call's prompts and sampling parameters (all of them before anything
        is queued; InvalidRequest names the first bad one)."""
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of prompt, input_ids or messages", "prompt")
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
                raise InvalidRequest(
                    f"{len(sampling_params)} sampling_params for {len(ids)} prompts",
                    "sampling_params",
                )
            raws = sampling_params
        else:
            raws = [sampling_params or {}] * len(ids)
        params = [
            make_sampling_params(r, self.limits, len(p)) for r, p in zip(raws, ids, strict=True)
        ]
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
        queues = self._start_requests(ids, params, rid, None, stream)
        if stream:
            if len(queues) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return (o.to_dict() for o in queues[0])
        if not batch:
            return merge(queues[0]).to_dict()
        from tqdm import tqdm

        show = use_tqdm and len(queues) > 1 and sys.stderr.isatty()
        return [merge(q).to_dict() for q in tqdm(queues, disable=not show, desc="generate")]

    async def async_generate(
        self,
        prompt: Prompt | list[Prompt] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        messages: Messages | list[Messages] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
    ) -> Any:
        """Async `generate`: awaits the result, or (stream=True) returns an async iterator."""
        ids, params, batch = self._normalize(prompt, sampling_params, input_ids, messages)
        loop = asyncio.get_running_loop()
        queues = await loop.run_in_executor(
            None, self._start_requests, ids, params, rid, loop, stream
        )
        if stream:
            if len(queues) != 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return _achunks(queues[0])

        async def merged(q: OutputQueue) -> dict[str, Any]:
            return merge([o async for o in q]).to_dict()

        results = await asyncio.gather(*(merged(q) for q in queues))
        return list(results) if batch else results[0]

    def chat(
        self, messages: Messages | list[Messages], sampling_params: dict[str, Any] | None = None
    ) -> Any:
        """`generate` on chat messages, formatted with the model's chat template."""
        return self.generate(messages=messages, sampling_params=sampling_params)

    # ------------------------------------------------------------------ control

    def abort(self, rid: str) -> bool:
        """Aborts a queued or running request; False if it is unknown or finished."""
        if self._replicas is not None:
            return self._replicas.abort(rid)
        return self._loop.abort(rid) if self._loop_running else False

    @property
    def _loop_running(self) -> bool:
        return self._loop._thread is not None

    def flush_cache(self) -> bool:
        """Empties the prefix cache (every rank's); only possible when no request is in
        the engine."""
        if self._replicas is not None:
            return self._replicas.flush_cache()
        if not self._loop_running:
            return self.core.flush_cache()
        return bool(self._loop.call(self.core.flush_cache))

    def check_integrity(self) -> None:
        """Runs the core's integrity check, every rank's (raises RuntimeError naming what
        is broken, and where)."""
        if self._replicas is not None:
            self._replicas.check_integrity()
        elif not self._loop_running:
            self.core.check()
        else:
            self._loop.call(self.core.check)

    def get_server_info(self) -> dict[str, Any]:
        """Options, derived sizes and the core's live statistics (with dp_size > 1: the
        ranks' summed, and each rank's in `internal_states`)."""
        info = dataclasses.asdict(self.args)
        if self._replicas is not None:
            info.update(self._replicas.server_info())
            return info
        info.update(
            self.stack.info(),
            context_length=self.context_length,
            max_total_tokens=self.max_total_tokens,
            kv_buffer_size=self.core.kv_buffer_size,
            kv_cache_storage_dtype=self.stack.kv_cache_dtype,
            model_dir=str(self.stack.model_dir),
            attention_backend=getattr(self.runner, "attention_backend", None),
            cuda_graphs=getattr(self.runner, "graphs", None) is not None,
            stats=self.core.stats(),
            steps=self._loop.steps,
            overlapped_steps=self._loop.overlapped_steps,
            speculative=self._loop.spec_stats(),
        )
        return info

    def shutdown(self) -> None:
        """Stops the loop (aborting what is left) and its stream, and frees the model's
        device memory; with dp_size > 1, stops the scheduler processes."""
        if self._replicas is not None:
            self._replicas.shutdown()
            return
        try:
            self._loop.shutdown()
        finally:
            if isinstance(self.runner, ModelRunner):
                self.runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


async def _achunks(q: OutputQueue) -> AsyncIterator[dict[str, Any]]:
    async for output in q:
        yield output.to_dict()
