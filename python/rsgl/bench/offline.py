"""Offline throughput: rsgl.Engine against HF transformers' `generate` on the same prompts.

    rsgl bench offline --num-prompts 64 --input-len 100 --output-len 128 --compare-hf
    rsgl bench offline --dataset gsp --compare-radix
    rsgl bench offline --tp-size 2 --profile-collectives
    rsgl bench offline --skip-no-overlap --compare-quantization none --compare-dtype float32

Prompts are seeded random token ids (`random`), or 16 groups x 16 prompts sharing a
1024-token system prompt (`gsp`). Every request is greedy with ignore_eos, so both systems
produce exactly `output_len` tokens per prompt. HF runs static batches of 32 and 64 (its
best is reported). With `--profile-collectives` (tp_size > 1) rank 0 counts and times its
collectives during the main run (their share of it includes waiting for the slower rank),
and `rsgl.bench.collectives` times them alone at batch 1, 16 and 64. Each comparison of two
rsgl engines (overlap off, `--compare-quantization`, `--compare-radix`) runs under both
orders of building them (`both_orders`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rsgl.args import KV_CACHE_DTYPES, QUANTIZATIONS
from rsgl.model_executor.executor import run_on_compute_thread


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    low, high = 100, vocab_size - 100  # stay clear of special tokens at either end

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(low, high, size=n)]

    if args.dataset == "random":
        return [tokens(args.input_len) for _ in range(args.num_prompts)]
    systems = [tokens(args.gsp_system_len) for _ in range(args.gsp_groups)]
    prompts = [
        systems[g] + tokens(args.input_len)
        for g in range(args.gsp_groups)
        for _ in range(args.gsp_prompts_per_group)
    ]
    order = rng.permutation(len(prompts))  # groups arrive interleaved
    return [prompts[i] for i in order]


def run_rsgl(
    prompts: list[list[int]], output_len: int, profile: bool = False, **options: Any
) -> dict[str, Any]:
    from rsgl.distributed.group import CollectiveProfile
    from rsgl.engine import Engine
    from rsgl.model_executor.model_runner import ModelRunner

    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    collectives = CollectiveProfile()
    with Engine(**options) as llm:
        llm.generate(input_ids=prompts[0][:16], sampling_params=dict(params, max_new_tokens=4))
        llm.flush_cache()
        tp = llm.runner.loaded.tp if isinstance(llm.runner, ModelRunner) else None
        if profile and tp is not None:
            tp.group.profile = collectives
        steps_before = llm.get_server_info()["steps"]
        start = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        info = llm.get_server_info()
        stats = info["stats"]
    produced = sum(len(o["output_ids"]) for o in outs)
    assert produced == output_len * len(prompts), "ignore_eos: every prompt runs to the end"
    result = {
        "output_tok_s": round(produced / elapsed, 2),
        "seconds": round(elapsed, 3),
        "cached_tokens": int(stats["cached_tokens"]),
        "retractions": int(stats["retractions"]),
        "dtype": info["dtype"],
        "tp_size": info.get("tp_size", 1),
    }
    if collectives.calls:
        steps = info["steps"] - steps_before
        result["steps"] = steps
        result["collectives_per_step"] = round(collectives.calls / steps, 1)
        result["us_per_collective"] = round(collectives.seconds / collectives.calls * 1e6, 1)
        result["ms_per_step"] = round(elapsed / steps * 1e3, 2)
        result["collective_share_of_run"] = round(collectives.seconds / elapsed, 3)
    return result


def both_orders(
    first: float, rsgl: Callable[..., float], **options: Any
) -> tuple[float, tuple[float, list[float]]]:
    """The engine with `options` against the bench's own (whose output tok/s, `first`, came
    from the first engine the process built), under both orders: it is built next, then
    again, then the bench's own engine again (a 2-core VM serves slower with the first
    engine a process builds, and an engine's first seconds are slower, whatever it is).
    Returns its first run's tok/s, and the bench's engine over it: the geometric mean of
    the two orders' ratios, and each."""
    other = rsgl(**options)
    other_again = rsgl(**options)
    again = rsgl()
    by_order = [first / other, again / other_again]
    mean = math.sqrt(by_order[0] * by_order[1])
    return other, (round(mean, 3), [round(r, 3) for r in by_order])


