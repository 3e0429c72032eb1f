"""Paged-attention metadata in CSR form, shared by the GPU attention backends.

FlashInfer's wrappers and the Triton kernels describe a batch as offset arrays over two
flat index spaces: the step's tokens (`qo_indptr`) and the KV slots every request reads
(`kv_indptr` into `kv_indices`). For rsgl a "page" is one KV slot: `req_to_token` names a
slot per token whatever page size the scheduling core allocates with, so every page holds
one token (`kv_last_page_len` is all ones) and `kv_indices` lists each request's slots in
position order.

The offsets come from the step's host arrays, so building them never waits for the device;
`kv_indices` is gathered on the device from `req_to_token`, which only the device holds.
All functions here are pure: they read their arguments and return new arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def lens_to_indptr(lens: np.ndarray) -> np.ndarray:
    """Offsets of consecutive segments of the given lengths: [n] -> [n + 1] int32, starting
    at 0 (`indptr[i]:indptr[i + 1]` is segment i). int32 because that is what the kernels
    index with; a step's token and KV counts are far below 2^31."""
    out = np.zeros(lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return out


@dataclass(frozen=True, slots=True)
class HostIndptrs:
    """A step's CSR offsets as int32 host tensors, views of one (optionally pinned) buffer.

    Pinned memory lets a backend hand these to a non-blocking host-to-device copy; a fresh
    buffer per step lets torch's caching host allocator keep it alive until that copy ran.
    """

    qo_indptr: torch.Tensor  # [B + 1]: request i's tokens are qo_indptr[i]:qo_indptr[i + 1]
    kv_indptr: torch.Tensor  # [B + 1]: request i's KV slots in kv_indices
    kv_last_page_len: torch.Tensor  # [B], all ones: a page is one slot
    kv_lens: torch.Tensor  # [B]: seq_lens, the KV length each request attends to
    num_kv_indices: int  # kv_indptr[-1], the length of kv_indices
    max_extend_len: int  # longest query run (1 for a decode-only step; 0 for no requests)
    max_seq_len: int  # longest KV run (0 for no requests)


def build_host_indptrs(
    extend_lens: np.ndarray, seq_lens: np.ndarray, *, pin: bool = False
) -> HostIndptrs:
    """CSR offsets of a batch from its host arrays (`ForwardBatch.extend_lens_host` and
    `seq_lens_host`): queries are each request's new tokens, keys its whole sequence
    (cached prefix plus new tokens). `pin` places them in page-locked memory (CUDA only)."""
    extend = np.asarray(extend_lens)
    seq = np.asarray(seq_lens)
    if extend.shape != seq.shape or extend.ndim != 1:
        raise ValueError(f"extend_lens {extend.shape} and seq_lens {seq.shape} differ")
    b = extend.shape[0]
    # One buffer, one allocation: [qo_indptr | kv_indptr | last_page_len | kv_lens].
    buf = torch.empty(4 * b + 2, dtype=torch.int32, pin_memory=pin)
    host = buf.numpy()
    host[: b + 1] = lens_to_indptr(extend)
    host[b + 1 : 2 * b + 2] = lens_to_indptr(seq)
    host[2 * b + 2 : 3 * b + 2] = 1
    host[3 * b + 2 :] = seq
    return HostIndptrs(
        qo_indptr=buf[: b + 1],
        kv_indptr=buf[b + 1 : 2 * b + 2],
        kv_last_page_len=buf[2 * b + 2 : 3 * b + 2],
        kv_lens=buf[3 * b + 2 :],
        num_kv_indices=int(host[2 * b + 1]),
        max_extend_len=int(extend.max()) if b else 0,
        max_seq_len=int(seq.max()) if b else 0,
    )


def gather_kv_indices(
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_indices: int,
) -> torch.Tensor:
    """`kv_indices` [num_kv_indices] int32: for each request i in order, the KV slots
    `req_to_token[req_slots[i], :seq_lens[i]]`, concatenated.

    Device tensors in, a device tensor out, without a host sync: `num_kv_indices`
    (= sum(seq_lens), from `build_host_indptrs`) fixes every shape up front, so
    `repeat_interleave` needs no device-to-host read of the lengths. Element j belongs to
    request `rows[j]` at position j minus that request's first element.
    """
    device = req_to_token.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    slots = req_slots.to(device=device, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    rows = torch.repeat_interleave(slots, lens, output_size=num_kv_indices)
    first = torch.repeat_interleave(starts, lens, output_size=num_kv_indices)
    cols = torch.arange(num_kv_indices, device=device, dtype=torch.int64) - first
    return req_to_token[rows, cols].to(torch.int32)


__all__ = ["HostIndptrs", "build_host_indptrs", "gather_kv_indices", "lens_to_indptr"]
