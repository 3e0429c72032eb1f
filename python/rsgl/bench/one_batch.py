"""`rsgl bench one-batch`: a static batch through the model runner, against its roofline.

Prefill all prompts in one extend step, then decode `output_len - 1` steps whose input
tokens are FutureMap placeholders (as in overlap mode); no scheduler is involved.

On CPU the roofline is the model's matmuls alone, timed in the same process (every layer's
projections and the LM head at the decode batch size, no attention, norms or sampling). On
CUDA a decode step is bound by memory: the roofline is the bytes one step must read (every
weight once, plus each request's K and V) over the device-to-device copy bandwidth measured
in the same process (bytes read + written per second, as copy-bandwidth tests count it).
Decode is timed twice there: step by step with the host waiting for each (`decode_*`), and as
the engine's overlap loop runs it, each step queued before the host reads the previous one's
tokens (`overlapped_*`).

    rsgl bench one-batch --device cuda --load-format dummy --model benches/configs/llama3-8b \
        --batch 64 --input-len 512 --output-len 256 [--disable-cuda-graph] \
        [--attention-backend triton|flashinfer]

`--dtype` picks the model dtype (auto: the loader's default for the device); on CPU the
matmul roofline runs the model's own projections, so it is in the run's dtype too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from rsgl._core import Plan
from rsgl.args import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS
from rsgl.layers.linear import PackedLinear
from rsgl.layers.quant_linear import QuantLinear, force_low_bit_max_rows, low_bit_rows_of
from rsgl.model_executor.executor import CudaStreamExecutor
from rsgl.model_executor.kv_cache import KVCache
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.models.dtype_choice import choose_dtype
from rsgl.models.llama import LlamaForCausalLM
from rsgl.sampling_params import SamplingParams

ROOFLINE_EVERY = 4

# --dtype values -> the torch dtype (None: "auto", chosen as `rsgl serve` chooses it:
# `choose_dtype`).
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}


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


def _matrix_bytes(module: torch.nn.Module, rows: int) -> int:
    """Weight bytes `module` (a projection as the model holds it) reads for `rows` rows."""
    if isinstance(module, QuantLinear):
        if module.dense is None or module.serves(rows):
            return module.weight.nbytes
        return _matrix_bytes(module.dense, rows)
    if isinstance(module, PackedLinear):
        return module.in_features * module.out_features * int(module.packed.element_size())
    return sum(p.numel() * p.element_size() for p in module.parameters())


def weight_bytes_per_step(model: LlamaForCausalLM, rows: int) -> int:
    """Bytes of weight a step of `rows` rows reads: every projection and the LM head as the
    model holds them (GGUF blocks or dense, whichever that batch size uses); norms and the
    embedding rows looked up are negligible."""
    total = 0
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            total += _matrix_bytes(proj, rows)
        total += _matrix_bytes(layer.mlp.gate_up_proj, rows)
        total += _matrix_bytes(layer.mlp.down_proj, rows)
    head = model.low_bit_lm_head
    if head is not None and head.serves(rows):
        return total + _matrix_bytes(head, rows)
    weight = model.model.embed_tokens.weight
    return total + weight.numel() * weight.element_size()


def cpu_read_bandwidth_bytes_s(size: int = 1 << 30, repeats: int = 7) -> float:
    """This machine's memory read bandwidth with torch's threads: a float32 sum over a
    buffer far larger than the caches (median bytes per second)."""
    buf = torch.ones(size // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times)


def copy_bandwidth_bytes_s(device: torch.device, size: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median)."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1000)
    del src, dst
    return float(2 * size / statistics.median(times))


def decode_bytes_per_step(runner: ModelRunner, batch: int, mean_seq_len: float) -> float:
    """Bytes a decode step must read at least: every weight once, each request's K and V."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    per_slot = KVCache.bytes_per_slot(runner.config, runner.kv_cache.dtype)
    return weights + batch * mean_seq_len * per_slot


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict[str, object] | list[dict[str, object]]:
    """Run the benchmark and return its figures."""
    if args.threads:
        torch.set_num_threads(args.threads)
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    batch, input_len, output_len = max(args.batches), args.input_len, args.output_len
    capacity = input_len + output_len
    device = torch.device(args.device)
    runner = ModelRunner.from_pretrained(
        args.model,
        kv_buffer_size=1 + batch * capacity,
        max_running_requests=batch,
        context_len=capacity + 1,
        device=device,
        dtype=choose_dtype(args.dtype, device).torch_dtype,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        cuda_graph_max_bs=args.cuda_graph_max_bs or batch,
        disable_cuda_graph=args.disable_cuda_graph,
    )
    forced = args.low_bit_max_rows
    if forced is not None and not force_low_bit_max_rows(runner.model, forced):
        raise SystemExit("--low-bit-max-rows: this model has no low-bit weights")
    if device.type == "cuda":
        return _run_cuda(args, runner)
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
    bandwidth = cpu_read_bandwidth_bytes_s()
    weight_bytes = weight_bytes_per_step(runner.model, batch)
    kv_bytes = (
        batch
        * (input_len + output_len / 2)
        * KVCache.bytes_per_slot(runner.config, runner.kv_cache.dtype)
    )
    median_step = statistics.median(step_times) if step_times else float("nan")

    roofline_s = min(roofline_times)
    decode_tok_s = batch * decode_steps / decode_s if decode_steps else 0.0
    roofline_tok_s = batch / roofline_s
    median_ratio = (
        statistics.median(roofline_times) / statistics.median(step_times) if step_times else 0.0
    )
    backend = runner.attn
    return {
        "model": str(runner.loaded.model_dir),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "threads": torch.get_num_threads(),
        "attention_backend": runner.attention_backend,
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
        "decode_step_ms_median": round(1000 * median_step, 2),
        "decode_tok_s": round(decode_tok_s, 1),
        "quantization": runner.loaded.quantization,
        # Steps of up to this many rows read the low-bit weights, larger ones the dense copy
        # (None: no low-bit weights; --low-bit-max-rows forces it).
        "low_bit_max_rows": low_bit_rows_of(runner.model),
        "weight_mb_per_step": round(weight_bytes / 1e6, 1),
        "kv_mb_per_step": round(kv_bytes / 1e6, 1),
        "memory_read_gb_s": round(bandwidth / 1e9, 2),
        # The step time if it only had to read its bytes once at that bandwidth, against
        # the median step: the fraction of the memory-bandwidth roofline reached.
        "bandwidth_roofline_step_ms": round(1000 * (weight_bytes + kv_bytes) / bandwidth, 2),
        "decode_vs_bandwidth_roofline": round(
            (weight_bytes + kv_bytes) / bandwidth / median_step, 3
        ),
        "roofline_decode_tok_s": round(roofline_tok_s, 1),
        "decode_vs_roofline": round(decode_tok_s / roofline_tok_s, 3),
        "decode_vs_roofline_median": round(median_ratio, 3),
    }


