"""The Triton attention kernels and the `triton` backend agree with plain torch.

Without a GPU the kernels run in Triton's CPU interpreter, which must be switched on before
triton is first imported (`triton.jit` decides when a function is defined), so this module
sets TRITON_INTERPRET=1 at collection and imports the kernels lazily. On a machine with CUDA
the same tests run the compiled kernels on the GPU. Shapes stay small: the interpreter runs
every program in numpy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rsgl.layers.attention import create_attention_backend
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend
from rsgl.layers.attention.triton_backend import (
    NUM_KV_SPLITS,
    TritonAttnBackend,
    TritonAttnMetadata,
)
from rsgl.model_executor.forward_batch import ForwardBatch
from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

ATOL = 2e-5


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    from rsgl.layers.attention import triton_ops

    if not triton_ops.kernels_interpreted() and not torch.cuda.is_available():
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set and there is no GPU; "
            "run this file in its own pytest process"
        )
    return triton_ops


@pytest.fixture(scope="module")
def device(ops: ModuleType) -> torch.device:
    return torch.device("cpu" if ops.kernels_interpreted() else "cuda")


# ---------------------------------------------------------------- torch references


def build_kv_indices_ref(
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """What `build_kv_indices` computes, with torch indexing."""
    lens = seq_lens.long()
    total = int(lens.sum())
    rows = torch.repeat_interleave(req_slots.long(), lens, output_size=total)
    starts = torch.repeat_interleave(kv_indptr[:-1].long(), lens, output_size=total)
    firsts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
    cols = torch.arange(total, device=lens.device) - firsts
    kv_indices[starts + cols] = req_to_token[rows, cols]


def paged_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: list[int],
    kv_indptr: list[int],
    kv_indices: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Per request: SDPA over its gathered K/V, query i seeing keys j <= i + kv_len - qo_len.
    A request without keys gets zeros."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_buffer.shape[1]
    for b in range(len(qo_indptr) - 1):
        q0, q1, k0, k1 = qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]
        if k1 == k0 or q1 == q0:
            continue
        slots = kv_indices[k0:k1].long()
        k = k_buffer[slots].to(q.dtype).repeat_interleave(group, 1).transpose(0, 1)
        v = v_buffer[slots].to(q.dtype).repeat_interleave(group, 1).transpose(0, 1)
        qo_len, kv_len = q1 - q0, k1 - k0
        rows = torch.arange(qo_len, device=q.device).unsqueeze(1)
        mask = torch.arange(kv_len, device=q.device).unsqueeze(0) <= rows + kv_len - qo_len
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k, v, attn_mask=mask, scale=sm_scale
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


# ---------------------------------------------------------------- kernel fixtures


@dataclass
class PagedKV:
    """A KV buffer with each request's keys at scattered slots (slot 0 never used)."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_indices: torch.Tensor  # int32 [total]


def paged_kv(
    kv_lens: list[int], num_kv_heads: int, head_dim: int, device: torch.device, seed: int
) -> PagedKV:
    gen = torch.Generator().manual_seed(seed)
    total = sum(kv_lens)
    size = 2 * total + 8
    k = torch.randn(size, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(size, num_kv_heads, head_dim, generator=gen)
    indices = (torch.randperm(size - 1, generator=gen)[:total] + 1).to(torch.int32)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32)
    return PagedKV(k.to(device), v.to(device), indptr.to(device), indices.to(device))


def _lens(seed: int, n: int, high: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, high + 1, size=n)]


# ---------------------------------------------------------------- build_kv_indices


@pytest.mark.parametrize("gap", [0, 3])
def test_build_kv_indices_matches_torch_gather(
    ops: ModuleType, device: torch.device, gap: int
) -> None:
    gen = torch.Generator().manual_seed(gap)
    rows, context_len = 6, 1100
    table = torch.randint(1, 10_000, (rows, context_len), generator=gen, dtype=torch.int32)
    # Requests 0 and 3 share a cached prefix (the radix cache hands out the same slots);
    # one sequence spans several 512-slot copy blocks, one is a single token.
    table[3, :40] = table[0, :40]
    req_slots = torch.tensor([3, 0, 5, 1, 2], dtype=torch.int64)
    seq_lens = torch.tensor([57, 40, 1, 1100, 9], dtype=torch.int64)
    starts = torch.cumsum(seq_lens + gap, 0) - seq_lens - gap
    indptr = torch.cat([starts, starts[-1:] + seq_lens[-1:]]).to(torch.int32)
    size = int(indptr[-1]) + 50  # an upper-bound buffer: the tail stays untouched
    got = torch.full((size,), -7, dtype=torch.int32)
    want = got.clone()
    build_kv_indices_ref(table, req_slots, seq_lens, indptr, want)
    out = got.to(device)
    ops.build_kv_indices(
        table.to(device), req_slots.to(device), seq_lens.to(device), indptr.to(device), out
    )
    assert torch.equal(out.cpu(), want)
    assert int(want[-1]) == -7
    assert torch.equal(want[:40], table[3, :40]) and torch.equal(
        want[57 + gap :][:40], table[0, :40]
    )


