"""A float16 / bfloat16 KV cache for the float32 SmolLM2: every path reads the same rounded
keys and values, and the model stays close to its float32-cache self."""

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


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("float16", torch.float16)])
def test_narrow_cache_paths_agree_and_stay_near_float32(
    smol_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype
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
    driver.run([driver.work(decoding, len(PROMPT))])
    decoding.tokens.append(tokens[0])
    # A mixed step (an extend and a decode) goes through the unfused decode kernel.
    mixed_out = driver.run([driver.work(mixed, 20), driver.work(decoding, 1)])
    assert int(mixed_out.next_token_ids[1]) == tokens[1]

    if backend.decode_kernel is not None:
        monkeypatch.setattr(backend, "decode_kernel", None)
        monkeypatch.setattr(rsgl.layers.norm, "load_cpu_kernels", lambda: None)
        monkeypatch.setattr(rsgl.models.llama, "load_cpu_kernels", lambda: None)
        driver.reset()
        eager, eager_logits = driver.greedy(driver.admit(0, PROMPT), 12, chunk=16)
        assert eager == tokens
        # The paths differ in the last float32 bits (a fused kernel vs torch ops), and a key
        # on a rounding boundary then lands one 16-bit step apart: not 1e-4, but one step.
        step = 0.1 if dtype == torch.bfloat16 else 0.01
        eager_diffs = [
            float(np.abs(a - b).max()) for a, b in zip(logits, eager_logits, strict=True)
        ]
        assert max(eager_diffs) < step, eager_diffs
        monkeypatch.undo()

    reference = Driver(smol_runner)
    ref_tokens, ref_logits = reference.greedy(reference.admit(0, PROMPT), 12, chunk=16)
    # Rounding K/V moves logits a little; it must not move them far. (Measured: bf16 ~0.07,
    # fp16 ~0.007 at most over these 12 steps; the bounds leave room, and a float32 cache
    # read as 16-bit by mistake, or keys stored unrotated, miss them by orders of magnitude.)
    bound = 0.5 if dtype == torch.bfloat16 else 0.05
    diffs = [float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits, strict=True)]
    assert max(diffs) < bound, diffs
    assert tokens[:4] == ref_tokens[:4]


def test_kv_cache_dtype_names_and_sizes() -> None:
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp16", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        resolve_kv_cache_dtype("int8", torch.float32)


def test_a_16_bit_cache_holds_twice_the_tokens(smol_runner: ModelRunner) -> None:
    cfg = smol_runner.config
    assert KVCache.bytes_per_slot(cfg, torch.float32) == 2 * KVCache.bytes_per_slot(
        cfg, torch.bfloat16
    )
