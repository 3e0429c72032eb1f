"""The tensor-parallel group: the all-reduce and all-gather a sharded model runs each layer.

torch.distributed's backends do the work: gloo on CPU, NCCL on CUDA. The group is a backend
object made over an explicit `TCPStore` (`TPGroup.create`), not torch.distributed's
process-global default group: nothing else in the process is affected, several engines can
live in one process (the tests run a TP=1 and a TP=2 engine side by side), and shutting one
down needs no `destroy_process_group`.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch.distributed.distributed_c10d import (
    PrefixStore,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    Store,
)

from rsgl.distributed.sharding import TPShard


class _Work(Protocol):
    def wait(self) -> bool: ...


class _Backend(Protocol):
    """What the group calls on a torch.distributed backend. Every backend has these
    methods; torch's type stubs declare them on `ProcessGroup` only."""

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work: ...

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
    ) -> _Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> _Work: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class CollectiveProfile:
    """How many collectives ran and the host wall time spent in them (waiting for the slowest
    rank included). On CUDA the collectives are asynchronous, so the time is only their
    launch cost."""

    calls: int = 0
    seconds: float = 0.0


class TPGroup:
    """One rank's view of its tensor-parallel group.

    `all_reduce` sums a tensor over the ranks in place (row-parallel outputs, the vocab-parallel
    embedding); `all_gather` concatenates each rank's slice along the last dimension (the
    logits); `broadcast` copies rank 0's tensor to every rank (a step's grammar masks). Every
    rank ends with bitwise identical results: ring and tree reductions broadcast one reduced
    copy, so the ranks' residual streams, and hence their sampling, never drift apart. Set
    `profile` to count and time the collectives.
    """

    def __init__(self, backend: _Backend, rank: int, size: int) -> None:
        self.backend = backend
        self.rank = rank
        self.size = size
        self.profile: CollectiveProfile | None = None

    @classmethod
    def create(
        cls,
        store: Store,
        rank: int,
        size: int,
        device: torch.device,
        timeout: datetime.timedelta,
    ) -> TPGroup:
        """Joins the group of `size` ranks that meet in `store`: blocks until all have joined.
        A collective that does not complete within `timeout` raises (a rank that died makes
        gloo raise at once: its connections close)."""
        prefixed = PrefixStore("rsgl-tp/", store)
        backend: object
        if device.type == "cuda":
            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            backend = ProcessGroupGloo(prefixed, rank, size, timeout)
        return cls(cast(_Backend, backend), rank, size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place; returns it."""
        start = time.perf_counter()
        self.backend.allreduce([x]).wait()
        self._count(start)
        return x

    def all_gather(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """Concatenates every rank's `x` ([rows, sizes[rank]]) along the last dimension.
        Backends gather equal shapes only, so uneven slices travel padded to the largest."""
        start = time.perf_counter()
        width = max(sizes)
        if x.shape[-1] != width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.backend.allgather([parts], [x.contiguous()]).wait()
        if width != min(sizes):
            parts = [p[..., :n] for p, n in zip(parts, sizes, strict=True)]
        out = torch.cat(parts, dim=-1)
        self._count(start)
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the others' `x` is overwritten); returns it."""
        start = time.perf_counter()
        self.backend.broadcast(x, 0).wait()
        self._count(start)
        return x

    def _count(self, start: float) -> None:
        """Profiles one collective that began at `start` (perf_counter)."""
        if self.profile is not None:
            self.profile.calls += 1
            self.profile.seconds += time.perf_counter() - start

    def close(self) -> None:
        """Shuts the backend down (its connections; NCCL's communicators)."""
        self.backend.shutdown()


@dataclass(frozen=True, slots=True)
class TPRank:
    """What a sharded model needs to know of its rank: the slice it holds and its group."""

    shard: TPShard
    group: TPGroup


__all__ = ["CollectiveProfile", "TPGroup", "TPRank"]
