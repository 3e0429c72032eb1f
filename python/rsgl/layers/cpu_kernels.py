"""Fused CPU kernels for float32 and bfloat16 models, compiled on first use: paged decode
attention over a float32, float16, bfloat16, fp8 (e4m3, e5m2) or int8 KV cache (alone, or
with the rotary and the KV store of a decode-only layer step), add+RMSNorm,
SiLU-and-multiply, rotary.

Eager PyTorch has to gather every decode request's keys and values into a padded copy before
it can attend (measured at batch 64: the gather alone costs more than a third of the model's
matmul time per step). The decode kernel reads K/V straight from the paged buffers through
req_to_token, once, with software prefetch for the indirect rows; `decode_layer` also
rotates q/k and stores k/v in the same pass over each request. The elementwise kernels
replace 4-7 small torch ops each (each op pays a thread-pool round trip at decode sizes).

The sources are plain C files in `rsgl/csrc` (no torch headers, so they compile in a few
seconds): `common.h` (helpers), `elementwise.c`, which instantiates `elementwise_impl.h`
once per activation (model) dtype, and `attention.c`, which instantiates `attention_impl.h`
once per KV element type (`kv8.h` holds the 8-bit types' conversions) and `decode_impl.h`
once per (activation, KV) pair. Arithmetic is
float32 throughout; bfloat16 kernels round each intermediate the eager torch ops round, in
the same order, so a bfloat16 model gives the eager path's numbers. They are built with the
system C compiler into `~/.cache/rsgl/kernels` and called through ctypes, which releases the
GIL during the call. Without a compiler every caller falls back to eager torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from rsgl.cache_dir import rsgl_cache_dir
from rsgl.cpu_features import kernel_march

logger = logging.getLogger(__name__)

# The C sources, shipped in the package: compiled together into one shared library.
CSRC = Path(__file__).resolve().parents[1] / "csrc"
_SOURCES = (
    "elementwise.c",
    "attention.c",
    "quant.c",
    "quant_a8.c",
    "decode_stack.c",
    "affinity.c",
)

# Kernel name suffix of each activation (model) dtype.
_ACT_SUFFIXES: dict[torch.dtype, str] = {torch.float32: "f32", torch.bfloat16: "bf16"}
ACT_DTYPES = tuple(_ACT_SUFFIXES)

# GGUF block formats the projection kernels read (quant.c): ggml's type name -> the
# kernels' name and the bytes of one 32-weight block.
QUANT_FORMATS: dict[str, tuple[str, int]] = {
    "Q4_0": ("q4_0", 18),
    "Q4_1": ("q4_1", 20),
    "Q8_0": ("q8_0", 34),
}
QUANT_BLOCK = 32

# Kernel name suffix of each KV cache dtype (attention.c instantiates one set per type;
# float16 only where the compiler has _Float16). An int8 cache keeps a float32 scale per
# slot and kv head beside its buffers (rsgl.model_executor.kv_cache).
_KV_SUFFIXES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float8_e5m2: "e5m2",
    torch.float8_e4m3fn: "e4m3",
    torch.int8: "i8",
}
SCALED_KV_DTYPES = (torch.int8,)


# `RSGL_AMX=0` keeps the exact bfloat16 blocks on AVX512-BF16's dot products where AMX's
# tiles would serve them (`CpuKernels.amx`).
AMX_ENV = "RSGL_AMX"

# Compile flags (the target's come from `kernel_march`: this CPU, or the level that
# RSGL_CPU_FEATURES emulates). -ffast-math is for compiling only: a shared library *linked*
# with it gets crtfastmath, which turns on flush-to-zero for the whole process, torch
# included.
_FLAGS = ["-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _compile_flags() -> list[str]:
    return [*_FLAGS, *kernel_march()]


def _check(*tensors: torch.Tensor) -> torch.dtype:
    """The activation dtype the tensors share; ValueError unless they are contiguous CPU
    tensors of one dtype the kernels were built for."""
    dtype = tensors[0].dtype
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError("CPU kernels take contiguous CPU tensors of one dtype")
    if dtype not in _ACT_SUFFIXES:
        raise ValueError(f"CPU kernels take float32 or bfloat16 tensors, not {dtype}")
    return dtype


def _check_kv(
    kernels: dict[tuple[torch.dtype, torch.dtype], Any],
    act: torch.dtype,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    heads: int,
) -> None:
    for t in (k_buffer, v_buffer):
        if not t.is_contiguous() or t.device.type != "cpu" or t.dtype != k_buffer.dtype:
            raise ValueError("the K and V buffers must be contiguous CPU tensors of one dtype")
    if k_buffer.dim() != 3 or k_buffer.shape != v_buffer.shape:
        raise ValueError("the K and V buffers must both be [slots, kv_heads, head_dim]")
    if (act, k_buffer.dtype) not in kernels:
        supported = ", ".join(str(kv) for a, kv in kernels if a == act)
        raise ValueError(f"KV buffers of {k_buffer.dtype}: the kernels were built for {supported}")
    if heads % k_buffer.shape[1]:
        raise ValueError(f"{heads} query heads do not divide into {k_buffer.shape[1]} kv heads")


def _scale_ptrs(
    k_buffer: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None
) -> tuple[int | None, int | None]:
    """The data pointers of an int8 cache's scales ([slots, kv heads] float32), checked;
    (None, None) for the other KV dtypes, which take none."""
    if k_buffer.dtype not in SCALED_KV_DTYPES:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"a {k_buffer.dtype} KV cache has no scales")
        return None, None
    if k_scales is None or v_scales is None:
        raise ValueError(f"a {k_buffer.dtype} KV cache needs its k and v scales")
    for t in (k_scales, v_scales):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("KV scales must be contiguous float32 CPU tensors")
        if t.shape != k_buffer.shape[:2]:
            raise ValueError(f"KV scales must be {list(k_buffer.shape[:2])}, not {list(t.shape)}")
        if t.numel() >= 2**31:
            raise ValueError("the kernels index KV scales with 32-bit offsets: 2^31 at most")
    return k_scales.data_ptr(), v_scales.data_ptr()


def _check_index(t: torch.Tensor, dtype: torch.dtype) -> None:
    if not t.is_contiguous() or t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"CPU kernels take contiguous {dtype} CPU index tensors")


def _check_blocks(blocks: torch.Tensor, fmt: str, k: int | None) -> tuple[int, int]:
    """(rows, K) of a GGUF-block matrix; ValueError unless it is a contiguous CPU uint8
    [rows, K / 32 * block bytes] of a known format (and K matches `k` when given)."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"GGUF format {fmt!r}: the kernels read {', '.join(QUANT_FORMATS)}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError("GGUF blocks must be a contiguous uint8 [rows, row bytes] tensor")
    if blocks.device.type != "cpu":
        raise ValueError("GGUF blocks must be on the CPU")
    size = QUANT_FORMATS[fmt][1]
    if blocks.shape[1] % size:
        raise ValueError(f"a {fmt} row is a whole number of {size}-byte blocks")
    cols = blocks.shape[1] // size * QUANT_BLOCK
    if k is not None and k != cols:
        raise ValueError(f"x has {k} columns, the {fmt} weight {cols}")
    return blocks.shape[0], cols


