"""Host arrays onto the device without waiting for it: one pinned buffer, one copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    arrays: Sequence[np.ndarray],
    device: torch.device | str,
    dtype: torch.dtype = torch.int64,
    *,
    share_on_cpu: bool = True,
) -> list[torch.Tensor]:
    """`arrays` as `dtype` tensors on `device`, in their shapes.

    Off the CPU they are packed into one pinned host buffer and sent in a single
    non-blocking copy on the current stream: a copy from pageable memory would block the
    host until the device drained its queue, which is exactly the overlap the loop is built
    for, and a fresh pinned buffer per call lets torch's caching host allocator keep it
    alive until the copy has run. On CPU the tensors share the arrays' memory where the
    dtype allows, unless `share_on_cpu` is off (the caller keeps mutating the arrays).
    """
    device = torch.device(device)
    if device.type == "cpu" and share_on_cpu:
        return [torch.as_tensor(np.asarray(a), dtype=dtype) for a in arrays]
    sizes = [int(np.size(a)) for a in arrays]
    staging = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
    host = staging.numpy()
    np.concatenate([np.ravel(np.asarray(a, dtype=host.dtype)) for a in arrays], out=host)
    packed = staging.to(device, non_blocking=True)
    parts = packed.split_with_sizes(sizes)
    return [part.view(np.shape(a)) for part, a in zip(parts, arrays, strict=True)]


__all__ = ["to_device"]
