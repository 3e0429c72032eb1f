"""A decode step through every decoder layer in one C call (`rsgl/csrc/decode_stack.c`).

For a model whose projections are all low-bit (GGUF blocks or load-time groups), a small
decode-only batch on CPU spends as long between its kernels as in its matmuls: at batch 1
each layer makes eight kernel calls from Python, each with its checks, its output
allocation and its module dispatch. The C driver makes the same calls on the same values in
the same order, so the logits are the layer-by-layer path's bit for bit; `DecodeStack`
describes the model to it once (weights, norms, KV buffers, which kernel instances), and
`run` hands it one step's indices.

A speculative verify step goes through it too when its tokens fit (each a row at its own
position, `TorchNativeAttnBackend.decode_stack_step`): a verify of 4 drafts at batch 1 went
from 68 to 14 ms (a decode step: 9.4 ms; bfloat16, 2 Sapphire Rapids cores, `rsgl bench
speculative --parts verify-cost`), and its logits are the decode steps' own.

RSGL_DECODE_STACK=0 keeps every step on the layer-by-layer path (to compare the two).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rsgl.layers.cpu_kernels import CpuKernels
from rsgl.layers.quant_linear import GGUFBlocks, GroupQuantized, InterleavedBlocks, LowBitWeight

ENABLED = os.environ.get("RSGL_DECODE_STACK", "1") != "0"

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Proj(ctypes.Structure):
    _fields_ = [
        ("gguf", _ptr),
        ("group_fn", _ptr),
        ("w", _ptr),
        ("scales", _ptr),
        ("mins", _ptr),
        ("group", _i64),
        ("n", _i64),
        ("k", _i64),
        ("bits", _i32),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Proj),
        ("o", _Proj),
        ("gate_up", _Proj),
        ("down", _Proj),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("k_scales", _ptr),
        ("v_scales", _ptr),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("add_rmsnorm", _ptr),
        ("silu_mul", _ptr),
        ("attend", _ptr),
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("inter", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("act_bytes", _i32),
    ]


@dataclass(frozen=True, slots=True)
class Shapes:
    """The decoder's sizes, and its norms' epsilon and attention's scale."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float


