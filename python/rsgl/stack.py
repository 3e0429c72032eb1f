"""A model stack: tokenizer, scheduling core and model runner, loaded and sized from the
engine arguments (`build_stack`), and the scheduling loop over it (`build_loop`).

Both callers of a scheduling loop assemble their stack here: `rsgl.Engine` in-process and the
server's scheduler process (`rsgl.server.scheduler_process`). It sits below both, so imports
only run downward (`tests/test_layering.py`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rsgl._core import Scheduler
from rsgl.args import EngineArgs
from rsgl.cpu_features import before_pinning, default_cpu_threads, omp_bind_cpus
from rsgl.grammar.backend import GrammarBackend, GrammarOptions
from rsgl.grammar.compiler import GrammarCompiler
from rsgl.grammar.registry import make_backend
from rsgl.layers.cpu_kernels import load_cpu_kernels
from rsgl.layers.quant_linear import low_bit_rows_of
from rsgl.model_executor.executor import StepExecutor, on_compute_thread, run_on_compute_thread
from rsgl.model_executor.kv_cache import KVCache, resolve_kv_cache_dtype
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.model_executor.null_runner import NullRunner
from rsgl.models.config import ModelConfig
from rsgl.models.dtype_choice import DtypeChoice, choose_dtype
from rsgl.reasoning import reasoning_end_ids
from rsgl.scheduler.loop import Emit, SchedulerLoop
from rsgl.speculative.choice import SpeculationChoice, choose_speculation, resolved
from rsgl.tokenizer.loader import load_tokenizer

if TYPE_CHECKING:
    from rsgl.distributed.sharding import TPShard
    from rsgl.models.loader import LoadedModel

logger = logging.getLogger(__name__)


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
    # The speculative algorithm the core runs (`--speculative-algorithm` resolved) and why.
    speculation: SpeculationChoice
    # Every tensor-parallel rank's slice of the model; empty with tp_size 1.
    tp_shards: tuple[TPShard, ...] = ()
    # The CPUs the compute threads are pinned to, one each (`--cpu-omp-threads-bind`);
    # empty where the OS places them.
    compute_cpus: tuple[int, ...] = ()

    def info(self) -> dict[str, Any]:
        """How the model runs, for get_server_info: its dtype and why, the threads, and the
        tensor-parallel ranks' slices (query / KV heads, intermediate units, vocabulary)."""
        return {
            "dtype": self.dtype_choice.chosen,
            "dtype_choice": self.dtype_choice.to_dict(),
            # SGLang's key, with auto resolved (None: off), and why.
            "speculative_algorithm": self.speculation.chosen,
            "speculation_choice": self.speculation.to_dict(),
            "cpu_threads": self.cpu_threads,
            "compute_cpus": list(self.compute_cpus),
            # How the weights are held (`--quantization` resolved: gguf or none).
            "quantization": getattr(getattr(self.runner, "loaded", None), "quantization", "none"),
            # Steps of up to this many rows read the low-bit weights
            # (`rsgl.layers.quant_linear.low_bit_max_rows`; None: no low-bit weights), larger
            # ones the dense copy.
            "low_bit_max_rows": self.low_bit_max_rows(),
            "tp_size": max(1, len(self.tp_shards)),
            "tp_shards": [shard.to_dict() for shard in self.tp_shards],
        }

    def low_bit_max_rows(self) -> int | None:
        """The most rows a step may have and still read the low-bit weights (None: no
        low-bit weights)."""
        model = getattr(getattr(self.runner, "loaded", None), "model", None)
        return None if model is None else low_bit_rows_of(model)


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
    torch.manual_seed(args.seed)
    cpu_threads = args.cpu_threads or default_cpu_threads()
    if args.tp_size > 1 and not args.cpu_threads:
        cpu_threads = max(1, cpu_threads // (args.tp_size // args.nnodes))
    torch.set_num_threads(cpu_threads)
    cpus = _bind_compute_threads(args, cpu_threads)
    cpu_threads = len(cpus) or cpu_threads
    logger.info("torch intra-op threads: %d", cpu_threads)
    stack = _load_stack(args, cpu_threads)
    stack.compute_cpus = cpus
    return stack


def _load_stack(args: EngineArgs, cpu_threads: int) -> ModelStack:
    """build_stack's model, tokenizer and core, once the threads are set."""
    from rsgl.models.loader import load_model

    if args.load_format == "null":
        return _null_stack(args, cpu_threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {args.device!r} was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    choice = choose_dtype(args.dtype, device)
    speculation = choose_speculation(args, device.type, choice)
    args = resolved(args, speculation)
    if args.tp_size > 1:
        return _tp_stack(args, device, choice, speculation, cpu_threads)
    loaded = load_model(
        args.model_path,
        device=device,
        dtype=choice.torch_dtype,
        max_positions=args.context_length,
        load_format=args.load_format,
        seed=args.seed,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
    )
    context_length = args.context_length or loaded.config.max_position_embeddings
    draft = _load_draft(args, device, choice, context_length)
    tokenizer = load_tokenizer(args.tokenizer_path or loaded.model_dir)
    max_total_tokens = args.max_total_tokens or _pool_tokens(
        args, loaded.config, loaded.dtype, draft_config=None if draft is None else draft.config
    )
    core = build_core(args, max_total_tokens, context_length, loaded.config)
    runner = ModelRunner(
        loaded,
        kv_buffer_size=core.kv_buffer_size,
        max_running_requests=args.max_running_requests,
        context_len=context_length,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        # A draft model follows every step eagerly: no decode graphs to capture.
        disable_cuda_graph=args.disable_cuda_graph or draft is not None,
    )
    if draft is not None:
        runner.attach_draft(draft)
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
        speculation,
    )


def _load_draft(
    args: EngineArgs, device: torch.device, choice: DtypeChoice, context_length: int
) -> LoadedModel | None:
    """STANDALONE speculation's draft model, whole (on rank 0 under tensor parallelism), or
    None without one."""
    from rsgl.models.loader import load_model

    if not (args.speculates and args.speculative_algorithm == "STANDALONE"):
        return None
    return load_model(
        args.speculative_draft_model_path or args.model_path,
        device=device,
        dtype=choice.torch_dtype,
        max_positions=context_length,  # the target's positions, whatever the draft's
        load_format=args.speculative_draft_load_format or args.load_format,
        seed=args.seed + 1,  # dummy weights unlike the target's
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
    )


def _tp_stack(
    args: EngineArgs,
    device: torch.device,
    choice: DtypeChoice,
    speculation: SpeculationChoice,
    cpu_threads: int,
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
        args.quantization,
        args.quantization_group_size,
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
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
        )
        context_length = args.context_length or config.max_position_embeddings
        draft = _load_draft(args, device, choice, context_length)
        tokenizer = load_tokenizer(args.tokenizer_path or model_dir)
        draft_config = None if draft is None else draft.config
        max_total_tokens = args.max_total_tokens or _pool_tokens(
            args, config, loaded.dtype, shards, draft_config
        )
        core = build_core(args, max_total_tokens, context_length, config)
        spec = RunnerSpec(
            kv_buffer_size=core.kv_buffer_size,
            max_running_requests=args.max_running_requests,
            context_len=context_length,
            attention_backend=args.attention_backend,
            kv_cache_dtype=args.kv_cache_dtype,
            endpoints={},
            drafts_from_rank0=draft is not None,
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
            disable_cuda_graph=args.disable_cuda_graph or draft is not None,
        )
        if draft is not None:
            runner.attach_draft(draft)
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
        speculation,
        tuple(shards),
    )


