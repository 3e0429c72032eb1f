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
    from rsgl.layers.vocab_mask import VocabMask
    from rsgl.models.config import ModelConfig
    from rsgl.sampling_params import SamplingParams


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: uint64 -> well-spread uint64 (element-wise)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


class NullRunner:
    """A token for every row of a plan, `step_ms` after the plan arrives.

    The token at each position is a hash of (seed, the request's prompt, the position), so
    a request's output does not depend on how it was batched, chunked, cached or retracted:
    every scheduling option must give the same text, which makes the null model a test
    oracle as well as a benchmark. Ids avoid the model's EOS ids, so a request runs to its
    length unless its own stop conditions end it.
    """

    def __init__(
        self, config: ModelConfig, *, max_running_requests: int, step_ms: float = 0.0, seed: int = 0
    ) -> None:
        self.config = config
        self.device = torch.device("cpu")
        self.step_s = step_ms / 1000
        self._seed = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
        self._keys = np.zeros(max_running_requests, dtype=np.uint64)  # per request slot
        eos = np.asarray(sorted(set(config.eos_token_ids)), dtype=np.int64)
        self._eos = eos[(eos >= 0) & (eos < config.vocab_size)]
        self._high = np.uint64(config.vocab_size - len(self._eos))

    def admit(
        self,
        req_slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None:
        """The slot's key: a hash of the prompt (whatever was generated before is implied)."""
        ids = np.asarray(prompt_ids, dtype=np.uint64)
        with np.errstate(over="ignore"):
            weights = _mix(np.arange(1, len(ids) + 1, dtype=np.uint64))
            self._keys[req_slot] = _mix(np.bitwise_xor.reduce(_mix(ids ^ weights)) ^ self._seed)

    def prepare(self, plan: Plan) -> Plan:
        """Nothing to copy: the plan is the input."""
        return plan

    def execute(self, plan: Plan, *, vocab_mask: VocabMask | None = None) -> StepOutput:
        """`step(plan, vocab_mask)`."""
        return self.step(plan, vocab_mask)

    def step(self, plan: Plan, vocab_mask: VocabMask | None = None) -> StepOutput:
        """One token per row of `plan` (the core ignores rows that do not sample). A row
        under a grammar mask takes the allowed token its hash picks among the allowed ones
        (EOS included: a grammar ends with it), so constrained outputs stay in the grammar
        and as independent of batching as free ones."""
        if self.step_s > 0:
            time.sleep(self.step_s)
        positions = plan.seq_lens.astype(np.uint64)
        with np.errstate(over="ignore"):
            h = _mix(self._keys[plan.req_slots] ^ _mix(positions))
        ids = (h % self._high).astype(np.int64)
        for e in self._eos:  # ascending, so each shift sees the ids already moved past
            ids += ids >= e
        if vocab_mask is not None:
            bitmask = vocab_mask.wait().numpy()
            vocab = self.config.vocab_size
            for i, row in enumerate(vocab_mask.rows.tolist()):
                bits = np.unpackbits(bitmask[i].view(np.uint8), bitorder="little")[:vocab]
                allowed = np.flatnonzero(bits)
                if len(allowed):
                    ids[row] = allowed[int(h[row] % np.uint64(len(allowed)))]
        return StepOutput(SampleOutput(torch.from_numpy(ids)))