@dataclass(frozen=True, slots=True)
class LayerParts:
    """One decoder layer as the driver reads it: norm weights (the activation dtype), the
    four projections' low-bit weights, and the layer's KV buffers ([slots, kv heads, head
    dim]; an int8 cache's scales [slots, kv heads], else None)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LowBitWeight
    o: LowBitWeight
    gate_up: LowBitWeight
    down: LowBitWeight
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None


class DecodeStack:
    """A model's decoder layers described once to `rsgl_decode_stack`; ValueError when a
    part is not what the kernels read (a shape, a dtype, a non-contiguous tensor). The
    tensors it points at must live and stay put as long as it does (it keeps references)."""

    def __init__(
        self,
        kernels: CpuKernels,
        act: torch.dtype,
        parts: Sequence[LayerParts],
        final_norm: torch.Tensor,
        shapes: Shapes,
    ) -> None:
        self.kernels = kernels
        self.act = act
        self.final_norm = _norm(final_norm, act, shapes.hidden)
        s = shapes
        kv_dtype = parts[0].k_cache.dtype
        norm, silu, attend = kernels.layer_kernels(act, kv_dtype)
        self._model = _Model(
            norm,
            silu,
            attend,
            s.hidden,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.inter,
            s.eps,
            s.scale,
            torch.empty((), dtype=act).element_size(),
        )
        q, width = s.heads * s.head_dim, (s.heads + 2 * s.kv_heads) * s.head_dim
        expected = {
            "qkv": (width, s.hidden),
            "o": (s.hidden, q),
            "gate_up": (2 * s.inter, s.hidden),
            "down": (s.hidden, s.inter),
        }
        self._keep: list[torch.Tensor] = [self.final_norm]
        self._layers = (_Layer * len(parts))()
        for i, p in enumerate(parts):
            layer = self._layers[i]
            layer.input_norm = self._hold(_norm(p.input_norm, act, s.hidden))
            layer.post_norm = self._hold(_norm(p.post_norm, act, s.hidden))
            for name, shape in expected.items():
                weight: LowBitWeight = getattr(p, name)
                if weight.shape != shape:
                    raise ValueError(f"layer {i} {name}: {weight.shape}, expected {shape}")
                setattr(layer, name, self._proj(weight))
            for name in ("k_cache", "v_cache"):
                cache: torch.Tensor = getattr(p, name)
                if cache.dtype != kv_dtype or cache.shape[1:] != (s.kv_heads, s.head_dim):
                    raise ValueError(f"layer {i} {name}: {cache.dtype} {tuple(cache.shape)}")
                setattr(layer, name, self._hold(cache))
            for name in ("k_scales", "v_scales"):
                scales: torch.Tensor | None = getattr(p, name)
                setattr(layer, name, None if scales is None else self._hold(scales))

    def _hold(self, t: torch.Tensor) -> int:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the decode stack reads contiguous CPU tensors")
        self._keep.append(t)
        return t.data_ptr()

    def _proj(self, weight: LowBitWeight) -> _Proj:
        n, k = weight.shape
        if isinstance(weight, (GGUFBlocks, InterleavedBlocks)):
            weight = weight.serving_form()  # what its kernel reads (interleaved or not)
            interleaved = isinstance(weight, InterleavedBlocks)
            fn = self.kernels.qlinear_address(
                weight.fmt,
                self.act,
                weight.int8_activations,
                interleaved,
                isinstance(weight, InterleavedBlocks) and weight.amx,
            )
            return _Proj(fn, None, self._hold(weight.data), None, None, k, n, k, 0)
        assert isinstance(weight, GroupQuantized)
        fn = self.kernels.qlinear_address(None, self.act, weight.int8_activations)
        mins = None if weight.mins is None else self._hold(weight.mins)
        w, scales = self._hold(weight.q), self._hold(weight.scales)
        return _Proj(None, fn, w, scales, mins, weight.group, n, k, weight.bits)

    def run(
        self,
        x: torch.Tensor,
        cis: torch.Tensor,
        loc: torch.Tensor,
        req_to_token: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """x: the embedded tokens [B, hidden] (overwritten); cis [B, head_dim / 2, 2]
        float32; loc, req_slots, seq_lens int64 [B]; req_to_token int32. Returns the final
        norm's output [B, hidden], what the LM head reads."""
        if x.dtype != self.act or not x.is_contiguous() or x.dim() != 2:
            raise ValueError(f"decode stack: x must be a contiguous [B, hidden] {self.act}")
        b = x.shape[0]
        if cis.dtype != torch.float32 or not cis.is_contiguous() or cis.shape[0] != b:
            raise ValueError("decode stack: cis must be a contiguous float32 [B, D / 2, 2]")
        for t in (loc, req_slots, seq_lens):
            if t.dtype != torch.int64 or t.shape != (b,) or not t.is_contiguous():
                raise ValueError(f"decode stack: index tensors must be int64 ({b},)")
        if req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
            raise ValueError("decode stack: req_to_token must be int32 with contiguous rows")
        return self.kernels.decode_stack(
            self._model,
            self._layers,
            len(self._layers),
            x,
            self.final_norm,
            cis,
            loc,
            req_to_token,
            req_slots,
            seq_lens,
        )


def _norm(weight: torch.Tensor, act: torch.dtype, hidden: int) -> torch.Tensor:
    """A norm's weight, which the kernels read in the activation dtype (as the layer path's
    fused norm does: it runs only where the two dtypes agree)."""
    if weight.shape != (hidden,) or weight.dtype != act:
        raise ValueError(f"a norm weight {weight.dtype} {tuple(weight.shape)}, not {act}")
    return weight.detach()


__all__ = ["ENABLED", "DecodeStack", "LayerParts", "Shapes"]
