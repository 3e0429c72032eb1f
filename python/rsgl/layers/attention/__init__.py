"""Attention backends, chosen by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rsgl.layers.attention.base import AttentionBackend
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend

if TYPE_CHECKING:
    from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch_native": TorchNativeAttnBackend,
}


def create_attention_backend(
    name: str,
    kv_cache: KVCache,
    req_to_token: ReqToTokenPool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    model_dtype: torch.dtype,
    **options: bool | None,
) -> AttentionBackend:
    """Instantiate the backend registered as `name` (`options` go to its constructor)."""
    try:
        cls = ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; available: {known}") from None
    return cls(
        kv_cache,
        req_to_token,
        num_heads,
        num_kv_heads,
        head_dim,
        model_dtype=model_dtype,
        **options,
    )


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "create_attention_backend"]
