"""Projections over GGUF blocks (`--quantization gguf`): the kernels rebuild exactly the
weights gguf's dequantize gives, multiply by them in one order whatever the batch, and the
embedded model served from its file's blocks holds the loaded weights and decodes the
dequantized model's greedy tokens."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from kquants import QUANTIZERS, k_quant_copy, quantize_q3_k, quantize_q6_k

from rsgl.args import EngineArgs
from rsgl.cpu_features import ENV, LEVELS, missing_flags
from rsgl.engine import Engine
from rsgl.layers.cpu_kernels import (
    CSRC,
    QUANT_FORMATS,
    CpuKernels,
    compile_kernels,
    load_cpu_kernels,
)
from rsgl.layers.quant_linear import (
    AMX_BF16_DOT_MAX_ROWS,
    AMX_TILES_MAX_ROWS,
    BF16_DOT_ENV,
    BF16_DOT_MAX_ROWS,
    DEFAULT_MAX_ROWS,
    INT8_ACTIVATIONS_MAX_ROWS,
    INTERLEAVED_INT8_MAX_ROWS,
    GGUFBlocks,
    GroupQuantized,
    InterleavedBlocks,
    LowBitWeight,
    QuantLinear,
    low_bit_max_rows,
    uses_bf16_dot,
)
from rsgl.models.gguf_weights import (
    hf_name,
    q3_k_groups,
    q4_k_groups,
    q5_k_groups,
    q6_k_groups,
    read_blocks,
)
from rsgl.models.loader import (
    embedded_gguf_path,
    load_model,
    resolve_quantization,
)


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = load_cpu_kernels()
    if loaded is None:
        pytest.skip("no C compiler: GGUF blocks need the C kernels")
    return loaded


def _random_blocks(fmt: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [rows, bytes], gguf's dequantized float32 [rows, cols]) of a random
    matrix quantized by gguf-py, with a few extreme rows (zeros, a huge scale)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[0] = 0.0
    w[1] *= 1000.0
    w[2] = np.abs(w[2])  # Q4_1 with m > 0
    qtype = GGMLQuantizationType[fmt]
    raw = quants.quantize(w, qtype)
    deq = quants.dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(deq.astype(np.float32))


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_rows_are_rebuilt_bit_for_bit(kernels: CpuKernels, fmt: str) -> None:
    blocks, dense = _random_blocks(fmt, 48, 160, seed=1)
    ids = torch.tensor([5, 0, 47, 1, 2, 5], dtype=torch.int64)
    assert torch.equal(kernels.dequant_rows(blocks, fmt, ids), dense[ids])
    # x = identity: each output column is one weight, so the product rebuilds W^T exactly.
    eye = torch.eye(160)
    assert torch.equal(kernels.qlinear(eye, blocks, fmt), dense.T.contiguous())


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_products_differ_from_the_dense_ones_by_summation_order(
    kernels: CpuKernels, fmt: str
) -> None:
    blocks, dense = _random_blocks(fmt, 67, 256, seed=2)
    x = torch.randn(21, 256, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ dense.double().T
    got = kernels.qlinear(x, blocks, fmt)
    # float32 sums of 256 products: within a few float32 ulps of the magnitudes summed.
    bound = 1e-6 * 256 * (x.double().abs() @ dense.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all()
    # One order per row whatever the batch: each row alone, and in batches that tile the
    # rows otherwise (the AVX-512 kernels rebuild a weight row once for up to 8 rows of x,
    # and take a lone row with two weight rows), gives the same bits.
    for start, stop in ((0, 1), (4, 5), (20, 21), (0, 3), (2, 9), (5, 17), (8, 16), (3, 21)):
        part = kernels.qlinear(x[start:stop].contiguous(), blocks, fmt)
        assert torch.equal(part, got[start:stop]), (start, stop)
    assert kernels.qlinear(x[:0], blocks, fmt).shape == (0, 67)


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as int8 activations see it (llama.cpp's Q8_1): per block of 32, scale max|x| / 127
    and each value rounded to the nearest multiple of it (ties to even)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
@pytest.mark.parametrize("cols", [256, 32 * 67])
def test_int8_activations_multiply_the_blocks_by_the_quantized_rows(
    kernels: CpuKernels, fmt: str, cols: int
) -> None:
    # 32 * 67: more blocks a row than the kernels read headers for at once (64), and an odd
    # count (the 4-bit formats take blocks in pairs).
    blocks, dense = _random_blocks(fmt, 67, cols, seed=5)
    x = torch.randn(21, cols, generator=torch.Generator().manual_seed(6))
    x[3, :32] = 0.0  # an all-zero block: scale 0
    x[4, 40] = 1e4  # one block dominated by one value
    x[5, -32:] = 0.0  # the last block (in an odd count, the one without a pair): scale 0
    x[6, -1] = -1e4
    # The int8 kernels read the blocks interleaved by eight weight rows: 67 rows leave the
    # last group three rows of padding.
    packed = kernels.pack_a8(blocks, fmt)
    assert packed.shape[0] == 9 and packed.numel() == 72 * blocks.shape[1]
    ids = torch.tensor([66, 0, 7, 8, 65, 8])
    assert torch.equal(kernels.unpack_rows_a8(packed, fmt, 67, cols, ids), blocks[ids])
    got = kernels.qlinear_a8(x, packed, fmt, 67)
    assert got.shape == (21, 67)
    # The file's weights times the quantized rows, up to float32 summation error ...
    reference = _quantized_rows(x).double() @ dense.double().T
    magnitudes = _quantized_rows(x).double().abs() @ dense.double().abs().T
    assert ((got.double() - reference).abs() <= 1e-6 * cols * magnitudes + 1e-30).all()
    # ... which is not the float product: each value moved by up to half a step.
    exact = x.double() @ dense.double().T
    steps = x.reshape(21, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32) / 127
    bound = 0.5 * steps.reshape(21, cols).double() @ dense.double().abs().T
    assert ((got.double() - exact).abs() <= 1.001 * bound + 1e-6 * cols * magnitudes).all()
    assert not torch.equal(got, kernels.qlinear(x, blocks, fmt))
    # One order per row whatever the batch: tiles of up to 4 rows (8 with AVX-512) share a
    # pass over a group's blocks, and a lone row, a full tile and every remainder must sum
    # alike.
    slices = ((0, 1), (4, 5), (20, 21), (0, 3), (0, 5), (2, 8), (0, 7), (1, 9), (2, 9), (0, 9))
    slices += ((5, 17), (3, 21))
    for start, stop in slices:
        part = kernels.qlinear_a8(x[start:stop].contiguous(), packed, fmt, 67)
        assert torch.equal(part, got[start:stop]), (start, stop)
    half = kernels.qlinear_a8(x.bfloat16(), packed, fmt, 67)
    assert half.dtype == torch.bfloat16
    widened = kernels.qlinear_a8(x.bfloat16().float(), packed, fmt, 67)
    assert torch.equal(half, widened.bfloat16())
    # The weight as a model holds it: interleaved when a projection is installed, its rows
    # rebuilt from there exactly as from the file's blocks.
    weight = GGUFBlocks(kernels, fmt, blocks, int8_activations=True).serving_form()
    assert isinstance(weight, InterleavedBlocks) and weight.shape == (67, cols)
    assert torch.equal(weight.matmul(x), got)
    assert torch.equal(weight.rows(ids), kernels.dequant_rows(blocks, fmt, ids))
    with pytest.raises(ValueError, match="interleaved"):
        kernels.qlinear_a8(x, packed, fmt, 75)


def test_int8_activations_give_the_same_floats_at_every_simd_level(
    kernels: CpuKernels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # AVX512-VNNI's byte dots and AVX2's multiply-adds make the same integer sums, and the
    # floats around them are the same operations in the same order: a request's tokens under
    # gguf_a8 do not depend on which of these builds the CPU runs. Each level this CPU has
    # (AVX2, and AVX-512 without VNNI where it has more) against the build for the CPU as is.
    # (A process capped below AVX2, `make test-portable`'s scalar level, runs the plain C
    # loops, which round their float sums their own way.)
    levels = [name for name in ("avx2", "avx512") if not missing_flags(LEVELS[name])]
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not levels or "avx2" not in kernels.isa or compiler is None:
        pytest.skip("the int8 kernels' SIMD forms need AVX2 and a C compiler")
    x = torch.randn(9, 32 * 19, generator=torch.Generator().manual_seed(8))
    weights = {}
    for fmt in QUANT_FORMATS:
        packed = kernels.pack_a8(_random_blocks(fmt, 21, 32 * 19, seed=9)[0], fmt)
        weights[fmt] = packed, kernels.qlinear_a8(x, packed, fmt, 21)
    for level in levels:
        monkeypatch.setenv(ENV, level)
        library = tmp_path / f"{level}.so"
        assert compile_kernels(CSRC, library, compiler) is None
        built = CpuKernels(library)
        assert "avx512_vnni" not in built.isa
        for fmt, (packed, want) in weights.items():
            assert torch.equal(built.qlinear_a8(x, packed, fmt, 21), want), (level, fmt)


def test_bfloat16_activations_round_once(kernels: CpuKernels) -> None:
    blocks, dense = _random_blocks("Q4_1", 32, 128, seed=4)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = kernels.qlinear(x, blocks, "Q4_1")
    assert got.dtype == torch.bfloat16
    want = (x.double() @ dense.double().T).to(torch.bfloat16)
    # Rounded once from a float32 sum: equal to the exact product's rounding but where the
    # float32 sum sits on a bfloat16 rounding boundary (at most one bfloat16 ulp off).
    ulp = want.float().abs() * 2.0**-7
    assert ((got.float() - want.float()).abs() <= ulp + 1e-30).all()


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
@pytest.mark.parametrize("cols", [256, 32 * 67])
@pytest.mark.parametrize("tiles", [False, True], ids=["dots", "amx"])
def test_bfloat16_dots_multiply_the_exact_weights(
    kernels: CpuKernels, fmt: str, cols: int, tiles: bool
) -> None:
    # AVX512-BF16's kernel where the build has it, else its plain C loops; or AMX's tiles
    # over their own layout where this CPU has them: either way the file's weights times the
    # bfloat16 rows, summed in float32 and rounded once.
    if tiles and not kernels.amx:
        pytest.skip("AMX's tiles are not enabled on this CPU")
    blocks, dense = _random_blocks(fmt, 67, cols, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(37, cols, generator=gen)
    x[3, :32] = 0.0
    x[4, 40] = 1e4  # one block dominated by one value
    x[6, -1] = -1e4
    x = x.bfloat16()
    packed = kernels.pack_amx(blocks, fmt) if tiles else kernels.pack_a8(blocks, fmt)
    qlinear = kernels.qlinear_amx if tiles else kernels.qlinear_x8b
    got = qlinear(x, packed, fmt, 67)
    assert got.shape == (37, 67) and got.dtype == torch.bfloat16
    exact = x.double() @ dense.double().T
    magnitudes = x.double().abs() @ dense.double().abs().T
    # Within float32 summation error of the exact product before the one rounding; a sum of
    # d * dot and m * sum(x) cancels where m is large against the weights, so the bound is
    # on the magnitudes summed, including the offsets' (|m| * sum |x|).
    offsets = x.double().abs() @ (dense.double().abs().T + dense.double().abs().amax(1))
    bound = exact.abs() * 2.0**-8 + 1e-6 * cols * (magnitudes + offsets) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()
    # Mostly it is the exact product's rounding.
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.9
    # One order per row whatever the batch (up to 8 rows share a pass of the dot products,
    # 16 a tile multiply).
    slices = [(0, 1), (4, 5), (20, 21), (0, 3), (2, 9), (0, 8), (1, 9), (5, 17), (3, 21)]
    slices += [(0, 16), (1, 17), (0, 33), (36, 37), (2, 37)]
    for start, stop in slices:
        part = qlinear(x[start:stop].contiguous(), packed, fmt, 67)
        assert torch.equal(part, got[start:stop]), (start, stop)
    assert qlinear(x[:0], packed, fmt, 67).shape == (0, 67)
    # As a model holds it: the blocks packed when the projection is installed, in AMX's
    # layout wherever AMX's tiles run.
    weight = GGUFBlocks(kernels, fmt, blocks, bf16_dot=True).serving_form()
    assert isinstance(weight, InterleavedBlocks) and not weight.int8_activations
    assert weight.amx == kernels.amx
    if weight.amx == tiles:
        assert torch.equal(weight.matmul(x), got)
    ids = torch.tensor([66, 0, 7, 8, 15, 16])
    assert torch.equal(weight.rows(ids), kernels.dequant_rows(blocks, fmt, ids))
    unpack = kernels.unpack_rows_amx if tiles else kernels.unpack_rows_a8
    assert torch.equal(unpack(packed, fmt, 67, cols, ids), blocks[ids])
    with pytest.raises(ValueError, match="bfloat16"):
        qlinear(x.float(), packed, fmt, 67)
    with pytest.raises(ValueError, match="contiguous CPU uint8"):
        qlinear(x, packed[:-1], fmt, 67)


def test_bad_operands_are_named(kernels: CpuKernels) -> None:
    blocks, _ = _random_blocks("Q8_0", 4, 64, seed=6)
    with pytest.raises(ValueError, match="x has 32 columns, the Q8_0 weight 64"):
        kernels.qlinear(torch.zeros(2, 32), blocks, "Q8_0")
    with pytest.raises(ValueError, match="Q5_K"):
        kernels.qlinear(torch.zeros(2, 64), blocks, "Q5_K")
    with pytest.raises(ValueError, match="whole number of 20-byte blocks"):
        kernels.qlinear(torch.zeros(2, 64), blocks, "Q4_1")
    with pytest.raises(ValueError, match=r"ids must be in \[0, 4\)"):
        kernels.dequant_rows(blocks, "Q8_0", torch.tensor([4]))


def test_a_gguf_linear_uses_its_dense_copy_above_max_rows(kernels: CpuKernels) -> None:
    blocks, dense = _random_blocks("Q4_0", 16, 64, seed=7)
    # A dense copy that differs from the blocks shows which one ran.
    other = torch.nn.Linear(64, 16, bias=False)
    bias = torch.arange(16, dtype=torch.float32)
    layer = QuantLinear(GGUFBlocks(kernels, "Q4_0", blocks), dense=other, bias=bias, max_rows=4)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(layer(x[:4]), kernels.qlinear(x[:4].contiguous(), blocks, "Q4_0") + bias)
        assert torch.equal(layer(x), other(x))


def test_gguf_names_map_to_the_models_parameters() -> None:
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.attn_norm.weight") is None
    assert hf_name("rope_freqs.weight") is None


@pytest.fixture(scope="module")
def embedded_blocks(kernels: CpuKernels) -> dict[str, GGUFBlocks]:
    return read_blocks(embedded_gguf_path(), kernels)


def test_the_embedded_files_blocks_hold_the_loaded_weights_exactly(
    kernels: CpuKernels, embedded_blocks: dict[str, GGUFBlocks]
) -> None:
    # Every projection and the embedding (the tied LM head), every row, bit for bit.
    plain = load_model(None, dtype=torch.float32, pack_weights=False, quantization="none")
    params = dict(plain.model.named_parameters())
    assert {b.fmt for b in embedded_blocks.values()} == {"Q4_1", "Q8_0"}
    assert len(embedded_blocks) == 30 * 7 + 1

    def rebuilt(*names: str) -> torch.Tensor:
        parts = [embedded_blocks[n] for n in names]
        return torch.cat([b.rows(torch.arange(b.data.shape[0])) for b in parts])

    fused = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj",),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.down_proj": ("mlp.down_proj",),
    }
    for i in range(30):
        for target, parts in fused.items():
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            weight = params[f"model.layers.{i}.{target}.weight"].detach()
            assert torch.equal(rebuilt(*names), weight), (i, target)
    embedding = params["model.embed_tokens.weight"].detach()
    assert torch.equal(rebuilt("model.embed_tokens.weight"), embedding)


def test_blocks_that_do_not_hold_the_weights_are_refused(
    kernels: CpuKernels, embedded_blocks: dict[str, GGUFBlocks]
) -> None:
    net = load_model(None, dtype=torch.float32, pack_weights=False, quantization="none").model
    swapped = dict(embedded_blocks)
    swapped["model.layers.0.mlp.down_proj.weight"] = embedded_blocks[
        "model.layers.1.mlp.down_proj.weight"
    ]
    with pytest.raises(ValueError, match=r"do not hold the loaded \[576, 1536\] weight"):
        net.use_gguf_blocks(swapped, max_rows=16)


def test_the_embedded_model_reads_its_blocks_by_default(kernels: CpuKernels) -> None:
    loaded = load_model(None)
    assert loaded.quantization == "gguf"
    layer = loaded.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and isinstance(qkv.weight, GGUFBlocks)
    assert qkv.weight.fmt == "Q4_1"
    head = loaded.model.low_bit_lm_head
    assert head is not None and isinstance(head.weight, GGUFBlocks) and head.weight.fmt == "Q8_0"
    assert load_model(None, quantization="none").model.low_bit_lm_head is None


def test_quantization_is_resolved_or_refused_with_the_reason(tmp_path: Path) -> None:
    gguf_file = embedded_gguf_path()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization(None, gguf_file, cpu, "auto") == "gguf"
    assert resolve_quantization(None, None, cpu, "auto") == "none"
    assert resolve_quantization(None, gguf_file, cuda, "auto") == "none"
    assert resolve_quantization("none", gguf_file, cpu, "auto") == "none"
    with pytest.raises(ValueError, match="needs a .gguf model"):
        resolve_quantization("gguf", None, cpu, "auto")
    with pytest.raises(ValueError, match="runs on CPU"):
        resolve_quantization("gguf", gguf_file, cuda, "auto")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        resolve_quantization("gguf_a8", gguf_file, cpu, "dummy")
    assert resolve_quantization("gguf_a8", gguf_file, cpu, "auto") == "gguf_a8"
    with pytest.raises(ValueError, match="expected one of gguf, gguf_a8, int8, int4, none"):
        resolve_quantization("awq", gguf_file, cpu, "auto")
    assert resolve_quantization("int4", None, cpu, "auto") == "int4"
    with pytest.raises(ValueError, match="quantization int8 runs on CPU"):
        resolve_quantization("int8", None, cuda, "auto")
    with pytest.raises(ValueError, match="invalid quantization 'int3'"):
        EngineArgs(quantization="int3")
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        EngineArgs(quantization="int4", quantization_group_size=48)


@pytest.mark.parametrize(("bits", "group"), [(8, 32), (8, 256), (4, 32), (4, 128)])
def test_load_time_quantization_rounds_to_the_nearest_level(
    kernels: CpuKernels, bits: int, group: int
) -> None:
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(40, 256, generator=gen)
    w[3] = 0.0  # a zero group: scale 0 must not divide by zero
    w[4, :32] = 2.5  # a constant group (with group 32)
    quant = GroupQuantized.quantize(kernels, w, bits, group)
    assert quant.shape == (40, 256)
    assert quant.nbytes == 40 * 256 * bits // 8 + 40 * (256 // group) * 4 * (1 if bits == 8 else 2)
    rebuilt = quant.rows(torch.arange(40))
    # Round to nearest: within half a level (plus float32 rounding) of each weight.
    step = quant.scales.repeat_interleave(group, dim=1)
    assert ((rebuilt - w).abs() <= step / 2 + 1e-6 * w.abs() + 1e-7).all()
    assert torch.equal(rebuilt[3], torch.zeros(256))
    if bits == 4 and group == 32:  # a constant group is its minimum, exactly
        assert torch.equal(rebuilt[4, :32], w[4, :32])
    # The kernels multiply by exactly these values (x = identity), one order per row.
    assert torch.equal(quant.matmul(torch.eye(256)), rebuilt.T.contiguous())
    x = torch.randn(5, 256, generator=gen)
    exact = x.double() @ rebuilt.double().T
    bound = 1e-6 * 256 * (x.double().abs() @ rebuilt.double().abs().T)
    assert ((quant.matmul(x).double() - exact).abs() <= bound).all()
    assert torch.equal(quant.matmul(x[2:3].contiguous()), quant.matmul(x)[2:3])


def test_groups_that_do_not_divide_a_row_are_refused(kernels: CpuKernels) -> None:
    with pytest.raises(
        ValueError, match="group 128 must be a multiple of 32 dividing the input size 576"
    ):
        GroupQuantized.quantize(kernels, torch.zeros(8, 576), 4, 128)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        GroupQuantized.quantize(kernels, torch.zeros(8, 64), 2, 32)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_model_computes_with_the_values_it_holds(
    kernels: CpuKernels, mode: str
) -> None:
    # Small batches read the low-bit weights, large ones the dense copy, which was
    # overwritten with the same values: both give the same logits up to summation order.
    loaded = load_model(None, dtype=torch.float32, pack_weights=False, quantization=mode)
    net = loaded.model
    assert loaded.quantization == mode
    layer = net.layers[5]
    proj = layer.mlp.down_proj
    assert isinstance(proj, QuantLinear) and isinstance(proj.weight, GroupQuantized)
    assert proj.weight.bits == int(mode[3:])
    assert proj.weight.group == (1536 if mode == "int8" else 32)
    assert proj.dense is not None
    dense = proj.dense.weight
    assert torch.equal(proj.weight.rows(torch.arange(576)), dense)
    head = net.low_bit_lm_head
    assert head is not None and isinstance(head.weight, GroupQuantized) and head.weight.bits == 8
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(10))
    torch.testing.assert_close(proj(x), x @ dense.T, rtol=1e-5, atol=1e-4)


# Each K-quant: its reader, its super-block's bytes, where its fp16 headers lie (d and dmin,
# or d), and the groups it is read as (bits, weights per scale, with minimums).
K_QUANT_LAYOUTS = {
    GGMLQuantizationType.Q3_K: (q3_k_groups, 110, slice(108, 110), (8, 16, False)),
    GGMLQuantizationType.Q4_K: (q4_k_groups, 144, slice(0, 4), (4, 32, True)),
    GGMLQuantizationType.Q5_K: (q5_k_groups, 176, slice(0, 4), (8, 32, True)),
    GGMLQuantizationType.Q6_K: (q6_k_groups, 210, slice(208, 210), (8, 16, False)),
}


@pytest.mark.parametrize("qtype", list(K_QUANT_LAYOUTS))
def test_k_quant_super_blocks_are_read_as_the_groups_they_hold(
    kernels: CpuKernels, qtype: GGMLQuantizationType
) -> None:
    # Random bytes are valid K-quant blocks once their fp16 headers are finite: every quant,
    # high bit, scale and minimum bit pattern. gguf's dequantize is the reference, bit for
    # bit.
    read, size, header, form = K_QUANT_LAYOUTS[qtype]
    rng = np.random.default_rng(int(qtype))
    rows, k = 7, 768
    raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    halves = rng.uniform(-0.02, 0.02, (rows, k // 256, (header.stop - header.start) // 2))
    raw[..., header] = halves.astype(np.float16).view(np.uint8)
    raw[0, 1, header] = 0  # a zero super-block header
    raw = raw.reshape(rows, -1)
    weight = read(kernels, raw)
    dense = torch.from_numpy(quants.dequantize(raw, qtype))
    assert weight.shape == (rows, k)
    assert (weight.bits, weight.group, weight.mins is not None) == form
    assert torch.equal(weight.rows(torch.arange(rows)), dense)
    assert torch.equal(weight.matmul(torch.eye(k)), dense.T.contiguous())
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(8))
    got = weight.matmul(x)
    bound = 1e-6 * k * (x.double().abs() @ dense.double().abs().T)
    assert ((got.double() - x.double() @ dense.double().T).abs() <= bound).all()
    # Each row in one order whatever the batch: alone and in tiles of other heights.
    for start, stop in ((0, 1), (12, 13), (0, 3), (2, 9), (4, 13)):
        assert torch.equal(weight.matmul(x[start:stop].contiguous()), got[start:stop])
    half = weight.matmul(x.bfloat16())
    assert torch.equal(half, weight.matmul(x.bfloat16().float()).bfloat16())


@pytest.mark.parametrize(
    ("qtype", "top"), [(GGMLQuantizationType.Q4_K, 15), (GGMLQuantizationType.Q5_K, 31)]
)
def test_the_test_quantizer_writes_k_quants_that_gguf_reads_back(
    qtype: GGMLQuantizationType, top: int
) -> None:
    w = np.random.default_rng(6).standard_normal((5, 512)).astype(np.float32) * 0.05
    w[0] = np.abs(w[0])  # no negative weight: a zero minimum
    back = quants.dequantize(QUANTIZERS[qtype](w), qtype)
    # Each group's levels step by at most (max - min) / top; 6-bit scales add a little.
    groups = w.reshape(5, 16, 32)
    step = (groups.max(-1) - np.minimum(groups.min(-1), 0)) / top
    error = np.abs(back - w).reshape(5, 16, 32).max(-1)
    assert (error <= 0.75 * step + 1e-3 * np.abs(w).max()).all()


def test_int8_groups_with_minimums_are_groups_of_32(kernels: CpuKernels) -> None:
    q, x = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(1, 64)
    for group in (16, 64):
        scales = torch.zeros(4, 64 // group)
        with pytest.raises(ValueError, match=f"minimums take groups of 32, not {group}"):
            kernels.qlinear_group(8, x, q, scales, scales, group)
    with pytest.raises(ValueError, match="int4 weights need their minimums"):
        kernels.qlinear_group(4, x, q[:, :32].contiguous(), torch.zeros(4, 2), None, 32)


def test_int8_groups_of_16_need_whole_blocks(kernels: CpuKernels) -> None:
    q, x = torch.zeros(4, 48, dtype=torch.uint8), torch.zeros(1, 48)
    with pytest.raises(ValueError, match="group 16 must be a multiple of 32 dividing K = 48"):
        kernels.qlinear_group(8, x, q, torch.zeros(4, 3), None, 16)
    nibbles, mins = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 4)
    with pytest.raises(ValueError, match="group 16 must be a multiple of 32 dividing K = 64$"):
        kernels.qlinear_group(4, torch.zeros(1, 64), nibbles, torch.zeros(4, 4), mins, 16)


# The test quantizers' symmetric K-quants: the step of a group's levels relative to its
# largest magnitude, and the error bound in steps. Q3_K's levels run -4..3: a group's largest
# magnitude lands on -4, one as large of the other sign clips at 3 (a step off). Q6_K's int8
# scales of the super-block's d move the step by up to half of d, and the largest values
# may clip at 31 levels. 6-bit scales add a little to both.
SYMMETRIC_K_QUANTS = {
    GGMLQuantizationType.Q3_K: (quantize_q3_k, 4, 1.1),
    GGMLQuantizationType.Q6_K: (quantize_q6_k, 32, 1.5),
}


@pytest.mark.parametrize("qtype", list(SYMMETRIC_K_QUANTS))
def test_the_test_quantizer_writes_symmetric_k_quants_that_gguf_reads_back(
    qtype: GGMLQuantizationType,
) -> None:
    quantize, levels, bound = SYMMETRIC_K_QUANTS[qtype]
    w = np.random.default_rng(6).standard_normal((5, 512)).astype(np.float32) * 0.05
    w[1] = 0.0  # a zero super-block
    back = quants.dequantize(quantize(w), qtype)
    assert not back[1].any()
    groups = w.reshape(5, 32, 16)
    step = np.abs(groups).max(-1) / levels
    error = np.abs(back - w).reshape(5, 32, 16).max(-1)
    assert (error <= bound * step + 1e-6).all()
    assert np.median(np.abs(back - w)) <= 0.3 * np.median(step)


@pytest.fixture(scope="module")
def k_quant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return k_quant_copy(tmp_path_factory.mktemp("k_quants"))


def test_a_k_quant_file_serves_its_super_blocks_with_the_dequantized_models_tokens(
    kernels: CpuKernels, k_quant_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RSGL_CACHE_DIR", str(k_quant_model.parent / "cache"))
    loaded = load_model(str(k_quant_model), dtype=torch.float32, pack_weights=False)
    assert loaded.quantization == "gguf"
    # Layer i's ffn_down in Q3_K, Q4_K, Q5_K or Q6_K by i % 4.
    forms = {3: (8, 16, False), 4: (8, 16, False), 5: (4, 32, True), 6: (8, 32, True)}
    for i, form in forms.items():
        layer = loaded.model.layers[i]
        down, qkv = layer.mlp.down_proj, layer.self_attn.qkv_proj
        assert isinstance(down, QuantLinear) and isinstance(down.weight, GroupQuantized)
        assert (down.weight.bits, down.weight.group, down.weight.mins is not None) == form
        assert isinstance(qkv, QuantLinear) and isinstance(qkv.weight, GGUFBlocks)
        assert down.dense is not None
        assert torch.equal(down.weight.rows(torch.arange(576)), down.dense.weight)
    # Greedy tokens through the engine: the blocks and groups against the dense model.
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = {"temperature": 0.0, "max_new_tokens": 16}
    outputs = {}
    for mode in ("gguf", "none"):
        with Engine(model_path=str(k_quant_model), quantization=mode, dtype="float32") as llm:
            assert llm.get_server_info()["quantization"] == mode
            outputs[mode] = [o["output_ids"] for o in llm.generate(prompts, params)]
            llm.check_integrity()
    assert outputs["gguf"] == outputs["none"]


@pytest.mark.parametrize("qtype", list(K_QUANT_LAYOUTS))
@pytest.mark.parametrize("k", [768, 256 * 9])
def test_k_quant_groups_multiply_int8_activations(
    kernels: CpuKernels, qtype: GGMLQuantizationType, k: int
) -> None:
    # 256 * 9: 72 blocks a row, past one chunk of 64 blocks' scales.
    read, size, header, _ = K_QUANT_LAYOUTS[qtype]
    rng = np.random.default_rng(int(qtype) + k)
    rows = 11
    raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    halves = rng.uniform(-0.02, 0.02, (rows, k // 256, (header.stop - header.start) // 2))
    raw[..., header] = halves.astype(np.float16).view(np.uint8)
    exact = read(kernels, raw.reshape(rows, -1))
    weight = dataclasses.replace(exact, int8_activations=True)
    dense = weight.rows(torch.arange(rows))
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(9))
    x[3, :32] = 0.0  # an all-zero block: scale 0
    x[4, 40] = 1e4  # one block dominated by one value
    got = weight.matmul(x)
    # The groups' weights times the quantized rows, up to float32 summation error, which is
    # not the float product.
    quantized = _quantized_rows(x).double()
    reference = quantized @ dense.double().T
    magnitudes = quantized.abs() @ dense.double().abs().T
    assert ((got.double() - reference).abs() <= 1e-6 * k * magnitudes + 1e-30).all()
    assert not torch.equal(got, exact.matmul(x))
    # One order per row whatever the batch (as for GGUF blocks' int8 activations).
    for start, stop in ((0, 1), (20, 21), (0, 3), (0, 5), (1, 9), (0, 9), (3, 21)):
        part = weight.matmul(x[start:stop].contiguous())
        assert torch.equal(part, got[start:stop]), (start, stop)
    half = weight.matmul(x.bfloat16())
    assert torch.equal(half, weight.matmul(x.bfloat16().float()).bfloat16())


def test_gguf_a8_reads_a_k_quant_files_groups_with_int8_activations(
    k_quant_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RSGL_CACHE_DIR", str(k_quant_model.parent / "cache"))
    loaded = load_model(
        str(k_quant_model), dtype=torch.float32, pack_weights=False, quantization="gguf_a8"
    )
    assert loaded.quantization == "gguf_a8"
    x = torch.randn(2, 1536, generator=torch.Generator().manual_seed(11))
    for i in (3, 4, 5, 6):  # Q6_K, Q3_K, Q4_K, Q5_K
        down = loaded.model.layers[i].mlp.down_proj
        assert isinstance(down, QuantLinear) and isinstance(down.weight, GroupQuantized)
        assert down.weight.int8_activations
        dense = down.weight.rows(torch.arange(576)).double()
        reference = _quantized_rows(x).double() @ dense.T
        bound = 1e-6 * 1536 * (_quantized_rows(x).double().abs() @ dense.abs().T)
        assert ((down(x).double() - reference).abs() <= bound).all()
        exact = dataclasses.replace(down.weight, int8_activations=False)
        assert not torch.equal(down(x), exact.matmul(x))


def _signed_bytes_with_minimums(kernels: CpuKernels, rows: int, k: int) -> GroupQuantized:
    """int8 groups of 32 with minimums over every byte value (Q5_K's hold 0..31 only)."""
    g = torch.Generator().manual_seed(12)
    q = torch.randint(-128, 128, (rows, k), generator=g, dtype=torch.int8).view(torch.uint8)
    scales = torch.rand(rows, k // 32, generator=g) * 0.01
    mins = torch.randn(rows, k // 32, generator=g) * 0.1
    return GroupQuantized(kernels, 8, 32, q, scales, mins)


@pytest.mark.parametrize("form", ["int4-32", "int4-per-channel", "int8-per-channel", "int8-min"])
def test_load_time_groups_multiply_int8_activations(kernels: CpuKernels, form: str) -> None:
    # 67 blocks a row: odd (the nibbles go in pairs, the last alone) and past one chunk of
    # 64; the last chunk's three blocks read their scales one by one. Groups of a row's
    # whole length span many blocks; int8 with minimums takes every byte value, signed.
    rows, k = 13, 32 * 67
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(11)) * 0.05
    if form == "int8-min":
        exact = _signed_bytes_with_minimums(kernels, rows, k)
    else:
        bits, group = int(form[3]), 32 if form.endswith("-32") else k
        exact = GroupQuantized.quantize(kernels, w, bits, group)
    weight = dataclasses.replace(exact, int8_activations=True)
    dense = weight.rows(torch.arange(rows)).double()
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(13))
    got = weight.matmul(x)
    quantized = _quantized_rows(x).double()
    bound = 1e-6 * k * (quantized.abs() @ dense.abs().T) + 1e-30
    assert ((got.double() - quantized @ dense.T).abs() <= bound).all()
    assert not torch.equal(got, exact.matmul(x))
    for start, stop in ((0, 1), (16, 17), (0, 5), (2, 11), (1, 17)):
        assert torch.equal(weight.matmul(x[start:stop].contiguous()), got[start:stop])


def _weight_in(kernels: CpuKernels, form: str, rows: int, k: int) -> LowBitWeight:
    """A weight matrix in each form the float32 kernels rebuild: GGUF's blocks, and the
    load-time groups (int4 in groups of 32 and per channel, int8 per channel, int8 with
    minimums over every byte value, int8 in groups of 16 as Q6_K's are read)."""
    if form in QUANT_FORMATS:
        return GGUFBlocks(kernels, form, _random_blocks(form, rows, k, seed=21)[0])
    if form == "int8-min":
        return _signed_bytes_with_minimums(kernels, rows, k)
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(22)) * 0.05
    if form == "int8-16":
        return _groups_of_16(kernels, w)
    return GroupQuantized.quantize(kernels, w, int(form[3]), 32 if form == "int4-32" else k)


