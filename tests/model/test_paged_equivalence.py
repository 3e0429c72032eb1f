"""The same request gives the same logits however its KV is computed: from a cached prefix,
in prefill chunks, or inside a mixed batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plan_builder import Driver, Work

from rsgl._core import Plan
from rsgl.layers.attention.torch_native import TorchNativeAttnBackend
from rsgl.model_executor.model_runner import ModelRunner

ATOL = 1e-4


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, size=n).tolist()


def _full_prefill_logits(driver: Driver, tokens: list[int], req_slot: int = 0) -> np.ndarray:
    seq = driver.admit(req_slot, tokens)
    out = driver.run([driver.work(seq, len(tokens))])
    assert out.logits is not None
    return out.logits[0].numpy().copy()


def _extends_through(backend: object, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Extends run as rows of the decode kernel (`rows`: any length) or through SDPA (`sdpa`:
    none is short enough for rows)."""
    assert isinstance(backend, TorchNativeAttnBackend)
    if path == "rows" and backend.decode_kernel is None:
        pytest.skip("no C compiler: extends run through SDPA only")
    monkeypatch.setattr(backend, "token_rows_max_extend", 0 if path == "sdpa" else None)


def _count_sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """One entry per call of torch's SDPA from now on (the path an extend took)."""
    calls: list[None] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(None)
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize(
    ("full_path", "extend_path"), [("rows", "rows"), ("sdpa", "sdpa"), ("sdpa", "rows")]
)
def test_cached_prefix_extend_matches_full_prefill(
    driver: Driver,
    smol_runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    full_path: str,
    extend_path: str,
) -> None:
    tokens = _prompt(1, 40)
    sdpa_calls = _count_sdpa_calls(monkeypatch)
    _extends_through(smol_runner.attn, full_path, monkeypatch)
    full = _full_prefill_logits(driver, tokens, req_slot=0)
    assert bool(sdpa_calls) == (full_path == "sdpa")
    _extends_through(smol_runner.attn, extend_path, monkeypatch)
    donor = driver.admit(1, tokens[:25])
    driver.run([driver.work(donor, 25)])
    # A new request whose first 25 tokens are already cached (the donor's KV slots, as the
    # radix cache would hand them out); only the 15-token suffix is computed.
    seq = driver.admit(2, tokens)
    seq.kv_slots = list(donor.kv_slots)
    new = driver.alloc(15)
    seq.kv_slots += new
    plan_work = Work(2, 25, tokens[25:], new)
    # req_to_token rows for the cached prefix, then the suffix extend in one step.
    driver.runner.req_to_token.apply_writes(
        np.full(25, 2), np.arange(25), np.asarray(donor.kv_slots, dtype=np.int64)
    )
    sdpa_calls.clear()
    out = driver.run([plan_work])
    assert bool(sdpa_calls) == (extend_path == "sdpa")
    assert out.logits is not None
    np.testing.assert_allclose(out.logits[0].numpy(), full, atol=ATOL, rtol=0)
    assert int(out.next_token_ids[0]) == int(np.argmax(full))


def test_prefill_in_chunks_of_seven_matches_full_prefill(driver: Driver) -> None:
    tokens = _prompt(2, 45)
    full = _full_prefill_logits(driver, tokens, req_slot=0)
    seq = driver.admit(1, tokens)
    for start in range(0, len(tokens), 7):
        out = driver.run([driver.work(seq, min(7, len(tokens) - start))])
    assert out.logits is not None
    np.testing.assert_allclose(out.logits[0].numpy(), full, atol=ATOL, rtol=0)
    # And the greedy continuations agree for a few tokens.
    a, _ = driver.greedy(driver.admit(2, tokens), 8)
    b, _ = driver.greedy(driver.admit(3, tokens), 8, chunk=7)
    assert a == b


