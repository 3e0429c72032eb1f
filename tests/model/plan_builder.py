"""Hand-built plans for model tests: what the scheduling core would produce, from lists."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rsgl._core import Plan
from rsgl.model_executor.model_runner import ModelRunner, StepOutput
from rsgl.sampling_params import SamplingParams


@dataclass
class Work:
    """One request's part of a step: compute `input_ids` after `prefix_len` cached tokens."""

    req_slot: int
    prefix_len: int
    input_ids: list[int]
    kv_slots: list[int]


def build_plan(works: list[Work]) -> Plan:
    """Lay requests out in the given order (callers put extends before decodes)."""
    lens = [len(w.input_ids) for w in works]
    if all(n == 1 and w.prefix_len > 0 for n, w in zip(lens, works, strict=True)):
        mode = "decode"
    elif any(n == 1 and w.prefix_len > 0 for n, w in zip(lens, works, strict=True)):
        mode = "mixed"
    else:
        mode = "extend"

    def arr(xs: list[int]) -> np.ndarray:
        return np.asarray(xs, dtype=np.int64)

    positions = [w.prefix_len + i for w in works for i in range(len(w.input_ids))]
    decodes = sum(n == 1 and w.prefix_len > 0 for n, w in zip(lens, works, strict=True))
    return Plan(
        forward_mode=mode,
        num_extends=len(works) - decodes,
        rids=arr(list(range(len(works)))),
        req_slots=arr([w.req_slot for w in works]),
        prefix_lens=arr([w.prefix_len for w in works]),
        extend_lens=arr(lens),
        seq_lens=arr([w.prefix_len + n for w, n in zip(works, lens, strict=True)]),
        input_ids=arr([t for w in works for t in w.input_ids]),
        positions=arr(positions),
        out_cache_loc=arr([s for w in works for s in w.kv_slots]),
        write_rows=arr([w.req_slot for w in works for _ in w.kv_slots]),
        write_cols=arr(positions),
        write_slots=arr([s for w in works for s in w.kv_slots]),
    )


@dataclass
class Sequence:
    """A request's tokens and the KV slots holding them."""

    req_slot: int
    tokens: list[int]
    kv_slots: list[int] = field(default_factory=list)

    @property
    def cached(self) -> int:
        return len(self.kv_slots)


class Driver:
    """Allocates KV slots (slot 0 reserved as padding) and runs hand-built steps."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_slot = 1

    def alloc(self, n: int) -> list[int]:
        slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        assert self.next_slot <= self.runner.kv_cache.size, "test KV pool exhausted"
        return slots

    def reset(self) -> None:
        self.next_slot = 1

    def admit(
        self, req_slot: int, tokens: list[int], params: SamplingParams | None = None
    ) -> Sequence:
        """A new request in `req_slot` (greedy unless `params` say otherwise)."""
        self.runner.admit(req_slot, params or SamplingParams(temperature=0.0), tokens)
        return Sequence(req_slot, list(tokens))

    def work(self, seq: Sequence, n: int) -> Work:
        """The next `n` uncomputed tokens of `seq` (allocating their slots)."""
        start = seq.cached
        new = self.alloc(n)
        seq.kv_slots += new
        return Work(seq.req_slot, start, seq.tokens[start : start + n], new)

    def run(self, works: list[Work], return_logits: bool = True) -> StepOutput:
        return self.runner.step(build_plan(works), return_logits=return_logits)

    def greedy(
        self,
        seq: Sequence,
        new_tokens: int,
        chunk: int | None = None,
        forced: list[int] | None = None,
    ) -> tuple[list[int], list[np.ndarray]]:
        """Prefill (in chunks of `chunk`) then decode; returns tokens and per-token logits.
        With `forced`, token i fed back is forced[i] (the returned tokens stay the argmax)."""
        remaining = len(seq.tokens) - seq.cached
        out = None
        while remaining:
            n = min(remaining, chunk or remaining)
            out = self.run([self.work(seq, n)])
            remaining -= n
        assert out is not None and out.logits is not None
        tokens: list[int] = []
        logits: list[np.ndarray] = []
        for i in range(new_tokens):
            assert out.logits is not None
            logits.append(out.logits[0].numpy().copy())
            token = int(out.next_token_ids[0])
            tokens.append(token)
            seq.tokens.append(token if forced is None else forced[i])
            if i + 1 < new_tokens:
                out = self.run([self.work(seq, 1)])
        return tokens, logits
