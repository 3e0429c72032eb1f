"""The CSR metadata of the GPU attention backends (`paged_metadata`) against a plain loop.

Batches are drawn at random the way the scheduling core builds them: requests in KV pages
of 1 or 16 slots (page 0 is padding, never handed out), prefixes shared page by page with
earlier requests, prompts computed in chunks (a chunk's prefix is the chunks before it), and
single-token decode rows last. Whatever the page size, req_to_token holds one KV slot per
token and the metadata indexes slots, one per "page" of the attention kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from rsgl.layers.attention.paged_metadata import (
    build_host_indptrs,
    gather_kv_indices,
    lens_to_indptr,
)
from rsgl.model_executor.forward_batch import ForwardBatch

MAX_REQS = 12
CONTEXT_LEN = 160
UNWRITTEN = -7  # req_to_token entries past a request's length: must never be gathered


@dataclass
class RandomBatch:
    table: torch.Tensor  # req_to_token [MAX_REQS + 1, CONTEXT_LEN] int32
    req_slots: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray

    @property
    def seq_lens(self) -> np.ndarray:
        lens: np.ndarray = self.prefix_lens + self.extend_lens
        return lens

    def forward_batch(self) -> ForwardBatch:
        n = int(self.extend_lens.sum())
        return ForwardBatch.from_arrays(
            forward_mode="mixed",
            req_slots=self.req_slots,
            prefix_lens=self.prefix_lens,
            extend_lens=self.extend_lens,
            input_ids=np.zeros(n, dtype=np.int64),
            out_cache_loc=np.zeros(n, dtype=np.int64),
        )


def random_batch(rng: np.random.Generator, page_size: int) -> RandomBatch:
    """A batch of extends (fresh, chunked or on a shared prefix) followed by decode rows."""
    table = torch.full((MAX_REQS + 1, CONTEXT_LEN), UNWRITTEN, dtype=torch.int32)
    pool_pages = MAX_REQS * CONTEXT_LEN // page_size + 2
    free_pages = list(rng.permutation(np.arange(1, pool_pages)))  # page 0: padding

    num_reqs = int(rng.integers(1, MAX_REQS + 1))
    num_decodes = int(rng.integers(0, num_reqs + 1))
    rows = [int(r) for r in rng.permutation(MAX_REQS)[:num_reqs]]
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    seq_of_row: dict[int, int] = {}
    for i, row in enumerate(rows):
        seq_len = int(rng.integers(1, CONTEXT_LEN + 1))
        shared = 0
        if i and rng.random() < 0.5:
            # A cached prefix of an earlier request, whole pages of it (the radix cache
            # matches page by page, and always leaves at least one token to compute).
            donor = rows[int(rng.integers(0, i))]
            shared = min(seq_of_row[donor], seq_len - 1) // page_size * page_size
            table[row, :shared] = table[donor, :shared]
        for start in range(shared, seq_len, page_size):
            page = int(free_pages.pop())
            n = min(page_size, seq_len - start)
            table[row, start : start + n] = torch.arange(
                page * page_size, page * page_size + n, dtype=torch.int32
            )
        if i >= num_reqs - num_decodes:
            extend = 1  # decode: one new token over everything before it
        else:
            # A fresh prompt, the next chunk of a chunked one, or the rest after a cache hit.
            extend = int(rng.integers(1, seq_len - shared + 1)) if rng.random() < 0.5 else 0
            extend = extend or seq_len - shared
        prefix_lens.append(seq_len - extend)
        extend_lens.append(extend)
        seq_of_row[row] = seq_len
    return RandomBatch(
        table=table,
        req_slots=np.asarray(rows, dtype=np.int64),
        prefix_lens=np.asarray(prefix_lens, dtype=np.int64),
        extend_lens=np.asarray(extend_lens, dtype=np.int64),
    )


def reference(batch: RandomBatch) -> tuple[list[int], list[int], list[int]]:
    """qo_indptr, kv_indptr and kv_indices, one request and one token at a time."""
    qo, kv, indices = [0], [0], []
    for row, prefix, extend in zip(
        batch.req_slots, batch.prefix_lens, batch.extend_lens, strict=True
    ):
        qo.append(qo[-1] + int(extend))
        kv.append(kv[-1] + int(prefix + extend))
        for pos in range(int(prefix + extend)):
            indices.append(int(batch.table[int(row), pos]))
    return qo, kv, indices


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(40))
def test_metadata_matches_the_loop_reference(page_size: int, seed: int) -> None:
    batch = random_batch(np.random.default_rng([seed, page_size]), page_size)
    fb = batch.forward_batch()
    want_qo, want_kv, want_indices = reference(batch)

    host = build_host_indptrs(fb.extend_lens_host, fb.seq_lens_host)
    b = fb.batch_size
    for t in (host.qo_indptr, host.kv_indptr, host.kv_last_page_len, host.kv_lens):
        assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert host.qo_indptr.tolist() == want_qo
    assert host.kv_indptr.tolist() == want_kv
    assert host.kv_last_page_len.tolist() == [1] * b
    assert host.kv_lens.tolist() == batch.seq_lens.tolist()
    assert host.num_kv_indices == want_kv[-1] == len(want_indices)
    assert host.max_extend_len == int(batch.extend_lens.max())
    assert host.max_seq_len == int(batch.seq_lens.max())

    got = gather_kv_indices(batch.table, fb.req_slots, fb.seq_lens, host.num_kv_indices)
    assert got.dtype == torch.int32
    assert got.tolist() == want_indices
    assert UNWRITTEN not in got.tolist() and 0 not in got.tolist()


def test_decode_rows_and_shared_prefixes_read_the_same_slots() -> None:
    # Request 5 is a chunk over 4 cached tokens; requests 2 and 7 decode over a prefix they
    # share (slots 10..13) and diverge after it.
    table = torch.zeros((9, 8), dtype=torch.int32)
    table[5, :6] = torch.tensor([40, 41, 42, 43, 44, 45])
    table[2, :5] = torch.tensor([10, 11, 12, 13, 20])
    table[7, :6] = torch.tensor([10, 11, 12, 13, 30, 31])
    extend, seq = np.array([2, 1, 1]), np.array([6, 5, 6])
    host = build_host_indptrs(extend, seq)
    assert host.qo_indptr.tolist() == [0, 2, 3, 4]
    assert host.kv_indptr.tolist() == [0, 6, 11, 17]
    got = gather_kv_indices(table, torch.tensor([5, 2, 7]), torch.as_tensor(seq), 17)
    assert got.tolist() == [40, 41, 42, 43, 44, 45, 10, 11, 12, 13, 20, 10, 11, 12, 13, 30, 31]


def test_index_dtypes_of_the_inputs_do_not_matter() -> None:
    table = torch.arange(30, dtype=torch.int32).view(3, 10)
    want = [20, 21, 22, 0, 1]
    for dtype in (torch.int32, torch.int64):
        slots = torch.tensor([2, 0], dtype=dtype)
        lens = torch.tensor([3, 2], dtype=dtype)
        assert gather_kv_indices(table, slots, lens, 5).tolist() == want


def test_an_empty_batch_has_empty_metadata() -> None:
    empty = np.zeros(0, dtype=np.int64)
    host = build_host_indptrs(empty, empty)
    assert host.qo_indptr.tolist() == [0] and host.kv_indptr.tolist() == [0]
    assert host.kv_last_page_len.numel() == 0 and host.num_kv_indices == 0
    assert host.max_extend_len == 0 and host.max_seq_len == 0
    table = torch.zeros((2, 4), dtype=torch.int32)
    got = gather_kv_indices(table, torch.zeros(0, dtype=torch.int64), torch.zeros(0), 0)
    assert got.shape == (0,) and got.dtype == torch.int32


def test_lens_to_indptr_and_mismatched_lengths() -> None:
    assert lens_to_indptr(np.array([3, 0, 2])).tolist() == [0, 3, 3, 5]
    assert lens_to_indptr(np.array([], dtype=np.int64)).tolist() == [0]
    assert lens_to_indptr(np.array([1])).dtype == np.int32
    with pytest.raises(ValueError, match="differ"):
        build_host_indptrs(np.array([1, 1]), np.array([1]))
