"""Grammar masks on logits: the tokens a request's grammar forbids get -inf before it
samples (`rsgl.grammar` fills the bitmasks; this applies them)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from rsgl.layers.cpu_kernels import load_cpu_kernels


class VocabMask(Protocol):
    """A step's allowed-token bitmasks (`rsgl.grammar.StepMask`): `rows` are the batch rows
    under a grammar; `wait()` returns their int32 bitmask (one row each, bit j % 32 of word
    j / 32 allows token j) once the loop has filled it."""

    rows: np.ndarray

    def wait(self) -> torch.Tensor: ...


def apply_token_bitmask(
    logits: torch.Tensor, rows: np.ndarray, bitmask: torch.Tensor, vocab_start: int = 0
) -> None:
    """In place on float32 logits [B, V]: row rows[i] keeps only what bitmask row i allows
    (tokens past the bitmask's width are forbidden). `vocab_start`: the logits are ids
    vocab_start .. vocab_start + V of the bitmask's vocabulary (a tensor-parallel rank's
    slice)."""
    if len(rows) == 0:
        return
    if vocab_start:
        bitmask = shift_bitmask(bitmask, vocab_start)
    if logits.device.type == "cpu" and logits.is_contiguous():
        kernels = load_cpu_kernels()
        if kernels is not None:
            kernels.apply_token_bitmask(
                logits, torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)), bitmask
            )
            return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:
        pad = allowed.new_zeros((allowed.shape[0], vocab - allowed.shape[1]))
        allowed = torch.cat([allowed, pad], dim=1)
    index = torch.as_tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))


def shift_bitmask(bitmask: torch.Tensor, start: int) -> torch.Tensor:
    """The bitmask of ids start, start + 1, .. (int32 words; bit j % 32 of word j / 32)."""
    words, bits = divmod(start, 32)
    if bits == 0:
        return bitmask[:, words:].contiguous()
    # Word k of the result is the high 32 - bits bits of word k + words and the low `bits`
    # of the next, shifted logically (in int64: int32 has only arithmetic shifts).
    full = bitmask[:, words:].long() & 0xFFFFFFFF
    after = torch.nn.functional.pad(full[:, 1:], (0, 1))
    joined = ((full >> bits) | (after << (32 - bits))) & 0xFFFFFFFF
    return torch.where(joined >= 1 << 31, joined - (1 << 32), joined).to(torch.int32)


__all__ = ["VocabMask", "apply_token_bitmask", "shift_bitmask"]
