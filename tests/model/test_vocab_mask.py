"""Grammar masks on logits: the C kernel and the torch path forbid exactly the tokens whose
bits are clear, only in the masked rows; the sampler then never picks a forbidden token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rsgl.layers import vocab_mask
from rsgl.layers.vocab_mask import apply_token_bitmask


def random_case(vocab: int, seed: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=gen)
    rows = np.array([4, 0, 2], dtype=np.int64)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    bitmask[1, :] = -1  # row 0 allows everything
    return logits, rows, bitmask


def expected(logits: torch.Tensor, rows: np.ndarray, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    for i, row in enumerate(rows.tolist()):
        for j in range(vocab):
            word = int(bitmask[i, j // 32]) & 0xFFFFFFFF
            if not (word >> (j % 32)) & 1:
                out[row, j] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 100, 1000])
@pytest.mark.parametrize("kernels", [True, False])
def test_masked_rows_keep_only_allowed_tokens(
    vocab: int, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(vocab_mask, "load_cpu_kernels", lambda: None)
    logits, rows, bitmask = random_case(vocab, seed=vocab)
    want = expected(logits, rows, bitmask)
    apply_token_bitmask(logits, rows, bitmask)
    torch.testing.assert_close(logits, want)


@pytest.mark.parametrize("kernels", [True, False])
def test_tokens_past_the_bitmask_width_are_forbidden(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(vocab_mask, "load_cpu_kernels", lambda: None)
    logits = torch.zeros(2, 40)  # a bitmask of one word covers 32 tokens
    apply_token_bitmask(logits, np.array([1]), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isinf(logits[1, 32:]).all() and (logits[1, :32] == 0).all()
    assert (logits[0] == 0).all()


@pytest.mark.parametrize(("start", "stop"), [(0, 500), (64, 1000), (333, 1000), (31, 97)])
def test_a_vocabulary_slice_is_masked_as_the_whole_row_is(start: int, stop: int) -> None:
    # A tensor-parallel rank masks its slice of the logits before the sharded argmax; its
    # ids need not start on a word of the bitmask.
    logits, rows, bitmask = random_case(1000, seed=start)
    whole = logits.clone()
    apply_token_bitmask(whole, rows, bitmask)
    part = logits[:, start:stop].contiguous()
    apply_token_bitmask(part, rows, bitmask, vocab_start=start)
    torch.testing.assert_close(part, whole[:, start:stop])
