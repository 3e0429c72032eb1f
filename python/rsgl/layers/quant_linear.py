"""Projections over low-bit weights: a GGUF file's own blocks (`--quantization gguf`) or
weights quantized when a model loads (`--quantization int8 / int4`).

A batch-1 decode step is bound by the bytes of weight it reads: SmolLM2's projections and
LM head are 538 MB in float32 but 96 MB as its GGUF stores them (Q4_1 and Q8_0 blocks).
`QuantLinear` keeps a projection in low-bit form and multiplies float32 (or bfloat16)
activations by it with rsgl's C kernels (`csrc/quant.c`), which rebuild each weight in
float32 exactly as the dequantized model holds it: the same numbers, a different summation
order. For a GGUF file that is the file's own model, so greedy tokens match the dequantized
float32 model's; int8 / int4 change the weights (measured by `rsgl bench quality`).
`--quantization gguf_a8` keeps the file's blocks but quantizes the activations to int8 per
block of 32, as llama.cpp does for Q4_0, Q4_1 and Q8_0 (`csrc/quant_a8.c`; the K-quants'
groups too, where llama.cpp takes blocks of 256): integer dot products instead of
rebuilt float32 weights, not the float32 model's logits. A bfloat16 model on a CPU with
AVX512-BF16 multiplies GGUF's blocks by its dot products instead (`uses_bf16_dot`,
`CpuKernels.qlinear_x8b`): the quants are small integers, exact in bfloat16, so the weights
stay the file's and only the summation order changes; no weight is rebuilt in float32.

Decode batches are bound by memory traffic; large ones (prefill chunks, mixed steps) by
arithmetic, where oneDNN's GEMM over a dense copy of the same (dequantized) values is
faster than rebuilding weights for each tile of rows. A projection therefore keeps both:
the low-bit form for up to `max_rows` rows, the dense copy above.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from rsgl.cpu_features import cpu_bf16_features
from rsgl.layers.cpu_kernels import QUANT_BLOCK, QUANT_FORMATS, CpuKernels

# Rows of x up to which the low-bit weights are read rather than the dense copy, where the
# kernels are built for AVX2 (without AVX-512). A tile of up to 8 rows of x rebuilds each
# weight once (`quant.c`), so past a few rows the blocks cost the tile's multiply-adds, as
# the dense GEMM does, plus a rebuild per tile and per weight row. SmolLM2's decode steps on
# a 2-core AMD EPYC (Zen 3), float32 (`rsgl bench one-batch --input-len 100 --output-len
# 32`, ms a step, alternated runs, blocks vs dense): 50.7 vs 80.8 at batch 16, 86.1 vs 99.3
# at 24, 116 vs 115 at 32.
DEFAULT_MAX_ROWS = 24

# The same for int8 activations (`gguf_a8`) over load-time groups (GGUF's K-quants), read row
# after row. SmolLM2's decode steps on the same Zen 3 (`rsgl bench one-batch --quantization
# gguf_a8`, ms a step, median of two alternated runs, blocks vs dense): 56 vs 84 at batch 16,
# 77 vs 109 at 24, 119 vs 128 at 32, where the matmuls alone already favour the dense copy.
INT8_ACTIVATIONS_MAX_ROWS = 24

# Int8 activations over GGUF's blocks interleaved by eight weight rows, on AVX2: their integer
# dot products beat the dense copy's GEMM at every size measured, so every batch reads the
# blocks. SmolLM2 on the same Zen 3 (two alternated runs each, blocks vs dense): decode steps
# of 24 rows 44.5 / 45.0 vs 97.8 / 112.8 ms, 64 rows 119 / 120 vs 193 / 204, 128 rows 235 /
# 246 vs 334 / 344; prefills of 512 rows 0.79 / 0.84 vs 1.02 / 1.02 s, of 12,800 rows 23.6 /
# 19.3 vs 21.7 / 22.6 s. (Without AVX2 the kernels are plain C: the limit stays 24.) So too
# with AVX-512 for float32: on a 2-core AMD EPYC Zen 4 (AVX512-VNNI), decode steps of 64 rows
# 76.7 / 64.1 vs 124 / 129 ms, 128 rows 138 / 123 vs 262 / 225, their prefills of 8,192 rows
# 6.6 / 6.1 vs 10.0 / 10.4 s; built without VNNI (`RSGL_CPU_FEATURES=avx512`) 64 rows 72.0 /
# 72.5 vs 127 / 129.
INTERLEAVED_INT8_MAX_ROWS = 1 << 30

# The same for bfloat16 activations where AVX-512 runs the dense copy (which multiplies
# bfloat16 natively on AVX512-BF16 and AMX; the int8 kernels widen x to float32): on the Zen 4,
# decode steps of 64 rows 61.7 / 62.1 vs 80.5 / 78.3 ms, 128 rows 135 / 106 vs 124 / 112, and
# the dense copy's prefill of 8,192 rows 1.4x faster.
INTERLEAVED_INT8_BF16_AVX512_MAX_ROWS = 64
# Where the dense copy runs on AMX's tiles: on a 2-core Xeon with AMX (/proc/cpuinfo family 6
# model 167; `rsgl bench one-batch --dtype bfloat16 --quantization gguf_a8 --input-len 100
# --output-len 32 --low-bit-max-rows 64 / 1`, ms a step, two alternated runs, blocks vs
# dense): 11.2 / 11.0 vs 28.6 / 29.5 at 8 rows, 18.9 / 20.4 vs 32.3 / 34.2 at 16, 38.9 /
# 35.7 vs 42.5 / 39.9 at 32, 73.0 / 72.7 vs 61.4 / 55.0 at 64; on another day (the same
# alternation; the dense copy slower there) 57.0 / 58.0 vs 82.4 / 65.1 at 40, 72.3 / 76.0 vs
# 78.7 / 89.7 at 48, 92.2 / 84.2 vs 92.4 / 82.1 at 64 (a tie).
INTERLEAVED_INT8_BF16_AMX_MAX_ROWS = 48

# Rows of bfloat16 activations up to which GGUF's blocks, interleaved, are multiplied by
# AVX512-BF16's dot products (`uses_bf16_dot`) rather than the dense copy. SmolLM2's decode
# steps on a 2-core Zen 4 (`rsgl bench one-batch --dtype bfloat16 --input-len 100
# --output-len 32 --low-bit-max-rows 64 / 16`, ms a step, two alternated runs, blocks vs the
# dense copy on AVX512-BF16 through oneDNN): 35.8 / 39.1 vs 42.4 / 42.2 at 32 rows, 53.0 /
# 57.7 vs 57.3 / 65.4 at 48, 69.8 / 73.5 vs 69.6 / 74.1 at 64; one layer's products and the
# LM head alone, 16.7 vs 15.0 ms at 80 rows.
BF16_DOT_MAX_ROWS = 64

# The same where the dense copy multiplies on AMX's tiles (`amx_bf16`), which overtake the
# dot products much sooner. SmolLM2 on a 2-core Xeon with AMX (/proc/cpuinfo family 6 model
# 167; the same bench, two alternated runs each, blocks vs dense): 20.2 / 20.1 vs 27.0 /
# 29.8 ms at 8 rows, 29.5 / 30.4 vs 31.6 / 33.3 at 12, 36.3 / 36.9 vs 30.7 / 34.0 at 16,
# 72.3 / 70.4 vs 40.8 / 46.2 at 32, 139.3 / 139.6 vs 58.6 / 54.8 at 64.
AMX_BF16_DOT_MAX_ROWS = 12

# Rows up to which GGUF's blocks multiply bfloat16 rows on AMX's tiles themselves
# (`CpuKernels.amx`: the blocks in AMX's layout). SmolLM2 on the same Xeon (the same bench,
# blocks on the tiles vs the dense copy, ms a step): 15.0 vs 36.9 at 8 rows, 19.9 vs 45.2 at
# 16, 38.8 vs 56.0 at 32, 69.1 vs 73.2 at 64. Every row takes the tiles, one included, so a
# row's bits do not depend on its batch (a verify's rows get the decode steps' logits); a
# step of one row pays for it, 7.5 / 8.6 ms against the dot products' 5.8 / 6.5: the tiles'
# products are as fast, but the core runs slower after them (Python between AMX's calls took
# 8% longer than between the dot products'; in C, a scalar loop 13% longer right after tile
# multiplies than after idling, 6% than after AVX-512 multiply-adds). `RSGL_AMX=0` keeps
# the dot products.
AMX_TILES_MAX_ROWS = 64

# `RSGL_BF16_DOT=0` keeps the exact blocks of bfloat16 models on the float32 kernels (quant.c)
# where AVX512-BF16 would serve them: the comparison `uses_bf16_dot`'s figures come from.
BF16_DOT_ENV = "RSGL_BF16_DOT"


def uses_bf16_dot(kernels: CpuKernels, dtype: torch.dtype) -> bool:
    """Whether GGUF's blocks (the exact weights, `--quantization gguf`) multiply `dtype`
    activations through AVX512-BF16's dot products (`CpuKernels.qlinear_x8b`): for bfloat16
    where the kernels run them natively, unless `RSGL_BF16_DOT=0`."""
    return (
        dtype == torch.bfloat16 and kernels.x8b_native and os.environ.get(BF16_DOT_ENV, "1") != "0"
    )


def low_bit_max_rows(
    kernels: CpuKernels,
    dtype: torch.dtype,
    int8_activations: bool = False,
    interleaved: bool = False,
    bf16_units: frozenset[str] | None = None,
) -> int:
    """The rows up to which projections of `dtype` activations read low-bit weights
    (quantized to int8 first with `int8_activations`; `interleaved`: GGUF's blocks, which
    int8 activations read interleaved, rather than load-time groups).

    The AVX-512 kernels rebuild a weight row once for 8 rows of x (`quant.c`), so the
    blocks stay ahead of the dense copy much longer. SmolLM2's decode steps on 2 Sapphire
    Rapids cores (`rsgl bench one-batch`, ms a step, blocks vs dense): float32 21.5 vs 73.6
    at batch 8, 41.6 vs 92.9 at 16, 93 vs 109 at 32, 199 vs 176 at 64; bfloat16 (whose dense
    copy runs on AMX) 26.3 vs 39.8 at 8, 34.4 vs 39.7 at 12, 51.3 vs 42.7 at 16. A CPU
    without AMX runs the dense bfloat16 copy slower, so its crossover is no lower. Int8
    activations over load-time groups (no AVX-512 form) keep the exact kernels' limits
    there; over GGUF's interleaved blocks (AVX512-VNNI's dot products where the CPU has
    them) they serve every float32 batch wherever AVX2 runs, and 64 rows of bfloat16 with
    AVX-512 (48 where the dense copy runs on AMX: `bf16_units`, default
    `cpu_bf16_features()`). Bfloat16 rows over GGUF's blocks through AVX512-BF16's dot
    products (`uses_bf16_dot`) serve up to `BF16_DOT_MAX_ROWS`, with AMX
    `AMX_BF16_DOT_MAX_ROWS`; on AMX's tiles themselves (`kernels.amx`) `AMX_TILES_MAX_ROWS`."""
    avx512 = "avx512f" in kernels.isa
    amx = "amx_bf16" in (cpu_bf16_features() if bf16_units is None else bf16_units)
    if not int8_activations and interleaved and uses_bf16_dot(kernels, dtype):
        if kernels.amx:
            return AMX_TILES_MAX_ROWS
        return AMX_BF16_DOT_MAX_ROWS if amx else BF16_DOT_MAX_ROWS
    if int8_activations and interleaved and "avx2" in kernels.isa:
        if dtype == torch.float32 or not avx512:
            return INTERLEAVED_INT8_MAX_ROWS
        if amx:
            return INTERLEAVED_INT8_BF16_AMX_MAX_ROWS
        return INTERLEAVED_INT8_BF16_AVX512_MAX_ROWS
    if not avx512:
        return INT8_ACTIVATIONS_MAX_ROWS if int8_activations else DEFAULT_MAX_ROWS
    return 32 if dtype == torch.float32 else 12


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    """A weight matrix as GGUF blocks: uint8 [rows, K / 32 * block bytes] of `fmt`,
    multiplied by float activations as they are, or quantized to int8 first
    (`int8_activations`, `--quantization gguf_a8`), or by bfloat16 activations through
    AVX512-BF16's dot products (`bf16_dot`, `uses_bf16_dot`); the last two read the blocks
    interleaved (`serving_form`: a projection is split and stacked in the file's layout
    first)."""

    kernels: CpuKernels
    fmt: str
    data: torch.Tensor
    int8_activations: bool = False
    bf16_dot: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] // QUANT_FORMATS[self.fmt][1] * QUANT_BLOCK

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def serving_form(self) -> GGUFBlocks | InterleavedBlocks:
        """The form the kernels multiply: these blocks, or with `int8_activations` or
        `bf16_dot` the same bytes interleaved by eight weight rows (`InterleavedBlocks`)."""
        if not (self.int8_activations or self.bf16_dot):
            return self
        rows, k = self.shape
        if self.bf16_dot and self.kernels.amx:
            packed = self.kernels.pack_amx(self.data, self.fmt)
            return InterleavedBlocks(self.kernels, self.fmt, packed, rows, k, False, amx=True)
        packed = self.kernels.pack_a8(self.data, self.fmt)
        return InterleavedBlocks(self.kernels, self.fmt, packed, rows, k, self.int8_activations)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations or self.bf16_dot:  # interleaves them for this one product
            return self.serving_form().matmul(x)
        return self.kernels.qlinear(x, self.data, self.fmt)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.dequant_rows(self.data, self.fmt, ids)