# ---------------------------------------------------------------- decode_attention


def _run_decode(
    ops: ModuleType, q: torch.Tensor, kv: PagedKV, splits: int, scale: float
) -> torch.Tensor:
    bs, hq, d = q.shape
    o = torch.full_like(q, float("nan"))
    partial_out = torch.full((bs, hq, splits, d), float("nan"), device=q.device)
    partial_lse = torch.full((bs, hq, splits), float("nan"), device=q.device)
    ops.decode_attention(
        q,
        kv.k_buffer,
        kv.v_buffer,
        o,
        kv.kv_indptr,
        kv.kv_indices,
        scale,
        num_kv_splits=splits,
        partial_out=partial_out,
        partial_lse=partial_lse,
    )
    return o


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (3, 3, 48), (8, 2, 48), (4, 1, 64)],
)
def test_decode_attention_matches_sdpa(
    ops: ModuleType, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # 200 keys make several 64-key blocks, cut into splits at block boundaries.
    kv_lens = [1, 70, 200, *_lens(num_heads, 2, 70)]
    kv = paged_kv(kv_lens, num_kv_heads, head_dim, device, seed=num_heads)
    q = torch.randn(len(kv_lens), num_heads, head_dim).to(device)
    scale = head_dim**-0.5
    qo = list(range(len(kv_lens) + 1))
    want = paged_attention_ref(
        q, kv.k_buffer, kv.v_buffer, qo, kv.kv_indptr.tolist(), kv.kv_indices, scale
    )
    # One split; three (200 keys: 128 + 72 + an empty one); the backend's count, which
    # leaves most splits of the short requests empty.
    for splits in (1, 3, NUM_KV_SPLITS):
        got = _run_decode(ops, q, kv, splits, scale)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"{splits} splits")


def test_decode_attention_request_without_keys_gives_zeros(
    ops: ModuleType, device: torch.device
) -> None:
    kv = paged_kv([5, 0, 33], 2, 64, device, seed=1)
    q = torch.randn(3, 4, 64).to(device)
    got = _run_decode(ops, q, kv, NUM_KV_SPLITS, 0.125)
    want = paged_attention_ref(
        q, kv.k_buffer, kv.v_buffer, [0, 1, 2, 3], kv.kv_indptr.tolist(), kv.kv_indices, 0.125
    )
    assert not got.isnan().any()
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_a_program_never_spans_two_kv_heads(ops: ModuleType) -> None:
    from rsgl.layers.attention.triton_ops.decode_attention import heads_per_program

    assert [heads_per_program(g) for g in (1, 3, 4, 8, 64)] == [1, 3, 4, 8, 64]
    assert heads_per_program(96) == 48 and heads_per_program(67) == 1


