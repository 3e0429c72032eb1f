"""kv_indices: the flat list of every request's KV slots, gathered from req_to_token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Slots copied per loop iteration of one program: large enough that a 4k-token request takes
# eight iterations, small enough to keep registers low.
_COPY_BLOCK = 512


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type hints
def _build_kv_indices_kernel(
    req_to_token: tl.tensor,
    req_slots: tl.tensor,
    seq_lens: tl.tensor,
    kv_indptr: tl.tensor,
    kv_indices: tl.tensor,
    stride_row: int,
    BLOCK: tl.constexpr,
) -> None:
    req = tl.program_id(0)
    row = tl.load(req_slots + req).to(tl.int64)
    seq_len = tl.load(seq_lens + req)
    dst = tl.load(kv_indptr + req).to(tl.int64)
    src = req_to_token + row * stride_row
    for start in range(0, seq_len, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < seq_len
        slots = tl.load(src + offs, mask=mask)
        tl.store(kv_indices + dst + offs, slots, mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """kv_indices[kv_indptr[i] + j] = req_to_token[req_slots[i], j] for j < seq_lens[i].

    One program per request copies its row prefix in blocks. Every length and offset is read
    on the device, so this runs without a host sync and inside CUDA graph capture;
    `kv_indices` may be longer than needed (an upper-bound buffer), the tail is untouched.
    """
    batch_size = req_slots.shape[0]
    if batch_size == 0:
        return
    assert req_to_token.stride(1) == 1, "req_to_token rows must be contiguous"
    _build_kv_indices_kernel[(batch_size,)](
        req_to_token,
        req_slots,
        seq_lens,
        kv_indptr,
        kv_indices,
        req_to_token.stride(0),
        BLOCK=_COPY_BLOCK,
    )
