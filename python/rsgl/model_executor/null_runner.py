"""A model runner that does no math: the loop's own cost, measured without a forward.

`NullRunner` takes the same plans as `ModelRunner` and returns seeded-random token ids at
once, or after a fixed `step_ms` that stands in for an accelerator's forward (a sleep, which
releases the GIL as a kernel launch would). Everything around the forward (the core, the
loop, detokenization, stop strings, delivery, IPC) runs for real; `load_format="null"`
selects it (`rsgl.Engine`, `rsgl serve --load-format null`, the benches).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from rsgl.layers.sampler import SampleOutput
from rsgl.model_executor.model_runner import StepOutput

if TYPE_CHECKING:
    from rsgl._core import Plan
    from rsgl.models.config import ModelConfig
    from rsgl.sampling_params import SamplingParams


class NullRunner:
    """Seeded-random tokens for every sampled row of a plan, `step_ms` after it arrives.

    Token ids avoid the model's EOS ids, so a request runs to its length unless its own
    stop conditions end it: the work per step is what the plan says, not luck.
    """

    def __init__(self, config: ModelConfig, *, step_ms: float = 0.0, seed: int = 0) -> None:
        self.config = config
        self.step_s = step_ms / 1000
        self._rng = np.random.default_rng(seed)
        eos = np.asarray(sorted(config.eos_token_ids), dtype=np.int64)
        # Draw from [0, vocab - len(eos)) and shift past each EOS id: uniform over the rest.
        self._eos = eos[(eos >= 0) & (eos < config.vocab_size)]
        self._high = config.vocab_size - len(self._eos)

    def admit(
        self,
        req_slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None:
        """Nothing to set up: the null model keeps no per-request state."""

    def step(self, plan: Plan) -> StepOutput:
        """One token per request of `plan` (the core ignores rows that do not sample)."""
        if self.step_s > 0:
            time.sleep(self.step_s)
        ids = self._rng.integers(0, self._high, size=len(plan.rids), dtype=np.int64)
        for e in self._eos:  # ascending, so each shift sees the ids already moved past
            ids += ids >= e
        return StepOutput(SampleOutput(torch.from_numpy(ids)))