# ---------------------------------------------------------------- prefill_attention


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 48), (2, 2, 64)]
)
def test_prefill_attention_matches_bottom_right_causal_sdpa(
    ops: ModuleType, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # (prefix, new tokens): no prefix, a prefix, a 70-token chunk over two query blocks,
    # a one-token prompt, then the decode tail of a MIXED batch.
    reqs = [(0, 5), (7, 3), (5, 70), (0, 1), (30, 1), (65, 1)]
    qo_lens = [n for _, n in reqs]
    kv_lens = [p + n for p, n in reqs]
    kv = paged_kv(kv_lens, num_kv_heads, head_dim, device, seed=head_dim)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).tolist()
    q = torch.randn(qo_indptr[-1], num_heads, head_dim).to(device)
    scale = head_dim**-0.5
    want = paged_attention_ref(
        q, kv.k_buffer, kv.v_buffer, qo_indptr, kv.kv_indptr.tolist(), kv.kv_indices, scale
    )
    qo = torch.tensor(qo_indptr, dtype=torch.int32, device=device)
    # The exact longest request, and a loose upper bound (idle query blocks return early).
    for max_qo_len in (max(qo_lens), 200):
        o = torch.full_like(q, float("nan"))
        ops.prefill_attention(
            q, kv.k_buffer, kv.v_buffer, o, qo, kv.kv_indptr, kv.kv_indices, max_qo_len, scale
        )
        torch.testing.assert_close(o, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_kernels_match_a_float32_reference(
    ops: ModuleType, device: torch.device, dtype: torch.dtype
) -> None:
    if dtype == torch.bfloat16 and ops.kernels_interpreted():
        pytest.skip("Triton's interpreter computes tl.dot on bfloat16 wrongly (GPU only)")
    reqs = [(0, 20), (40, 3), (17, 1), (70, 1)]
    qo_lens = [n for _, n in reqs]
    kv = paged_kv([p + n for p, n in reqs], 2, 64, device, seed=5)
    kv.k_buffer, kv.v_buffer = kv.k_buffer.to(dtype), kv.v_buffer.to(dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).tolist()
    q = torch.randn(qo_indptr[-1], 8, 64).to(device, dtype)
    want = paged_attention_ref(
        q.float(), kv.k_buffer, kv.v_buffer, qo_indptr, kv.kv_indptr.tolist(), kv.kv_indices, 0.125
    )
    o = torch.empty_like(q)
    qo = torch.tensor(qo_indptr, dtype=torch.int32, device=device)
    ops.prefill_attention(
        q, kv.k_buffer, kv.v_buffer, o, qo, kv.kv_indptr, kv.kv_indices, max(qo_lens), 0.125
    )
    assert o.dtype == dtype
    torch.testing.assert_close(o.float(), want, atol=2e-2, rtol=0)
    # The decode kernel on the last two requests (one query each).
    tail = PagedKV(
        kv.k_buffer,
        kv.v_buffer,
        kv.kv_indptr[2:] - kv.kv_indptr[2],
        kv.kv_indices[kv.kv_indptr[2] :],
    )
    got = _run_decode(ops, q[-2:].contiguous(), tail, NUM_KV_SPLITS, 0.125)
    torch.testing.assert_close(got.float(), want[-2:], atol=2e-2, rtol=0)


# ---------------------------------------------------------------- the backend end to end

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 9, 3, 64, 2
CONTEXT_LEN, MAX_REQS, KV_SLOTS = 96, 8, 600


@dataclass
class Step:
    """One step's requests as (req_slot, prefix_len, extend_len), extends before decodes."""

    reqs: list[tuple[int, int, int]]


def _setup(
    device: torch.device, step: Step, seed: int
) -> tuple[KVCache, ReqToTokenPool, ForwardBatch]:
    """A cache with every request's prefix already stored at scattered slots, req_to_token
    rows covering prefix and new tokens, and the step's batch."""
    rng = np.random.default_rng(seed)
    cache = KVCache(KV_SLOTS, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, torch.float32, device)
    gen = torch.Generator().manual_seed(seed)
    for buf in cache.k_buffers + cache.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    pool = ReqToTokenPool(MAX_REQS, CONTEXT_LEN, device)
    free = (rng.permutation(KV_SLOTS - 1) + 1).tolist()
    out_cache_loc: list[int] = []
    for slot, prefix, extend in step.reqs:
        slots = [free.pop() for _ in range(prefix + extend)]
        pool.req_to_token[slot, : prefix + extend] = torch.tensor(slots, dtype=torch.int32)
        out_cache_loc += slots[prefix:]
    extend_lens = [r[2] for r in step.reqs]
    batch = ForwardBatch.from_arrays(
        forward_mode="decode" if max(extend_lens) == 1 else "mixed",
        req_slots=np.array([r[0] for r in step.reqs]),
        prefix_lens=np.array([r[1] for r in step.reqs]),
        extend_lens=np.array(extend_lens),
        input_ids=np.zeros(len(out_cache_loc), dtype=np.int64),
        out_cache_loc=np.array(out_cache_loc),
        device=device,
    )
    return cache, pool, batch


def _clone(cache: KVCache) -> KVCache:
    twin = KVCache(cache.size, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, cache.dtype, cache.device)
    for dst, src in zip(
        twin.k_buffers + twin.v_buffers, cache.k_buffers + cache.v_buffers, strict=True
    ):
        dst.copy_(src)
    return twin


def _backends(
    cache: KVCache, pool: ReqToTokenPool
) -> tuple[TritonAttnBackend, TorchNativeAttnBackend, KVCache]:
    ref_cache = _clone(cache)
    triton_backend = create_attention_backend(
        "triton", cache, pool, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, model_dtype=torch.float32
    )
    assert isinstance(triton_backend, TritonAttnBackend)
    ref = TorchNativeAttnBackend(
        ref_cache,
        pool,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        model_dtype=torch.float32,
        use_decode_kernel=False,
    )
    return triton_backend, ref, ref_cache


STEPS = {
    "extend": Step([(0, 0, 9), (3, 12, 5), (5, 0, 1)]),
    "mixed": Step([(1, 20, 6), (0, 0, 4), (2, 33, 1), (4, 70, 1), (6, 1, 1)]),
    "decode": Step([(2, 40, 1), (7, 1, 1), (0, 95, 1), (3, 8, 1)]),
}


@pytest.mark.parametrize("mode", sorted(STEPS))
def test_backend_matches_torch_native(ops: ModuleType, device: torch.device, mode: str) -> None:
    step = STEPS[mode]
    cache, pool, batch = _setup(device, step, seed=len(mode))
    triton_backend, ref, ref_cache = _backends(cache, pool)
    triton_backend.prepare(batch)
    meta = batch.attn_metadata
    assert isinstance(meta, TritonAttnMetadata)
    assert meta.decode_only == (mode == "decode")
    ref_batch = dataclasses.replace(batch, attn_metadata=None)
    ref.prepare(ref_batch)
    gen = torch.Generator().manual_seed(7)
    t = batch.num_tokens
    for layer in range(NUM_LAYERS):
        q = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=gen).to(device)
        k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device)
        v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device)
        got = triton_backend.forward(q, k, v, layer, batch)
        want = ref.forward(q, k, v, layer, ref_batch)
        assert got.shape == (t, NUM_HEADS * HEAD_DIM)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert torch.equal(cache.k_buffers[layer], ref_cache.k_buffers[layer])
        assert torch.equal(cache.v_buffers[layer], ref_cache.v_buffers[layer])


