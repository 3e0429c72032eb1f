"""rsgl.Engine(dp_size=2): two scheduler processes driven through the server's frontend, with
the same answers as the in-process engine (greedy tokens, streaming, async, errors), the
controls mapped onto every rank, and no process left behind by shutdown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import rsgl
from rsgl.engine import Engine
from rsgl.errors import InvalidRequest

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
PROMPTS = [
    "Write one sentence about the ocean.",
    "Q: What do you know about prime numbers?\nA:",
    "An old lighthouse is",
    "List three facts about coffee:\n1.",
    "The moon landing was",
    "Write one sentence about a lost key.",
]
# float32: greedy tokens are then the same bit for bit however requests are batched.
OPTIONS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 16384}


@pytest.fixture(scope="module")
def one_rank() -> list[dict[str, Any]]:
    with rsgl.Engine(**OPTIONS) as llm:
        outs: list[dict[str, Any]] = llm.generate(PROMPTS, GREEDY)
        return outs


@pytest.fixture(scope="module")
def expected(one_rank: list[dict[str, Any]]) -> list[list[int]]:
    return [o["output_ids"] for o in one_rank]


@pytest.fixture(scope="module")
def dp2() -> Iterator[Engine]:
    llm = rsgl.Engine(dp_size=2, load_balance_method="total_requests", **OPTIONS)
    yield llm
    llm.shutdown()


def rank_requests(llm: Engine) -> list[int]:
    return [int(s["requests"]) for s in llm.get_server_info()["internal_states"]]


def test_two_ranks_give_the_one_rank_greedy_tokens(
    dp2: Engine, one_rank: list[dict[str, Any]]
) -> None:
    before = rank_requests(dp2)
    outs = dp2.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in one_rank]
    assert [o["text"] for o in outs] == [o["text"] for o in one_rank]
    finishes = [o["meta_info"]["finish_reason"] for o in outs]
    assert finishes == [o["meta_info"]["finish_reason"] for o in one_rank]
    moved = [a - b for a, b in zip(rank_requests(dp2), before, strict=True)]
    assert sum(moved) == len(PROMPTS) and all(m > 0 for m in moved), moved
    dp2.check_integrity()


def test_streaming_async_and_n_copies_match(dp2: Engine, expected: list[list[int]]) -> None:
    chunks = list(dp2.generate(PROMPTS[0], GREEDY, stream=True))
    assert sum((c["output_ids"] for c in chunks), []) == expected[0]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 24

    async def run() -> tuple[Any, str]:
        whole = await dp2.async_generate(PROMPTS[1], GREEDY)
        stream = await dp2.async_generate(PROMPTS[1], GREEDY, stream=True)
        return whole, "".join([c["text"] async for c in stream])

    whole, streamed = asyncio.run(run())
    assert whole["output_ids"] == expected[1] and streamed == whole["text"]
    # n copies share their prompt: they go to one rank together.
    before = rank_requests(dp2)
    copies = dp2.generate(PROMPTS[2], dict(GREEDY, n=4))
    assert [c["output_ids"] for c in copies] == [expected[2]] * 4
    moved = sorted(a - b for a, b in zip(rank_requests(dp2), before, strict=True))
    assert moved == [0, 4]


def test_errors_abort_flush_and_server_info_behave_as_with_one_rank(dp2: Engine) -> None:
    with pytest.raises(InvalidRequest) as bad:
        dp2.generate("Hi", {"temperature": -1})
    assert bad.value.param == "temperature"
    assert dp2.abort("no-such-request") is False
    stream = dp2.generate("Count to one thousand:", {"max_new_tokens": 400}, stream=True, rid="r")
    first = next(stream)
    assert dp2.abort("r") is True
    rest = list(stream)
    assert (rest[-1] if rest else first)["meta_info"]["finish_reason"]["type"] == "abort"
    # The rank frees the aborted request after its step in flight; then the flush goes.
    for _ in range(200):
        if dp2.flush_cache():
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"never flushed: {dp2.get_server_info()['internal_states']}")
    assert all(s["evictable"] == 0 for s in dp2.get_server_info()["internal_states"])
    info = dp2.get_server_info()
    assert info["dp_size"] == 2 and info["dtype"] == "float32"
    assert info["speculative_algorithm"] is None  # auto's choice, from rank 0's facts
    assert info["max_total_tokens"] == 16384 and info["context_length"] == 8192
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    assert info["stats"]["requests"] == sum(s["requests"] for s in info["internal_states"])
    assert {"running", "waiting", "evictable", "cached_tokens"} <= set(info["stats"])
    dp2.check_integrity()


def scheduler_children() -> set[int]:
    """This process's children that multiprocessing spawned (not its resource tracker)."""
    children = psutil.Process().children(recursive=True)
    return {c.pid for c in children if "spawn_main" in " ".join(c.cmdline())}


def test_shutdown_leaves_no_scheduler_process() -> None:
    before = scheduler_children()  # the module's engine, if it still runs
    llm = rsgl.Engine(dp_size=2, load_format="null", null_step_ms=1.0, max_total_tokens=4096)
    pids = {int(s["scheduler_pid"]) for s in llm.get_server_info()["internal_states"]}
    assert scheduler_children() - before == pids
    assert llm.generate("Hello", {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert scheduler_children() == before
