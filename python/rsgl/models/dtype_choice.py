"""`--dtype auto`: which dtype the model runs in, and why.

On CUDA bfloat16. On a CPU, bfloat16 only where it has matrix units for it (AMX-BF16 or
AVX512-BF16, `rsgl.cpu_features`) *and* a start-up calibration measures its projections
faster than float32's. The flags alone are not enough: a bfloat16 GEMM that oneDNN cannot
route to those units (an old torch, a build without them, a hypervisor that masks the tile
state) runs far slower than float32, and without the units at all ~100x slower. The
calibration multiplies one decode-shaped and one prefill-shaped batch by SmolLM2's MLP
up-projection in each dtype, through the same path the model's projections take
(`PackedLinear` where the weight can be packed, `F.linear` otherwise), in tens of ms.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsgl.args import check_dtype
from rsgl.cpu_features import cpu_bf16_features
from rsgl.layers.linear import PackedLinear, can_pack

logger = logging.getLogger(__name__)

# bfloat16 must beat float32 by this much at both shapes to be chosen: near a tie float32's
# precision wins, and on 2 shared cores a few percent is timing noise.
MIN_BF16_SPEEDUP = 1.2
# Calibration shapes: SmolLM2-135M's gate/up projection (hidden 576 -> intermediate 1536), at
# a mid-size decode batch and at a prefill chunk. Fixed rather than the loaded model's, so
# the calibration costs the same tens of ms for an 8B model.
HIDDEN = 576
INTERMEDIATE = 1536
DECODE_ROWS = 64
PREFILL_ROWS = 512


@dataclass(frozen=True, slots=True)
class Bf16Speedup:
    """float32 time over bfloat16 time for one projection (above 1: bfloat16 is faster)."""

    decode: float
    prefill: float


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype the model runs in and why (`get_server_info()["dtype_choice"]`)."""

    chosen: str
    reason: str
    requested: str = "auto"
    bf16_speedup_decode: float | None = None
    bf16_speedup_prefill: float | None = None
    cpu_bf16_features: tuple[str, ...] = ()
    # What the calibration cost at start-up (None where none ran).
    calibration_ms: float | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.chosen)
        return dtype

    def to_dict(self) -> dict[str, Any]:
        info = dataclasses.asdict(self)
        info["cpu_bf16_features"] = list(self.cpu_bf16_features)
        return info


def choose_dtype(
    requested: str,
    device: torch.device,
    *,
    features: frozenset[str] | None = None,
    calibrate: Callable[[], Bf16Speedup] | None = None,
) -> DtypeChoice:
    """Resolves `--dtype` for a model on `device` and logs the choice. `features` (default:
    this CPU's `cpu_bf16_features()`) and `calibrate` (default: `measure_bf16_speedup`) are
    there for tests to stand in for other hardware."""
    check_dtype(requested)
    choice = _choose(requested, device, features, calibrate or measure_bf16_speedup)
    logger.info(
        "dtype %s (%s; bf16 speedup decode %s, prefill %s, calibrated in %s; CPU bf16 units: %s)",
        choice.chosen,
        choice.reason,
        _ratio(choice.bf16_speedup_decode),
        _ratio(choice.bf16_speedup_prefill),
        "-" if choice.calibration_ms is None else f"{choice.calibration_ms:.0f} ms",
        ", ".join(choice.cpu_bf16_features) or "none",
    )
    return choice


def _choose(
    requested: str,
    device: torch.device,
    features: frozenset[str] | None,
    calibrate: Callable[[], Bf16Speedup],
) -> DtypeChoice:
    found: tuple[str, ...] = ()
    if device.type == "cpu":  # reported whatever is chosen: what the machine could do
        found = tuple(sorted(cpu_bf16_features() if features is None else features))
    if requested != "auto":
        return DtypeChoice(requested, "forced by --dtype", requested, cpu_bf16_features=found)
    if device.type != "cpu":
        return DtypeChoice("bfloat16", f"{device.type}: bfloat16 is the accelerator's native width")
    if not found:
        return DtypeChoice(
            "float32", "the CPU has no bfloat16 matrix units (amx_bf16, avx512_bf16)"
        )
    start = time.perf_counter()
    speedup = calibrate()
    calibration_ms = (time.perf_counter() - start) * 1e3
    faster = min(speedup.decode, speedup.prefill) >= MIN_BF16_SPEEDUP
    reason = (
        f"calibration: bfloat16 projections at least {MIN_BF16_SPEEDUP}x float32's"
        if faster
        else f"calibration: bfloat16 projections under {MIN_BF16_SPEEDUP}x float32's"
    )
    return DtypeChoice(
        "bfloat16" if faster else "float32",
        reason,
        bf16_speedup_decode=round(speedup.decode, 3),
        bf16_speedup_prefill=round(speedup.prefill, 3),
        cpu_bf16_features=found,
        calibration_ms=round(calibration_ms, 1),
    )


@torch.inference_mode()
def measure_bf16_speedup(rounds: int = 3) -> Bf16Speedup:
    """Times `DECODE_ROWS` and `PREFILL_ROWS` rows through a HIDDEN -> INTERMEDIATE projection
    in float32 and bfloat16 on this CPU with torch's current thread count. Each figure is
    the best of `rounds` (the dtypes alternate, so a noisy neighbour slows both alike)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN**-0.5
    ratios = []
    for rows, calls in ((DECODE_ROWS, 8), (PREFILL_ROWS, 2)):
        x = torch.randn(rows, HIDDEN, generator=gen)
        f32 = _timer(weight, x, calls)
        bf16 = _timer(weight.bfloat16(), x.bfloat16(), calls)
        best_f32 = best_bf16 = float("inf")
        for _ in range(rounds):
            best_f32 = min(best_f32, f32())
            best_bf16 = min(best_bf16, bf16())
        ratios.append(best_f32 / best_bf16)
    return Bf16Speedup(decode=ratios[0], prefill=ratios[1])


def _timer(weight: torch.Tensor, x: torch.Tensor, calls: int) -> Callable[[], float]:
    """A function timing `calls` projections of `x` by `weight`, warmed up (oneDNN builds its
    kernel for a shape on the first call)."""
    packs = can_pack(weight) and os.environ.get("RSGL_ONEDNN", "1") != "0"
    packed = PackedLinear(weight, None) if packs else None

    def project() -> torch.Tensor:
        return packed(x) if packed is not None else F.linear(x, weight)

    project()

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            project()
        return time.perf_counter() - start

    return timed


def _ratio(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}x"


__all__ = [
    "MIN_BF16_SPEEDUP",
    "Bf16Speedup",
    "DtypeChoice",
    "choose_dtype",
    "measure_bf16_speedup",
]
