"""Simulated traffic: token-id prompts, output lengths and arrival times.

The simulator needs no text, so prompts are token ids drawn from a seeded generator, with
the shapes of `rsgl bench serving`'s datasets: `random` (fixed input and output lengths),
`gsp` (groups sharing a system prompt, interleaved), and a recorded `trace` in the format of
`../shared/traces` (a JSONL file, gzipped or not: `{"prompt": [...], "output": [...]}` per
line, a header line without a prompt skipped; a `"timestamp"` in seconds, when lines carry
one, is the arrival time). Prompts are made lazily in arrival order, so an hour of traffic
never sits in memory at once.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Prompt ids are drawn from [LOW_ID, vocab): low ids are special tokens in most vocabularies.
LOW_ID = 10


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The dataset options of `rsgl bench simulate` (as `rsgl bench serving`'s)."""

    dataset: str = "random"
    num_prompts: int = 128
    random_input_len: int = 100
    random_output_len: int = 128
    gsp_num_groups: int = 16
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 1024
    gsp_question_len: int = 128
    gsp_output_len: int = 128
    trace: str | None = None
    vocab_size: int = 32000
    seed: int = 0


@dataclass(slots=True)
class Workload:
    """`arrivals[i]` (seconds) and `requests()`, yielding `(prompt_ids, output_len)` in
    arrival order."""

    arrivals: np.ndarray
    spec: WorkloadSpec
    # Recorded requests (a trace, or given by the caller), repeated if there are more arrivals.
    recorded: list[tuple[np.ndarray, int]] | None = None

    def __len__(self) -> int:
        return len(self.arrivals)

    def requests(self) -> Iterator[tuple[np.ndarray, int]]:
        s = self.spec
        rng = np.random.default_rng(s.seed)
        n = len(self.arrivals)
        if self.recorded is not None:
            for i in range(n):
                yield self.recorded[i % len(self.recorded)]
        elif s.dataset == "random":
            for _ in range(n):
                yield rng.integers(LOW_ID, s.vocab_size, s.random_input_len), s.random_output_len
        elif s.dataset == "gsp":
            groups = s.gsp_num_groups
            systems = rng.integers(LOW_ID, s.vocab_size, (groups, s.gsp_system_prompt_len))
            per_round = np.repeat(np.arange(groups), s.gsp_prompts_per_group)
            order = np.empty(0, dtype=np.int64)
            for i in range(n):
                if i % len(per_round) == 0:
                    order = rng.permutation(per_round)
                question = rng.integers(LOW_ID, s.vocab_size, s.gsp_question_len)
                group = order[i % len(per_round)]
                yield np.concatenate([systems[group], question]), s.gsp_output_len
        else:
            raise ValueError(f"unknown dataset {s.dataset!r}")


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """`n` arrival times of a Poisson process of `rate` per second, the first at 0 (as
    `rsgl bench serving` sends them; all at 0 when the rate is inf)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def read_trace(path: str | Path) -> tuple[list[tuple[np.ndarray, int]], np.ndarray | None]:
    """A trace's requests, and its arrival times when every line has a timestamp."""
    opener = gzip.open if str(path).endswith(".gz") else open
    requests: list[tuple[np.ndarray, int]] = []
    stamps: list[float] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "prompt" not in record:
                continue  # the header
            output = record.get("output")
            out_len = len(output) if isinstance(output, list) else int(record["output_len"])
            requests.append((np.asarray(record["prompt"], dtype=np.int64), out_len))
            if "timestamp" in record:
                stamps.append(float(record["timestamp"]))
    times = None
    if stamps and len(stamps) == len(requests):
        times = np.asarray(stamps) - stamps[0]
    return requests, times


def make_workload(spec: WorkloadSpec, rate: float, duration_s: float | None = None) -> Workload:
    """The requests of `spec` arriving at `rate` (Poisson, seeded) or at the trace's own
    times. With `duration_s` (and a finite rate) as many requests as arrive in that time."""
    if spec.dataset == "trace":
        if spec.trace is None:
            raise ValueError("--dataset trace needs --trace FILE")
        requests, stamps = read_trace(spec.trace)
        if stamps is not None:
            return Workload(stamps, spec, requests)
        return Workload(poisson_arrivals(len(requests), rate, spec.seed), spec, requests)
    n = spec.num_prompts
    if spec.dataset == "gsp":
        n = spec.gsp_num_groups * spec.gsp_prompts_per_group
    if duration_s is not None and not math.isinf(rate):
        n = max(1, int(rate * duration_s))
    return Workload(poisson_arrivals(n, rate, spec.seed), spec)
