"""A `HardwareSpec` for this CPU, measured here: `rsgl bench simulate --calibrate-hardware`.

The shipped GPU specs hold published peaks derated by assumed efficiencies. A CPU has no
datasheet figure worth pricing steps with (a VM's share of a socket's bandwidth is its own),
so this one is measured: the memory read bandwidth (a sum over 1 GiB with the engine's
threads, as `rsgl bench one-batch` measures it), the matrix-multiply FLOP/s in float32 and
bfloat16 (a square torch GEMM, as large as a prefill's projections), and the memory the
machine has. Those are rates reached, not peaks, so their efficiencies are 1.

The spec prices a model on this CPU through `--hardware FILE`, which a calibration, timing
one model, cannot do: its KV pool sized by the server's CPU rule over the machine's memory,
bfloat16 under `--dtype auto` where the spec's GEMM is `MIN_BF16_SPEEDUP` times faster in
it (the server's threshold; the server times two projection shapes of its own instead), and
each of the dp x tp ranks with its share of the bandwidth and the cores, as the server
splits the cores among them. It suits models large enough that their steps are bound by bytes and
FLOPs: a small model's steps are bound by the work per layer and per kernel call, which
scale with neither, and its calibration (`--calibrate`) prices it better. Nothing is
fitted: the per-step overhead is 0. The interconnect figure for `--tp-size` (ranks on one
machine, all-reducing through gloo) is not measured: it is the memory bandwidth halved, an
assumption the file states.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from rsgl.args import EngineArgs, from_cli
from rsgl.bench.sim.calibrate import cpu_name
from rsgl.bench.sim.cost import HardwareSpec, spec_as_dict
from rsgl.cpu_features import default_cpu_threads

# The GEMM timed for each dtype's FLOP/s: square, as large as a prefill's projections.
GEMM_SIZE = 2048


def gemm_flops(dtype: torch.dtype, size: int = GEMM_SIZE, repeats: int = 5) -> float:
    """FLOP/s of one `size`³ matrix multiply in `dtype` with torch's threads (median)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2.0 * size**3 / statistics.median(times)


def memory_bytes() -> int:
    """The machine's physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure(
    threads: int | None = None, bandwidth_bytes: int = 1 << 30, gemm_size: int = GEMM_SIZE
) -> HardwareSpec:
    """This CPU's spec from its measured rates (efficiencies 1, no step overhead)."""
    from rsgl.bench.one_batch import cpu_read_bandwidth_bytes_s

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        bandwidth = cpu_read_bandwidth_bytes_s(bandwidth_bytes)
        flops = {
            name: gemm_flops(getattr(torch, name), gemm_size) for name in ("float32", "bfloat16")
        }
    finally:
        torch.set_num_threads(previous)
    flops["float16"] = flops["bfloat16"]
    used = threads or previous
    return HardwareSpec(
        name=f"{cpu_name()}, {used} threads",
        memory_bytes=memory_bytes(),
        memory_bandwidth=bandwidth,
        peak_flops=flops,
        interconnect_bandwidth=bandwidth / 2,
        efficiency={"memory": 1.0, "compute": 1.0, "interconnect": 1.0},
        allreduce_latency_s=5e-5,
        step_overhead_s=0.0,
        device="cpu",
        source=(
            f"measured by rsgl bench simulate --calibrate-hardware on {cpu_name()} with "
            f"{used} torch threads: memory read bandwidth (a float32 sum over "
            f"{bandwidth_bytes >> 20} MiB), FLOP/s of a {gemm_size}^3 torch matmul per dtype "
            "(float16 taken as bfloat16's), physical memory; the interconnect (ranks on this "
            "machine, through gloo) is assumed at half the memory bandwidth with 50 us a call"
        ),
    )


def hardware_main(args: argparse.Namespace) -> int:
    """`--calibrate-hardware`: measure this CPU and write its spec to `--hardware-output`."""
    engine: EngineArgs = from_cli(EngineArgs, args)
    spec = measure(engine.cpu_threads or default_cpu_threads())
    with open(args.hardware_output, "w", encoding="utf-8") as f:
        json.dump(spec_as_dict(spec), f, indent=1)
    flops = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in spec.peak_flops.items())
    print(
        f"{spec.name}: memory read {spec.memory_bandwidth / 1e9:.1f} GB/s, GEMM GFLOP/s "
        f"{flops}, memory {spec.memory_bytes / 2**30:.1f} GiB; wrote {args.hardware_output}",
        file=sys.stderr,
    )
    return 0
