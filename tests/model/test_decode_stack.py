"""The decode stack (`rsgl.layers.decode_stack`): a small batch of a low-bit model (decodes, or
short extends as a row per token) goes through every decoder layer in one C call, and its logits
are the layer-by-layer path's bit for bit, over GGUF blocks and load-time groups, float32 and
bfloat16 activations, and 16-bit and 8-bit KV caches; batches above the low-bit rows, and parts
the driver does not read, stay on the layer path."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kquants import k_quant_copy
from plan_builder import Driver

from rsgl.layers import decode_stack
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend
from rsgl.layers.cpu_kernels import load_cpu_kernels
from rsgl.layers.quant_linear import GroupQuantized
from rsgl.model_executor.model_runner import ModelRunner

CONFIGS: dict[str, dict[str, Any]] = {
    "gguf-float32": {"dtype": torch.float32},
    "gguf-bfloat16-int8-cache": {"dtype": torch.bfloat16, "kv_cache_dtype": "int8"},
    "gguf_a8-float32": {"dtype": torch.float32, "quantization": "gguf_a8"},
    "int4-float32-fp8-cache": {
        "dtype": torch.float32,
        "quantization": "int4",
        "kv_cache_dtype": "fp8_e5m2",
    },
}
PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 2],
    [1, 9690, 28, 957, 253, 1653, 30, 1041, 634, 744, 2838, 30],
    [1, 42, 43],
]
STEPS = 12
MAX_RUNNING = 40


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler: the decode stack is a C kernel")
    config = CONFIGS[request.param]
    return ModelRunner.from_pretrained(
        None, kv_buffer_size=2048, max_running_requests=MAX_RUNNING, context_len=256, **config
    )


@pytest.fixture
def stack_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the driver's calls (each is one decode step's batch size)."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    calls: list[int] = []
    run = kernels.decode_stack

    def counted(*args: Any) -> torch.Tensor:
        calls.append(int(args[3].shape[0]))
        return run(*args)

    monkeypatch.setattr(kernels, "decode_stack", counted)
    yield calls


def greedy(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[int], list[np.ndarray]]:
    """Prefill the prompts together, then STEPS decode steps of all of them (their KV slots
    interleaved, so each reads through req_to_token); every step's tokens and logits."""
    driver = Driver(runner)
    seqs = [driver.admit(i, p) for i, p in enumerate(prompts)]
    out = driver.run([driver.work(s, len(s.tokens)) for s in seqs])
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    for _ in range(STEPS):
        assert out.logits is not None
        logits.append(out.logits.float().numpy().copy())
        for i, s in enumerate(seqs):
            tokens.append(int(out.next_token_ids[i]))
            s.tokens.append(tokens[-1])
        out = driver.run([driver.work(s, 1) for s in seqs])
    return tokens, logits


def both_paths(
    runner: ModelRunner, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> tuple[tuple[list[int], list[np.ndarray]], tuple[list[int], list[np.ndarray]]]:
    runner.model._stack_key = None
    stacked = greedy(runner, prompts)
    with monkeypatch.context() as off:
        off.setattr(decode_stack, "ENABLED", False)
        runner.model._stack_key = None
        layered = greedy(runner, prompts)
        assert runner.model._stack is None
    runner.model._stack_key = None
    return stacked, layered


def test_the_stack_gives_the_layer_paths_logits_bit_for_bit(
    runner: ModelRunner, stack_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tokens, logits), (layer_tokens, layer_logits) = both_paths(runner, PROMPTS, monkeypatch)
    # Every decode step, and the prefill too where its tokens fit the rows (each prompt is
    # a short extend: a row per token).
    head = runner.model.low_bit_lm_head
    assert head is not None
    prefill = sum(map(len, PROMPTS))
    assert stack_calls == [prefill] * (prefill <= head.max_rows) + [len(PROMPTS)] * STEPS
    assert tokens == layer_tokens
    for step, (a, b) in enumerate(zip(logits, layer_logits, strict=True)):
        assert np.array_equal(a, b), f"step {step}: max diff {np.abs(a - b).max()}"


def test_a_batch_above_the_low_bit_rows_stays_on_the_layer_path(
    runner: ModelRunner, stack_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    head = runner.model.low_bit_lm_head
    assert head is not None
    # Int8 activations read the blocks at every batch size (INT8_ACTIVATIONS_MAX_ROWS), and
    # AVX512-BF16's dot products up to 64 rows: there the runner's most requests run in the
    # stack, and their prefill of a row per token where it fits the rows too.
    n = min(head.max_rows + 1, MAX_RUNNING)
    prompts = [[1, 100 + i, 200 + i] for i in range(n)]
    (tokens, logits), (layer_tokens, layer_logits) = both_paths(runner, prompts, monkeypatch)
    prefill = [3 * n] if 3 * n <= head.max_rows else []
    assert stack_calls == ([] if n > head.max_rows else prefill + [n] * STEPS)
    assert tokens == layer_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, layer_logits, strict=True))