@dataclass(frozen=True, slots=True)
class InterleavedBlocks:
    """GGUF blocks of `fmt` interleaved by eight weight rows (`CpuKernels.pack_a8`: uint8
    [ceil(rows / 8), ...]), multiplied by activations quantized to int8 per block of 32
    (`int8_activations`, `--quantization gguf_a8`), or else by bfloat16 activations as they
    are, the weights exact (`CpuKernels.qlinear_x8b`). A register's 8 lanes are 8 weight
    rows (16 lanes, two per row, for bfloat16), so a block's scales are one load and no sum
    crosses rows: SmolLM2's batch-1 int8 products ran 1.35-1.5x faster than over the file's
    layout on a 2-core Zen 3, at the memory bandwidth. With `amx` (bfloat16 activations,
    where `CpuKernels.amx`) the blocks are in AMX's layout instead, by sixteen weight rows
    (`CpuKernels.pack_amx`), and multiplied on AMX's tiles (`CpuKernels.qlinear_amx`)."""

    kernels: CpuKernels
    fmt: str
    data: torch.Tensor
    out_rows: int
    in_features: int
    int8_activations: bool = True
    amx: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_rows, self.in_features

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def serving_form(self) -> InterleavedBlocks:
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return self.kernels.qlinear_a8(x, self.data, self.fmt, self.out_rows)
        if self.amx:
            return self.kernels.qlinear_amx(x, self.data, self.fmt, self.out_rows)
        return self.kernels.qlinear_x8b(x, self.data, self.fmt, self.out_rows)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        unpack = self.kernels.unpack_rows_amx if self.amx else self.kernels.unpack_rows_a8
        blocks = unpack(self.data, self.fmt, self.out_rows, self.in_features, ids)
        return self.kernels.dequant_rows(blocks, self.fmt, torch.arange(len(ids)))


