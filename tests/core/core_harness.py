"""A fake executor for driving rsgl._core from tests without a model.

It does what the real executor does with a plan — applies the req_to_token writes, resolves
FutureMap placeholders, writes each computed token into its KV slot — and then checks that the
KV slots a request reads (its req_to_token row up to seq_len) hold exactly its prompt and
outputs. The fake model's output number i of request r is `fake_token(r, i)`: independent of
batching, caching and retraction, so any disturbance of a request's output is a core bug.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from rsgl._core import FUTURE_TOKEN, FinishReason, Outcome, Plan, Scheduler

VOCAB = 1000


def fake_token(rid: int, index: int) -> int:
    """Output `index` of request `rid` (never 0, which tests use as EOS unless asked)."""
    return 1 + (rid * 7919 + index * 104729 + (rid ^ index) * 31) % (VOCAB - 1)


@dataclass
class FakeExecutor:
    """Runs plans against a simulated KV cache and a deterministic fake model."""

    core: Scheduler
    max_running: int
    context_len: int
    prompts: dict[int, list[int]] = field(default_factory=dict)
    eos_at: dict[int, int] = field(default_factory=dict)  # rid -> output index that is EOS
    outputs: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[int, FinishReason] = field(default_factory=dict)
    plans: list[Plan] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.req_to_token = np.zeros((self.max_running, self.context_len), dtype=np.int64)
        self.kv_token = np.full(self.core.kv_buffer_size, -1, dtype=np.int64)
        self.future = np.zeros(self.max_running, dtype=np.int64)

    def add(self, rid: int, prompt: list[int], max_new_tokens: int, **kwargs: object) -> None:
        self.core.add_request(rid, np.asarray(prompt, dtype=np.int64), max_new_tokens, **kwargs)
        self.prompts[rid] = list(prompt)
        self.core.check()

    def model_token(self, rid: int, index: int) -> int:
        return 0 if self.eos_at.get(rid) == index else fake_token(rid, index)

    def expected_sequence(self, rid: int, length: int) -> list[int]:
        prompt = self.prompts[rid]
        return prompt[:length] + [self.model_token(rid, i) for i in range(length - len(prompt))]

    def execute(self, plan: Plan) -> np.ndarray:
        """The forward: returns one sampled token per request of the plan."""
        self.req_to_token[plan.write_rows, plan.write_cols] = plan.write_slots
        token_slots = np.repeat(plan.req_slots, plan.extend_lens)
        ids = plan.input_ids.copy()
        pending = ids == FUTURE_TOKEN
        ids[pending] = self.future[token_slots[pending]]
        assert (plan.out_cache_loc >= self.core.page_size).all(), "padding slot handed out"
        self.kv_token[plan.out_cache_loc] = ids
        sampled = np.zeros(plan.batch_size, dtype=np.int64)
        for i in range(plan.batch_size):
            rid, row, seq_len = int(plan.rids[i]), int(plan.req_slots[i]), int(plan.seq_lens[i])
            seen = self.kv_token[self.req_to_token[row, :seq_len]].tolist()
            assert seen == self.expected_sequence(rid, seq_len), f"request {rid} reads wrong KV"
            sampled[i] = self.model_token(rid, seq_len - len(self.prompts[rid]))
        self.future[plan.req_slots] = sampled
        return sampled

    def land(self, plan: Plan, sampled: np.ndarray) -> Outcome:
        outcome = self.core.commit(plan.id, sampled)
        self.core.check()
        for rid, tok in zip(outcome.rids.tolist(), outcome.tokens.tolist(), strict=True):
            self.outputs[rid].append(tok)
        for f in outcome.finished:
            assert f.rid not in self.finished, f"request {f.rid} reported twice"
            self.finished[f.rid] = f.finish_reason
        return outcome

    def run(self, overlap: bool = False, steps_limit: int | None = None) -> int:
        """Steps until nothing is left (or `steps_limit` steps, then lands what is in flight);
        with `overlap`, plans step N+1 before landing step N."""
        inflight: list[tuple[Plan, np.ndarray]] = []
        steps, max_steps = 0, 100_000
        while (self.core.has_work or inflight) and steps != steps_limit:
            plan = self.core.schedule()
            self.core.check()
            self.plans.append(plan)
            if plan.forward_mode != "idle":
                self.assert_no_slot_reuse_in_flight(plan, [p for p, _ in inflight])
                inflight.append((plan, self.execute(plan)))
            keep = 1 if overlap and plan.forward_mode != "idle" else 0
            while len(inflight) > keep:
                self.land(*inflight.pop(0))
            steps += 1
            assert steps < max_steps, f"no progress: {self.core.stats()}"
        while inflight:
            self.land(*inflight.pop(0))
        return steps

    @staticmethod
    def assert_no_slot_reuse_in_flight(plan: Plan, inflight: list[Plan]) -> None:
        """A request slot an in-flight step still uses must not go to another request."""
        owner = {}
        for p in inflight:
            owner.update(zip(p.req_slots.tolist(), p.rids.tolist(), strict=True))
        for slot, rid in zip(plan.req_slots.tolist(), plan.rids.tolist(), strict=True):
            assert owner.get(slot, rid) == rid, f"slot {slot} reused by {rid} while in flight"

    def assert_outputs_undisturbed(self) -> None:
        for rid, out in self.outputs.items():
            assert out == [self.model_token(rid, i) for i in range(len(out))], rid
