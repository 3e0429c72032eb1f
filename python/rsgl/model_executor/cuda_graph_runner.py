"""CUDA graphs for decode steps: capture once per batch size, replay with padded batches.

A decode step of a small model on a GPU is mostly kernel-launch time: hundreds of launches of
microsecond kernels. A captured graph replays them all with one launch. Graphs freeze shapes
and addresses, so every input lives in a static buffer sized for the largest captured batch,
a batch is padded up to the next captured size, and the captured region reads only those
buffers: FutureMap resolution, the attention backend's device-side metadata and the model
forward. Sampling stays outside (its options change per batch); extend and mixed steps run
eagerly.

Padding rows use the padding request row (`ReqToTokenPool.padding_row`, all zeros), sequence
length 1, position 0 and KV slot 0: they attend to and overwrite only the padding slot.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from rsgl.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from rsgl.layers.attention.base import AttentionBackend
    from rsgl.model_executor.future_map import FutureMap
    from rsgl.models.llama import LlamaForCausalLM


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to `max_bs` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest captured size that holds `batch_size` rows (None: run eagerly)."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def pad_decode_arrays(
    arrays: dict[str, np.ndarray], size: int, padding_row: int
) -> dict[str, np.ndarray]:
    """A decode batch's per-request arrays padded with rows that touch only padding state:
    the padding request row, KV slot 0, position 0, token 0, sequence length 1."""
    n = arrays["req_slots"].shape[0]
    fill = {
        "req_slots": padding_row,
        "prefix_lens": 0,
        "extend_lens": 1,
        "seq_lens": 1,
        "input_ids": 0,
        "positions": 0,
        "out_cache_loc": 0,
    }
    out = {}
    for name, value in fill.items():
        padded = np.full(size, value, dtype=np.int64)
        padded[:n] = arrays[name]
        out[name] = padded
    return out


class Graph(Protocol):
    """What the runner needs of a graph: capture a callable once, then replay it."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class TorchCudaGraph:
    """A `torch.cuda.CUDAGraph` captured on `stream`, sharing one memory pool with the
    graphs captured before it (largest first, so the smaller ones fit in its memory)."""

    def __init__(self, stream: torch.cuda.Stream, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.stream = stream
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            fn()  # warm up: kernels compiled and autotuned, workspaces allocated
        torch.cuda.synchronize(self.stream.device)
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            out = fn()
        self.pool = self.graph.pool()
        return out

    def replay(self) -> None:
        self.graph.replay()


@dataclass(slots=True)
class _Captured:
    graph: Graph
    batch: ForwardBatch  # views of the static buffers, `size` rows
    logits: torch.Tensor  # [size, vocab], written by every replay


class CudaGraphRunner:
    """Captured decode graphs for each size of `capture_batch_sizes(max_bs)`.

    `make_graph(pool)` builds one graph object (a `TorchCudaGraph` on CUDA; tests pass a
    stand-in that re-runs the captured callable, which is exactly what a replay must be
    equivalent to, since the callable reads nothing but the static buffers).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        future_map: FutureMap,
        *,
        max_bs: int,
        max_context_len: int,
        device: torch.device,
        make_graph: Callable[[object | None], Graph],
    ) -> None:
        self.model = model
        self.attn = attn
        self.future_map = future_map
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.device = device
        self._make_graph = make_graph
        self._captured: dict[int, _Captured] = {}

        def zeros() -> np.ndarray:  # one array per buffer: on CPU tensors share memory
            return np.zeros(max_bs, dtype=np.int64)

        self.static = ForwardBatch.from_arrays(
            forward_mode=ForwardMode.DECODE,
            req_slots=zeros(),
            prefix_lens=zeros(),
            extend_lens=np.ones(max_bs, dtype=np.int64),
            input_ids=zeros(),
            out_cache_loc=zeros(),
            device=device,
        )
        attn.init_cuda_graph_state(max_bs, max_context_len)

    def capture(self, padding_row: int) -> None:
        """Captures every size, largest first, into one memory pool."""
        pool: object | None = None
        for size in reversed(self.sizes):
            batch = self._view(size)
            batch.req_slots.fill_(padding_row)
            graph = self._make_graph(pool)
            logits = graph.capture(lambda b=batch: self._forward(b))  # type: ignore[misc]
            pool = getattr(graph, "pool", None)
            self._captured[size] = _Captured(graph, batch, logits)

    def _view(self, size: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=s.input_ids[:size],
            positions=s.positions[:size],
            out_cache_loc=s.out_cache_loc[:size],
            req_slots=s.req_slots[:size],
            prefix_lens=s.prefix_lens[:size],
            extend_lens=s.extend_lens[:size],
            seq_lens=s.seq_lens[:size],
            extend_start_loc=s.extend_start_loc[:size],
            req_slots_host=s.req_slots_host[:size],
            prefix_lens_host=s.prefix_lens_host[:size],
            extend_lens_host=s.extend_lens_host[:size],
            seq_lens_host=s.seq_lens_host[:size],
            num_decodes=size,
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        # Decode rows hold one token each, so a token's request slot is its row's.
        input_ids = self.future_map.resolve(batch.input_ids, batch.req_slots)
        self.attn.prepare_for_capture(batch)
        logits: torch.Tensor = self.model(input_ids, batch, self.attn)
        return logits

    def can_run(self, batch_size: int, forward_mode: ForwardMode) -> bool:
        return forward_mode == ForwardMode.DECODE and batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch.batch_size, vocab] of a decode batch already padded to a captured
        size (see `pad_decode_arrays`); a view into the graph's output buffer, valid until
        the next replay of that size."""
        captured = self._captured[batch.batch_size]
        static = captured.batch
        for dst, src in (
            (static.input_ids, batch.input_ids),
            (static.positions, batch.positions),
            (static.out_cache_loc, batch.out_cache_loc),
            (static.req_slots, batch.req_slots),
            (static.prefix_lens, batch.prefix_lens),
            (static.seq_lens, batch.seq_lens),
        ):
            dst.copy_(src, non_blocking=True)
        self.attn.prepare_for_replay(batch)
        captured.graph.replay()
        return captured.logits


__all__ = [
    "CudaGraphRunner",
    "Graph",
    "TorchCudaGraph",
    "capture_batch_sizes",
    "pad_decode_arrays",
    "padded_size",
]
