"""The CUDA path's fused elementwise kernels round as the torch ops they replace.

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1
before triton is imported) in float32 and float16; the interpreter converts to bfloat16 by
truncating instead of rounding, so bfloat16 is checked on CUDA only. On CPU the reference's
exp, rsqrt and row sums differ from the interpreter's numpy in the last float32 bits, and a
row sum in another order can move a normalised value by one unit in the last place (ulp) of
the model dtype, which the weight multiply carries into its own rounding: comparisons allow
two ulps in float16 and bfloat16, four in float32.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from plan_builder import Driver

from rsgl.layers.rotary import RotaryEmbedding, apply_rotary
from rsgl.models.config import RopeConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# (hidden, intermediate, q heads, kv heads, head_dim): SmolLM2-135M, Llama-3-8B, and sizes
# that are not powers of two.
SHAPES = [(576, 1536, 9, 3, 64), (4096, 14336, 32, 8, 128), (1000, 2000, 5, 1, 96)]
TOKENS = [1, 3]
EPS = 1e-5


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    from rsgl.layers import triton_kernels

    if not triton_kernels.kernels_interpreted() and not CUDA:
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set and there is no GPU; "
            "run this file in its own pytest process"
        )
    return triton_kernels


@pytest.fixture(scope="module")
def device(kernels: ModuleType) -> torch.device:
    return torch.device("cpu" if kernels.kernels_interpreted() else "cuda")


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The unit in the last place of each element of t (in its dtype), as float32."""
    info = torch.finfo(t.dtype)
    return torch.exp2(torch.floor(torch.log2(t.float().abs().clamp_min(info.tiny)))) * info.eps


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| in units of the last place of `want` (in its dtype)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    return float(((got.float() - want.float()).abs() / ulp(want)).max()) if want.numel() else 0.0


def tolerance(dtype: torch.dtype) -> int:
    return 4 if dtype == torch.float32 else 2


def reference_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # RMSNorm._norm's ops, spelled out so the test does not depend on the dispatch.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * normed.to(x.dtype)


def rand(*shape: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=GEN, dtype=torch.float32) * scale).to(device, dtype)


GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}")
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rmsnorm_rounds_as_the_torch_ops(
    kernels: ModuleType,
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    tokens: int,
) -> None:
    hidden = shape[0]
    x = rand(tokens, hidden, dtype=dtype, device=device)
    residual = rand(tokens, hidden, dtype=dtype, device=device, scale=4.0)
    weight = rand(hidden, dtype=dtype, device=device, scale=0.2) + 1
    normed, summed = kernels.add_rmsnorm(x, residual, weight, EPS)
    want_sum = residual + x
    assert torch.equal(summed, want_sum)
    assert ulps(normed, reference_norm(want_sum, weight)) <= tolerance(dtype)
    alone = kernels.rmsnorm(x, weight, EPS)
    assert ulps(alone, reference_norm(x, weight)) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_reads_strided_head_rows(
    kernels: ModuleType, device: torch.device, dtype: torch.dtype
) -> None:
    # Qwen3's q norm reads [T, heads, D] straight out of the fused QKV projection's rows.
    tokens, heads, kv_heads, dim = 3, 9, 3, 64
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device, scale=3.0)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    weight = rand(dim, dtype=dtype, device=device, scale=0.2) + 1
    got = kernels.rmsnorm(q, weight, EPS)
    assert got.is_contiguous()
    assert ulps(got, reference_norm(q, weight)) <= tolerance(dtype)


def test_a_float32_weight_promotes_the_output(kernels: ModuleType, device: torch.device) -> None:
    x = rand(2, 576, dtype=torch.float16, device=device)
    weight = rand(576, dtype=torch.float32, device=device) + 1
    got = kernels.rmsnorm(x, weight, EPS)
    want = reference_norm(x, weight)
    assert got.dtype == want.dtype == torch.float32
    assert ulps(got, want) <= tolerance(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"i{s[1]}")
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul_rounds_as_silu_then_multiply(
    kernels: ModuleType,
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    tokens: int,
) -> None:
    inter = shape[1]
    gate_up = rand(tokens, 2 * inter, dtype=dtype, device=device, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate)
    want = act * up
    got = kernels.silu_mul(gate_up)
    assert got.shape == want.shape
    # silu's rounded result may differ by its tolerance (see the module docstring), which
    # the multiply by `up` scales, before the product's own rounding.
    slack = tolerance(dtype) * (ulp(act) * up.float().abs() + ulp(want))
    assert bool(((got.float() - want.float()).abs() <= slack).all())


def _rotary(dim: int, device: torch.device) -> RotaryEmbedding:
    rope = RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    return RotaryEmbedding(dim, 4096, rope).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[2]}x{s[3]}x{s[4]}")
