"""What one step computes, as cost models see it: `StepShape`. The scheduling loop logs it
per step (`--step-log`) and `rsgl bench simulate`'s cost models price it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rsgl._core import Plan


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, as the cost models see it.

    `context_tokens` is the KV the step reads (every row's sequence length), and
    `attention_pairs` the query-key pairs it scores: a decode row scores its whole context,
    an extend row of `e` new tokens after a cached prefix `p` scores `e · (p + (e + 1) / 2)`.
    """

    batch_size: int
    new_tokens: int
    num_extends: int
    context_tokens: int
    prefix_tokens: int
    attention_pairs: float

    @classmethod
    def of(cls, plan: Plan) -> StepShape:
        n = plan.num_extends
        if n == 0:  # decode: one token per row, each scoring its whole context
            context = int(plan.seq_lens.sum())
            return cls(plan.batch_size, plan.num_tokens, 0, context, 0, float(context))
        extend = plan.extend_lens
        prefix = plan.prefix_lens
        pairs = float(np.dot(extend, prefix) + 0.5 * np.dot(extend, extend + 1))
        return cls(
            plan.batch_size,
            plan.num_tokens,
            n,
            int(plan.seq_lens.sum()),
            int(prefix[:n].sum()),
            pairs,
        )

    def features(self) -> list[float]:
        """LinearCost's feature vector (see FEATURES)."""
        return [
            1.0,
            float(self.batch_size),
            float(self.new_tokens),
            self.attention_pairs,
            float(self.num_extends),
            float(self.context_tokens),
        ]


def steps_of_log(lines: list[str]) -> tuple[list[StepShape], list[float]]:
    """Each line of a `--step-log`: its step's shape and seconds (the fields a speculating
    loop adds, and any other, are not the shape's and are left out)."""
    shapes, seconds = [], []
    for line in lines:
        step = json.loads(line)
        seconds.append(float(step["seconds"]))
        shapes.append(StepShape(**{f.name: step[f.name] for f in dataclasses.fields(StepShape)}))
    return shapes, seconds


def idles_of_log(lines: list[str]) -> list[float]:
    """Each line's `idle_s`: how long the device sat idle before its step (0 in logs written
    before the loop recorded it)."""
    return [float(json.loads(line).get("idle_s", 0.0)) for line in lines]


__all__ = ["StepShape", "idles_of_log", "steps_of_log"]
