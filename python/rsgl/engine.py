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
import os
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from rsgl._core import Scheduler
from rsgl.args import EngineArgs
from rsgl.cpu_features import default_cpu_threads
from rsgl.errors import InvalidRequest
from rsgl.gc_tuning import freeze_startup_objects
from rsgl.model_executor.executor import on_compute_thread, run_on_compute_thread
from rsgl.model_executor.kv_cache import KVCache, resolve_kv_cache_dtype
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.model_executor.null_runner import NullRunner
from rsgl.models.config import ModelConfig
from rsgl.models.dtype_choice import DtypeChoice, choose_dtype
from rsgl.outputs import merge
from rsgl.sampling_params import SamplingParams
from rsgl.scheduler.loop import SchedulerLoop
from rsgl.tokenizer.loader import load_tokenizer
from rsgl.tokenizer.output_processor import OutputProcessor, OutputQueue, RequestRecord
from rsgl.validation import expand_requests, make_sampling_params, tokenize_prompt

if TYPE_CHECKING:
    from rsgl.distributed.sharding import TPShard
    from rsgl.server.threaded_frontend import ThreadedFrontend

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Messages = list[dict[str, Any]]

# Share of physical memory the KV pool may take when neither max_total_tokens nor
# mem_fraction is given (CPU: the "device" memory is the machine's).
DEFAULT_MEM_FRACTION = 0.15
# Default pool cap, so a big machine does not pin tens of GB for a 135M model.
DEFAULT_MAX_TOTAL_TOKENS = 1 << 18
# On CUDA: the share of GPU memory for weights + KV pool (SGLang's mem_fraction_static).
DEFAULT_CUDA_MEM_FRACTION = 0.85


@dataclass(slots=True)
class ModelStack:
    """Everything a scheduling loop needs: tokenizer, core and runner, sized from the args."""

    tokenizer: Any
    core: Scheduler
    runner: ModelRunner | NullRunner
    config: ModelConfig
    model_dir: Path
    context_length: int
    max_total_tokens: int
    kv_cache_dtype: str
    dtype_choice: DtypeChoice
    cpu_threads: int
    # Every tensor-parallel rank's slice of the model; empty with tp_size 1.
    tp_shards: tuple[TPShard, ...] = ()

    def info(self) -> dict[str, Any]:
        """How the model runs, for get_server_info: its dtype and why, the threads, and the
        tensor-parallel ranks' slices (query / KV heads, intermediate units, vocabulary)."""
        return {
            "dtype": self.dtype_choice.chosen,
            "dtype_choice": self.dtype_choice.to_dict(),
            "cpu_threads": self.cpu_threads,
            "tp_size": max(1, len(self.tp_shards)),
            "tp_shards": [shard.to_dict() for shard in self.tp_shards],
        }