def run_hf(
    prompts: list[list[int]],
    output_len: int,
    model_dir: str,
    batch_sizes: list[int],
    dtype: torch.dtype = torch.float32,
) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.train(False)
    results = {}
    for bs in batch_sizes:
        produced, elapsed = 0, 0.0
        for i in range(0, len(prompts), bs):
            batch = torch.tensor(prompts[i : i + bs])  # equal lengths: no padding needed
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    batch,
                    attention_mask=torch.ones_like(batch),
                    max_new_tokens=output_len,
                    min_new_tokens=output_len,
                    do_sample=False,
                    pad_token_id=0,
                )
            elapsed += time.perf_counter() - start
            produced += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        results[bs] = round(produced / elapsed, 2)
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rsgl bench offline", description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dataset", choices=["random", "gsp"], default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--gsp-groups", type=int, default=16)
    parser.add_argument("--gsp-prompts-per-group", type=int, default=16)
    parser.add_argument("--gsp-system-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-hf", action="store_true")
    parser.add_argument("--compare-radix", action="store_true", help="also run without the cache")
    parser.add_argument("--skip-no-overlap", action="store_true")
    parser.add_argument("--hf-batch-sizes", default="32,64")
    parser.add_argument(
        "--hf-dtypes", default="float32", help="comma-separated: HF runs each, its best counts"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="weights (default: the engine's: gguf for GGUF files on CPU)",
    )
    parser.add_argument(
        "--compare-quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="also run with these weights (e.g. none: the dequantized float32 model)",
    )
    parser.add_argument(
        "--compare-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the model dtype of the --compare-quantization run (default: --dtype)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=160)
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="per rank (default: the engine's)"
    )
    parser.add_argument(
        "--profile-collectives",
        action="store_true",
        help="with --tp-size > 1: time rank 0's collectives, and time them alone",
    )
    args = parser.parse_args(argv)

    from rsgl.models.config import ModelConfig
    from rsgl.models.loader import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model_path))
    prompts = make_prompts(args, ModelConfig.from_model_dir(model_dir).vocab_size)
    engine = {
        "model_path": args.model_path,
        "max_running_requests": args.max_running_requests,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "dtype": args.dtype,
        "device": args.device,
        "load_format": args.load_format,
        "attention_backend": args.attention_backend,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "tp_size": args.tp_size,
        "cpu_threads": args.cpu_threads,
    }
    result: dict[str, Any] = {
        "dataset": args.dataset,
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "kv_cache_dtype": args.kv_cache_dtype,
        "device": args.device,
        "tp_size": args.tp_size,
    }
    rsgl_run = run_rsgl(prompts, args.output_len, args.profile_collectives, **engine)
    result["torch_threads"] = run_on_compute_thread(torch.get_num_threads)
    result["rsgl_output_tok_s"] = rsgl_run["output_tok_s"]
    result["rsgl"] = rsgl_run

    def rsgl(**options: Any) -> float:
        tok_s: float = run_rsgl(prompts, args.output_len, **(engine | options))["output_tok_s"]
        return tok_s

    if not args.skip_no_overlap:
        off, ratios = both_orders(rsgl_run["output_tok_s"], rsgl, disable_overlap_schedule=True)
        result["rsgl_no_overlap_output_tok_s"] = off
        result["overlap_speedup"], result["overlap_speedup_by_order"] = ratios
    if args.compare_quantization:
        options = {"quantization": args.compare_quantization}
        options["dtype"] = args.compare_dtype or args.dtype
        compared, ratios = both_orders(rsgl_run["output_tok_s"], rsgl, **options)
        result["compared"] = options
        result["compared_output_tok_s"] = compared
        result["quantization_speedup"], result["quantization_speedup_by_order"] = ratios
    if args.compare_radix:
        no_cache, ratios = both_orders(rsgl_run["output_tok_s"], rsgl, disable_radix_cache=True)
        result["rsgl_no_radix_output_tok_s"] = no_cache
        result["radix_speedup"], result["radix_speedup_by_order"] = ratios
    if args.profile_collectives and args.tp_size > 1:
        from rsgl.bench.collectives import measure

        config = ModelConfig.from_model_dir(model_dir)
        result["collectives_alone"] = measure(
            tp_size=args.tp_size,
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            device=args.device,
        )
    if args.compare_hf:
        sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
        by_dtype = {
            # On the compute thread, as rsgl's forward: one OpenMP team in the process (see
            # run_on_compute_thread), so neither run pays for the other's idle threads.
            name: run_on_compute_thread(
                lambda name=name: run_hf(  # type: ignore[misc]
                    prompts, args.output_len, model_dir, sizes, getattr(torch, name)
                )
            )
            for name in args.hf_dtypes.split(",")
        }
        result["hf_output_tok_s_by_dtype_and_batch"] = by_dtype
        result["hf_output_tok_s"] = max(v for runs in by_dtype.values() for v in runs.values())
        result["ratio"] = round(result["rsgl_output_tok_s"] / result["hf_output_tok_s"], 3)
    print(json.dumps(result))
    return 0
