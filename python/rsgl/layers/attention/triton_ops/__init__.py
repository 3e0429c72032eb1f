"""Triton kernels of the `triton` attention backend (importing this imports triton).

To run them on the CPU through Triton's interpreter, set TRITON_INTERPRET=1 before triton
itself is first imported: `triton.jit` decides between compiling and interpreting when each
function is defined, triton.language's own helpers included.
"""

from __future__ import annotations

from rsgl.layers.attention.triton_ops.decode_attention import decode_attention
from rsgl.layers.attention.triton_ops.kv_indices import _build_kv_indices_kernel, build_kv_indices
from rsgl.layers.attention.triton_ops.prefill_attention import prefill_attention


def kernels_interpreted() -> bool:
    """Whether these kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_build_kv_indices_kernel).__name__ == "InterpretedFunction"


__all__ = ["build_kv_indices", "decode_attention", "kernels_interpreted", "prefill_attention"]
