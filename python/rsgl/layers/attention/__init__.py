"""Attention backends, chosen by name."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from rsgl.layers.attention.base import AttentionBackend
from rsgl.layers.attention.flashinfer_backend import FlashInferAttnBackend, FlashInferUnavailable
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend
from rsgl.layers.attention.triton_backend import TritonAttnBackend

if TYPE_CHECKING:
    from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch_native": TorchNativeAttnBackend,
    # Imports triton only when created.
    "triton": TritonAttnBackend,
    # Imports flashinfer only when created; falls back to triton when it cannot run.
    "flashinfer": FlashInferAttnBackend,
}

logger = logging.getLogger(__name__)


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
    """Instantiate the backend registered as `name` (`options` go to its constructor).

    flashinfer is an optional package whose kernels compile on the machine: when it is
    missing or they fail, this logs a warning and returns the triton backend instead."""
    try:
        cls = ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; available: {known}") from None
    try:
        return cls(
            kv_cache,
            req_to_token,
            num_heads,
            num_kv_heads,
            head_dim,
            model_dtype=model_dtype,
            **options,
        )
    except FlashInferUnavailable as exc:
        logger.warning("attention backend flashinfer is unavailable, using triton: %s", exc)
        return create_attention_backend(
            "triton",
            kv_cache,
            req_to_token,
            num_heads,
            num_kv_heads,
            head_dim,
            model_dtype=model_dtype,
        )


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "create_attention_backend"]
