"""The allowed-token bitmask of one step's constrained rows, handed from the loop thread
(which fills it once the rows' grammar states are known) to the step's sampler (which waits
for it only after the forward)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from rsgl.grammar.backend import GrammarBackend, Matcher


class StepMask:
    """`rows`: the batch rows that sample under a grammar; row i of `bitmask` is rows[i]'s.

    The loop calls `fill` exactly once (or `release` when the step's tokens will be
    discarded, so a waiting sampler never hangs); the sampler calls `wait`. A row whose
    matcher is None (its request ended while the step was in flight) keeps the all-ones
    row: its token is dropped by the core anyway.
    """

    __slots__ = ("_ready", "bitmask", "fill_seconds", "rows")

    def __init__(self, rows: np.ndarray, words: int) -> None:
        self.rows = rows
        self.bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        self.fill_seconds = 0.0
        self._ready = threading.Event()

    @property
    def filled(self) -> bool:
        return self._ready.is_set()

    def fill(self, backend: GrammarBackend, matchers: Sequence[Matcher | None]) -> None:
        """Writes each live matcher's row (in one batched backend call), then wakes the
        sampler."""
        start = time.perf_counter()
        try:
            live = [i for i, m in enumerate(matchers) if m is not None]
            if len(live) == len(matchers):
                backend.fill(matchers, self.bitmask)  # type: ignore[arg-type]
            elif live:
                part = torch.full((len(live), self.bitmask.shape[1]), -1, dtype=torch.int32)
                backend.fill([matchers[i] for i in live], part)  # type: ignore[misc]
                self.bitmask[torch.as_tensor(live)] = part
        finally:
            self.fill_seconds = time.perf_counter() - start
            self._ready.set()

    def release(self) -> None:
        """Wakes the sampler without a mask (the step's tokens will not be used)."""
        self._ready.set()

    def wait(self) -> torch.Tensor:
        """The filled bitmask, once `fill` (or `release`) has run."""
        self._ready.wait()
        return self.bitmask


__all__ = ["StepMask"]
