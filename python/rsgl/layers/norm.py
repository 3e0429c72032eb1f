"""RMSNorm as Llama-family checkpoints define it, with the residual add fused in."""

from __future__ import annotations

import torch
from torch import nn

from rsgl.layers.cpu_kernels import ACT_DTYPES, load_cpu_kernels


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    The statistics are computed in float32 and the result is cast back before the weight is
    applied, exactly as HF transformers does, so low-precision runs round the same way. On
    CPU in float32 or bfloat16 one fused C kernel does the residual add and the norm, with
    the same rounding (`rsgl.layers.cpu_kernels`); on CUDA a Triton
    kernel does, with the same rounding (`rsgl.layers.triton_kernels`) unless
    `use_triton` is off. (Not `F.rms_norm`: on CPU with two threads it measured ~100x
    slower than the four ops it replaces.)
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_triton = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.use_triton and x.dim() in (2, 3) and x.stride(-1) == 1:
            from rsgl.layers import triton_kernels

            return triton_kernels.rmsnorm(x, self.weight, self.eps)
        if x.dim() == 2 and _fused(x, self.weight):
            kernels = load_cpu_kernels()
            assert kernels is not None
            return kernels.add_rmsnorm(x, None, self.weight, self.eps)[0]
        return self._norm(x)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm block's residual step."""
        if self.use_triton and _triton_add(x, residual):
            from rsgl.layers import triton_kernels

            return triton_kernels.add_rmsnorm(x, residual, self.weight, self.eps)
        if _fused(x, self.weight) and residual.is_contiguous() and residual.dtype == x.dtype:
            kernels = load_cpu_kernels()
            assert kernels is not None
            return kernels.add_rmsnorm(x, residual, self.weight, self.eps)
        summed = residual + x
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _triton_add(x: torch.Tensor, residual: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and x.stride(-1) == 1
        and residual.stride(-1) == 1
    )


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in ACT_DTYPES
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and load_cpu_kernels() is not None
    )