def build_stack(args: EngineArgs) -> ModelStack:
    """Loads the model and tokenizer and sizes the KV pool and the core from `args`.

    Sets torch's intra-op threads for this process first (`--cpu-threads`: the Engine's
    process, or the server's scheduler process), so the dtype calibration and the model
    run with the threads they will be served with. On CPU it all runs on the process's
    compute thread, where the steps will run (`run_on_compute_thread` says why). With
    tp_size > 1 this process becomes tensor-parallel rank 0 (`_tp_stack`); the ranks of a
    node share its cores, and each defaults to its share of them.
    """
    if torch.device(args.device).type == "cpu" and not on_compute_thread():
        return run_on_compute_thread(lambda: build_stack(args))
    from rsgl.models.loader import load_model

    torch.manual_seed(args.seed)
    cpu_threads = args.cpu_threads or default_cpu_threads()
    if args.tp_size > 1 and not args.cpu_threads:
        cpu_threads = max(1, cpu_threads // (args.tp_size // args.nnodes))
    torch.set_num_threads(cpu_threads)
    logger.info("torch intra-op threads: %d", cpu_threads)
    if args.load_format == "null":
        return _null_stack(args, cpu_threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {args.device!r} was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    choice = choose_dtype(args.dtype, device)
    if args.tp_size > 1:
        return _tp_stack(args, device, choice, cpu_threads)
    loaded = load_model(
        args.model_path,
        device=device,
        dtype=choice.torch_dtype,
        max_positions=args.context_length,
        load_format=args.load_format,
        seed=args.seed,
    )
    context_length = args.context_length or loaded.config.max_position_embeddings
    tokenizer = load_tokenizer(args.tokenizer_path or loaded.model_dir)
    max_total_tokens = args.max_total_tokens or _pool_tokens(args, loaded.config, loaded.dtype)
    core = _core(args, max_total_tokens, context_length, loaded.config)
    runner = ModelRunner(
        loaded,
        kv_buffer_size=core.kv_buffer_size,
        max_running_requests=args.max_running_requests,
        context_len=context_length,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_cuda_graph=args.disable_cuda_graph,
    )
    kv_name = str(runner.kv_cache.dtype).removeprefix("torch.")
    return ModelStack(
        tokenizer,
        core,
        runner,
        loaded.config,
        loaded.model_dir,
        context_length,
        max_total_tokens,
        kv_name,
        choice,
        cpu_threads,
    )


def _tp_stack(
    args: EngineArgs, device: torch.device, choice: DtypeChoice, cpu_threads: int
) -> ModelStack:
    """Rank 0 of a tensor-parallel group: starts the followers, loads rank 0's shard, sizes
    the core, and returns a stack whose runner sends every step to the followers
    (`TPRunner`, whose `close` stops them). See `rsgl.model_executor.tp_launch`."""
    from rsgl.distributed.group import TPRank
    from rsgl.model_executor.tp_launch import (
        LoadSpec,
        RunnerSpec,
        check_tensor_parallel,
        start_followers,
        start_runner,
    )
    from rsgl.models.loader import load_model, resolve_model_dir

    model_dir = resolve_model_dir(args.model_path)
    config = ModelConfig.from_model_dir(model_dir)
    shards = check_tensor_parallel(args, config)
    load = LoadSpec(
        args.model_path,
        choice.chosen,
        args.load_format,
        args.seed,
        args.context_length,
        cpu_threads,
    )
    followers = start_followers(args, device, load)
    try:
        loaded = load_model(
            args.model_path,
            device=device,
            dtype=choice.torch_dtype,
            max_positions=args.context_length,
            load_format=args.load_format,
            seed=args.seed,
            tp=TPRank(shards[0], followers.group),
        )
        context_length = args.context_length or config.max_position_embeddings
        tokenizer = load_tokenizer(args.tokenizer_path or model_dir)
        max_total_tokens = args.max_total_tokens or _pool_tokens(args, config, loaded.dtype, shards)
        core = _core(args, max_total_tokens, context_length, config)
        spec = RunnerSpec(
            kv_buffer_size=core.kv_buffer_size,
            max_running_requests=args.max_running_requests,
            context_len=context_length,
            attention_backend=args.attention_backend,
            kv_cache_dtype=args.kv_cache_dtype,
            endpoints={},
        )
        runner = start_runner(
            followers,
            loaded,
            spec,
            kv_buffer_size=spec.kv_buffer_size,
            max_running_requests=spec.max_running_requests,
            context_len=spec.context_len,
            attention_backend=spec.attention_backend,
            kv_cache_dtype=spec.kv_cache_dtype,
            seed=args.seed,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            disable_cuda_graph=args.disable_cuda_graph,
        )
    except BaseException:
        followers.close(kill=True)
        raise
    kv_name = str(runner.kv_cache.dtype).removeprefix("torch.")
    return ModelStack(
        tokenizer,
        core,
        runner,
        config,
        model_dir,
        context_length,
        max_total_tokens,
        kv_name,
        choice,
        cpu_threads,
        tuple(shards),
    )


def _null_stack(args: EngineArgs, cpu_threads: int) -> ModelStack:
    """The null executor over the model's config and tokenizer: no weights, no KV memory."""
    from rsgl.models.loader import resolve_model_dir

    # No forward runs, so there is nothing to calibrate: auto stays float32 (the pool is
    # sized, never allocated, in the dtype named here).
    if args.dtype == "auto":
        choice = DtypeChoice("float32", "load format null runs no model")
    else:
        choice = DtypeChoice(args.dtype, "forced by --dtype", args.dtype)
    model_dir = resolve_model_dir(args.model_path)
    config = ModelConfig.from_model_dir(model_dir)
    context_length = args.context_length or config.max_position_embeddings
    tokenizer = load_tokenizer(args.tokenizer_path or model_dir)
    max_total_tokens = args.max_total_tokens or _pool_tokens(args, config, choice.torch_dtype)
    core = _core(args, max_total_tokens, context_length, config)
    runner = NullRunner(
        config,
        max_running_requests=args.max_running_requests,
        step_ms=args.null_step_ms,
        seed=args.seed,
    )
    return ModelStack(
        tokenizer,
        core,
        runner,
        config,
        model_dir,
        context_length,
        max_total_tokens,
        "none",
        choice,
        cpu_threads,
    )


def _core(
    args: EngineArgs, max_total_tokens: int, context_length: int, config: ModelConfig
) -> Scheduler:
    return Scheduler(
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
        eos_token_ids=list(config.eos_token_ids),
        seed=args.seed,
    )


def _pool_tokens(
    args: EngineArgs,
    config: ModelConfig,
    model_dtype: torch.dtype,
    shards: Sequence[TPShard] = (),
) -> int:
    """KV pool size in tokens.

    CPU: `mem_fraction` of the machine's memory (a default share, capped). CUDA, as SGLang's
    `--mem-fraction-static`: weights and KV pool together take that share of the GPU, so
    the pool gets it minus what is in use once the weights are loaded; the rest is left to
    activations, the sampler and CUDA graphs.

    Tensor-parallel ranks hold every slot, each for its own KV heads: on CUDA a slot costs
    a device what the rank with the most heads stores; on CPU the node's ranks share one
    memory, so it costs their heads together (replicated heads count on every rank).
    """
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype)
    per_token = KVCache.bytes_per_slot(config, kv_dtype)
    device = torch.device(args.device)
    if shards:
        per_rank = [KVCache.bytes_per_slot(config, kv_dtype, s.num_kv_heads) for s in shards]
        on_node = per_rank[: args.tp_size // args.nnodes]
        per_token = max(per_rank) if device.type == "cuda" else sum(on_node)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * (args.mem_fraction or DEFAULT_CUDA_MEM_FRACTION) - (total - free)
        if budget < 4 * args.page_size * per_token:
            raise RuntimeError(
                f"no GPU memory left for the KV pool: {(total - free) / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB are in use after loading the weights; raise "
                "--mem-fraction-static or use a smaller model"
            )
        return int(budget // per_token)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokens = int(total * (args.mem_fraction or DEFAULT_MEM_FRACTION) / per_token)
    cap = DEFAULT_MAX_TOTAL_TOKENS if args.mem_fraction is None else tokens
    return max(4 * args.page_size, min(tokens, cap))


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
            self.tokenizer, on_stop=lambda rid, matched: self._loop.finish(rid, matched)
        )
        self._loop = SchedulerLoop(
            self.core,
            self.runner,
            self.processor.process,
            overlap=not self.args.disable_overlap_schedule,
        )
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
