"""The flashinfer attention backend against torch_native on the same batches, in bfloat16.

Each case builds one step over a random KV cache: requests with cached prefixes (two of
them sharing theirs slot for slot), chunks, and decode rows last, in every layout a step
can have (EXTEND, MIXED, DECODE), for query/KV head groups that take FlashInfer's CUDA-core
decode (1, 3) and its tensor-core decode (4, 8). Both backends run on one cache: each
stores the step's keys/values at the same slots before attending, so they read the same
values. Skipped without CUDA (tests/gpu/conftest.py) or without flashinfer (install it
from the wheels of tools/fetch_gpu_wheels.sh).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from rsgl.layers.attention import create_attention_backend
from rsgl.layers.attention.base import AttentionBackend
from rsgl.layers.attention.flashinfer_backend import FlashInferAttnBackend
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend
from rsgl.model_executor.forward_batch import ForwardBatch
from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: flashinfer runs on CUDA only"
)
needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="flashinfer is not installed (wheels: tools/fetch_gpu_wheels.sh)",
)

DTYPE = torch.bfloat16
MAX_REQS = 8
CONTEXT_LEN = 1024
KV_SLOTS = 8192
# bfloat16 keeps 8 bits of mantissa: two kernels that sum in different orders differ by a
# few 1e-3 on outputs of order 1; a wrong mask or a wrong slot is off by order 1.
ATOL = RTOL = 3e-2

# (query heads, KV heads, head dim): groups 1 and 3 decode on CUDA cores, 4 and 8 on
# tensor cores.
HEADS = [(4, 4, 64), (9, 3, 64), (8, 2, 128), (32, 4, 128)]
HEAD_IDS = ["mha-d64", "gqa3-d64", "gqa4-d128", "gqa8-d128"]


@dataclass
class Step:
    cache: KVCache
    pool: ReqToTokenPool
    batch: ForwardBatch
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor


def make_step(
    seed: int,
    heads: tuple[int, int, int],
    prefix_lens: list[int],
    extend_lens: list[int],
    mode: str,
    cache: KVCache | None = None,
    pool: ReqToTokenPool | None = None,
) -> Step:
    """A step over a random cache. Request 1 shares request 0's prefix slots as far as both
    prefixes go; every other token has a slot of its own."""
    hq, hkv, d = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if cache is None:
        cache = KVCache(KV_SLOTS, 1, hkv, d, DTYPE, "cuda")
        for buf in (cache.k_buffers[0], cache.v_buffers[0]):
            buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda", dtype=DTYPE))
    if pool is None:
        pool = ReqToTokenPool(MAX_REQS, CONTEXT_LEN, "cuda")
    rng = np.random.default_rng(seed)
    slots = rng.permutation(np.arange(1, KV_SLOTS))  # slot 0: padding
    taken = 0
    rows = [int(r) for r in rng.permutation(MAX_REQS)[: len(prefix_lens)]]
    out_cache_loc: list[int] = []
    table = pool.req_to_token
    for i, (row, prefix, extend) in enumerate(zip(rows, prefix_lens, extend_lens, strict=True)):
        seq = prefix + extend
        own = slots[taken : taken + seq]
        taken += seq
        table[row, :seq] = torch.as_tensor(own, dtype=torch.int32)
        if i == 1:
            shared = min(prefix_lens[0], prefix)
            table[row, :shared] = table[rows[0], :shared]
        out_cache_loc += own[prefix:].tolist()
    n = sum(extend_lens)
    batch = ForwardBatch.from_arrays(
        forward_mode=mode,
        req_slots=np.asarray(rows),
        prefix_lens=np.asarray(prefix_lens),
        extend_lens=np.asarray(extend_lens),
        input_ids=np.zeros(n, dtype=np.int64),
        out_cache_loc=np.asarray(out_cache_loc),
        device="cuda",
    )

    def rand(h: int) -> torch.Tensor:
        return torch.randn((n, h, d), generator=gen, device="cuda", dtype=DTYPE)

    return Step(cache, pool, batch, rand(hq), rand(hkv), rand(hkv))


def run(backend: AttentionBackend, step: Step) -> torch.Tensor:
    backend.prepare(step.batch)
    return backend.forward(step.q, step.k, step.v, 0, step.batch)


def backends(step: Step) -> tuple[AttentionBackend, AttentionBackend]:
    hq, hkv, d = step.q.shape[1], step.k.shape[1], step.q.shape[2]
    ref = TorchNativeAttnBackend(step.cache, step.pool, hq, hkv, d, model_dtype=DTYPE)
    fi = FlashInferAttnBackend(step.cache, step.pool, hq, hkv, d, model_dtype=DTYPE)
    return ref, fi


LAYOUTS = {
    # name: (mode, prefix_lens, extend_lens)
    "extend-fresh": ("extend", [0, 0], [37, 130]),
    "extend-prefix": ("extend", [64, 100, 17], [20, 45, 1]),
    "mixed": ("mixed", [40, 40, 300, 0, 9], [33, 7, 1, 1, 1]),
    "decode": ("decode", [300, 299, 1, 0, 700, 63], [1, 1, 1, 1, 1, 1]),
}


@needs_flashinfer
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flashinfer_matches_torch_native(heads: tuple[int, int, int], layout: str) -> None:
    mode, prefix, extend = LAYOUTS[layout]
    step = make_step(1, heads, prefix, extend, mode)
    ref, fi = backends(step)
    want = run(ref, step)
    got = run(fi, step)
    assert got.shape == (step.batch.num_tokens, heads[0] * heads[2]) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)
    # The step's keys/values were stored where req_to_token says.
    loc = step.batch.out_cache_loc
    assert torch.equal(step.cache.k_buffers[0][loc], step.k)
    assert torch.equal(step.cache.v_buffers[0][loc], step.v)


@needs_flashinfer
@pytest.mark.parametrize("heads", HEADS[1:3], ids=HEAD_IDS[1:3])
def test_one_backend_serves_steps_of_every_layout_in_turn(heads: tuple[int, int, int]) -> None:
    # Decode and prefill wrappers share the workspaces; re-planning one after the other
    # must not leave stale state behind.
    first = make_step(2, heads, [0], [8], "extend")
    ref, fi = backends(first)
    for i, name in enumerate(["extend-prefix", "decode", "mixed", "decode", "extend-fresh"]):
        mode, prefix, extend = LAYOUTS[name]
        step = make_step(10 + i, heads, prefix, extend, mode, first.cache, first.pool)
        want = run(ref, step)
        got = run(fi, step)
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


@needs_flashinfer
@pytest.mark.parametrize("heads", HEADS[1:3], ids=HEAD_IDS[1:3])
def test_graph_replay_matches_eager_decode(heads: tuple[int, int, int]) -> None:
    """The hooks in the order of rsgl's CudaGraphRunner: a warm-up forward and a capture of
    a padding batch, then for each real batch, inputs copied into the static buffers,
    `prepare_for_replay` and a replay."""
    hq, hkv, d = heads
    bs = 4
    first = make_step(3, heads, [5] * bs, [1] * bs, "decode")
    cache, pool = first.cache, first.pool
    fi = FlashInferAttnBackend(cache, pool, hq, hkv, d, model_dtype=DTYPE)
    ref = TorchNativeAttnBackend(cache, pool, hq, hkv, d, model_dtype=DTYPE)
    fi.init_cuda_graph_state(8, CONTEXT_LEN)

    ones = np.ones(bs, dtype=np.int64)
    static = ForwardBatch.from_arrays(
        forward_mode="decode",
        req_slots=np.full(bs, pool.padding_row),
        prefix_lens=np.zeros(bs, dtype=np.int64),
        extend_lens=ones,
        input_ids=np.zeros(bs, dtype=np.int64),
        out_cache_loc=np.zeros(bs, dtype=np.int64),
        device="cuda",
    )
    q = torch.zeros((bs, hq, d), dtype=DTYPE, device="cuda")
    k = torch.zeros((bs, hkv, d), dtype=DTYPE, device="cuda")
    v = torch.zeros_like(k)

    def forward() -> torch.Tensor:
        fi.prepare_for_capture(static)
        return fi.forward(q, k, v, 0, static)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        forward()  # warm-up: creates and plans the wrapper for this size
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = forward()

    # Sequence lengths from short to long: the re-plan must carry each into the graph.
    for i, prefix in enumerate([[5, 17, 0, 40], [300, 2, 650, 129], [1000, 999, 1, 512]]):
        step = make_step(20 + i, heads, prefix, [1] * bs, "decode", cache, pool)
        want = run(ref, step)
        eager = run(fi, step)
        for dst, src in (
            (static.out_cache_loc, step.batch.out_cache_loc),
            (static.req_slots, step.batch.req_slots),
            (static.seq_lens, step.batch.seq_lens),
            (q, step.q),
            (k, step.k),
            (v, step.v),
        ):
            dst.copy_(src)
        fi.prepare_for_replay(step.batch)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), want.float(), atol=ATOL, rtol=RTOL)
        # Not bitwise: in graph mode FlashInfer always splits the KV of a batch that does
        # not fill the GPU, so its partial sums differ from the eager plan's.
        torch.testing.assert_close(out.float(), eager.float(), atol=ATOL, rtol=RTOL)


@needs_flashinfer
def test_float32_models_are_refused() -> None:
    cache = KVCache(64, 1, 2, 64, torch.float32, "cuda")
    pool = ReqToTokenPool(2, 16, "cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        FlashInferAttnBackend(cache, pool, 4, 2, 64, model_dtype=torch.float32)


def test_missing_flashinfer_falls_back_to_triton(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # None in sys.modules makes `import flashinfer` raise ImportError.
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    cache = KVCache(256, 1, 2, 64, DTYPE, "cuda")
    pool = ReqToTokenPool(2, 64, "cuda")
    with caplog.at_level(logging.WARNING, logger="rsgl.layers.attention"):
        backend = create_attention_backend("flashinfer", cache, pool, 4, 2, 64, model_dtype=DTYPE)
    assert type(backend).__name__ == "TritonAttnBackend"
    assert "flashinfer is unavailable" in caplog.text