def test_rotary_rotates_q_and_k_in_place_as_apply_rotary(
    kernels: ModuleType, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    _, _, heads, kv_heads, dim = shape
    rotary = _rotary(dim, device)
    positions = torch.tensor([0, 7, 100, 4095], device=device)
    cis = rotary.cis(positions)
    qkv = rand(4, (heads + 2 * kv_heads) * dim, dtype=dtype, device=device, scale=3.0)
    before = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * dim].view(4, heads + kv_heads, dim)
    want = apply_rotary(qk, cis)
    kernels.rotary_qk(qk, cis)
    assert ulps(qk, want) <= tolerance(dtype)
    # v, the rest of the row, is left alone.
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], before[:, (heads + kv_heads) * dim :])


def test_empty_batches_launch_nothing(kernels: ModuleType, device: torch.device) -> None:
    x = torch.empty(0, 64, device=device)
    weight = torch.ones(64, device=device)
    assert kernels.rmsnorm(x, weight, EPS).shape == (0, 64)
    assert kernels.add_rmsnorm(x, x, weight, EPS)[1].shape == (0, 64)
    assert kernels.silu_mul(torch.empty(0, 128, device=device)).shape == (0, 64)
    kernels.rotary_qk(torch.empty(0, 2, 64, device=device), torch.empty(0, 32, 2, device=device))


def test_bad_shapes_are_refused(kernels: ModuleType, device: torch.device) -> None:
    with pytest.raises(ValueError, match="weight"):
        kernels.rmsnorm(torch.ones(2, 64, device=device), torch.ones(32, device=device), EPS)
    with pytest.raises(ValueError, match="2I"):
        kernels.silu_mul(torch.ones(2, 63, device=device))
    with pytest.raises(ValueError, match="cos, sin"):
        kernels.rotary_qk(torch.ones(2, 2, 64, device=device), torch.ones(2, 16, 2, device=device))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_kernels_replay_in_a_cuda_graph(kernels: ModuleType) -> None:
    device = torch.device("cuda")
    x = rand(8, 4096, dtype=torch.bfloat16, device=device)
    residual = rand(8, 4096, dtype=torch.bfloat16, device=device)
    weight = rand(4096, dtype=torch.bfloat16, device=device) + 1
    gate_up = rand(8, 2 * 1536, dtype=torch.bfloat16, device=device)
    qk = rand(8, 40, 128, dtype=torch.bfloat16, device=device)
    cis = _rotary(128, device).cis(torch.arange(8, device=device))

    def step() -> tuple[torch.Tensor, ...]:
        normed, summed = kernels.add_rmsnorm(x, residual, weight, EPS)
        rotated = qk.clone()
        kernels.rotary_qk(rotated, cis)
        return normed, summed, kernels.silu_mul(gate_up), rotated

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert torch.equal(got, want)


# ---------------------------------------------------------------- a whole model, on and off

TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 192,
    "intermediate_size": 320,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _write_config(path: Path, qk_norm: bool) -> None:
    config = dict(TINY)
    if qk_norm:
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32)
    else:
        config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.skipif(not CUDA, reason="the fused kernels run in the model on CUDA only")
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_model_logits_match_with_kernels_on_and_off(tmp_path: Path, qk_norm: bool) -> None:
    from rsgl.model_executor.model_runner import ModelRunner

    _write_config(tmp_path, qk_norm)

    def runner(fused: bool) -> ModelRunner:
        r = ModelRunner.from_pretrained(
            tmp_path,
            kv_buffer_size=1024,
            max_running_requests=4,
            context_len=256,
            device="cuda",
            load_format="dummy",
            seed=3,
            cuda_graph_max_bs=4,
            disable_cuda_graph=not fused,  # the fused run also proves graph capture
        )
        with torch.no_grad():  # dummy norms are all ones; make a skipped weight show
            for name, p in sorted(r.model.named_parameters()):
                if "norm" in name:
                    gen = torch.Generator(device="cuda").manual_seed(len(name))
                    p.add_(torch.randn(p.shape, generator=gen, device="cuda").to(p.dtype) * 0.2)
        r.model.set_triton_kernels(fused)
        return r

    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    forced = [17, 300, 42, 7, 99]  # the same tokens for both runs, so the steps stay aligned
    logits = []
    for fused in (True, False):
        driver = Driver(runner(fused))
        seq = driver.admit(0, prompt)
        steps = [driver.run([driver.work(seq, len(prompt))])]
        for token in forced:
            seq.tokens.append(token)
            steps.append(driver.run([driver.work(seq, 1)]))
        logits.append([s.logits for s in steps])
    for on, off in zip(*logits, strict=True):
        assert on is not None and off is not None
        want = torch.as_tensor(off).float()
        worst = float((torch.as_tensor(on).float() - want).abs().max() / want.std())
        # One-ulp differences in bfloat16 norms move the logits by well under a percent of
        # their spread; a wrong rotation or a skipped weight moves them by the spread itself.
        assert worst < 0.02, f"max |diff| / std(logits) = {worst:.4f}"