def _check_groups(
    bits: int, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int
) -> tuple[int, int]:
    """(rows, K) of a load-time quantized matrix; ValueError unless its parts agree."""
    if q.dtype != torch.uint8 or q.dim() != 2 or not q.is_contiguous() or q.device.type != "cpu":
        raise ValueError("quantized weights must be a contiguous uint8 [rows, bytes] CPU tensor")
    if bits not in (4, 8):
        raise ValueError(f"quantized weights have 4 or 8 bits, not {bits}")
    if bits == 4 and mins is None:
        raise ValueError("int4 weights need their minimums")
    rows, k = q.shape[0], q.shape[1] * 8 // bits
    # int8 without minimums also takes groups of 16 (GGUF's Q6_K: two scales a block of 32);
    # with minimums (GGUF's Q5_K) only groups of 32.
    halves = bits == 8 and mins is None and group == QUANT_BLOCK // 2
    if bits == 8 and mins is not None and group != QUANT_BLOCK:
        raise ValueError(f"int8 weights with minimums take groups of {QUANT_BLOCK}, not {group}")
    if group <= 0 or (group % QUANT_BLOCK and not halves) or k % QUANT_BLOCK or k % group:
        raise ValueError(
            f"group {group} must be a multiple of {QUANT_BLOCK} dividing K = {k}"
            + (f" (or {QUANT_BLOCK // 2}, for int8 weights)" if mins is None else "")
        )
    for t in (scales, mins):
        if t is None:
            continue
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("scales and mins must be contiguous float32 CPU tensors")
        if t.shape != (rows, k // group):
            raise ValueError(f"scales and mins must be [{rows}, {k // group}], not {list(t.shape)}")
    return rows, k


class CpuKernels:
    """ctypes handles on the compiled kernels; every method writes into `out`."""

    def __init__(self, library: Path) -> None:
        self.library = library
        lib = ctypes.CDLL(str(library))
        ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        # Per (activation, KV cache) dtype pair: the attention kernels instantiated for
        # them (a KV type whose guard failed at compile time has none).
        self._decode: dict[tuple[torch.dtype, torch.dtype], Any] = {}
        self._decode_layer: dict[tuple[torch.dtype, torch.dtype], Any] = {}
        for act, act_suffix in _ACT_SUFFIXES.items():
            for kv, kv_suffix in _KV_SUFFIXES.items():
                suffix = f"{act_suffix}_{kv_suffix}"
                if not hasattr(lib, f"rsgl_decode_attention_{suffix}"):
                    continue
                decode = getattr(lib, f"rsgl_decode_attention_{suffix}")
                decode.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
                decode.argtypes += [i64, i64, i64, i64, f32, i32]
                layer = getattr(lib, f"rsgl_decode_layer_{suffix}")
                layer.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
                layer.argtypes += [i64, i64, i64, i64, f32, i32]
                self._decode[act, kv], self._decode_layer[act, kv] = decode, layer
        # Per activation dtype.
        self._add_rmsnorm: dict[torch.dtype, Any] = {}
        self._silu_mul: dict[torch.dtype, Any] = {}
        self._rotary: dict[torch.dtype, Any] = {}
        self._argmax: dict[torch.dtype, Any] = {}
        for act, suffix in _ACT_SUFFIXES.items():
            argmax = getattr(lib, f"rsgl_argmax_rows_{suffix}")
            argmax.argtypes = [ptr, i64, i64, ptr, i32]
            self._argmax[act] = argmax
            norm = getattr(lib, f"rsgl_add_rmsnorm_{suffix}")
            norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
            silu = getattr(lib, f"rsgl_silu_mul_{suffix}")
            silu.argtypes = [ptr, ptr, i64, i64, i32]
            rotary = getattr(lib, f"rsgl_rotary_{suffix}")
            rotary.argtypes = [ptr, ptr, i64, i64, i64, i64, i32]
            self._add_rmsnorm[act], self._silu_mul[act], self._rotary[act] = norm, silu, rotary
        # Per (GGUF format, activation dtype): y = x . W^T over the format's blocks.
        # The same with int8 activations (quant_a8.c), keyed (format, activation dtype, True),
        # over the blocks interleaved by eight weight rows (`pack_a8`).
        self._qlinear: dict[tuple[str, torch.dtype, bool], Any] = {}
        self._dequant_rows: dict[str, Any] = {}
        self._packed_a8_bytes: dict[str, Any] = {}
        self._pack_a8: dict[str, Any] = {}
        self._unpack_rows_a8: dict[str, Any] = {}
        # Per GGUF format: bfloat16 activations times the interleaved blocks, the weights
        # exact (quant_a8.c's AVX512-BF16 kernels; plain C where the build lacks them).
        self._qlinear_x8b: dict[str, Any] = {}
        # The same over AMX's layout (`pack_amx`), on its tiles: per format, the product,
        # the packed size, the packing and rows back out.
        self._amx: dict[str, tuple[Any, Any, Any, Any]] = {}
        for fmt, (name, _) in QUANT_FORMATS.items():
            self._packed_a8_bytes[fmt] = getattr(lib, f"rsgl_packed_a8_bytes_{name}")
            self._packed_a8_bytes[fmt].argtypes = [i64, i64]
            self._packed_a8_bytes[fmt].restype = i64
            self._pack_a8[fmt] = getattr(lib, f"rsgl_pack_a8_{name}")
            self._pack_a8[fmt].argtypes = [ptr, i64, i64, ptr]
            self._unpack_rows_a8[fmt] = getattr(lib, f"rsgl_unpack_rows_a8_{name}")
            self._unpack_rows_a8[fmt].argtypes = [ptr, i64, ptr, i64, ptr]
            for act, suffix in _ACT_SUFFIXES.items():
                for a8, infix in ((False, ""), (True, "_a8")):
                    qlinear = getattr(lib, f"rsgl_qlinear_{name}{infix}_{suffix}")
                    qlinear.argtypes = [ptr, i64, i64, ptr, i64, ptr, i32]
                    self._qlinear[fmt, act, a8] = qlinear
            self._qlinear_x8b[fmt] = getattr(lib, f"rsgl_qlinear_{name}_x8b_bf16")
            self._qlinear_x8b[fmt].argtypes = [ptr, i64, i64, ptr, i64, ptr, i32]
            amx = [
                getattr(lib, f"rsgl_{part}")
                for part in (
                    f"qlinear_{name}_amx_bf16",
                    f"packed_amx_bytes_{name}",
                    f"pack_amx_{name}",
                    f"unpack_rows_amx_{name}",
                )
            ]
            amx[0].argtypes = [ptr, i64, i64, ptr, i64, ptr, i32]
            amx[1].argtypes, amx[1].restype = [i64, i64], i64
            amx[2].argtypes = [ptr, i64, i64, ptr]
            amx[3].argtypes = [ptr, i64, ptr, i64, ptr]
            self._amx[fmt] = (amx[0], amx[1], amx[2], amx[3])
            self._dequant_rows[fmt] = getattr(lib, f"rsgl_dequant_rows_{name}")
            self._dequant_rows[fmt].argtypes = [ptr, i64, ptr, i64, ptr]
        # Weights quantized at load time: one entry per activation dtype and int8 activations
        # or not, the bits an argument.
        self._qlinear_group: dict[tuple[torch.dtype, bool], Any] = {}
        for act, suffix in _ACT_SUFFIXES.items():
            for a8, infix in ((False, ""), (True, "_a8")):
                group = getattr(lib, f"rsgl_qlinear_group{infix}_{suffix}")
                group.argtypes = [i32, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i32]
                self._qlinear_group[act, a8] = group
        self._dequant_rows_group = lib.rsgl_dequant_rows_group
        self._dequant_rows_group.argtypes = [i32, ptr, ptr, ptr, i64, i64, ptr, i64, ptr]
        self._bitmask = lib.rsgl_apply_token_bitmask_f32
        self._bitmask.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i32]
        self._race_uniforms = lib.rsgl_race_uniforms
        self._race_uniforms.argtypes = [ptr, ptr, i64, i64, ptr, i32]
        # A decode step through every layer of a low-bit model in one call (decode_stack.c).
        self._decode_stack = lib.rsgl_decode_stack
        self._decode_stack.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64]
        self._decode_stack.argtypes += [ptr, ptr, i32]
        self._decode_stack.restype = ctypes.c_int
        self._bind = lib.rsgl_bind_omp_threads
        self._bind.argtypes, self._bind.restype = [ptr, i32], ctypes.c_int
        native = lib.rsgl_x8b_native
        native.argtypes, native.restype = [], ctypes.c_int
        # Whether `qlinear_x8b` runs on AVX512-BF16's dot products (else in plain C).
        self.x8b_native = bool(native())
        # Whether the exact bfloat16 blocks are laid out for AMX's tiles and multiplied on
        # them (`pack_amx`, `qlinear_amx`), in every batch: where the kernels were built for
        # AMX and Linux grants this process its tiles, unless `RSGL_AMX=0` (which keeps
        # `qlinear_x8b`'s dot products, to compare).
        enable = lib.rsgl_amx_enable
        enable.argtypes, enable.restype = [], ctypes.c_int
        self.amx = os.environ.get(AMX_ENV, "1") != "0" and bool(enable())
        isa = lib.rsgl_kernel_isa
        isa.argtypes, isa.restype = [], ctypes.c_char_p
        # The instruction sets the kernels were compiled for (which of their paths run).
        self.isa: tuple[str, ...] = tuple(isa().decode().split())
        for fn in (
            *self._decode.values(),
            *self._decode_layer.values(),
            *self._add_rmsnorm.values(),
            *self._silu_mul.values(),
            *self._rotary.values(),
            *self._argmax.values(),
            *self._qlinear.values(),
            *self._qlinear_x8b.values(),
            *(fns[i] for fns in self._amx.values() for i in (0, 2, 3)),
            *self._dequant_rows.values(),
            *self._qlinear_group.values(),
            self._dequant_rows_group,
            self._bitmask,
            self._race_uniforms,
        ):
            fn.restype = None

    def layer_kernels(self, act: torch.dtype, kv: torch.dtype) -> tuple[int, int, int]:
        """The addresses of the add+RMSNorm, SiLU-and-multiply and fused decode-layer kernels
        for activations of `act` over a KV cache of `kv` (for `rsgl_decode_stack`)."""
        fns = (self._add_rmsnorm[act], self._silu_mul[act], self._decode_layer[act, kv])
        return tuple(_address(fn) for fn in fns)  # type: ignore[return-value]

    def qlinear_address(
        self,
        fmt: str | None,
        act: torch.dtype,
        int8_activations: bool = False,
        interleaved: bool = False,
        amx: bool = False,
    ) -> int:
        """The projection kernel over GGUF blocks of `fmt` (None: over load-time groups),
        exact or with `int8_activations` (GGUF's: over the blocks `pack_a8` interleaved);
        exact over the `interleaved` blocks: `qlinear_x8b`'s, or with `amx` (blocks in AMX's
        layout) `qlinear_amx`'s (bfloat16 only)."""
        if fmt is None:
            return _address(self._qlinear_group[act, int8_activations])
        if interleaved and not int8_activations:
            if act != torch.bfloat16:
                raise ValueError("the interleaved blocks' exact kernel takes bfloat16 rows")
            return _address(self._amx[fmt][0] if amx else self._qlinear_x8b[fmt])
        return _address(self._qlinear[fmt, act, int8_activations])

    def decode_stack(
        self,
        model: Any,
        layers: Any,
        num_layers: int,
        x: torch.Tensor,
        final_norm: torch.Tensor,
        cis: torch.Tensor,
        loc: torch.Tensor,
        req_to_token: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Every decoder layer of a decode step, then the final norm, in one call (see
        decode_stack.c; `model` and `layers` are its ctypes structures, built and checked by
        rsgl.layers.decode_stack). x: [B, hidden], the embedded tokens (overwritten);
        returns the normed [B, hidden] the LM head reads."""
        normed = torch.empty_like(x)
        status = self._decode_stack(
            ctypes.byref(model),
            layers,
            num_layers,
            x.data_ptr(),
            normed.data_ptr(),
            final_norm.data_ptr(),
            x.shape[0],
            cis.data_ptr(),
            loc.data_ptr(),
            req_to_token.data_ptr(),
            req_to_token.stride(0),
            req_slots.data_ptr(),
            seq_lens.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("decode_stack: no memory for the step's scratch")
        return normed

    def supports(self, act_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether the attention kernels were built for activations of `act_dtype` (the
        model's) over a KV cache of `kv_dtype`."""
        return (act_dtype, kv_dtype) in self._decode

    def decode_attention(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """q/out: [B, H, D] float32 or bfloat16; buffers [N, Hkv, D] of a KV dtype (float32,
        float16, bfloat16, float8_e5m2, float8_e4m3fn, or int8 with its scales [N, Hkv]);
        req_to_token int32; slots/lens int64 [B]."""
        act = _check(q, out)
        _check_kv(self._decode, act, k_buffer, v_buffer, q.shape[1])
        ks, vs = _scale_ptrs(k_buffer, k_scales, v_scales)
        _check_index(req_to_token, torch.int32)
        _check_index(req_slots, torch.int64)
        _check_index(seq_lens, torch.int64)
        b, h, d = q.shape
        if d != k_buffer.shape[2] or out.shape != q.shape:
            raise ValueError("decode_attention: q, out and the KV buffers' head_dim must agree")
        if req_slots.shape != (b,) or seq_lens.shape != (b,):
            raise ValueError(f"decode_attention: req_slots and seq_lens must have shape ({b},)")
        self._decode[act, k_buffer.dtype](
            q.data_ptr(),
            k_buffer.data_ptr(),
            v_buffer.data_ptr(),
            ks,
            vs,
            req_to_token.data_ptr(),
            req_to_token.stride(0),
            req_slots.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            b,
            h,
            k_buffer.shape[1],
            d,
            scale,
            torch.get_num_threads(),
        )

    def decode_layer(
        self,
        qkv: torch.Tensor,
        cis: torch.Tensor,
        out_cache_loc: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        num_heads: int,
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotary + KV store + decode attention for a decode-only batch, in one call.

        qkv: [B, (H + 2 Hkv) D] float32 or bfloat16 (pair-interleaved q/k); cis: [B, D / 2, 2]
        float32 (cos, sin); out_cache_loc, req_slots, seq_lens: int64 [B]; the scales of an
        int8 cache are stored too. Returns [B, H * D] of qkv's dtype.
        """
        act = _check(qkv)
        if _check(cis) != torch.float32:
            raise ValueError("decode_layer: cis must be float32")
        _check_kv(self._decode_layer, act, k_buffer, v_buffer, num_heads)
        ks, vs = _scale_ptrs(k_buffer, k_scales, v_scales)
        _check_index(req_to_token, torch.int32)
        b = qkv.shape[0]
        for t in (out_cache_loc, req_slots, seq_lens):
            _check_index(t, torch.int64)
            if t.shape != (b,):
                raise ValueError(f"decode_layer: index tensors must have shape ({b},)")
        _, kv_heads, d = k_buffer.shape
        if qkv.shape[1] != (num_heads + 2 * kv_heads) * d or cis.numel() != b * d:
            raise ValueError("decode_layer: qkv / cis shapes do not match the KV buffers")
        out = torch.empty((b, num_heads * d), dtype=qkv.dtype)
        self._decode_layer[act, k_buffer.dtype](
            qkv.data_ptr(),
            cis.data_ptr(),
            out_cache_loc.data_ptr(),
            k_buffer.data_ptr(),
            v_buffer.data_ptr(),
            ks,
            vs,
            req_to_token.data_ptr(),
            req_to_token.stride(0),
            req_slots.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            b,
            num_heads,
            kv_heads,
            d,
            scale,
            torch.get_num_threads(),
        )
        return out

    def add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) * weight, x + residual); without residual, (norm(x), x).
        All of one dtype, float32 or bfloat16 (statistics in float32 either way)."""
        act = _check(x, weight) if residual is None else _check(x, residual, weight)
        rows, dim = x.shape
        out = torch.empty_like(x)
        summed = x if residual is None else torch.empty_like(x)
        self._add_rmsnorm[act](
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            summed.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out, summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] ([rows, 2 * inter]), float32 or
        bfloat16."""
        act = _check(gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul[act](
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out

    def rotary_qk(self, qkv: torch.Tensor, cis: torch.Tensor, heads: int, head_dim: int) -> None:
        """Rotates in place the first `heads` heads of each row of qkv ([T, width] float32 or
        bfloat16, pair-interleaved; q heads then k heads) by cis ([T, head_dim / 2, 2]
        float32 (cos, sin))."""
        act = _check(qkv)
        if _check(cis) != torch.float32:
            raise ValueError("rotary_qk: cis must be float32")
        rows, width = qkv.shape
        if heads * head_dim > width or head_dim % 2 or cis.numel() != rows * head_dim:
            raise ValueError("rotary_qk: qkv / cis shapes do not match heads x head_dim")
        self._rotary[act](
            qkv.data_ptr(), cis.data_ptr(), rows, width, heads, head_dim, torch.get_num_threads()
        )

    def bind_omp_threads(self, cpus: list[int]) -> bool:
        """Pins the calling thread's OpenMP team (torch's intra-op threads, which these
        kernels share) to `cpus`, thread i to cpus[i]: the caller to cpus[0]. Sets torch's
        intra-op threads to len(cpus). False when some thread could not be pinned."""
        if not cpus:
            raise ValueError("bind_omp_threads: no CPUs")
        torch.set_num_threads(len(cpus))
        array = (ctypes.c_int * len(cpus))(*cpus)
        return int(self._bind(array, len(cpus))) == 0

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x.argmax(dim=-1)` for x [rows, cols] float32 or bfloat16 (int64 indices; the
        first of equal maxima, NaN largest, as torch). torch's CPU argmax over a batch of
        SmolLM2 logits ([64, 49152]) took 2 ms in float32 and 5 ms in bfloat16."""
        act = _check(x)
        rows, cols = x.shape
        if cols == 0:
            raise ValueError("argmax_rows: rows are empty")
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax[act](x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads())
        return out

    def qlinear(self, x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
        """x [M, K] (float32 or bfloat16) times W^T, where W is stored as GGUF blocks of
        `fmt` (`QUANT_FORMATS`): blocks is uint8 [N, K / 32 * block bytes], one weight row
        per row. Returns [M, N] of x's dtype."""
        act = _check(x)
        rows, k = _check_blocks(blocks, fmt, x.shape[1] if x.dim() == 2 else -1)
        if x.dim() != 2:
            raise ValueError("qlinear: x must be [M, K]")
        return self._run_qlinear(self._qlinear[fmt, act, False], x, blocks, rows, k)

    def _run_qlinear(
        self, fn: Any, x: torch.Tensor, w: torch.Tensor, rows: int, k: int
    ) -> torch.Tensor:
        out = torch.empty((x.shape[0], rows), dtype=x.dtype)
        if x.shape[0]:
            fn(
                x.data_ptr(),
                x.shape[0],
                k,
                w.data_ptr(),
                rows,
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out

    def pack_a8(self, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
        """GGUF blocks (see `qlinear`) interleaved by eight weight rows, as the int8-
        activation kernels read them (quant_a8.c): uint8 [ceil(N / 8), K / 32 * 8 blocks'
        bytes], the last group padded with zero rows. The same bytes, reordered."""
        rows, k = _check_blocks(blocks, fmt, None)
        out = torch.empty((-(-rows // 8), self._packed_a8_bytes[fmt](8, k)), dtype=torch.uint8)
        self._pack_a8[fmt](blocks.data_ptr(), rows, k, out.data_ptr())
        return out

    def pack_amx(self, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
        """GGUF blocks (see `qlinear`) in AMX's layout, as `qlinear_amx` reads them
        (quant_a8.c): uint8 [ceil(N / 16), K / 32 * 16 blocks' bytes], the last group padded
        with zero rows. The same bytes, reordered (nibbles moved within their blocks)."""
        rows, k = _check_blocks(blocks, fmt, None)
        out = torch.empty((-(-rows // 16), self._amx[fmt][1](16, k)), dtype=torch.uint8)
        self._amx[fmt][2](blocks.data_ptr(), rows, k, out.data_ptr())
        return out

    def qlinear_amx(
        self, x: torch.Tensor, packed: torch.Tensor, fmt: str, rows: int
    ) -> torch.Tensor:
        """`qlinear_x8b`'s product (the weights exact) over W's GGUF blocks as `pack_amx`
        laid them out, on AMX's tiles; only where `amx` says they run. Returns [M, rows]
        bfloat16."""
        if not self.amx:
            raise RuntimeError("qlinear_amx: AMX's tiles are not enabled in this process")
        return self._exact_bf16(x, packed, fmt, rows, amx=True)

    def _exact_bf16(
        self, x: torch.Tensor, packed: torch.Tensor, fmt: str, rows: int, amx: bool
    ) -> torch.Tensor:
        if _check(x) != torch.bfloat16 or x.dim() != 2 or x.shape[1] % QUANT_BLOCK:
            name = "qlinear_amx" if amx else "qlinear_x8b"
            raise ValueError(f"{name}: x must be bfloat16 [M, K], K a multiple of {QUANT_BLOCK}")
        self._check_packed(packed, fmt, rows, x.shape[1], amx)
        fn = self._amx[fmt][0] if amx else self._qlinear_x8b[fmt]
        return self._run_qlinear(fn, x, packed, rows, x.shape[1])

    def unpack_rows_amx(
        self, packed: torch.Tensor, fmt: str, rows: int, k: int, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows `ids` (int64) of a `pack_amx` matrix of `rows` x `k` weights, as the file held
        them: uint8 [len(ids), K / 32 * block bytes]."""
        return self._unpack_rows(packed, fmt, rows, k, ids, amx=True)

    def _check_packed(
        self, packed: torch.Tensor, fmt: str, rows: int, k: int, amx: bool = False
    ) -> None:
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"GGUF format {fmt!r}: the kernels read {', '.join(QUANT_FORMATS)}")
        group, layout = (16, "in AMX's layout") if amx else (8, "interleaved")
        shape = (
            -(-rows // group),
            (self._amx[fmt][1] if amx else self._packed_a8_bytes[fmt])(group, k),
        )
        if (
            packed.dtype != torch.uint8
            or tuple(packed.shape) != shape
            or not packed.is_contiguous()
            or packed.device.type != "cpu"
        ):
            raise ValueError(
                f"{rows} x {k} {fmt} weights {layout} are a contiguous CPU uint8 {shape}"
            )

    def qlinear_a8(
        self, x: torch.Tensor, packed: torch.Tensor, fmt: str, rows: int
    ) -> torch.Tensor:
        """x [M, K] (float32 or bfloat16) times W^T for W's GGUF blocks as `pack_a8`
        interleaved them (`rows` weight rows), x quantized to int8 per block of 32 first,
        as llama.cpp does for these formats (quant_a8.c; not the float32 product). Returns
        [M, rows] of x's dtype."""
        act = _check(x)
        if x.dim() != 2 or x.shape[1] % QUANT_BLOCK:
            raise ValueError(f"qlinear_a8: x must be [M, K], K a multiple of {QUANT_BLOCK}")
        self._check_packed(packed, fmt, rows, x.shape[1])
        return self._run_qlinear(self._qlinear[fmt, act, True], x, packed, rows, x.shape[1])

    def qlinear_x8b(
        self, x: torch.Tensor, packed: torch.Tensor, fmt: str, rows: int
    ) -> torch.Tensor:
        """x [M, K] bfloat16 times W^T for W's GGUF blocks as `pack_a8` interleaved them
        (`rows` weight rows), the weights exact: per block d * sum(q * x) + m * sum(x), the
        quants' products with x exact in float32 (quant_a8.c). Returns [M, rows] bfloat16."""
        return self._exact_bf16(x, packed, fmt, rows, amx=False)

    def unpack_rows_a8(
        self, packed: torch.Tensor, fmt: str, rows: int, k: int, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows `ids` (int64) of a `pack_a8` matrix of `rows` x `k` weights, as the file held
        them: uint8 [len(ids), K / 32 * block bytes]."""
        return self._unpack_rows(packed, fmt, rows, k, ids, amx=False)

    def _unpack_rows(
        self, packed: torch.Tensor, fmt: str, rows: int, k: int, ids: torch.Tensor, amx: bool
    ) -> torch.Tensor:
        _check_index(ids, torch.int64)
        self._check_packed(packed, fmt, rows, k, amx)
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < rows:
            raise ValueError(f"unpack_rows: ids must be in [0, {rows})")
        out = torch.empty((len(ids), k // QUANT_BLOCK * QUANT_FORMATS[fmt][1]), dtype=torch.uint8)
        unpack = self._amx[fmt][3] if amx else self._unpack_rows_a8[fmt]
        unpack(packed.data_ptr(), k, ids.data_ptr(), len(ids), out.data_ptr())
        return out

    def dequant_rows(self, blocks: torch.Tensor, fmt: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64) of a GGUF-block matrix (see `qlinear`) as float32 [len, K]:
        exactly gguf's dequantize of those rows."""
        _check_index(ids, torch.int64)
        rows, k = _check_blocks(blocks, fmt, None)
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < rows:
            raise ValueError(f"dequant_rows: ids must be in [0, {rows})")
        out = torch.empty((len(ids), k), dtype=torch.float32)
        self._dequant_rows[fmt](blocks.data_ptr(), k, ids.data_ptr(), len(ids), out.data_ptr())
        return out

    def qlinear_group(
        self,
        bits: int,
        x: torch.Tensor,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        group: int,
        int8_activations: bool = False,
    ) -> torch.Tensor:
        """x [M, K] (float32 or bfloat16) times W^T for W quantized at load time
        (`rsgl.layers.quant_linear.GroupQuantized`): q uint8 [N, K] (`bits` 8: int8 bytes,
        w = s * q, or s * q + m with `mins`) or [N, K / 2] (4: nibbles, w = s * q + m),
        float32 scales (and mins) [N, K / group]. Returns [M, N]. `int8_activations`: x
        quantized to int8 per block of 32 first (quant_a8.c), as for GGUF blocks."""
        act = _check(x)
        rows, k = _check_groups(bits, q, scales, mins, group)
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"qlinear_group: x must be [M, {k}]")
        out = torch.empty((x.shape[0], rows), dtype=x.dtype)
        if x.shape[0]:
            self._qlinear_group[act, int8_activations](
                bits,
                x.data_ptr(),
                x.shape[0],
                k,
                q.data_ptr(),
                scales.data_ptr(),
                None if mins is None else mins.data_ptr(),
                group,
                rows,
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out

    def dequant_rows_group(
        self,
        bits: int,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        group: int,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        """Rows `ids` of a load-time quantized matrix (see `qlinear_group`) as float32."""
        _check_index(ids, torch.int64)
        rows, k = _check_groups(bits, q, scales, mins, group)
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < rows:
            raise ValueError(f"dequant_rows_group: ids must be in [0, {rows})")
        out = torch.empty((len(ids), k), dtype=torch.float32)
        self._dequant_rows_group(
            bits,
            q.data_ptr(),
            scales.data_ptr(),
            None if mins is None else mins.data_ptr(),
            k,
            group,
            ids.data_ptr(),
            len(ids),
            out.data_ptr(),
        )
        return out

    def race_uniforms(
        self, seeds: torch.Tensor, positions: torch.Tensor, vocab: int
    ) -> torch.Tensor:
        """The uniforms [n, vocab] float32 of the sampler's exponential race for n (seed,
        position) rows, exactly as `rsgl.layers.sampler.race_uniforms` computes them in
        torch: ~20x faster on 2 cores (its int64 tensor ops read and write 8 bytes a token
        each, ten times over)."""
        _check_index(seeds, torch.int64)
        _check_index(positions, torch.int64)
        if seeds.dim() != 1 or positions.shape != seeds.shape or vocab < 0:
            raise ValueError("race_uniforms: seeds and positions must be [n] alike")
        out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32)
        self._race_uniforms(
            seeds.data_ptr(),
            positions.data_ptr(),
            seeds.shape[0],
            vocab,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def apply_token_bitmask(
        self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
    ) -> None:
        """Sets to -inf, in place, the logits of every token a grammar forbids: row rows[i]
        of logits ([B, V] float32) by row i of bitmask (int32 [len(rows), ceil(V / 32)])."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError("apply_token_bitmask: logits must be float32 [B, V], rows dense")
        _check_index(rows, torch.int64)
        _check_index(bitmask, torch.int32)
        if bitmask.dim() != 2 or bitmask.shape[0] != rows.shape[0]:
            raise ValueError("apply_token_bitmask: one bitmask row per masked row")
        if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < logits.shape[0]:
            raise ValueError("apply_token_bitmask: a row is out of range")
        self._bitmask(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[1],
            rows.data_ptr(),
            len(rows),
            bitmask.data_ptr(),
            bitmask.shape[1],
            torch.get_num_threads(),
        )


def _address(fn: Any) -> int:
    """A ctypes function's address, to hand to another kernel."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    assert address is not None
    return address


def _cpu_fingerprint() -> str:
    # -march=native code must not be reused on a CPU with other instruction sets.
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def compile_kernels(src_dir: Path, library: Path, compiler: str) -> str | None:
    """Builds `library` from the sources in `src_dir`; the compiler's messages (which name
    the real files and lines) when it fails, else None."""
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        objects = [Path(tmp) / f"{Path(name).stem}.o" for name in _SOURCES]
        tmp_lib = Path(tmp) / library.name
        commands = [
            [compiler, *_compile_flags(), "-c", str(src_dir / name), "-o", str(obj)]
            for name, obj in zip(_SOURCES, objects, strict=True)
        ]
        commands.append([compiler, *_LINK_FLAGS, *map(str, objects), "-o", str(tmp_lib)])
        for cmd in commands:
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                return result.stderr
        # Rename is atomic, so concurrent first loads never see a half-written library.
        os.replace(tmp_lib, library)
    return None


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> CpuKernels | None:
    """Compile (once per source and CPU) and load the kernels; None when they cannot be built.

    Set RSGL_CPU_KERNELS=0 to force the eager torch paths.
    """
    if os.environ.get("RSGL_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    flags = " ".join(_compile_flags() + _LINK_FLAGS)
    key = hashlib.sha256((_sources_digest() + flags + _cpu_fingerprint()).encode()).hexdigest()
    out_dir = rsgl_cache_dir() / "kernels"
    library = out_dir / f"cpu_kernels-{key[:16]}.so"
    if not library.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        errors = compile_kernels(CSRC, library, compiler)
        if errors is not None:
            logger.warning(
                "the CPU kernels did not compile (%s); using eager torch ops:\n%s",
                compiler,
                errors[-2000:],
            )
            return None
    try:
        return CpuKernels(library)
    except OSError:
        return None