def _bind_compute_threads(args: EngineArgs, threads: int) -> tuple[int, ...]:
    """Pins this (compute) thread's OpenMP team on CPU as `--cpu-omp-threads-bind` says
    (`omp_bind_cpus`; an explicit CPU list also sets the team's size); returns the CPUs,
    or () where nothing was pinned."""
    if torch.device(args.device).type != "cpu":
        return ()
    ranks = args.dp_size * args.tp_size // args.nnodes
    cpus = omp_bind_cpus(args.cpu_omp_threads_bind, threads, ranks)
    if not cpus:
        return ()
    kernels = load_cpu_kernels()
    if kernels is None:
        logger.warning("compute threads not pinned: the CPU kernels are not available")
        return ()
    before_pinning()
    if not kernels.bind_omp_threads(cpus):
        logger.warning("could not pin the compute threads to CPUs %s", cpus)
        torch.set_num_threads(threads)
        return ()
    logger.info("compute threads pinned to CPUs %s", ",".join(map(str, cpus)))
    return tuple(cpus)


def _null_stack(args: EngineArgs, cpu_threads: int) -> ModelStack:
    """The null executor over the model's config and tokenizer: no weights, no KV memory."""
    from rsgl.models.loader import resolve_model_dir

    # No forward runs, so there is nothing to calibrate: auto stays float32 (the pool is
    # sized, never allocated, in the dtype named here).
    if args.dtype == "auto":
        choice = DtypeChoice("float32", "load format null runs no model")
    else:
        choice = DtypeChoice(args.dtype, "forced by --dtype", args.dtype)
    speculation = choose_speculation(args, "cpu", choice)
    args = resolved(args, speculation)
    model_dir = resolve_model_dir(args.model_path)
    config = ModelConfig.from_model_dir(model_dir)
    context_length = args.context_length or config.max_position_embeddings
    tokenizer = load_tokenizer(args.tokenizer_path or model_dir)
    max_total_tokens = args.max_total_tokens or _pool_tokens(args, config, choice.torch_dtype)
    core = build_core(args, max_total_tokens, context_length, config)
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
        speculation,
    )


