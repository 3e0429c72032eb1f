"""Paged prefill attention: many query tokens per request over prefix + new KV, causal.

The new tokens' keys/values are already in the cache, so one kernel reads every key
through kv_indices, whether it belongs to a cached prefix or to this step. The causal mask
is bottom-right aligned (query i of qo_len sees key j <= i + kv_len - qo_len), which makes
a decode row (qo_len 1) plain attention over its whole sequence: one launch covers EXTEND
and MIXED batches.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rsgl.layers.attention.triton_ops.decode_attention import dot_precision

_LOG2E = math.log2(math.e)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _prefill_kernel(
    q: tl.tensor,
    k_buffer: tl.tensor,
    v_buffer: tl.tensor,
    o: tl.tensor,
    qo_indptr: tl.tensor,
    kv_indptr: tl.tensor,
    kv_indices: tl.tensor,
    scale_log2: float,
    stride_q_tok: int,
    stride_q_head: int,
    stride_k_tok: int,
    stride_k_head: int,
    stride_v_tok: int,
    stride_v_head: int,
    stride_o_tok: int,
    stride_o_head: int,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    m_block = tl.program_id(0)
    req = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    qo_start = tl.load(qo_indptr + req)
    qo_len = tl.load(qo_indptr + req + 1) - qo_start
    # The grid is sized by the longest request; shorter ones have idle query blocks.
    if m_block * BLOCK_M >= qo_len:
        return
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    causal_shift = kv_len - qo_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < qo_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tokens = (qo_start + offs_m).to(tl.int64)
    q_ptrs = q + tokens[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :]
    q_blk = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the block's last query's causal bound are never needed.
    kv_end = tl.minimum(kv_len, (m_block + 1) * BLOCK_M + causal_shift)
    for n_start in range(0, kv_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slots = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k_ptrs = k_buffer + slots[:, None] * stride_k_tok + kv_head * stride_k_head
        k_blk = tl.load(k_ptrs + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q_blk, tl.trans(k_blk.to(q_blk.dtype)), input_precision=DOT_PRECISION)
        visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None] + causal_shift)
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so its
        # weights are exp2(-inf) = 0, not NaN.
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_base[:, None])
        alpha = tl.exp2(m_i - m_base)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_buffer + slots[:, None] * stride_v_tok + kv_head * stride_v_head
        v_blk = tl.load(v_ptrs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q_blk.dtype), v_blk.to(q_blk.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = o + tokens[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _blocks(block_d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 64 x 64 tiles up to head_dim 128, halved above it to
    stay within shared memory. Untuned; a starting point for GPU measurements."""
    if block_d <= 128:
        return 64, 64, 4
    return 32, 32, 8


def prefill_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_qo_len: int,
    sm_scale: float,
) -> None:
    """Causal attention of request b's queries q[qo_indptr[b]:qo_indptr[b + 1]] over its keys
    kv_indices[kv_indptr[b]:kv_indptr[b + 1]], bottom-right aligned, into o.

    q, o: [T, Hq, D] (o in q's dtype); k_buffer, v_buffer: [slots, Hkv, D]; the indptrs are
    int32 [B + 1] with kv_len >= qo_len per request; `max_qo_len` (a host int, an upper
    bound is fine) sizes the grid.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    batch_size = qo_indptr.shape[0] - 1
    if num_tokens == 0 or batch_size == 0 or max_qo_len == 0:
        return
    assert num_heads % num_kv_heads == 0, "query heads must group evenly over KV heads"
    for t in (q, k_buffer, v_buffer, o):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps = _blocks(block_d)
    grid = (triton.cdiv(max_qo_len, block_m), batch_size, num_heads)
    _prefill_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        o.stride(0),
        o.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
    )
