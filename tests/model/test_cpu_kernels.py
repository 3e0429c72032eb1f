"""The compiled CPU kernels agree with the eager torch ops they replace."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from plan_builder import Driver

import rsgl.layers.norm
import rsgl.models.llama
from rsgl.cpu_features import cpu_flags
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend
from rsgl.layers.cpu_kernels import CSRC, CpuKernels, compile_kernels, load_cpu_kernels
from rsgl.layers.rotary import apply_rotary
from rsgl.layers.sampler import race_uniforms
from rsgl.model_executor.kv_cache import KVCache
from rsgl.model_executor.model_runner import ModelRunner


@pytest.fixture
def kernels() -> CpuKernels:
    loaded = load_cpu_kernels()
    if loaded is None:
        pytest.skip("no C compiler: the eager paths are the only paths")
    return loaded


def test_add_rmsnorm_matches_torch(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(37, 576, generator=gen) for _ in range(3))
    w = w[0].contiguous()
    out, summed = kernels.add_rmsnorm(x, res, w, 1e-5)
    h = x + res
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(summed, h, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    alone, same = kernels.add_rmsnorm(x, None, w, 1e-5)
    assert same is x
    torch.testing.assert_close(
        alone, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_picks_what_torch_argmax_picks(kernels: CpuKernels, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 49152, generator=gen).to(dtype)
    x[1, 9000] = x[1, 70] = 50.0  # equal maxima: the first
    x[2, 40_000] = x[2, 30_000] = float("nan")  # NaN beats everything: the first NaN
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, 49151] = float("inf")  # the last column
    x[5] = 0.0
    x[5, 100] = -0.0  # -0 == +0: still the first
    x[6, :3] = 1e30
    got = kernels.argmax_rows(x)
    torch.testing.assert_close(got, x.argmax(dim=-1), atol=0, rtol=0)
    assert got[:7].tolist() == [int(x[0].float().argmax()), 70, 30_000, 0, 49151, 0, 0]
    # Rows of one element, and more rows than threads.
    column = torch.randn(33, 1, generator=gen).to(dtype)
    assert kernels.argmax_rows(column).tolist() == [0] * 33


def test_race_uniforms_are_the_torch_hash_bit_for_bit(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, (1 << 63) - 1, (40,), generator=gen)
    positions = torch.randint(0, 1 << 20, (40,), generator=gen)
    # (125, 0) hashes token 45437 to the largest 24 bits (v + 0.5 rounds to 1.0: held
    # below); this pair token 14138 to 2^24 - 2, whose v + 0.5 is a tie rounded to even
    # (split into two roundings under -ffast-math, it rounded up).
    seeds[:2] = torch.tensor([125, 5308518104502300029])
    positions[:2] = torch.tensor([0, 478546])
    got = kernels.race_uniforms(seeds, positions, 49152)
    want = race_uniforms(seeds, positions, 49152)
    assert torch.equal(got, want)
    assert float(got[0, 45437]) == 1.0 - 2.0**-24 and float(got[1, 14138]) == 1.0 - 2.0**-23
    assert kernels.race_uniforms(seeds[:1], positions[:1], 0).shape == (1, 0)


def test_silu_mul_matches_torch_over_a_wide_range(kernels: CpuKernels) -> None:
    gate_up = torch.randn(9, 2 * 300, generator=torch.Generator().manual_seed(1)) * 30
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5
    )


def test_whole_model_eager_paths_match_kernel_paths(
    driver: Driver, smol_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch, kernels: CpuKernels
) -> None:
    prompt = np.random.default_rng(4).integers(100, 40000, size=30).tolist()
    with_kernels, logits_k = driver.greedy(driver.admit(0, prompt), 4)
    backend = smol_runner.attn
    assert isinstance(backend, TorchNativeAttnBackend)
    monkeypatch.setattr(backend, "decode_kernel", None)
    monkeypatch.setattr(rsgl.layers.norm, "load_cpu_kernels", lambda: None)
    monkeypatch.setattr(rsgl.models.llama, "load_cpu_kernels", lambda: None)
    eager, logits_e = driver.greedy(driver.admit(1, prompt), 4)
    assert eager == with_kernels
    for a, b in zip(logits_k, logits_e, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# float32 runs the compiler's loops (constant-size paths for 64 and 128); 16-bit caches run
# the AVX-512 path when head_dim is a multiple of 16 (on CPUs that have it: 4 query heads
# per register group, so 8 per kv head take two groups, 6 take 3 + 3 at 80, 1 group of one
# at 256) and the widening loops otherwise (40).
def _scattered_requests(
    gen: torch.Generator, max_len: int, kv_slots: int, first_len: int | None = None
) -> tuple[list[int], torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """17 decoding requests (so the threads split them): request 1 decodes its first token,
    request 2 has exactly two 16-position tiles (the AVX-512 path scores 16 at a time), the
    others a random length below `max_len` with a tail (request 0: `first_len`, if given).
    Each sequence lives in scattered KV slots (1 .. kv_slots - 1); its last position is the
    new token. Returns (lens, the req_to_token table, the requests' rows in it, each one's
    slots, the new tokens' slots)."""
    lens = [int(n) for n in torch.randint(1, max_len, (17,), generator=gen)]
    lens[1], lens[2] = 1, 32
    if first_len is not None:
        lens[0] = first_len
    slots = torch.randperm(kv_slots - 1, generator=gen)[: sum(lens)] + 1
    table = torch.zeros(20, max(lens), dtype=torch.int32)
    req_slots = torch.randperm(20, generator=gen)[: len(lens)]
    seq_slots = slots.split(lens)
    for row, sl in zip(req_slots.tolist(), seq_slots, strict=True):
        table[row, : len(sl)] = sl.to(torch.int32)
    loc = torch.stack([sl[-1] for sl in seq_slots]).long()
    return lens, table, req_slots, seq_slots, loc


@pytest.mark.parametrize(
    ("dim", "kv_dtype", "heads", "kv_heads"),
    [
        (16, F32, 6, 2),
        (64, F32, 6, 2),
        (128, F32, 6, 2),
        (64, F32, 8, 1),
        (64, F16, 6, 2),
        (48, F16, 6, 2),
        (40, F16, 6, 2),
        (64, BF16, 6, 2),
        (128, BF16, 6, 2),
        (40, BF16, 6, 2),
        (64, BF16, 8, 1),
        (64, F16, 8, 2),
        (64, BF16, 4, 4),
        (80, BF16, 6, 2),
        (256, F16, 4, 2),
    ],
)
def test_decode_layer_rotates_stores_and_attends(
    kernels: CpuKernels, dim: int, kv_dtype: torch.dtype, heads: int, kv_heads: int
) -> None:
    gen = torch.Generator().manual_seed(dim)
    lens, table, req_slots, seq_slots, loc = _scattered_requests(gen, 48, 1024)
    b = len(lens)
    k_buf = torch.randn(1024, kv_heads, dim, generator=gen).to(kv_dtype)
    v_buf = torch.randn(1024, kv_heads, dim, generator=gen).to(kv_dtype)
    qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(b, 1, dim // 2, generator=gen) * 6
    cis = torch.polar(torch.ones_like(angles), angles)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()

    out = kernels.decode_layer(
        qkv,
        torch.view_as_real(cis),
        loc,
        k_buf,
        v_buf,
        table,
        req_slots,
        torch.tensor(lens),
        heads,
        dim**-0.5,
    )

    q = apply_rotary(qkv[:, : heads * dim].view(b, heads, dim), cis)
    k_new = apply_rotary(qkv[:, heads * dim : (heads + kv_heads) * dim].view(b, kv_heads, dim), cis)
    k_ref[loc] = k_new.to(kv_dtype)
    v_ref[loc] = qkv[:, (heads + kv_heads) * dim :].view(b, kv_heads, dim).to(kv_dtype)
    # Stored keys are rounded as torch rounds (the rotation's last float bit may differ).
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[kv_dtype]
    torch.testing.assert_close(k_buf.float(), k_ref.float(), atol=ulp, rtol=ulp)
    torch.testing.assert_close(v_buf, v_ref, atol=0, rtol=0)
    for i, sl in enumerate(seq_slots):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i].unsqueeze(1),
            k_buf[sl].float().transpose(0, 1),
            v_buf[sl].float().transpose(0, 1),
            enable_gqa=True,
        )
        torch.testing.assert_close(out[i].view(heads, dim), ref.squeeze(1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shape"):
        kernels.decode_layer(
            qkv, torch.view_as_real(cis), loc[:-1], k_buf, v_buf, table, req_slots,
            torch.tensor(lens), heads, dim**-0.5,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("loc", "slot", "seq_len", "what"),
    [(10**9, 0, 5, "out_cache_loc"), (7, 99, 5, "request slot"), (7, 0, 10**6, "sequence length")],
)
def test_decode_bounds_are_checked_before_the_kernel_runs(
    smol_runner: ModelRunner, kernels: CpuKernels, loc: int, slot: int, seq_len: int, what: str
) -> None:
    from rsgl.model_executor.forward_batch import ForwardBatch

    backend = smol_runner.attn
    assert isinstance(backend, TorchNativeAttnBackend) and backend.decode_kernel is not None
    batch = ForwardBatch.from_arrays(
        forward_mode="decode",
        req_slots=np.array([slot]),
        prefix_lens=np.array([seq_len - 1]),
        extend_lens=np.array([1]),
        input_ids=np.array([5]),
        out_cache_loc=np.array([loc]),
    )
    with pytest.raises(IndexError, match=what):
        backend.prepare(batch)


@pytest.mark.parametrize("kv_dtype", [F16, BF16])
def test_16_bit_stores_round_like_torch(kernels: CpuKernels, kv_dtype: torch.dtype) -> None:
    # NaN, infinities, overflow, ties to even, a denormal and -0 go through the KV store.
    special = [float("nan"), float("inf"), -float("inf"), 3.4e38, 70000.0, -0.0, 1e-39, 1e-7]
    special += [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 2.5, -1 / 3]
    dim = 16
    v = torch.tensor(special + [0.0] * (dim - len(special)))
    qkv = torch.cat([torch.zeros(2 * dim), torch.zeros(dim), v]).unsqueeze(0)  # H=2, Hkv=1
    k_buf = torch.zeros(4, 1, dim, dtype=kv_dtype)
    v_buf = torch.zeros(4, 1, dim, dtype=kv_dtype)
    table = torch.tensor([[3]], dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int64)
    cis = torch.view_as_real(torch.ones(1, dim // 2, dtype=torch.complex64))
    kernels.decode_layer(qkv, cis, 3 * one, k_buf, v_buf, table, 0 * one, one, 2, 0.25)
    torch.testing.assert_close(v_buf[3, 0].float(), v.to(kv_dtype).float(), equal_nan=True)


def test_loading_the_kernels_keeps_denormals() -> None:
    # A library linked with -ffast-math would switch the process to flush-to-zero.
    code = (
        "import torch\n"
        "from rsgl.layers.cpu_kernels import load_cpu_kernels\n"
        "assert load_cpu_kernels() is not None\n"
        "print(float(torch.tensor(1e-39) * 1))\n"
    )
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) == pytest.approx(1e-39, rel=1e-3)


def test_a_compile_error_names_the_real_file_and_line(tmp_path: Path):
    """The kernels are C files, not strings: a compiler error points at their lines."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    src = tmp_path / "src"
    shutil.copytree(CSRC, src)
    lines = (src / "elementwise.c").read_text().splitlines()
    broken = len(lines) + 1
    (src / "elementwise.c").write_text("\n".join([*lines, "this is not C;"]) + "\n")
    errors = compile_kernels(src, tmp_path / "k.so", compiler)
    assert errors is not None and f"elementwise.c:{broken}:" in errors
    assert compile_kernels(CSRC, tmp_path / "ok.so", compiler) is None
    assert (tmp_path / "ok.so").is_file()


def test_the_kernels_are_built_for_the_features_rsgl_reports(kernels: CpuKernels) -> None:
    # The paths that run follow `rsgl.cpu_features` (RSGL_CPU_FEATURES' level included):
    # AVX-512 code only where the CPU is treated as having it, SSE2 loops where not even AVX.
    flags = cpu_flags()
    for feature in ("avx512f", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c"):
        assert (feature in kernels.isa) == (feature in flags), (feature, kernels.isa)
    assert ("sse2" in kernels.isa) == ("avx" not in flags)


EIGHT_BIT = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _fp8_probe_values(kv_dtype: torch.dtype) -> torch.Tensor:
    """Every value of an fp8 format, the midpoints between neighbours (ties to even), points
    just off them, values past its largest, denormals and -0 (one head of 64 per row)."""
    grid = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    probes = [grid, mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1])]
    probes.append(torch.tensor([1e9, -1e9, 500.0, 460.0, 6e4, -0.0, 1e-30, 3e-10]))
    values = torch.cat(probes)
    return torch.cat([values, torch.zeros(-len(values) % 64)]).view(-1, 1, 64)


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_8_bit_stores_write_the_bytes_torch_writes(
    kernels: CpuKernels, kv_dtype: torch.dtype
) -> None:
    if kv_dtype == torch.int8:
        gen = torch.Generator().manual_seed(3)
        rows = torch.randn(40, 1, 64, generator=gen) * torch.logspace(-6, 4, 40).view(-1, 1, 1)
        rows[0] = 0.0  # amax 0: zeros and a zero scale
        rows[1, 0, :4] = torch.tensor([127.0, 0.5, -0.5, 1.5])  # ties to even
        values = rows
    else:
        values = _fp8_probe_values(kv_dtype)
    b, dim = values.shape[0], 64
    # The values go in as V and as K under an identity rotation (cos 1, sin 0 leave them).
    qkv = torch.cat([torch.zeros(b, dim), values.view(b, dim), values.view(b, dim)], dim=1)
    cis = torch.view_as_real(torch.ones(b, dim // 2, dtype=torch.complex64))
    fused = KVCache(b + 1, 1, 1, dim, kv_dtype, "cpu")
    eager = KVCache(b + 1, 1, 1, dim, kv_dtype, "cpu")
    loc = torch.arange(1, b + 1)
    table = loc.view(b, 1).to(torch.int32)
    scales = (fused.k_scales[0], fused.v_scales[0]) if fused.scaled else (None, None)
    kernels.decode_layer(
        qkv, cis, loc, fused.k_buffers[0], fused.v_buffers[0], table, torch.arange(b),
        torch.ones(b, dtype=torch.int64), 1, 0.125, *scales,
    )  # fmt: skip
    eager.set_kv(0, loc, values, values)
    for got, want in [
        (fused.k_buffers[0], eager.k_buffers[0]),
        (fused.v_buffers[0], eager.v_buffers[0]),
        (fused.k_scales[0], eager.k_scales[0]),
        (fused.v_scales[0], eager.v_scales[0]),
    ]:
        assert torch.equal(_bits(got), _bits(want))
    k, v = fused.get_kv(0, loc, torch.float32)
    assert torch.isfinite(k).all() and torch.equal(k, v)
    if kv_dtype != torch.int8:
        # Saturated at the largest finite value, never infinity or NaN.
        top = torch.finfo(kv_dtype).max
        assert float(k.max()) == top and float(k.min()) == -top


def _filled_cache(
    gen: torch.Generator, kv_dtype: torch.dtype, kv_heads: int, dim: int, key_scale: float = 1.0
) -> KVCache:
    """A one-layer cache of 2048 slots holding random keys (times `key_scale`) and values."""
    cache = KVCache(2048, 1, kv_heads, dim, kv_dtype, "cpu")
    keys = torch.randn(2048, kv_heads, dim, generator=gen) * key_scale
    cache.set_kv(0, torch.arange(2048), keys, torch.randn(2048, kv_heads, dim, generator=gen))
    return cache


def _rounded(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] rounded per head as the kernels score an int8 cache against it (csrc/kv8.h
    q16_split: round(q * 32639 / amax), the multiplier one float32 division), in floats."""
    amax = q.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, amax.new_full(amax.shape, 32639.0) / amax, 0.0)
    step = amax * torch.tensor(1 / 32639, dtype=torch.float32)
    return torch.round(q * inv).clamp(-32639, 32639) * step


@pytest.mark.parametrize(("dim", "heads", "kv_heads"), [(64, 9, 3), (128, 4, 2), (40, 6, 2)])
def test_an_int8_cache_is_scored_against_the_rounded_query(
    kernels: CpuKernels, dim: int, heads: int, kv_heads: int
) -> None:
    # To 16-bit integers per head: with AVX512-VNNI (D 64, 128) the scores are exact
    # integer dot products, elsewhere (AVX2, D 40) those of the rounded query in floats.
    # Either way they are the rounded query's, to float rounding.
    gen = torch.Generator().manual_seed(dim * heads)
    lens, table, req_slots, seq_slots, _ = _scattered_requests(gen, 70, 2048)
    cache = _filled_cache(gen, torch.int8, kv_heads, dim, key_scale=3.0)
    q = torch.randn(len(lens), heads, dim, generator=gen) * 2
    out = torch.empty_like(q)
    kernels.decode_attention(
        q, cache.k_buffers[0], cache.v_buffers[0], table, req_slots, torch.tensor(lens), out,
        dim**-0.5, cache.k_scales[0], cache.v_scales[0],
    )  # fmt: skip
    worst_float_q = 0.0
    for i, sl in enumerate(seq_slots):
        k, v = (x.transpose(0, 1) for x in cache.get_kv(0, sl, torch.float32))
        attend = torch.nn.functional.scaled_dot_product_attention
        ref = attend(_rounded(q[i]).unsqueeze(1), k, v, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
        unrounded = attend(q[i].unsqueeze(1), k, v, enable_gqa=True).squeeze(1)
        worst_float_q = max(worst_float_q, float((out[i] - unrounded).abs().max()))
    assert worst_float_q > 1e-5  # the rounding shows: this is not the float query's


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "heads", "kv_heads"), [(64, 9, 3), (128, 4, 2), (40, 6, 2)])
def test_8_bit_caches_attend_over_their_stored_values(
    kernels: CpuKernels,
    kv_dtype: torch.dtype,
    act: torch.dtype,
    dim: int,
    heads: int,
    kv_heads: int,
) -> None:
    gen = torch.Generator().manual_seed(dim + heads)
    lens, table, req_slots, seq_slots, loc = _scattered_requests(gen, 70, 2048)
    b = len(lens)
    cache = _filled_cache(gen, kv_dtype, kv_heads, dim, key_scale=3.0)
    qkv = (torch.randn(b, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(act)
    angles = torch.rand(b, 1, dim // 2, generator=gen) * 6
    cis = torch.polar(torch.ones_like(angles), angles)
    scales = (cache.k_scales[0], cache.v_scales[0]) if cache.scaled else (None, None)

    out = kernels.decode_layer(
        qkv, torch.view_as_real(cis), loc, cache.k_buffers[0], cache.v_buffers[0], table,
        req_slots, torch.tensor(lens), heads, dim**-0.5, *scales,
    )  # fmt: skip

    # The new keys: the rotation's last float bit may differ from torch's, so within one
    # step of the format (int8: the head's scale; fp8: 2^-mantissa bits relative).
    k_new = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(b, -1, dim), cis)[:, heads:]
    k_new = k_new.float()
    stored, _ = cache.get_kv(0, loc, torch.float32)
    if cache.scaled:
        step = cache.k_scales[0][loc].unsqueeze(-1)
    else:
        # (mantissa bits, the denormals' step)
        bits, tiny = {torch.float8_e4m3fn: (3, 2.0**-9), torch.float8_e5m2: (2, 2.0**-16)}[kv_dtype]
        step = k_new.abs() * 2.0**-bits + tiny
    assert ((stored - k_new).abs() <= step * 1.01).all()
    q = apply_rotary(qkv[:, : heads * dim].view(b, heads, dim), cis).to(act).float()
    tol = 1e-5 if act == torch.float32 else 2e-2
    if cache.scaled:
        # An int8 cache is scored against the query rounded to 16-bit integers per head
        # (test_an_int8_cache_is_scored_against_the_rounded_query). The rotation's last
        # bit may differ from torch's, and round a query element the other way.
        q = _rounded(q)
        tol = max(tol, 1e-4)
    for i, sl in enumerate(seq_slots):
        k, v = cache.get_kv(0, sl, torch.float32)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True
        )
        torch.testing.assert_close(
            out[i].view(heads, dim).float(), ref.squeeze(1), atol=tol, rtol=tol
        )
    with pytest.raises(ValueError, match="scales"):
        kernels.decode_layer(
            qkv, torch.view_as_real(cis), loc, cache.k_buffers[0], cache.v_buffers[0], table,
            req_slots, torch.tensor(lens), heads, dim**-0.5,
            *((None, None) if cache.scaled else (cache.k_scales[0], cache.v_scales[0])),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("kv_dtype", "act", "dim", "heads", "kv_heads"),
    [
        (F32, torch.float32, 64, 6, 2),
        (BF16, torch.bfloat16, 64, 9, 3),
        (F16, torch.bfloat16, 40, 8, 4),
        (torch.int8, torch.float32, 64, 9, 3),
        (torch.float8_e4m3fn, torch.bfloat16, 128, 4, 2),
    ],
)
def test_a_request_alone_gets_the_bits_it_gets_in_a_batch(
    kernels: CpuKernels,
    kv_dtype: torch.dtype,
    act: torch.dtype,
    dim: int,
    heads: int,
    kv_heads: int,
) -> None:
    # A request alone is split into its kv heads among the threads; in the batch of 17 only
    # request 0, longer than a thread's share of the batch's positions, is, and the others
    # are one work item each. A head's arithmetic must not depend on which (4 threads: the
    # splits happen on any machine).
    gen = torch.Generator().manual_seed(dim + kv_heads)
    lens, table, req_slots, _, loc = _scattered_requests(gen, 70, 2048, first_len=400)
    assert 4 * lens[0] > sum(lens) and all(4 * n < sum(lens) for n in lens[1:])
    b = len(lens)
    cache = _filled_cache(gen, kv_dtype, kv_heads, dim)
    qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, generator=gen).to(act)
    angles = torch.rand(b, 1, dim // 2, generator=gen) * 6
    cis = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
    scales = (cache.k_scales[0], cache.v_scales[0]) if cache.scaled else (None, None)
    caches = cache.k_buffers[0], cache.v_buffers[0]
    lengths = torch.tensor(lens)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        together = kernels.decode_layer(
            qkv, cis, loc, *caches, table, req_slots, lengths, heads, dim**-0.5, *scales
        )
        q = qkv[:, : heads * dim].reshape(b, heads, dim).contiguous()
        attended = torch.empty_like(q)
        kernels.decode_attention(
            q, *caches, table, req_slots, lengths, attended, dim**-0.5, *scales
        )
        for i in range(b):
            one = slice(i, i + 1)
            alone = kernels.decode_layer(
                qkv[one], cis[one], loc[one], *caches, table, req_slots[one], lengths[one],
                heads, dim**-0.5, *scales,
            )  # fmt: skip
            assert torch.equal(alone, together[one]), f"request {i} (length {lens[i]})"
            solo = torch.empty_like(q[one])
            kernels.decode_attention(
                q[one], *caches, table, req_slots[one], lengths[one], solo, dim**-0.5, *scales
            )
            assert torch.equal(solo, attended[one])
    finally:
        torch.set_num_threads(threads)


def _allowed_cpus(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/status", encoding="utf-8") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))


def _cpu_ticks(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat", encoding="utf-8") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # user + system


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux's per-thread affinity")
def test_binding_pins_the_caller_and_its_workers_one_cpu_each(kernels: CpuKernels) -> None:
    import os
    import threading

    # The affinity's last CPUs, the caller on the later one: not where threads start anyway.
    cpus = sorted(os.sched_getaffinity(0))[-2:][::-1]
    seen: dict[str, object] = {}

    def on_a_fresh_thread() -> None:  # a compute thread of its own, as the engine's
        tid = threading.get_native_id()
        before = set(os.listdir("/proc/self/task"))
        seen["bound"] = kernels.bind_omp_threads(cpus)
        seen["threads"] = torch.get_num_threads()
        others = {int(t) for t in set(os.listdir("/proc/self/task")) - before}
        ticks = {t: _cpu_ticks(t) for t in others}
        x = torch.randn(1024, 1024)
        for _ in range(20):  # a later team, torch's own: its workers are those that worked
            x @ x
        seen["caller"] = _allowed_cpus(tid)
        seen["workers"] = sorted(_allowed_cpus(t) for t in others if _cpu_ticks(t) > ticks[t])

    threads = torch.get_num_threads()
    try:
        worker = threading.Thread(target=on_a_fresh_thread)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert seen["bound"] is True and seen["threads"] == len(cpus)
    assert seen["caller"] == str(cpus[0])
    assert seen["workers"] == sorted(str(c) for c in cpus[1:])
    with pytest.raises(ValueError, match="no CPUs"):
        kernels.bind_omp_threads([])
