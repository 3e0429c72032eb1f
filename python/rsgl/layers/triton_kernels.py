"""Fused elementwise kernels for the CUDA path: (add +) RMSNorm, SiLU-and-multiply, rotary.

Eager PyTorch spends 3-7 kernel launches on each of these (RMSNorm alone is cast, square,
mean, add, rsqrt, multiply, cast, weight multiply); at decode sizes every launch costs more
than the bytes it moves, so a Llama layer lost most of its time between its matmuls. Each
kernel here reads its inputs once and rounds exactly where the torch ops round, in the same
float32 arithmetic: statistics and activations in float32, the result cast to the model dtype
before the weight (or `up`) multiplies it, as HF transformers does. Only the order of a
row's float32 sum can differ from torch's reduction, which can move the normalised value by
one unit in the last place of the model dtype.

On CUDA the transcendental functions come from libdevice (`expf`, `rsqrtf`, the functions
torch's own kernels call) rather than Triton's approximate defaults, and division is IEEE.
Triton's CPU interpreter (TRITON_INTERPRET=1, for the tests) has no libdevice, so there the
kernels use `tl.exp`/`tl.rsqrt`, which numpy evaluates exactly rounded.

Importing this module imports triton; callers import it only for CUDA tensors, so a CPU-only
install without triton never does. Every launch takes its grid from shapes and reads no
device value on the host, so the kernels run inside CUDA graph capture.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Elements one SiLU-and-multiply program covers along the intermediate dimension.
_SILU_BLOCK = 1024
# Elements (rows x row length) one RMSNorm program aims to cover when rows are short, as the
# per-head q/k norms of Qwen3 are (a 128-wide row alone would leave most lanes idle).
_NORM_TILE = 4096


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _rmsnorm_kernel(
    x: tl.tensor,
    residual: tl.tensor,
    weight: tl.tensor,
    out: tl.tensor,
    summed: tl.tensor,
    num_rows: int,
    rows_per_token: int,
    stride_x_tok: int,
    stride_x_row: int,
    stride_res: int,
    stride_out: int,
    stride_sum: int,
    eps: float,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ADD: tl.constexpr,
    LIBDEVICE: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < HIDDEN)[None, :]
    rows64 = rows.to(tl.int64)
    # A row is (token, head) for a [T, heads, D] input, so strided views of q or k need no copy.
    x_off = (rows64 // rows_per_token) * stride_x_tok + (rows64 % rows_per_token) * stride_x_row
    v = tl.load(x + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    if ADD:
        r = tl.load(residual + rows64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        # torch's `residual + x` rounds the sum to the model dtype before the norm reads it.
        v = (r.to(tl.float32) + v.to(tl.float32)).to(v.dtype)
        tl.store(summed + rows64[:, None] * stride_sum + cols[None, :], v, mask=mask)
    vf = v.to(tl.float32)
    # torch's CUDA mean multiplies the sum by a float32 1/n; the eps add is a separate op,
    # so nothing here may fuse into an fma (the launch disables fp fusion).
    mean_sq = tl.sum(vf * vf, axis=1) * (1.0 / HIDDEN)
    inv_rms = libdevice.rsqrt(mean_sq + eps) if LIBDEVICE else tl.rsqrt(mean_sq + eps)
    normed = (vf * inv_rms[:, None]).to(v.dtype)
    w = tl.load(weight + cols, mask=cols < HIDDEN, other=0.0)
    y = w.to(tl.float32)[None, :] * normed.to(tl.float32)
    tl.store(
        out + rows64[:, None] * stride_out + cols[None, :], y.to(out.dtype.element_ty), mask=mask
    )


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _silu_mul_kernel(
    gate_up: tl.tensor,
    out: tl.tensor,
    stride_in: int,
    stride_out: int,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
) -> None:
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(gate_up + tok * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up + tok * stride_in + INTER + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in float32, rounded to the dtype before the multiply.
    denom = 1.0 + (libdevice.exp(-g) if LIBDEVICE else tl.exp(-g))
    act = tl.div_rn(g, denom).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out + tok * stride_out + cols, y.to(out.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _rotary_kernel(
    qk: tl.tensor,
    cis: tl.tensor,
    heads: int,
    stride_tok: int,
    stride_head: int,
    stride_cis: int,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
) -> None:
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    # Whole rows are loaded contiguously and split into (even, odd) lanes in registers: two
    # stride-2 loads measured 2-3x slower than torch's unfused ops on an H100.
    col = tl.arange(0, 2 * BLOCK_P)
    col_mask = col < 2 * HALF
    table = tl.load(cis + tok * stride_cis + col, mask=col_mask, other=0.0)
    cos, sin = tl.split(tl.reshape(table, (BLOCK_P, 2)))
    mask = (head < heads)[:, None] & col_mask[None, :]
    base = qk + tok * stride_tok + head.to(tl.int64)[:, None] * stride_head + col[None, :]
    x = tl.load(base, mask=mask, other=0.0)
    a, b = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_H, BLOCK_P, 2)))
    # (a + ib)(cos + i sin), as c10::complex multiplies: real a*c - b*d, imaginary a*d + b*c.
    real = a * cos[None, :] - b * sin[None, :]
    imag = a * sin[None, :] + b * cos[None, :]
    out = tl.reshape(tl.join(real, imag), (BLOCK_H, 2 * BLOCK_P))
    tl.store(base, out.to(x.dtype), mask=mask)


def kernels_interpreted() -> bool:
    """Whether these kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_silu_mul_kernel).__name__ == "InterpretedFunction"


