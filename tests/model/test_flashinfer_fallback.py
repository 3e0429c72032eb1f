"""Choosing the flashinfer backend on a machine that cannot run it.

Configuration errors (a CPU device) are reported as they are; a machine without flashinfer,
or where its kernels do not build, gets the triton backend and a warning instead. The
kernels themselves are tested on a GPU (tests/gpu/test_flashinfer.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import rsgl.layers.attention as attention
from rsgl.layers.attention import AttentionBackend, create_attention_backend
from rsgl.layers.attention.flashinfer_backend import FlashInferUnavailable
from rsgl.model_executor.forward_batch import ForwardBatch
from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool


def _cache_and_pool() -> tuple[KVCache, ReqToTokenPool]:
    return KVCache(64, 1, 2, 16, torch.bfloat16, "cpu"), ReqToTokenPool(2, 16, "cpu")


def test_a_cpu_device_is_refused_not_replaced() -> None:
    cache, pool = _cache_and_pool()
    with pytest.raises(ValueError, match="CUDA only"):
        create_attention_backend("flashinfer", cache, pool, 4, 2, 16, model_dtype=torch.bfloat16)


class _Unbuildable(AttentionBackend):
    """Stands in for FlashInferAttnBackend on a machine where its kernels fail to build."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise FlashInferUnavailable("nvcc: not found")

    def prepare(self, batch: ForwardBatch) -> None:
        raise AssertionError("never built")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        raise AssertionError("never built")


class _Fallback(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        pass

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        return q.flatten(1)


def test_an_unavailable_flashinfer_falls_back_to_triton_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(attention.ATTENTION_BACKENDS, "flashinfer", _Unbuildable)
    monkeypatch.setitem(attention.ATTENTION_BACKENDS, "triton", _Fallback)
    cache, pool = _cache_and_pool()
    with caplog.at_level(logging.WARNING, logger="rsgl.layers.attention"):
        backend = create_attention_backend(
            "flashinfer", cache, pool, 4, 2, 16, model_dtype=torch.bfloat16, warmup=False
        )
    assert isinstance(backend, _Fallback)
    assert (backend.num_heads, backend.num_kv_heads, backend.head_dim) == (4, 2, 16)
    assert "flashinfer is unavailable, using triton: nvcc: not found" in caplog.text


def test_the_default_cuda_backend_is_flashinfer_only_where_it_can_run() -> None:
    from rsgl.model_executor.model_runner import default_attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert default_attention_backend(cpu, fp32, fp32) == "torch_native"
    assert default_attention_backend(cpu, bf16, bf16) == "torch_native"
    assert default_attention_backend(cuda, bf16, bf16) == "flashinfer"
    assert default_attention_backend(cuda, fp16, fp16) == "flashinfer"
    # flashinfer refuses float32 models and a KV cache narrower than the model: triton runs them.
    assert default_attention_backend(cuda, fp32, fp32) == "triton"
    assert default_attention_backend(cuda, bf16, fp16) == "triton"
