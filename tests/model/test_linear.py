"""oneDNN-prepacked projections agree with `F.linear`, alone and across the whole model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from plan_builder import Driver

from rsgl.layers.linear import PackedLinear, can_pack, pack_linears
from rsgl.model_executor.model_runner import ModelRunner

needs_onednn = pytest.mark.skipif(
    not can_pack(torch.empty(1)), reason="this torch build has no oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 37, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=gen) / 24
    bias = torch.randn(960, generator=gen) if with_bias else None
    x = torch.randn(rows, 576, generator=gen)
    out = PackedLinear(weight, bias)(x)
    assert out.shape == (rows, 960) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=2e-5, rtol=1e-5)


@needs_onednn
def test_pack_linears_swaps_only_float32_and_bfloat16_cpu_linears() -> None:
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 4), torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
    )
    net[1].to(torch.bfloat16)
    net[3].to(torch.float64)
    # bfloat16 packs where oneDNN has bfloat16 kernels for this CPU (AVX-512 on): the same
    # probe the code uses, so the expectation holds on every CPU and emulated level.
    bf16_packs = can_pack(torch.empty(1, dtype=torch.bfloat16))
    assert pack_linears(net) == 1 + bf16_packs
    assert isinstance(net[0], PackedLinear)
    assert isinstance(net[1], PackedLinear if bf16_packs else torch.nn.Linear)
    assert isinstance(net[3], torch.nn.Linear)


@needs_onednn
def test_whole_model_packed_matches_plain_linear(
    driver: Driver, smol_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = smol_runner.model
    assert model.packed_lm_head is not None, "float32 CPU models are packed"
    with pytest.raises(RuntimeError, match="load first, then pack"):
        model.load_weights([])
    monkeypatch.setenv("RSGL_ONEDNN", "0")
    plain_runner = ModelRunner.from_pretrained(
        None, kv_buffer_size=512, max_running_requests=2, context_len=256
    )
    assert plain_runner.model.packed_lm_head is None
    plain = Driver(plain_runner)
    prompt = np.random.default_rng(7).integers(100, 40000, size=40).tolist()
    packed_tokens, packed_logits = driver.greedy(driver.admit(0, prompt), 6)
    plain_tokens, plain_logits = plain.greedy(plain.admit(0, prompt), 6)
    assert packed_tokens == plain_tokens
    for a, b in zip(packed_logits, plain_logits, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
