"""A `HardwareSpec` for this CPU, measured here: `rsgl bench simulate --calibrate-hardware`.

The shipped GPU specs hold published peaks derated by assumed efficiencies. A CPU has no
datasheet figure worth pricing steps with (a VM's share of a socket's bandwidth is its own),
so this one is measured: the memory read bandwidth (a sum over 1 GiB with the engine's
threads, as `rsgl bench one-batch` measures it), the matrix-multiply FLOP/s in float32 and
bfloat16 (a square GEMM through torch, which is what a dense projection runs), and the
memory the machine has. Those are rates reached, not peaks, so their efficiencies are 1.

Given a calibration of a dense model on the same machine (`--cost-model`, from
`--calibrate --quantization none`: the roofline prices weights at the dtype's bytes, which
only a dense model reads), the efficiencies and the per-step overhead are fitted to its
timed steps instead (`fit_to_steps`): a step takes bytes / (bandwidth · e_mem) + overhead on
the memory side and FLOPs / (FLOP/s · e_compute) + overhead on the compute side, the
decode steps fitting the first and the large prefills the second. The spec then prices
another model on this CPU through `--hardware FILE` (its KV pool sized from the machine's
memory), which is what a calibration of one model cannot do. The interconnect figure for
`--tp-size` (ranks on one machine, all-reducing through gloo) is not measured: it is the
memory bandwidth halved, an assumption the file states.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from rsgl.args import EngineArgs, from_cli
from rsgl.bench.sim.calibrate import cpu_name
from rsgl.bench.sim.cluster import Deployment
from rsgl.bench.sim.cost import (
    HardwareSpec,
    ModelFootprint,
    RooflineCost,
    load_cost_model,
    spec_as_dict,
)
from rsgl.cpu_features import default_cpu_threads
from rsgl.models.config import ModelConfig
from rsgl.models.loader import resolve_model_dir
from rsgl.scheduler.step_shape import StepShape

# The GEMM timed for each dtype's FLOP/s: square, as large as a prefill's projections.
GEMM_SIZE = 2048
# A calibration needs prefill steps at least this long (new tokens): compute-bound on a
# CPU, they pin the compute efficiency.
COMPUTE_BOUND_TOKENS = 256
# What a spec says when nothing was fitted.
UNFITTED_OVERHEAD_S = 0.0


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
    """This CPU's spec from its measured rates (efficiencies 1, no overhead yet)."""
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
        step_overhead_s=UNFITTED_OVERHEAD_S,
        device="cpu",
        source=(
            f"measured by rsgl bench simulate --calibrate-hardware on {cpu_name()} with "
            f"{used} torch threads: memory read bandwidth (a float32 sum over "
            f"{bandwidth_bytes >> 20} MiB), FLOP/s of a {gemm_size}^3 torch matmul per dtype "
            "(float16 taken as bfloat16's), physical memory; the interconnect (ranks on this "
            "machine, through gloo) is assumed at half the memory bandwidth with 50 us a call"
        ),
    )


def fit_to_steps(
    spec: HardwareSpec,
    footprint: ModelFootprint,
    dtype: str,
    shapes: list[StepShape],
    seconds: list[float],
) -> tuple[HardwareSpec, dict[str, Any]]:
    """`spec` with its memory and compute efficiencies and its step overhead fitted to a
    calibration's timed steps of a model of `footprint` (see the module doc), and how well
    the fitted roofline prices those steps (mean and worst relative error, by kind).

    The three minimize the mean relative error of max(bytes · a, FLOPs · c) + overhead over
    every step (a = 1 / (bandwidth · e_mem), c = 1 / (FLOP/s · e_compute)), found by a grid
    search that zooms in around its best point: a max has no least-squares solution, and
    which side binds differs by step (a CPU's decode steps of many rows are compute-bound).
    """
    has_prefill = any(s.num_extends and s.new_tokens >= COMPUTE_BOUND_TOKENS for s in shapes)
    if not has_prefill or sum(not s.num_extends for s in shapes) < 2:
        raise ValueError(
            "fitting a CPU spec needs decode steps and prefills of at least "
            f"{COMPUTE_BOUND_TOKENS} tokens in the calibration"
        )
    unit = RooflineCost(spec, footprint, dtype)
    read = np.array([unit.bytes_read(s) for s in shapes])
    flops = np.array([unit.flops(s) for s in shapes])
    took = np.asarray(seconds, dtype=np.float64)
    a, c, overhead = _zoom(read, flops, took)
    efficiency = dict(
        spec.efficiency,
        memory=float(1.0 / (a * spec.memory_bandwidth)),
        compute=float(1.0 / (c * spec.peak_flops[dtype])),
    )
    fitted = dataclasses.replace(spec, efficiency=efficiency, step_overhead_s=float(overhead))
    roofline = RooflineCost(fitted, footprint, dtype)
    report: dict[str, Any] = {}
    for kind, decode in (("decode", True), ("prefill", False)):
        steps = [
            (s, t) for s, t in zip(shapes, seconds, strict=True) if (not s.num_extends) == decode
        ]
        rel = np.array([abs(roofline.step_seconds(s) - t) / t for s, t in steps])
        report[f"{kind}_mean_rel_error"] = round(float(rel.mean()), 4)
        report[f"{kind}_max_rel_error"] = round(float(rel.max()), 4)
        report[f"{kind}_steps"] = len(steps)
    return fitted, report