def test_parts_the_driver_does_not_read_are_refused(runner: ModelRunner) -> None:
    model, attn = runner.model, runner.attn
    assert isinstance(attn, TorchNativeAttnBackend)
    act = runner.dtype
    stack = model._decode_stack(attn, act)
    assert stack is not None
    kernels = stack.stack.kernels
    layer = model.layers[0]
    parts = decode_stack.LayerParts(
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        layer.self_attn.qkv_proj.weight,  # type: ignore[arg-type]
        layer.self_attn.o_proj.weight,  # type: ignore[arg-type]
        layer.mlp.gate_up_proj.weight,  # type: ignore[arg-type]
        layer.mlp.down_proj.weight,  # type: ignore[arg-type]
        *attn.layer_caches(0),
    )
    shapes = decode_stack.Shapes(
        model.config.hidden_size,
        attn.num_heads,
        attn.num_kv_heads,
        model.config.head_dim,
        layer.mlp.intermediate_size,
        model.config.rms_norm_eps,
        attn.scale,
    )
    final = model.model.norm.weight
    decode_stack.DecodeStack(kernels, act, [parts], final, shapes)  # as built: accepted
    swapped = replace(parts, qkv=parts.o)
    with pytest.raises(ValueError, match="layer 0 qkv"):
        decode_stack.DecodeStack(kernels, act, [swapped], final, shapes)
    other = torch.float32 if act == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="norm weight"):
        decode_stack.DecodeStack(kernels, act, [parts], final.to(other), shapes)
    strided = replace(parts, k_cache=parts.k_cache.transpose(1, 2))
    with pytest.raises(ValueError, match="k_cache"):
        decode_stack.DecodeStack(kernels, act, [strided], final, shapes)
    # A model dtype other than the backend's builds none.
    assert model._decode_stack(attn, other) is None
    model._stack_key = None


def test_a_k_quant_files_groups_run_in_the_stack_with_int8_activations(
    tmp_path: Path, stack_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every ffn_down of this copy is a K-quant's groups: under gguf_a8 the stack must call
    # the groups' int8-activation kernel, as the layer path does (the exact one rounds
    # otherwise, and the logits would differ).
    path = k_quant_copy(tmp_path)
    monkeypatch.setenv("RSGL_CACHE_DIR", str(tmp_path / "cache"))
    runner = ModelRunner.from_pretrained(
        str(path),
        kv_buffer_size=2048,
        max_running_requests=40,
        context_len=256,
        dtype=torch.float32,
        quantization="gguf_a8",
    )
    down = runner.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, GroupQuantized) and down.int8_activations
    (tokens, logits), (layer_tokens, layer_logits) = both_paths(runner, PROMPTS, monkeypatch)
    assert stack_calls[-STEPS:] == [len(PROMPTS)] * STEPS
    assert tokens == layer_tokens
    for step, (a, b) in enumerate(zip(logits, layer_logits, strict=True)):
        assert np.array_equal(a, b), f"step {step}: max diff {np.abs(a - b).max()}"
