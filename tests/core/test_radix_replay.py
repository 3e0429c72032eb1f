"""benches/radix_replay.py's replay of the shared-prefix trace gives SGLang's RadixCache counts.

`matched_tokens` and `evicted_tokens` depend only on the replay semantics
(../shared/traces/README.md), so any change to matching, insertion, LRU order or eviction
that moves them is a behaviour change, however fast it makes the replay."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benches" / "radix_replay.py"
# CI clones the repository next to ../shared.
TRACE = ROOT.parent / "shared" / "traces" / "gsp.jsonl.gz"

Trace = tuple[int, list[tuple[np.ndarray, int]]]


@pytest.fixture(scope="module")
def replay_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_radix_replay", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trace(replay_module: ModuleType) -> Trace:
    if not TRACE.is_file():
        pytest.skip(f"no trace at {TRACE} (the shared folder sits beside the repository)")
    loaded: Trace = replay_module.load(str(TRACE))
    return loaded


@pytest.mark.parametrize(
    ("page_size", "pool_tokens", "matched_tokens", "evicted_tokens"),
    [
        # The trace's own pool (131,072 tokens): SGLang's figures.
        (1, None, 451425, 67943),
        (16, None, 445920, 67840),
        # Shrunk until about 400 tokens are evicted per request.
        (1, 32768, 300784, 317460),
    ],
)
def test_the_replay_matches_and_evicts_sglangs_token_counts(
    replay_module: ModuleType,
    trace: Trace,
    page_size: int,
    pool_tokens: int | None,
    matched_tokens: int,
    evicted_tokens: int,
) -> None:
    trace_pool, requests = trace
    assert trace_pool == 131072
    result = replay_module.replay(pool_tokens or trace_pool, requests, page_size)
    counts = {k: result[k] for k in ("requests", "skipped", "matched_tokens", "evicted_tokens")}
    assert counts == {
        "requests": 768,
        "skipped": 0,
        "matched_tokens": matched_tokens,
        "evicted_tokens": evicted_tokens,
    }