def build_core(
    args: EngineArgs, max_total_tokens: int, context_length: int, config: ModelConfig
) -> Scheduler:
    """The scheduling core of one replica, configured from `args` (the simulator of
    `rsgl bench simulate` builds its replicas' cores here too)."""
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
        # A mixed step's prefill rows are no verify rows: speculation decodes in decode
        # steps only (SGLang forces mixed chunks off with speculation too).
        enable_mixed_chunk=args.enable_mixed_chunk and not args.speculates,
        eos_token_ids=list(config.eos_token_ids),
        seed=args.seed,
        spec_num_draft_tokens=args.verified_tokens if args.speculates else 0,
        spec_ngram_min_window=args.speculative_ngram_min_match_window_size,
        spec_ngram_max_window=args.speculative_ngram_max_match_window_size,
        spec_draft_model=args.speculative_algorithm == "STANDALONE",
    )


def _pool_tokens(
    args: EngineArgs,
    config: ModelConfig,
    model_dtype: torch.dtype,
    shards: Sequence[TPShard] = (),
    draft_config: ModelConfig | None = None,
) -> int:
    """KV pool size in tokens (a STANDALONE draft's cache, `draft_config`'s, holds every
    slot too).

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
    if draft_config is not None:
        per_token += KVCache.bytes_per_slot(draft_config, kv_dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return device_pool_tokens(total, total - free, args.mem_fraction, per_token, args.page_size)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return cpu_pool_tokens(total, args.mem_fraction, per_token, args.page_size)


def cpu_pool_tokens(total: int, mem_fraction: float | None, per_token: int, page_size: int) -> int:
    """KV pool tokens of a CPU with `total` bytes of memory: `mem_fraction` of it, or by
    default a share capped at DEFAULT_MAX_TOTAL_TOKENS."""
    tokens = int(total * (mem_fraction or DEFAULT_MEM_FRACTION) / per_token)
    cap = DEFAULT_MAX_TOTAL_TOKENS if mem_fraction is None else tokens
    return max(4 * page_size, min(tokens, cap))


def device_pool_tokens(
    total: int, in_use: int, mem_fraction: float | None, per_token: int, page_size: int
) -> int:
    """KV pool tokens of an accelerator with `total` bytes of which `in_use` are taken once
    the weights are loaded (SGLang's `--mem-fraction-static` rule, see `_pool_tokens`);
    `rsgl bench simulate` sizes the pools of devices it does not have with it."""
    budget = total * (mem_fraction or DEFAULT_CUDA_MEM_FRACTION) - in_use
    if budget < 4 * page_size * per_token:
        raise RuntimeError(
            f"no GPU memory left for the KV pool: {in_use / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB are in use after loading the weights; raise "
            "--mem-fraction-static or use a smaller model"
        )
    return int(budget // per_token)


def build_loop(
    stack: ModelStack,
    args: EngineArgs,
    emit: Emit,
    executor: StepExecutor | None = None,
    dp_rank: int = 0,
) -> SchedulerLoop:
    """The scheduling loop over `stack` (data-parallel rank `dp_rank`), with its grammar
    compiler (`--grammar-backend`)."""
    grammar, refusal = _grammar_compiler(stack, args)
    return SchedulerLoop(
        stack.core,
        stack.runner,
        emit,
        overlap=not args.disable_overlap_schedule,
        executor=executor,
        grammar=grammar,
        grammar_refusal=refusal,
        grammar_compile_timeout=args.grammar_compile_timeout,
        reasoning_end_ids=reasoning_end_ids(stack.tokenizer, args.reasoning_parser),
        adaptive_drafts=not args.disable_speculative_adaptive,
        low_bit_rows=stack.low_bit_max_rows(),
        step_log=args.step_log,
        dp_rank=dp_rank,
    )


def _grammar_compiler(stack: ModelStack, args: EngineArgs) -> tuple[GrammarCompiler | None, str]:
    """The compiler of constraints, or None and why requests with one are refused."""
    if args.grammar_backend == "none":
        return None, "constrained decoding is off (--grammar-backend none)"
    options = GrammarOptions(
        disable_any_whitespace=args.constrained_json_disable_any_whitespace,
        max_whitespace=args.constrained_json_max_whitespace or None,
    )
    config, tokenizer = stack.config, stack.tokenizer

    def backend() -> GrammarBackend:
        made = make_backend(
            args.grammar_backend, tokenizer, config.vocab_size, config.eos_token_ids, options
        )
        assert made is not None
        return made

    compiler = GrammarCompiler(backend, cache_bytes=args.grammar_cache_mb << 20)
    compiler.prewarm()  # while the server starts; a failure is reported by the first compile
    return compiler, ""