def _libdevice() -> bool:
    return not kernels_interpreted()


def _check_rows(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


def _norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rmsnorm: weight of shape {tuple(weight.shape)} for rows of {hidden}")
    _check_rows(x, "rmsnorm input")
    if x.dim() == 2:
        rows_per_token, stride_tok, stride_row = 1, x.stride(0), 0
    elif x.dim() == 3:
        rows_per_token, stride_tok, stride_row = x.shape[1], x.stride(0), x.stride(1)
    else:
        raise ValueError(f"rmsnorm takes [T, H] or [T, heads, D] inputs, got {tuple(x.shape)}")
    num_rows = x.numel() // hidden
    # Same result dtype as torch's `weight * normed` (a float32 weight promotes).
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = None
    if residual is not None:
        if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("add_rmsnorm: x and residual must be [T, H] of one dtype")
        _check_rows(residual, "add_rmsnorm residual")
        summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, summed
    block = triton.next_power_of_2(hidden)
    rows = max(1, min(_NORM_TILE // block, triton.next_power_of_2(num_rows)))
    num_warps = max(1, min(16, block * rows // 512))
    _rmsnorm_kernel[(triton.cdiv(num_rows, rows),)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        summed if summed is not None else out,
        num_rows,
        rows_per_token,
        stride_tok,
        stride_row,
        residual.stride(0) if residual is not None else 0,
        hidden,
        hidden,
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ROWS=rows,
        ADD=residual is not None,
        LIBDEVICE=_libdevice(),
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return out, summed


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension of x ([T, H], or
    [T, heads, D] with any token and head strides), rounded as `RMSNorm` rounds."""
    return _norm_launch(x, None, weight, eps)[0]


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x), residual + x) for [T, H] rows: the pre-norm residual step."""
    out, summed = _norm_launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [T, 2I] (gate first, as the fused projection writes it)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul takes [T, 2I], got {tuple(gate_up.shape)}")
    _check_rows(gate_up, "silu_mul input")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0 or inter == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        inter,
        INTER=inter,
        BLOCK=block,
        LIBDEVICE=_libdevice(),
        num_warps=4,
    )
    return out


def rotary_qk(qk: torch.Tensor, cis: torch.Tensor) -> None:
    """Rotate qk ([T, heads, D], pair-interleaved, last dimension contiguous) in place by the
    per-token table `RotaryEmbedding.cis` returns ([T, 1, D/2] complex64, read as its float32
    (cos, sin) pairs with no copy); rounds as `apply_rotary` does."""
    if qk.dim() != 3 or qk.shape[2] % 2:
        raise ValueError(f"rotary_qk takes [T, heads, D] with D even, got {tuple(qk.shape)}")
    _check_rows(qk, "rotary_qk input")
    tokens, heads, dim = qk.shape
    table = torch.view_as_real(cis) if cis.is_complex() else cis
    if table.shape[0] != tokens or math.prod(table.shape[1:]) != dim:
        raise ValueError(f"rotary_qk: cis must hold {dim // 2} (cos, sin) pairs per token")
    table = table.reshape(tokens, dim)
    if table.dtype != torch.float32 or table.stride(1) != 1:
        raise ValueError("rotary_qk: cis must be float32 with contiguous (cos, sin) pairs")
    if tokens == 0:
        return
    half = dim // 2
    block_p = triton.next_power_of_2(half)
    # Few tokens: a head or two per program, so a decode step still fills the GPU.
    per_program = 2 if tokens < 16 else max(1, 2048 // block_p)
    block_h = min(triton.next_power_of_2(heads), per_program)
    _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
        qk,
        table,
        heads,
        qk.stride(0),
        qk.stride(1),
        table.stride(0),
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_P=block_p,
        num_warps=4,
    )