def test_capture_metadata_equals_prepare_and_follows_static_inputs(
    ops: ModuleType, device: torch.device
) -> None:
    step = STEPS["decode"]
    cache, pool, batch = _setup(device, step, seed=3)
    backend, ref, _ = _backends(cache, pool)
    backend.init_cuda_graph_state(max_bs=8, max_context_len=CONTEXT_LEN)
    eager = dataclasses.replace(batch)
    backend.prepare(eager)
    backend.prepare_for_capture(batch)
    want, got = eager.attn_metadata, batch.attn_metadata
    assert isinstance(want, TritonAttnMetadata) and isinstance(got, TritonAttnMetadata)
    total = int(batch.seq_lens_host.sum())
    assert got.decode_only and got.max_qo_len == 1
    assert torch.equal(got.qo_indptr, want.qo_indptr)
    assert torch.equal(got.kv_indptr, want.kv_indptr)
    assert torch.equal(got.kv_indices[:total], want.kv_indices)
    assert got.partial_out is not None and got.partial_out.shape[0] == batch.batch_size

    q = torch.randn(batch.batch_size, NUM_HEADS, HEAD_DIM).to(device)
    k = torch.randn(batch.batch_size, NUM_KV_HEADS, HEAD_DIM).to(device)
    out_eager = backend.forward(q, k, k, 0, eager)
    out_graph = backend.forward(q, k, k, 0, batch)
    torch.testing.assert_close(out_graph, out_eager, atol=0, rtol=0)

    # A replay re-runs the captured ops on new contents of the same static tensors: here one
    # request turns into a padding row (the all-zero padding request row, length 1).
    batch.req_slots[1] = pool.padding_row
    batch.seq_lens[1] = 1
    backend.prepare_for_capture(batch)
    meta = batch.attn_metadata
    assert isinstance(meta, TritonAttnMetadata)
    lens = [41, 1, 96, 9]
    assert meta.kv_indptr.tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert meta.kv_indices[41:42].tolist() == [0]
    assert torch.equal(meta.kv_indices[42:138], pool.req_to_token[0, :96])