def _groups_of_16(kernels: CpuKernels, w: torch.Tensor) -> GroupQuantized:
    """int8 with a scale per 16 weights (the form Q6_K and Q3_K super-blocks are read in)."""
    rows, k = w.shape
    groups = w.reshape(rows, k // 16, 16)
    scales = groups.abs().amax(-1) / 127
    q = (groups / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
    return GroupQuantized(kernels, 8, 16, q.reshape(rows, k).view(torch.uint8), scales, None)


@pytest.mark.parametrize(
    "form",
    [*QUANT_FORMATS, "int4-32", "int4-per-channel", "int8-per-channel", "int8-min", "int8-16"],
)
def test_every_form_multiplies_the_same_weights_in_one_order_per_row(
    kernels: CpuKernels, form: str
) -> None:
    # 67 weight rows (no whole number of the 4 or 2 a tile takes), 67 blocks a row (odd,
    # past a chunk of 64 headers) and 37 rows of x.
    rows, k, m = 67, 32 * 67, 37
    weight = _weight_in(kernels, form, rows, k)
    dense = weight.rows(torch.arange(rows)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(23))
    x[3] = 0.0
    got = weight.matmul(x[:16].contiguous())
    bound = 1e-6 * k * (x[:16].double().abs() @ dense.abs().T) + 1e-30
    assert ((got.double() - x[:16].double() @ dense.T).abs() <= bound).all()
    # The same numbers as the dense model: rows of the identity give W^T exactly.
    eye = torch.eye(k)[:40].contiguous()
    assert torch.equal(weight.matmul(eye), dense.T[:40].float())
    # Each row summed in one order whatever the batch and wherever its tile puts it: a lone
    # row (four weight rows a tile, three at the end), tiles of 2-4 rows (two), of 5-8
    # (one), and batches in equal tiles (9: 5 and 4; 12: 6 and 6; 16; 17: 6, 6 and 5).
    whole = weight.matmul(x)
    assert torch.equal(whole[:16], got)
    slices = [(0, 1), (4, 5), (36, 37), (0, 2), (1, 4), (0, 4), (2, 7), (0, 8), (3, 11)]
    slices += [(0, 9), (5, 17), (8, 24), (20, 37), (1, 33)]
    for start, stop in slices:
        part = weight.matmul(x[start:stop].contiguous())
        assert torch.equal(part, whole[start:stop]), (start, stop)
    assert weight.matmul(x[:0]).shape == (0, rows)


def test_the_blocks_serve_each_cpus_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    avx2 = SimpleNamespace(isa=("avx2", "fma", "f16c"), x8b_native=False, amx=False)
    for dtype in (torch.float32, torch.bfloat16):
        assert low_bit_max_rows(avx2, dtype) == DEFAULT_MAX_ROWS  # type: ignore[arg-type]
    a8 = low_bit_max_rows(avx2, torch.float32, int8_activations=True)  # type: ignore[arg-type]
    assert a8 == INT8_ACTIVATIONS_MAX_ROWS
    # GGUF's blocks, interleaved for int8 activations, serve every batch on AVX2; without
    # AVX2 their kernels are plain C and keep the limit.
    blocks = low_bit_max_rows(avx2, torch.float32, True, interleaved=True)  # type: ignore[arg-type]
    assert blocks == INTERLEAVED_INT8_MAX_ROWS
    plain = SimpleNamespace(isa=("sse2",), x8b_native=False, amx=False)
    assert low_bit_max_rows(plain, torch.float32, True, True) == INT8_ACTIVATIONS_MAX_ROWS  # type: ignore[arg-type]
    avx512 = SimpleNamespace(isa=("avx2", "fma", "f16c", "avx512f"), x8b_native=False, amx=False)
    assert low_bit_max_rows(avx512, torch.float32) == 32  # type: ignore[arg-type]
    assert low_bit_max_rows(avx512, torch.bfloat16) == 12  # type: ignore[arg-type]
    # With AVX-512 the interleaved blocks still serve every float32 batch; bfloat16's dense
    # copy, multiplied natively there, takes over past 64 rows, on AMX's tiles past 48.
    cases = [(torch.float32, frozenset(), INTERLEAVED_INT8_MAX_ROWS)]
    cases += [(torch.float32, frozenset({"amx_bf16"}), INTERLEAVED_INT8_MAX_ROWS)]
    cases += [(torch.bfloat16, frozenset({"avx512_bf16"}), 64)]
    cases += [(torch.bfloat16, frozenset({"avx512_bf16", "amx_bf16"}), 48)]
    for dtype, units, rows in cases:
        got = low_bit_max_rows(avx512, dtype, True, interleaved=True, bf16_units=units)  # type: ignore[arg-type]
        assert got == rows, (dtype, units)
    assert low_bit_max_rows(avx512, torch.float32, True) == 32  # type: ignore[arg-type]
    # With AVX512-BF16, GGUF's blocks multiply bfloat16 rows by its dot products (interleaved)
    # up to 64 rows, float32 ones as before; RSGL_BF16_DOT=0 keeps them on the float32 kernels.
    isa = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16")
    bf16 = SimpleNamespace(isa=isa, x8b_native=True, amx=False)
    assert uses_bf16_dot(bf16, torch.bfloat16) and not uses_bf16_dot(bf16, torch.float32)  # type: ignore[arg-type]
    assert not uses_bf16_dot(avx512, torch.bfloat16)  # type: ignore[arg-type]
    zen4, amx = frozenset({"avx512_bf16"}), frozenset({"avx512_bf16", "amx_bf16"})
    rows = low_bit_max_rows(bf16, torch.bfloat16, interleaved=True, bf16_units=zen4)  # type: ignore[arg-type]
    assert rows == BF16_DOT_MAX_ROWS
    # Where the dense copy runs on AMX's tiles, it takes over much sooner.
    rows = low_bit_max_rows(bf16, torch.bfloat16, interleaved=True, bf16_units=amx)  # type: ignore[arg-type]
    assert rows == AMX_BF16_DOT_MAX_ROWS < BF16_DOT_MAX_ROWS
    assert low_bit_max_rows(bf16, torch.float32, interleaved=True, bf16_units=amx) == 32  # type: ignore[arg-type]
    # Where the blocks themselves multiply on AMX's tiles, they keep up with the dense copy.
    tiles = SimpleNamespace(isa=isa, x8b_native=True, amx=True)
    rows = low_bit_max_rows(tiles, torch.bfloat16, interleaved=True, bf16_units=amx)  # type: ignore[arg-type]
    assert rows == AMX_TILES_MAX_ROWS > AMX_BF16_DOT_MAX_ROWS
    monkeypatch.setenv(BF16_DOT_ENV, "0")
    assert not uses_bf16_dot(bf16, torch.bfloat16)  # type: ignore[arg-type]
    for units in (zen4, amx):
        rows = low_bit_max_rows(bf16, torch.bfloat16, interleaved=True, bf16_units=units)  # type: ignore[arg-type]
        assert rows == 12
