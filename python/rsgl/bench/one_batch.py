"""`rsgl bench one-batch`: a static batch through the model runner, against the matmul limit.

Prefill all prompts in one extend step, then decode `output_len - 1` steps whose input
tokens are FutureMap placeholders (as in overlap mode); no scheduler is involved. In the same
process it times the model's matmuls alone (every layer's projections and the LM head at the
decode batch size, no attention, norms or sampling): the practical decode roofline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from rsgl._core import Plan
from rsgl.args import KV_CACHE_DTYPES
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.models.llama import LlamaForCausalLM
from rsgl.sampling_params import SamplingParams

ROOFLINE_EVERY = 4


def _prefill_plan(prompts: np.ndarray, capacity: int) -> Plan:
    batch, input_len = prompts.shape
    slots = np.arange(batch, dtype=np.int64)
    # Request r owns KV slots 1 + r * capacity ... (slot 0 is the reserved padding slot).
    kv = 1 + slots[:, None] * capacity + np.arange(input_len)[None, :]
    return Plan(
        forward_mode="extend",
        rids=slots,
        req_slots=slots,
        prefix_lens=np.zeros(batch, dtype=np.int64),
        extend_lens=np.full(batch, input_len, dtype=np.int64),
        seq_lens=np.full(batch, input_len, dtype=np.int64),
        input_ids=prompts.reshape(-1).astype(np.int64),
        positions=np.tile(np.arange(input_len, dtype=np.int64), batch),
        out_cache_loc=kv.reshape(-1),
        write_rows=np.repeat(slots, input_len),
        write_cols=np.tile(np.arange(input_len, dtype=np.int64), batch),
        write_slots=kv.reshape(-1),
    )


def _decode_plan(batch: int, position: int, capacity: int) -> Plan:
    slots = np.arange(batch, dtype=np.int64)
    kv = 1 + slots * capacity + position
    pos = np.full(batch, position, dtype=np.int64)
    return Plan(
        forward_mode="decode",
        rids=slots,
        req_slots=slots,
        prefix_lens=pos,
        extend_lens=np.ones(batch, dtype=np.int64),
        seq_lens=pos + 1,
        input_ids=np.full(batch, -1, dtype=np.int64),  # resolved from the FutureMap
        positions=pos,
        out_cache_loc=kv,
        write_rows=slots,
        write_cols=pos,
        write_slots=kv,
    )


@torch.inference_mode()
def matmul_roofline_step_s(
    model: LlamaForCausalLM, batch: int, repeats: int = 5, warm_up: bool = True
) -> float:
    """Seconds for one decode step's matmuls alone (median of `repeats`)."""
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    device = model.model.embed_tokens.weight.device
    x = torch.randn(batch, cfg.hidden_size, dtype=dtype, device=device)
    attn_out = torch.randn(batch, cfg.q_size, dtype=dtype, device=device)
    act = torch.randn(batch, cfg.intermediate_size, dtype=dtype, device=device)

    def step() -> None:
        # The model's own projection modules, so the limit uses the same matmul kernels.
        for layer in model.layers:
            layer.self_attn.qkv_proj(x)
            layer.self_attn.o_proj(attn_out)
            layer.mlp.gate_up_proj(x)
            layer.mlp.down_proj(act)
        model.compute_logits(x)

    if warm_up:
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, object]:
    """Run the benchmark and return its figures."""
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, input_len, output_len = args.batch, args.input_len, args.output_len
    capacity = input_len + output_len
    runner = ModelRunner.from_pretrained(
        args.model,
        kv_buffer_size=1 + batch * capacity,
        max_running_requests=batch,
        context_len=capacity + 1,
        device=args.device,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    rng = np.random.default_rng(args.seed)
    vocab = runner.config.vocab_size
    prompts = rng.integers(100, vocab - 100, size=(batch, input_len))
    for slot in range(batch):
        runner.admit(slot, greedy, prompts[slot].tolist())

    # Warm up allocators, the decode kernel and oneDNN on a throwaway request.
    runner.step(_prefill_plan(prompts[:1, :8], capacity))
    runner.step(_decode_plan(1, 8, capacity))

    t0 = time.perf_counter()
    runner.step(_prefill_plan(prompts, capacity))
    prefill_s = time.perf_counter() - t0

    # On a shared machine a neighbour's burst can slow any stretch of the run, so the matmul
    # limit is sampled between decode steps (every ROOFLINE_EVERY-th, outside the timed
    # steps). `decode_vs_roofline` sets the decode throughput against the fastest sample (the
    # limit); `decode_vs_roofline_median` sets the median step against the median sample.
    roofline_times = [matmul_roofline_step_s(runner.model, batch, repeats=3)]
    step_times: list[float] = []
    decode_steps = output_len - 1
    for i in range(decode_steps):
        t0 = time.perf_counter()
        out = runner.step(_decode_plan(batch, input_len + i, capacity))
        step_times.append(time.perf_counter() - t0)
        if (i + 1) % ROOFLINE_EVERY == 0:
            roofline_times.append(
                matmul_roofline_step_s(runner.model, batch, repeats=1, warm_up=False)
            )
    decode_s = sum(step_times)
    assert decode_steps == 0 or out.next_token_ids.shape[0] == batch

    roofline_s = min(roofline_times)
    decode_tok_s = batch * decode_steps / decode_s if decode_steps else 0.0
    roofline_tok_s = batch / roofline_s
    median_ratio = (
        statistics.median(roofline_times) / statistics.median(step_times) if step_times else 0.0
    )
    backend = runner.attn
    return {
        "model": str(runner.loaded.model_dir),
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "threads": torch.get_num_threads(),
        "attention_backend": args.attention_backend,
        "cpu_kernels": getattr(backend, "decode_kernel", None) is not None,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_storage_dtype": str(runner.kv_cache.dtype).removeprefix("torch."),
        "prefill_s": round(prefill_s, 3),
        "prefill_tok_s": round(batch * input_len / prefill_s, 1),
        "decode_s": round(decode_s, 3),
        "decode_step_ms": round(1000 * decode_s / max(decode_steps, 1), 2),
        "roofline_step_ms": round(1000 * roofline_s, 2),
        "roofline_median_step_ms": round(1000 * statistics.median(roofline_times), 2),
        "matmul_kernels": (
            "onednn-packed" if runner.model.packed_lm_head is not None else "torch-linear"
        ),
        "decode_tok_s": round(decode_tok_s, 1),
        "roofline_decode_tok_s": round(roofline_tok_s, 1),
        "decode_vs_roofline": round(decode_tok_s / roofline_tok_s, 3),
        "decode_vs_roofline_median": round(median_ratio, 3),
    }


def main(argv: list[str]) -> int:
    """Entry point of `rsgl bench one-batch`."""
    parser = argparse.ArgumentParser(prog="rsgl bench one-batch", description=__doc__)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="torch_native")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.input_len < 1 or args.output_len < 1:
        parser.error("--batch, --input-len and --output-len must be >= 1")
    print(json.dumps(run(args)))
    return 0