@dataclass(frozen=True, slots=True)
class GroupQuantized:
    """A weight matrix quantized at load time: `bits` 8 (w = s * q, q int8) or 4 (w = s * q +
    m, q in 0..15, two per byte in GGUF's nibble order within each 32), a float32 scale (and
    for 4 bits a minimum) per `group` weights of a row ([rows, K / group]). GGUF's K-quants
    are read into the same form (`rsgl.models.gguf_weights`): Q5_K as 8 bits with a minimum
    per 32 (w = s * q + m, q in 0..31). `int8_activations`: their products quantize the
    activations (`--quantization gguf_a8`), as `GGUFBlocks` does."""

    kernels: CpuKernels
    bits: int
    group: int
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    int8_activations: bool = False

    @classmethod
    def quantize(
        cls, kernels: CpuKernels, weight: torch.Tensor, bits: int, group: int
    ) -> GroupQuantized:
        """Round-to-nearest quantization of `weight` ([rows, K] float) in groups of `group`
        (a multiple of 32 dividing K; K itself: one scale per output channel): symmetric
        int8 (scale = max |w| / 127), asymmetric int4 (scale = (max - min) / 15, min)."""
        rows, k = weight.shape
        if bits not in (4, 8):
            raise ValueError(f"weights quantize to 4 or 8 bits, not {bits}")
        if group % QUANT_BLOCK or k % group:
            raise ValueError(
                f"quantization group {group} must be a multiple of {QUANT_BLOCK} dividing the "
                f"input size {k}"
            )
        w = weight.detach().float().reshape(rows, k // group, group)
        if bits == 8:
            scales = w.abs().amax(-1) / 127
            safe = torch.where(scales > 0, scales, torch.ones_like(scales))
            q = (w / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
            packed = q.reshape(rows, k).view(torch.uint8)
            return cls(kernels, 8, group, packed.contiguous(), scales.contiguous(), None)
        lo, hi = w.amin(-1), w.amax(-1)
        scales = (hi - lo) / 15
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = ((w - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
        # Each 32 values: byte j holds value j (low nibble) and value j + 16 (high nibble).
        q = q.reshape(rows, k // QUANT_BLOCK, 2, QUANT_BLOCK // 2)
        packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows, k // 2)
        return cls(kernels, 4, group, packed.contiguous(), scales.contiguous(), lo.contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    @property
    def nbytes(self) -> int:
        extra = 0 if self.mins is None else self.mins.numel() * 4
        return int(self.q.numel() + self.scales.numel() * 4 + extra)

    def serving_form(self) -> GroupQuantized:
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.qlinear_group(
            self.bits, x, self.q, self.scales, self.mins, self.group, self.int8_activations
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.dequant_rows_group(
            self.bits, self.q, self.scales, self.mins, self.group, ids
        )


# A low-bit matrix as a file or a load-time quantization gives it (split for tensor
# parallelism and stacked into fused projections in this form), and as the kernels read it.
LoadedWeight = GGUFBlocks | GroupQuantized
LowBitWeight = LoadedWeight | InterleavedBlocks


class QuantLinear(nn.Module):
    """`y = x @ W.T (+ bias)` with W held in low-bit form (`weight`), and optionally as a
    dense module of the same values, used for batches of more than `max_rows` rows."""

    bias: torch.Tensor | None

    def __init__(
        self,
        weight: LowBitWeight,
        dense: nn.Module | None = None,
        bias: torch.Tensor | None = None,
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        super().__init__()
        self.weight = weight.serving_form()
        self.dense = dense
        self.max_rows = max_rows
        self.register_buffer("bias", bias, persistent=False)
        self.out_features, self.in_features = weight.shape

    def serves(self, rows: int) -> bool:
        """Whether a batch of `rows` rows reads the low-bit weights (else the dense copy)."""
        return rows <= self.max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.dense is not None and not self.serves(rows):
            out: torch.Tensor = self.dense(x)
            return out
        y = self.weight.matmul(x.contiguous())
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        w = self.weight
        if isinstance(w, GGUFBlocks):
            kind = w.fmt
        elif isinstance(w, InterleavedBlocks):
            acts = "int8" if w.int8_activations else "bfloat16"
            kind = f"{w.fmt} interleaved, {acts} activations"
        else:
            minimums = ", with minimums" if w.bits == 8 and w.mins is not None else ""
            kind = f"int{w.bits}, group {w.group}{minimums}"
        dense_above = self.max_rows if self.dense is not None else None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {kind}, "
            f"dense_above={dense_above}"
        )


def low_bit_rows_of(model: nn.Module) -> int | None:
    """The most rows a step of `model` may have and still read its low-bit weights (None:
    it has none)."""
    rows = [m.max_rows for m in model.modules() if isinstance(m, QuantLinear)]
    return max(rows) if rows else None


def force_low_bit_max_rows(model: nn.Module, rows: int) -> int:
    """Make every low-bit projection of `model` (and its low-bit LM head) read the low-bit
    weights for steps of up to `rows` rows and the dense copy above, in place of the limit
    `low_bit_max_rows` chose for this CPU, so that a crossover can be measured (`rsgl bench
    one-batch --low-bit-max-rows`). Before the model's first step: its decode stack reads
    the limits when it is built. Returns how many modules it changed."""
    if rows < 0:
        raise ValueError(f"low-bit max rows must be >= 0, not {rows}")
    modules = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in modules:
        m.max_rows = rows
    return len(modules)


__all__ = [
    "AMX_TILES_MAX_ROWS",
    "DEFAULT_MAX_ROWS",
    "INT8_ACTIVATIONS_MAX_ROWS",
    "INTERLEAVED_INT8_BF16_AVX512_MAX_ROWS",
    "INTERLEAVED_INT8_MAX_ROWS",
    "GGUFBlocks",
    "GroupQuantized",
    "InterleavedBlocks",
    "LoadedWeight",
    "LowBitWeight",
    "QuantLinear",
    "force_low_bit_max_rows",
    "low_bit_max_rows",
    "uses_bf16_dot",
    "low_bit_rows_of",
]
