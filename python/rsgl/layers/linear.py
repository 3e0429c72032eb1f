"""Projections with weights prepacked for oneDNN on CPU.

PyTorch's `F.linear` on CPU goes to MKL's sgemm, which repacks the weight on every call and,
on the AMD CPUs we run on, measured 1.5-2x slower than oneDNN's kernels over a weight that
was reordered once into oneDNN's blocked layout (SmolLM2's projections at batch 64: 230 ms
vs 118 ms per decode step's worth). `PackedLinear` holds only the packed weight; the float32
results match `F.linear` to rounding (the reduction order differs).

bfloat16 weights pack the same way, for oneDNN's AMX / AVX512-BF16 kernels (float32
accumulation, bfloat16 output). On a 2-core Xeon with AMX, SmolLM2's shapes ran 1.3-1.8x
faster packed than through `F.linear` in bfloat16 at batch 16-256 (576 -> 3072 at batch
64: 1,763 vs 1,071 GFLOP/s; float32 packed: 337), and about even at batch 1.
"""

from __future__ import annotations

import torch
from torch import nn

from rsgl.cpu_features import allows

# Weight dtypes oneDNN's packed linear takes.
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed: float32 or bfloat16 on CPU, with a torch build that
    has oneDNN (bfloat16 also needs a CPU oneDNN has bfloat16 kernels for: AVX-512 at least,
    which an emulated lower level (`rsgl.cpu_features`) takes away)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and (weight.dtype != torch.bfloat16 or _onednn_bf16())
    )


def _onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and allows("avx512bw")


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's blocked layout (an opaque mkldnn tensor).

    The packed weight is a plain attribute, not a parameter: `.to()` and `state_dict()` do
    not know the layout, so packing is the last step of loading a model.
    """

    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count


__all__ = ["PACKED_DTYPES", "PackedLinear", "can_pack", "pack_linears"]