def _run_cuda(args: argparse.Namespace, runner: ModelRunner) -> list[dict[str, object]]:
    """Decode against the HBM roofline (see the module docstring) for every batch size in
    `args.batches`, with CUDA graphs and (`--compare-graphs`) without, in one process."""
    input_len, output_len = args.input_len, args.output_len
    capacity = input_len + output_len
    device = runner.device
    greedy = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    rng = np.random.default_rng(args.seed)
    vocab = runner.config.vocab_size
    bandwidth = copy_bandwidth_bytes_s(device)
    graphs = runner.graphs
    modes = [graphs is not None] + ([False] if args.compare_graphs and graphs is not None else [])
    results = []
    for batch in args.batches:
        prompts = rng.integers(100, vocab - 100, size=(batch, input_len))
        for use_graphs in modes:
            runner.graphs = graphs if use_graphs else None
            for slot in range(batch):
                runner.admit(slot, greedy, prompts[slot].tolist())
            runner.step(_prefill_plan(prompts[:1, :8], capacity))  # warm-up: kernels compile
            runner.step(_decode_plan(1, 8, capacity))
            _sync(device)
            t0 = time.perf_counter()
            runner.step(_prefill_plan(prompts, capacity))
            _sync(device)
            prefill_s = time.perf_counter() - t0
            step_times: list[float] = []
            for i in range(output_len - 1):
                t0 = time.perf_counter()
                runner.step(_decode_plan(batch, input_len + i, capacity))
                _sync(device)
                step_times.append(time.perf_counter() - t0)
            # The same steps as the engine's overlap loop runs them: step i+1 is queued on the
            # forward stream before the host waits for step i's tokens (one wall-clock span).
            executor = CudaStreamExecutor(device)
            plans = [_decode_plan(batch, input_len + i, capacity) for i in range(output_len - 1)]
            t0 = time.perf_counter()
            previous = None
            for plan in plans:
                launched = executor.launch(lambda p=plan: runner.prepare(p), runner.execute)  # type: ignore[misc]
                if previous is not None:
                    previous.result()
                previous = launched
            if previous is not None:
                previous.result()
            overlapped_step = (time.perf_counter() - t0) / max(len(plans), 1)
            executor.shutdown()
            mean_seq = input_len + output_len / 2
            roofline_s = decode_bytes_per_step(runner, batch, mean_seq) / bandwidth
            median_step = statistics.median(step_times)
            results.append(
                {
                    "model": str(runner.loaded.model_dir),
                    "device": torch.cuda.get_device_name(device),
                    "dtype": str(runner.dtype).removeprefix("torch."),
                    "batch": batch,
                    "input_len": input_len,
                    "output_len": output_len,
                    "attention_backend": type(runner.attn).__name__,
                    "cuda_graphs": use_graphs,
                    "prefill_s": round(prefill_s, 4),
                    "prefill_tok_s": round(batch * input_len / prefill_s, 1),
                    "decode_step_ms_median": round(1000 * median_step, 3),
                    "decode_tok_s": round(batch / median_step, 1),
                    "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                    "roofline_step_ms": round(1000 * roofline_s, 3),
                    "roofline_decode_tok_s": round(batch / roofline_s, 1),
                    "decode_vs_roofline": round(roofline_s / median_step, 3),
                    "overlapped_step_ms": round(1000 * overlapped_step, 3),
                    "overlapped_decode_tok_s": round(batch / overlapped_step, 1),
                    "overlapped_vs_roofline": round(roofline_s / overlapped_step, 3),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    runner.graphs = graphs
    return results


def main(argv: list[str]) -> int:
    """Entry point of `rsgl bench one-batch`."""
    parser = argparse.ArgumentParser(prog="rsgl bench one-batch", description=__doc__)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default=None, help="default: the device's")
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS[:2])
    parser.add_argument("--cuda-graph-max-bs", type=int, default=0, help="default: --batch")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument(
        "--batches", default="", help="CUDA: comma-separated batch sizes, one model load"
    )
    parser.add_argument(
        "--compare-graphs", action="store_true", help="CUDA: also run each batch eagerly"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="model dtype (auto: as rsgl serve chooses)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="weights: gguf (the file's own blocks), gguf_a8 (the same, int8 activations), "
        "int8 / int4 (quantized at load) or "
        "none (as loaded); default: gguf for GGUF files on CPU",
    )
    parser.add_argument("--quantization-group-size", type=int, default=None)
    parser.add_argument(
        "--low-bit-max-rows",
        type=int,
        default=None,
        help="steps of up to this many rows read the low-bit weights, larger ones the dense "
        "copy (default: what rsgl chose for this CPU and dtype); to measure the crossover",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.input_len < 1 or args.output_len < 1:
        parser.error("--batch, --input-len and --output-len must be >= 1")
    result = run(args)
    if isinstance(result, dict):  # CUDA prints one line per configuration as it goes
        print(json.dumps(result))
    return 0