def _mixed_batch_vs_solo(driver: Driver) -> None:
    decodes = [driver.admit(slot, _prompt(10 + slot, 9 + 4 * slot)) for slot in range(5)]
    for seq in decodes:
        driver.run([driver.work(seq, len(seq.tokens))])
        seq.tokens.append(1000 + seq.req_slot)  # the token this step decodes
    extends = []
    for i, prefix in enumerate([0, 6, 13]):
        seq = driver.admit(5 + i, _prompt(20 + i, prefix + 10))
        if prefix:
            driver.run([driver.work(seq, prefix)])
        extends.append(seq)

    # Solo: each request's pending work alone, then roll the KV slots back so the batched
    # run computes exactly the same positions again.
    solo: dict[int, np.ndarray] = {}
    pending = extends + decodes
    for seq in pending:
        n = len(seq.tokens) - seq.cached
        out = driver.run([driver.work(seq, n)])
        assert out.logits is not None
        solo[seq.req_slot] = out.logits[0].numpy().copy()
        del seq.kv_slots[-n:]

    works = [driver.work(seq, len(seq.tokens) - seq.cached) for seq in pending]
    assert [len(w.input_ids) for w in works][3:] == [1] * 5
    out = driver.run(works)
    assert out.logits is not None
    for row, seq in enumerate(pending):
        np.testing.assert_allclose(
            out.logits[row].numpy(),
            solo[seq.req_slot],
            atol=ATOL,
            rtol=0,
            err_msg=f"request in slot {seq.req_slot}",
        )


def test_mixed_batch_matches_each_request_alone(driver: Driver) -> None:
    _mixed_batch_vs_solo(driver)


def test_mixed_batch_eager_decode_path_matches_alone(
    driver: Driver, smol_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = smol_runner.attn
    assert isinstance(backend, TorchNativeAttnBackend)
    monkeypatch.setattr(backend, "decode_kernel", None)
    _mixed_batch_vs_solo(driver)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_kernel_matches_eager_gather(
    smol_runner: ModelRunner, kv_dtype: torch.dtype
) -> None:
    backend = smol_runner.attn
    assert isinstance(backend, TorchNativeAttnBackend)
    if backend.decode_kernel is None:
        pytest.skip("no C compiler: the eager path is the only path")
    gen = torch.Generator().manual_seed(0)
    kv = smol_runner.kv_cache
    b, heads, d = 6, smol_runner.config.num_attention_heads, smol_runner.config.head_dim
    table = smol_runner.req_to_token.req_to_token
    lens = torch.tensor([1, 5, 17, 64, 3, 200])
    slots = torch.arange(10, 16)
    perm = torch.randperm(kv.size - 1, generator=gen) + 1
    for i, n in enumerate(lens.tolist()):
        table[slots[i], :n] = perm[i * 200 : i * 200 + n].to(torch.int32)
    k_buf = torch.randn(kv.size, kv.num_kv_heads, d, generator=gen).to(kv_dtype)
    v_buf = torch.randn(kv.size, kv.num_kv_heads, d, generator=gen).to(kv_dtype)
    q = torch.randn(b, heads, d, generator=gen)
    out = torch.empty_like(q)
    backend.decode_kernel.decode_attention(q, k_buf, v_buf, table, slots, lens, out, backend.scale)
    for i, n in enumerate(lens.tolist()):
        idx = table[slots[i], :n].long()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i].unsqueeze(1),
            k_buf[idx].float().transpose(0, 1),
            v_buf[idx].float().transpose(0, 1),
            enable_gqa=True,
        ).squeeze(1)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_future_map_placeholder_resolves_to_previous_sample(driver: Driver) -> None:
    tokens = _prompt(3, 12)
    seq = driver.admit(0, tokens)
    first = driver.run([driver.work(seq, 12)])
    sampled = int(first.next_token_ids[0])
    explicit = driver.admit(1, tokens + [sampled])
    driver.run([driver.work(explicit, 12)])
    ref = driver.run([driver.work(explicit, 1)])
    # Overlap mode: the decode's input token is a placeholder resolved on the execution side.
    seq.tokens.append(-1)
    out = driver.run([driver.work(seq, 1)])
    assert out.logits is not None and ref.logits is not None
    np.testing.assert_allclose(out.logits[0].numpy(), ref.logits[0].numpy(), atol=ATOL, rtol=0)


def test_idle_plan_applies_writes_and_computes_nothing(driver: Driver) -> None:
    plan = Plan(forward_mode="idle", write_rows=[3], write_cols=[0], write_slots=[42])
    out = driver.runner.step(plan)
    assert out.next_token_ids.shape == (0,)
    assert int(driver.runner.req_to_token.req_to_token[3, 0]) == 42
