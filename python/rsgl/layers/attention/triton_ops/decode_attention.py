"""Split-KV decode attention: one query token per request over its paged KV.

Stage 1 splits every request's KV range into `num_kv_splits` slices and computes, per slice,
the softmax-normalised partial output and its log-sum-exp; stage 2 merges the slices. The
split spreads a long sequence over many programs when the batch is small, and a fixed split
count keeps the workspaces' shapes static for CUDA graphs.

Log-sum-exps are kept in base 2 (scores are pre-multiplied by log2(e) so the kernels use
`exp2`); they never leave this module.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = math.log2(math.e)
# Keys per inner-loop block, and the most query heads one program shares its keys with.
_BLOCK_N = 64
_MAX_HEADS_PER_PROGRAM = 64
# tl.dot needs at least 16 rows; a GQA group smaller than that pads the head block.
_MIN_BLOCK_H = 16


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _decode_split_kernel(
    q: tl.tensor,
    k_buffer: tl.tensor,
    v_buffer: tl.tensor,
    kv_indptr: tl.tensor,
    kv_indices: tl.tensor,
    partial_out: tl.tensor,
    partial_lse: tl.tensor,
    scale_log2: float,
    stride_q_tok: int,
    stride_q_head: int,
    stride_k_tok: int,
    stride_k_head: int,
    stride_v_tok: int,
    stride_v_head: int,
    stride_po_req: int,
    stride_po_head: int,
    stride_po_split: int,
    stride_pl_req: int,
    stride_pl_head: int,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    req = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    # HEADS consecutive query heads, all in one GQA group, share each key/value load.
    first_head = head_block * HEADS
    kv_head = first_head // GROUP
    offs_h = first_head + tl.arange(0, BLOCK_H)
    mask_h = tl.arange(0, BLOCK_H) < HEADS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    # Slices are whole key blocks, so short sequences leave the last splits empty rather
    # than giving every split a ragged sliver.
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    q_ptrs = q + req * stride_q_tok + offs_h[:, None] * stride_q_head + offs_d[None, :]
    q_blk = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = k_buffer + slots[:, None] * stride_k_tok + kv_head * stride_k_head
        k_blk = tl.load(k_ptrs + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q_blk, tl.trans(k_blk.to(q_blk.dtype)), input_precision=DOT_PRECISION)
        scores = tl.where(mask_n[None, :], scores * scale_log2, float("-inf"))
        # Every block inside [lo, hi) has a valid key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_buffer + slots[:, None] * stride_v_tok + kv_head * stride_v_head
        v_blk = tl.load(v_ptrs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q_blk.dtype), v_blk.to(q_blk.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    # An empty split stores a zero output with lse -inf, which stage 2 weighs by zero.
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    po_ptrs = (
        partial_out
        + req * stride_po_req
        + offs_h[:, None] * stride_po_head
        + split * stride_po_split
        + offs_d[None, :]
    )
    tl.store(po_ptrs, out, mask=mask_h[:, None] & mask_d[None, :])
    pl_ptrs = partial_lse + req * stride_pl_req + offs_h * stride_pl_head + split
    tl.store(pl_ptrs, lse, mask=mask_h)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _decode_merge_kernel(
    partial_out: tl.tensor,
    partial_lse: tl.tensor,
    o: tl.tensor,
    stride_po_req: int,
    stride_po_head: int,
    stride_po_split: int,
    stride_pl_req: int,
    stride_pl_head: int,
    stride_o_tok: int,
    stride_o_head: int,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(
        partial_lse + req * stride_pl_req + head * stride_pl_head + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    # A request with no keys at all (every split empty) has m = -inf: merge to zeros, not NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.exp2(lse - m)
    has_keys = weights > 0.0
    po_ptrs = (
        partial_out
        + req * stride_po_req
        + head * stride_po_head
        + offs_s[:, None] * stride_po_split
        + offs_d[None, :]
    )
    partial = tl.load(po_ptrs, mask=has_keys[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    o_ptrs = o + req * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=mask_d)


def heads_per_program(group: int) -> int:
    """Query heads one stage-1 program handles: the whole GQA group when it fits, else the
    largest divisor of it that does (so a program never straddles two KV heads)."""
    return max(d for d in range(1, min(group, _MAX_HEADS_PER_PROGRAM) + 1) if group % d == 0)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact for float32 (a reference-grade model), which Triton
    would otherwise round to TF32; irrelevant for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    num_kv_splits: int,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
) -> None:
    """o[b] = softmax(q[b] K_b^T * sm_scale) V_b, where request b's keys are the KV slots
    kv_indices[kv_indptr[b]:kv_indptr[b + 1]].

    q, o: [B, Hq, D] (o in q's dtype); k_buffer, v_buffer: [slots, Hkv, D]; kv_indptr:
    int32 [B + 1]; kv_indices: int32. partial_out: float32 [>= B, Hq, num_kv_splits, D] and
    partial_lse: float32 [>= B, Hq, num_kv_splits] are scratch. Only host shapes decide the
    grid, so this can be captured in a CUDA graph. A request with no keys gets a zero output.
    """
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if batch_size == 0:
        return
    assert num_heads % num_kv_heads == 0, "query heads must group evenly over KV heads"
    for t in (q, k_buffer, v_buffer, o, partial_out):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    assert partial_out.dtype == torch.float32 and partial_lse.dtype == torch.float32
    assert partial_out.shape[2] == num_kv_splits and partial_lse.shape[2] == num_kv_splits
    assert partial_lse.stride(2) == 1

    group = num_heads // num_kv_heads
    heads = heads_per_program(group)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch_size, num_heads // heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        partial_out,
        partial_lse,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        GROUP=group,
        HEADS=heads,
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_H=max(_MIN_BLOCK_H, triton.next_power_of_2(heads)),
        BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
    )
    _decode_merge_kernel[(batch_size, num_heads)](
        partial_out,
        partial_lse,
        o,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        o.stride(0),
        o.stride(1),
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_D=block_d,
        num_warps=4 if block_d > 64 else 2,
    )
