"""triton: paged attention with rsgl's own Triton kernels, the CUDA path without extra wheels.

Triton ships with PyPI torch on Linux x86_64; this module imports it only when a backend
is created, so merely registering the backend costs nothing on machines without it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rsgl.layers.attention.base import AttentionBackend
from rsgl.layers.attention.paged_metadata import build_host_indptrs

if TYPE_CHECKING:
    from rsgl.model_executor.forward_batch import ForwardBatch
    from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool

# KV splits of the decode kernel. Fixed, so its float32 workspaces have static shapes under
# CUDA graphs. 8 splits give a batch of one 8 x 8 = 64 programs per request on an 8-KV-head
# model, enough to keep a long sequence busy, while a large batch (already parallel across
# requests) pays only 8 partial outputs per head for the merge.
NUM_KV_SPLITS = 8


@dataclass(slots=True)
class TritonAttnMetadata:
    """One step's attention metadata, shared by every layer.

    `qo_indptr`/`kv_indptr` (int32 [B + 1]) delimit each request's query tokens and its
    slice of `kv_indices` (int32 KV slots, prefix then new tokens). A decode-only step also
    carries the split-KV workspaces; `max_qo_len` sizes the prefill grid.
    """

    decode_only: bool
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_qo_len: int
    partial_out: torch.Tensor | None = None  # float32 [B, Hq, NUM_KV_SPLITS, D]
    partial_lse: torch.Tensor | None = None  # float32 [B, Hq, NUM_KV_SPLITS]


@dataclass(slots=True)
class _GraphBuffers:
    """Static metadata buffers for captured decode batches of up to `max_bs` rows."""

    max_context_len: int
    qo_indptr: torch.Tensor  # arange(max_bs + 1): one query per decode row
    kv_indptr: torch.Tensor  # [max_bs + 1], entry 0 stays 0
    kv_indices: torch.Tensor  # [max_bs * max_context_len], an upper bound
    partial_out: torch.Tensor
    partial_lse: torch.Tensor


class TritonAttnBackend(AttentionBackend):
    """Attention through rsgl's Triton kernels over the page-size-1 KV cache.

    Why these kernels: they need nothing beyond torch's own Triton, compile in seconds, and
    read all their metadata on the device, so the decode path can be captured in a CUDA
    graph. `prepare` builds `qo_indptr`/`kv_indptr` from the batch's host arrays (pinned,
    non-blocking copy) and gathers `kv_indices` from req_to_token on the device: no host
    sync. Each layer stores the step's K/V first and then attends, so one paged prefill
    kernel with a bottom-right causal mask covers EXTEND and MIXED steps; decode-only steps
    use the split-KV decode kernel.

    Metadata lives in buffers reused from step to step, so `prepare` and `forward` must run
    on one stream (the runner's forward stream), which orders each step after the last.
    """

    supports_cuda_graph = True

    def __init__(
        self,
        kv_cache: KVCache,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        model_dtype: torch.dtype,
    ) -> None:
        super().__init__(
            kv_cache, req_to_token, num_heads, num_kv_heads, head_dim, model_dtype=model_dtype
        )
        if kv_cache.dtype.itemsize == 1:
            raise ValueError(
                f"the triton attention backend reads 16- and 32-bit KV caches, not "
                f"{kv_cache.dtype}; the 8-bit caches run on torch_native (CPU)"
            )
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(
                "the triton attention backend needs the `triton` package (PyPI torch on "
                "Linux x86_64 installs it); use attention_backend='torch_native' instead"
            )
        from rsgl.layers.attention.triton_ops import (
            build_kv_indices,
            decode_attention,
            kernels_interpreted,
            prefill_attention,
        )

        self.device = kv_cache.device
        if self.device.type != "cuda" and not kernels_interpreted():
            raise ValueError(
                f"the triton attention backend runs on CUDA, not {self.device.type} (to run "
                "its kernels on the CPU in Triton's interpreter, set TRITON_INTERPRET=1 "
                "before importing triton)"
            )
        self._build_kv_indices = build_kv_indices
        self._decode_attention = decode_attention
        self._prefill_attention = prefill_attention
        # Every request's full sequence fits in its req_to_token row, so the rows' total
        # bounds any step's kv_indices.
        self._kv_indices = torch.empty(
            req_to_token.req_to_token.numel(), dtype=torch.int32, device=self.device
        )
        self._graph: _GraphBuffers | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        # Host arrays only: offsets built on the host, one pinned copy to the device.
        host = build_host_indptrs(
            batch.extend_lens_host, batch.seq_lens_host, pin=self.device.type == "cuda"
        )
        total_kv = host.num_kv_indices
        if total_kv > self._kv_indices.shape[0]:
            raise ValueError(
                f"{total_kv} KV entries exceed req_to_token's {self._kv_indices.shape[0]}"
            )
        qo_indptr = host.qo_indptr.to(self.device, non_blocking=True)
        kv_indptr = host.kv_indptr.to(self.device, non_blocking=True)
        kv_indices = self._kv_indices[:total_kv]
        self._build_kv_indices(
            self.req_to_token.req_to_token, batch.req_slots, batch.seq_lens, kv_indptr, kv_indices
        )
        decode_only = bs > 0 and batch.num_decodes == bs
        meta = TritonAttnMetadata(
            decode_only=decode_only,
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            max_qo_len=host.max_extend_len,
        )
        if decode_only:
            meta.partial_out, meta.partial_lse = self._split_workspaces(bs)
        batch.attn_metadata = meta

    def _split_workspaces(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (bs, self.num_heads, NUM_KV_SPLITS)
        out = torch.empty((*shape, self.head_dim), dtype=torch.float32, device=self.device)
        lse = torch.empty(shape, dtype=torch.float32, device=self.device)
        return out, lse

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, TritonAttnMetadata), "prepare(batch) was not called"
        self.kv_cache.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf = self.kv_cache.k_buffers[layer_id]
        v_buf = self.kv_cache.v_buffers[layer_id]
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode_only:
            assert meta.partial_out is not None and meta.partial_lse is not None
            self._decode_attention(
                q,
                k_buf,
                v_buf,
                out,
                meta.kv_indptr,
                meta.kv_indices,
                self.scale,
                num_kv_splits=NUM_KV_SPLITS,
                partial_out=meta.partial_out,
                partial_lse=meta.partial_lse,
            )
        else:
            self._prefill_attention(
                q,
                k_buf,
                v_buf,
                out,
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.max_qo_len,
                self.scale,
            )
        return out.view(q.shape[0], -1)

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        dev = self.device
        out, lse = self._split_workspaces(max_bs)
        self._graph = _GraphBuffers(
            max_context_len=max_context_len,
            qo_indptr=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            kv_indices=torch.zeros(max_bs * max_context_len, dtype=torch.int32, device=dev),
            partial_out=out,
            partial_lse=lse,
        )

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        graph = self._graph
        if graph is None:
            raise RuntimeError("init_cuda_graph_state was not called")
        bs = batch.batch_size
        if batch.num_decodes != bs or bs > graph.qo_indptr.shape[0] - 1:
            raise ValueError(
                f"graphs capture decode batches of up to {graph.qo_indptr.shape[0] - 1} rows"
            )
        # Device-only: a replay recomputes all of this from the static seq_lens/req_slots.
        kv_indptr = graph.kv_indptr[: bs + 1]
        torch.cumsum(batch.seq_lens, 0, dtype=torch.int32, out=kv_indptr[1:])
        kv_indices = graph.kv_indices[: bs * graph.max_context_len]
        self._build_kv_indices(
            self.req_to_token.req_to_token, batch.req_slots, batch.seq_lens, kv_indptr, kv_indices
        )
        batch.attn_metadata = TritonAttnMetadata(
            decode_only=True,
            qo_indptr=graph.qo_indptr[: bs + 1],
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            max_qo_len=1,
            partial_out=graph.partial_out[:bs],
            partial_lse=graph.partial_lse[:bs],
        )

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        """Nothing: the captured `prepare_for_capture` rebuilds the metadata on the device."""
