"""Layers whose output is completed across tensor-parallel ranks.

Column-parallel projections (fused QKV, gate_up) need no layer of their own: each rank's
`nn.Linear` simply has fewer output rows, and the loader gives it its rows. What follows a
column-parallel projection is row-parallel (o_proj, down_proj): each rank multiplies its
slice of the input by its columns of the weight, and the partial sums are all-reduced. The
embedding and the LM head are split by vocabulary rows. tp_size=1 models use none of these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from rsgl.layers.linear import PackedLinear, can_pack
from rsgl.layers.quant_linear import QuantLinear
from rsgl.layers.sampler import argmax_rows

if TYPE_CHECKING:
    from rsgl.distributed.group import TPGroup


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x_local @ W_local.T) + b`: W_local holds this rank's input columns.

    The bias is whole on every rank and added after the sum, so it counts once. `pack()`
    reorders the weight for oneDNN on CPU, as `rsgl.layers.linear.pack_linears` does for
    plain projections (the parameter names stay HF's `o_proj.weight` / `down_proj.weight`).
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group
        self.packed: PackedLinear | None = None
        # Set when the projection also has low-bit weights (rsgl.layers.quant_linear): read
        # by the batches it serves (`QuantLinear.serves`), the dense weight by larger ones.
        self.low_bit: QuantLinear | None = None

    def pack(self) -> None:
        """Keep the weight only in oneDNN's layout (float32 / bfloat16 on CPU)."""
        if self.weight is not None and can_pack(self.weight):
            self.packed = PackedLinear(self.weight, None)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        low_bit = self.low_bit
        if low_bit is not None and low_bit.serves(x.shape[0]):
            out = low_bit(x)
        elif self.packed is not None:
            out = self.packed(x)
        else:
            assert self.weight is not None
            out = F.linear(x, self.weight)
        self.group.all_reduce(out)
        if self.bias is not None:
            out += self.bias
        return out


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows `vocab` on this rank: a token outside them looks up zeros,
    and the all-reduce gives every rank the full embedding (exactly one rank contributes a
    non-zero row per token, so the sum is exact)."""

    def __init__(self, vocab: range, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.vocab = vocab
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size))
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inside = (input_ids >= self.vocab.start) & (input_ids < self.vocab.stop)
        local = torch.where(inside, input_ids - self.vocab.start, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        self.group.all_reduce(out)
        return out


__all__ = ["RowParallelLinear", "VocabParallelEmbedding"]


def sharded_argmax(local_logits: torch.Tensor, vocab_start: int, group: TPGroup) -> torch.Tensor:
    """The argmax over the whole vocabulary of logits split by vocabulary across the ranks
    (this rank holds `local_logits` [B, n] for ids vocab_start ..): each rank's best
    (value, id) pair is all-gathered ([B, 2] per rank instead of its [B, n] logits) and the
    best pair wins. It is `argmax` of the gathered logits exactly: ranks hold ascending id
    ranges and each local argmax is the first of its maxima, so the first rank holding the
    global maximum has its first occurrence; a NaN is the largest, as in torch. Every rank
    gets the same ids. float64 carries the values and the ids exactly."""
    ids = argmax_rows(local_logits)
    best = local_logits.gather(1, ids.unsqueeze(1)).squeeze(1).double()
    pair = torch.stack([best, (ids + vocab_start).double()], dim=1)
    pairs = group.all_gather(pair, (2,) * group.size).view(-1, group.size, 2)
    winner = pairs[:, :, 0].argmax(dim=1, keepdim=True)
    return pairs[:, :, 1].gather(1, winner).squeeze(1).long()