# The grid search's points per rate and its zooms.
GRID_POINTS = 41
GRID_ROUNDS = 10


def _zoom(read: np.ndarray, flops: np.ndarray, took: np.ndarray) -> tuple[float, float, float]:
    """(a, c, overhead) >= 0 minimizing mean |max(read · a, flops · c) + overhead - took| /
    took: a grid of (a, c) around each step's own rates, narrowed around the best point
    each round, the best overhead for each point exact (`_best_overheads`)."""
    a, c = float(np.median(took / read)), float(np.median(took / flops))
    spread = 10.0
    ramp = np.linspace(-1.0, 1.0, GRID_POINTS)
    overhead = 0.0
    for _ in range(GRID_ROUNDS):
        grid_a, grid_c = a * spread**ramp, c * spread**ramp
        bound = np.maximum(
            read[None, None, :] * grid_a[:, None, None],
            flops[None, None, :] * grid_c[None, :, None],
        )  # [A, C, N]
        residual = took - bound
        o = _best_overheads(residual, 1.0 / took)
        err = (np.abs(residual - o[..., None]) / took).mean(axis=-1)
        i, j = np.unravel_index(int(err.argmin()), err.shape)
        a, c, overhead = float(grid_a[i]), float(grid_c[j]), float(o[i, j])
        # The next grid spans four of this one's steps each way.
        spread = spread ** (8.0 / (GRID_POINTS - 1))
    return a, c, overhead


def _best_overheads(residual: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """For each row of `residual` (last axis: the steps), the o >= 0 minimizing
    Σ weight · |residual - o|: the weighted median, or 0 where that is negative."""
    order = np.argsort(residual, axis=-1)
    sorted_r = np.take_along_axis(residual, order, axis=-1)
    cum = np.cumsum(weight[order], axis=-1)
    half = cum[..., -1:] / 2.0
    k = (cum < half).sum(axis=-1)
    median = np.take_along_axis(sorted_r, k[..., None], axis=-1)[..., 0]
    out: np.ndarray = np.maximum(median, 0.0)
    return out


def calibration_steps(data: dict[str, Any]) -> tuple[list[StepShape], list[float]]:
    """The timed steps a `--calibrate` file keeps (`samples`); ValueError if it has none."""
    fields = data.get("sample_fields")
    if not fields or not data.get("samples"):
        raise ValueError("the calibration keeps no timed steps: recalibrate with --calibrate")
    names = [f.name for f in dataclasses.fields(StepShape)]
    shapes, seconds = [], []
    for row in data["samples"]:
        values = dict(zip(fields, row, strict=True))
        shapes.append(StepShape(**{n: values[n] for n in names}))
        seconds.append(float(values["seconds"]))
    return shapes, seconds


def hardware_main(args: argparse.Namespace) -> int:
    """`--calibrate-hardware`: measure this CPU, fit it to `--cost-model` when given, and
    write the spec to `--hardware-output`."""
    engine: EngineArgs = from_cli(EngineArgs, args)
    threads = engine.cpu_threads or default_cpu_threads()
    fitting = None
    if args.cost_model is not None:
        with open(args.cost_model, encoding="utf-8") as f:
            data = json.load(f)
        calibrated = load_cost_model(args.cost_model)
        meta = calibrated.meta or {}
        if meta.get("quantization") != "none":
            print(
                f"rsgl bench simulate: {args.cost_model} timed a model with "
                f"{meta.get('quantization', 'unrecorded')} weights; a spec is fitted to a "
                "dense model's steps (--calibrate --quantization none), whose weights the "
                "roofline prices",
                file=sys.stderr,
            )
            return 2
        config = ModelConfig.from_model_dir(resolve_model_dir(engine.model_path))
        fitting = (Deployment(engine, config, calibrated=calibrated), meta, data)
        threads = int(meta.get("cpu_threads") or threads)
    spec = measure(threads)
    fit = None
    if fitting is not None:
        dep, meta, data = fitting
        shapes, seconds = calibration_steps(data)
        spec, fit = fit_to_steps(spec, dep.footprint(), dep.dtype, shapes, seconds)
        spec = dataclasses.replace(
            spec,
            source=f"{spec.source}; efficiencies and step overhead fitted to the "
            f"{meta.get('dtype')} steps of {meta.get('model')} timed in {args.cost_model} "
            f"({meta.get('date')})",
            meta={"fit": fit, "calibration": meta},
        )
    with open(args.hardware_output, "w", encoding="utf-8") as f:
        json.dump(spec_as_dict(spec), f, indent=1)
    flops = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in spec.peak_flops.items())
    print(
        f"{spec.name}: memory read {spec.memory_bandwidth / 1e9:.1f} GB/s, GEMM GFLOP/s "
        f"{flops}; efficiency {spec.efficiency}, step overhead "
        f"{spec.step_overhead_s * 1e3:.2f} ms"
        + (f"; the fitted roofline's error on the calibration's steps: {fit}" if fit else "")
        + f"; wrote {args.hardware_output}",
        file=sys.stderr,
    )
    return 0
