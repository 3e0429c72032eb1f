"""Projections that read a GGUF file's own weight blocks (`--quantization gguf`).

A batch-1 decode step is bound by the bytes of weight it reads: SmolLM2's projections and
LM head are 538 MB in float32 but 96 MB as the GGUF stores them (Q4_1 and Q8_0 blocks).
`GGUFLinear` keeps a projection in its blocks and multiplies float32 (or bfloat16)
activations by them with rsgl's C kernels (`csrc/quant.c`), which rebuild each weight
exactly as the dequantized float32 model holds it: the same numbers, a different summation
order, so greedy tokens match the float32 model's.

Decode batches are bound by memory traffic; large ones (prefill chunks, mixed steps) by
arithmetic, where oneDNN's float32 (or bfloat16) GEMM over a dequantized copy is faster
than rebuilding weights per row pair. A projection therefore keeps both: the blocks for up
to `max_rows` rows, the dense copy above.
"""

from __future__ import annotations

import torch
from torch import nn

from rsgl.layers.cpu_kernels import QUANT_FORMATS, CpuKernels

# Rows of x up to which the blocks are read rather than the dense copy.
DEFAULT_MAX_ROWS = 16


class GGUFLinear(nn.Module):
    """`y = x @ W.T (+ bias)` with W held as GGUF blocks (uint8 [out, in / 32 * block bytes]
    of `fmt`), and optionally as a dense module used for batches of more than `max_rows`."""

    blocks: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        blocks: torch.Tensor,
        fmt: str,
        kernels: CpuKernels,
        dense: nn.Module | None = None,
        bias: torch.Tensor | None = None,
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        super().__init__()
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"GGUF format {fmt!r}: rsgl reads {', '.join(QUANT_FORMATS)}")
        self.fmt = fmt
        self.kernels = kernels
        self.dense = dense
        self.max_rows = max_rows
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] // QUANT_FORMATS[fmt][1] * 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > self.max_rows:
            out: torch.Tensor = self.dense(x)
            return out
        y = self.kernels.qlinear(x.contiguous(), self.blocks, self.fmt)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fmt={self.fmt}, dense_above={self.max_rows if self.dense is not None else None}"
        )


__all__ = ["DEFAULT_MAX_ROWS", "GGUFLinear"]
