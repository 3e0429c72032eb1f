"""The attention backend interface every backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rsgl.model_executor.forward_batch import ForwardBatch
    from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool


class AttentionBackend(ABC):
    """Paged attention over the KV cache for a batch that mixes extends and decodes.

    Per step the runner calls `prepare(batch)` once, which computes whatever every layer
    shares (index tables, masks, kernel plans) and stores it in `batch.attn_metadata`; each
    layer then calls `forward` (or, for decode-only batches, may first try the fused
    `forward_decode_qkv`), which writes the step's new keys/values into the KV cache at
    `batch.out_cache_loc` and returns the attention output. Keys and values are read only
    through `req_to_token`, so a request's cached prefix may live in any slots, shared with
    other requests.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        model_dtype: torch.dtype,
        **options: bool | None,
    ) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} takes no options {sorted(options)}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} groups")
        self.kv_cache = kv_cache
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # The dtype of queries and outputs; the cache may store K/V narrower.
        self.model_dtype = model_dtype

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Compute the step's shared attention metadata into `batch.attn_metadata`."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (rotated) -> output [T, Hq * D]."""

    # CUDA graphs (rsgl.model_executor.cuda_graph_runner): a backend that sets this builds
    # decode metadata with device-only ops into static buffers, so the graph's replay
    # recomputes it from the static inputs.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Allocate the static metadata buffers for decode batches of up to `max_bs` rows."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        """`prepare` for a decode batch of static buffers, with device-only operations (it
        runs inside graph capture and again, as part of the graph, on every replay)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        """Host-side work before replaying a graph for `batch` (already padded), if any."""
        return None

    def forward_decode_qkv(
        self, qkv: torch.Tensor, cis: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor | None:
        """Optional fused path for a decode-only batch: rotary, the KV store and attention
        straight from the QKV projection's output ([T, (Hq + 2 Hkv) * D], pair-interleaved
        q/k; `cis` as `RotaryEmbedding.cis` returns it). Returns [T, Hq * D], or None when
        this backend has no such path for `batch` (the caller then rotates and calls
        `forward`)."""
        return None
