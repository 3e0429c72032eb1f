"""`rsgl bench quality`: teacher-forced logits are the model's causal logits at every
position, and each low-bit mode stays within its accuracy budget against float32 on the
shipped text (thresholds about twice what was measured on the embedded SmolLM2)."""

from __future__ import annotations

import pytest
import torch

from rsgl.bench.quality import Quality, compare, load, measure, parse_mode, text_tokens
from rsgl.layers.cpu_kernels import load_cpu_kernels


def test_teacher_forced_logits_are_each_positions_causal_logits() -> None:
    runner = load(None, "none", None, 64)
    ids = text_tokens(runner, 40)
    assert len(ids) == 40
    full = runner.teacher_forced_logits(ids)
    assert full.shape == (40, runner.config.vocab_size)
    for end in (1, 17, 40):
        # A prefix sees only itself: its last row is the full run's row at that position.
        prefix = runner.teacher_forced_logits(ids[:end])
        torch.testing.assert_close(prefix[-1], full[end - 1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="do not fit"):
        runner.teacher_forced_logits(ids * 2)
    # Through decode steps, one token each: the same logits, up to summation order.
    decoded = runner.teacher_forced_logits(ids, decode=True)
    torch.testing.assert_close(decoded, full, rtol=1e-4, atol=1e-4)


def test_compare_measures_distance_and_agreement() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(50, 100, generator=gen)
    targets = torch.randint(0, 100, (50,), generator=gen)
    same = compare("same", ref, ref.clone(), targets)
    assert same.kld_mean == 0.0 and same.top1_agreement == 1.0 and same.delta_ppl == 0.0
    # Swapping each row's top two logits flips every first choice.
    swapped = ref.clone()
    top2 = ref.topk(2, dim=-1).indices
    rows = torch.arange(50)
    swapped[rows, top2[:, 0]], swapped[rows, top2[:, 1]] = (
        ref[rows, top2[:, 1]],
        ref[rows, top2[:, 0]],
    )
    flipped = compare("flipped", ref, swapped, targets)
    assert flipped.top1_agreement == 0.0 and flipped.kld_mean > 0


def test_a_mode_names_a_quantization_a_kv_cache_and_a_dtype() -> None:
    assert parse_mode("int4") == ("int4", "auto", torch.float32)
    assert parse_mode("gguf+kv:int8") == ("gguf", "int8", torch.float32)
    # A bfloat16 model keeps a bfloat16 cache unless one is named, as rsgl serve does.
    assert parse_mode("gguf+dtype:bfloat16") == ("gguf", "auto", torch.bfloat16)
    assert parse_mode("dtype:bfloat16+kv:fp8_e4m3") == ("none", "fp8_e4m3", torch.bfloat16)
    with pytest.raises(ValueError, match="dtype 'float16' is not one of"):
        parse_mode("gguf+dtype:float16")


@pytest.fixture(scope="module")
def qualities() -> dict[str, Quality]:
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler: low-bit weights need the C kernels")
    modes = ["gguf", "gguf_a8", "int8", "int4", "kv:int8", "kv:fp8_e4m3", "kv:fp8_e5m2"]
    modes += ["gguf+kv:int8", "gguf+dtype:bfloat16"]
    return {q.mode: q for q in measure(None, modes, max_tokens=256)}


def test_gguf_blocks_are_the_float32_models_own_weights(qualities: dict[str, Quality]) -> None:
    # Measured: KLD 0, agreement 1 (prefill reads the dense copy of the blocks' values,
    # which are exactly the dequantized file's).
    gguf = qualities["gguf"]
    assert gguf.kld_mean == 0.0 and gguf.top1_agreement == 1.0


@pytest.mark.parametrize(
    ("mode", "max_kld", "min_top1"),
    # Measured on 884 tokens: int8 per channel KLD 0.0037, top-1 0.959; int4 groups of 32
    # KLD 0.0010, top-1 0.975 (the file's weights are Q4_1 already: groups of 32 that
    # int4 re-quantizes almost losslessly; one scale per row of int8 fits them worse).
    # KV caches, on these 255 tokens (Sapphire Rapids): int8 (a scale per token and head)
    # KLD 0.00047, top-1 0.973; fp8_e4m3 0.0052, 0.957; fp8_e5m2 0.021, 0.902. The file's
    # blocks with int8 activations (every row through the int8 kernels): KLD 0.0028, top-1
    # 0.973 on these 255 tokens (0.0025, 0.967 on 884; AMD Zen 3).
    [
        ("gguf_a8", 0.006, 0.93),
        ("int8", 0.01, 0.92),
        ("int4", 0.005, 0.94),
        ("kv:int8", 0.001, 0.95),
        ("kv:fp8_e4m3", 0.01, 0.92),
        ("kv:fp8_e5m2", 0.04, 0.85),
        # The model in bfloat16 (rsgl serve's choice where the CPU has AVX512-BF16 or AMX):
        # a prefill of this many rows multiplies the dense bfloat16 copy, the weights
        # rounded to 8 bits. KLD 0.00080, top-1 0.988 on these 255 tokens (0.00084, 0.974 on
        # 884; Zen 4).
        ("gguf+dtype:bfloat16", 0.002, 0.94),
    ],
)
def test_each_lossy_mode_stays_within_its_budget(
    qualities: dict[str, Quality], mode: str, max_kld: float, min_top1: float
) -> None:
    q = qualities[mode]
    assert q.tokens == 255
    assert 0 < q.kld_mean < max_kld, q
    assert q.top1_agreement >= min_top1, q
    assert abs(q.delta_ppl) < 0.05 * q.ref_ppl, q


def test_exact_weights_with_an_int8_cache_cost_what_the_cache_costs(
    qualities: dict[str, Quality],
) -> None:
    # The GGUF blocks are the float32 model's own weights: only the cache moves the logits.
    both, cache = qualities["gguf+kv:int8"], qualities["kv:int8"]
    assert both.kld_mean == pytest.approx(cache.kld_mean, rel=1e-3)
    assert both.top1_agreement == cache.top1_agreement


@pytest.mark.parametrize(
    ("mode", "max_kld", "min_top1"),
    # Generation reads the cache through the decode kernels, which score an int8 cache
    # against the query rounded to 16-bit integers: teacher-forced through decode steps,
    # measured KLD 0.00051, top-1 0.980 on these 255 tokens (Zen 4, AVX512-VNNI), as the
    # float query scored them before (0.00046, 0.984 on 884 tokens, both ways). Decode
    # steps in bfloat16 read the file's blocks (through AVX512-BF16's dot products where the
    # CPU has them) with bfloat16 activations: KLD 0.00076, top-1 0.980 on these 255 tokens
    # (0.00079, 0.974 on 884; Zen 4), about what the dense bfloat16 copy's prefill measures.
    [("kv:int8", 0.001, 0.95), ("gguf+dtype:bfloat16", 0.002, 0.94)],
)
def test_decode_steps_stay_within_the_modes_budget(
    mode: str, max_kld: float, min_top1: float
) -> None:
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler: the decode kernels are the C kernels")
    (q,) = measure(None, [mode], max_tokens=256, decode=True)
    assert q.tokens == 255
    assert 0 < q.kld_mean < max_kld, q
    assert q.top1_agreement >= min_top1, q
    assert abs(q.delta_ppl) < 0.05 * q.ref_ppl, q
