"""Narrow KV caches for the float32 SmolLM2 (float16, bfloat16, fp8_e4m3, fp8_e5m2, int8 with
its scales): every path reads the same rounded keys and values, and the model stays close to
its float32-cache self."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plan_builder import Driver

import rsgl.layers.norm
import rsgl.models.llama
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend
from rsgl.model_executor.kv_cache import KVCache, resolve_kv_cache_dtype
from rsgl.model_executor.model_runner import ModelRunner

PROMPT = np.random.default_rng(11).integers(100, 40000, size=40).tolist()


def _runner(smol_runner: ModelRunner, kv_cache_dtype: str) -> ModelRunner:
    return ModelRunner(
        smol_runner.loaded,
        kv_buffer_size=1024,
        max_running_requests=4,
        context_len=1024,
        kv_cache_dtype=kv_cache_dtype,
    )


# name, storage dtype, the bound on a logit between the fused kernel and eager torch (a key
# on a rounding boundary lands one step apart), the bound on a logit against the float32
# cache (both fed the narrow cache's greedy tokens), and how many of the first greedy tokens
# must equal the float32 cache's (this random prompt has near-ties an fp8 step flips).
# Measured over these 12 steps on a Sapphire Rapids (kernel vs eager / vs float32): bf16
# 0.047 / 0.072, fp16 0.0034 / 0.0086, int8 0.22 / 0.24, fp8_e4m3 0.67 / 0.77, fp8_e5m2
# 0.38 / 29 (0.96 / - since a 16-token chunk reads the GGUF blocks: the same weights,
# another summation order, and so other keys on e5m2's rounding boundaries). The bounds
# leave room, and a cache read wrongly (a float32 cache read as 16-bit, keys stored
# unrotated, scales dropped) misses them by orders of magnitude. e5m2's
# two mantissa bits move this random prompt's attention far from float32's (KL divergence
# 2.8 at one step; on real text `rsgl bench quality` measures 0.02): it has no bound here,
# test_quality bounds it.
NARROW = [
    ("bf16", torch.bfloat16, 0.1, 0.5, 4),
    ("float16", torch.float16, 0.01, 0.05, 4),
    ("int8", torch.int8, 0.45, 0.6, 4),
    ("fp8_e4m3", torch.float8_e4m3fn, 1.3, 1.5, 1),
    ("fp8_e5m2", torch.float8_e5m2, 1.5, None, 0),
]


@pytest.mark.parametrize(("name", "dtype", "step", "bound", "same"), NARROW)
def test_narrow_cache_paths_agree_and_stay_near_float32(
    smol_runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    dtype: torch.dtype,
    step: float,
    bound: float | None,
    same: int,
) -> None:
    runner = _runner(smol_runner, name)
    assert runner.kv_cache.dtype == dtype
    assert all(buf.dtype == dtype for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers)
    backend = runner.attn
    assert isinstance(backend, TorchNativeAttnBackend)

    driver = Driver(runner)
    # Prefill in chunks of 16, so later chunks read the earlier ones back from the cache.
    tokens, logits = driver.greedy(driver.admit(0, PROMPT), 12, chunk=16)
    mixed = driver.admit(1, PROMPT[:20])
    decoding = driver.admit(2, PROMPT)
    # Prefilled in the same chunks: its cache then holds the first request's keys bit for bit
    # (a prefill of another size may take another kernel, and so another summation order,
    # whose keys land on other rounding boundaries of a narrow cache).
    for start in range(0, len(PROMPT), 16):
        driver.run([driver.work(decoding, min(16, len(PROMPT) - start))])
    decoding.tokens.append(tokens[0])
    # A mixed step (an extend and a decode) goes through the unfused decode kernel.
    mixed_out = driver.run([driver.work(mixed, 20), driver.work(decoding, 1)])
    assert int(mixed_out.next_token_ids[1]) == tokens[1]

    if backend.decode_kernel is not None:
        monkeypatch.setattr(backend, "decode_kernel", None)
        monkeypatch.setattr(rsgl.layers.norm, "load_cpu_kernels", lambda: None)
        monkeypatch.setattr(rsgl.models.llama, "load_cpu_kernels", lambda: None)
        driver.reset()
        # Fed the kernel's tokens, so a near-tie one 8-bit step flips cannot derail the rest.
        eager, eager_logits = driver.greedy(driver.admit(0, PROMPT), 12, chunk=16, forced=tokens)
        if dtype.itemsize == 2:
            assert eager == tokens
        # The paths differ in the last float32 bits (a fused kernel vs torch ops), and a key
        # on a rounding boundary then lands one step apart: not 1e-4, but one step.
        eager_diffs = [
            float(np.abs(a - b).max()) for a, b in zip(logits, eager_logits, strict=True)
        ]
        assert max(eager_diffs) < step, eager_diffs
        monkeypatch.undo()

    reference = Driver(smol_runner)
    ref_tokens, ref_logits = reference.greedy(
        reference.admit(0, PROMPT), 12, chunk=16, forced=tokens
    )
    # Rounding K/V moves logits a little; it must not move them far.
    diffs = [float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits, strict=True)]
    assert bound is None or max(diffs) < bound, diffs
    assert tokens[:same] == ref_tokens[:same]


def test_kv_cache_dtype_names_and_sizes() -> None:
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp16", torch.float32) == torch.float16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'"):
        resolve_kv_cache_dtype("int4", torch.float32)


def test_narrow_caches_hold_more_tokens(smol_runner: ModelRunner) -> None:
    cfg = smol_runner.config
    full = KVCache.bytes_per_slot(cfg, torch.float32)
    assert full == 2 * KVCache.bytes_per_slot(cfg, torch.bfloat16)
    assert full == 4 * KVCache.bytes_per_slot(cfg, torch.float8_e4m3fn)
    # int8 adds a float32 scale per kv head to each head's head_dim bytes, K and V.
    heads, dim = cfg.num_key_value_heads, cfg.head_dim
    per_layer = 2 * heads * (dim + 4)
    assert KVCache.bytes_per_slot(cfg, torch.int8) == cfg.num_hidden_layers * per_layer
    cache = KVCache.for_model(cfg, 64, torch.int8, "cpu")
    assert cache.scaled and cache.k_scales[0].shape == (64, heads)
    assert not KVCache.for_model(cfg, 64, torch.float8_e5m2, "cpu").scaled


def test_backends_without_8_bit_kernels_refuse_an_8_bit_cache(smol_runner: ModelRunner) -> None:
    from rsgl.layers.attention.triton_backend import TritonAttnBackend

    cache = KVCache.for_model(smol_runner.config, 64, torch.int8, "cpu")
    cfg = smol_runner.config
    with pytest.raises(ValueError, match="16- and 32-bit KV caches, not torch.int8"):
        TritonAttnBackend(
            cache,
            smol_runner.req_to_token,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            model_dtype=torch.float32,
        )
