"""`rsgl serve --dp-size 2`: two scheduler processes behind one frontend. Concurrent traffic
is split over both (constrained requests too, each rank compiling and masking its own), a
shared-prefix workload under `cache_aware` keeps each prefix on one rank (and caches as much
as one replica does), an abort reaches the rank serving the request, and a rank that dies
fails only its own requests while the other keeps serving.

The ranks run the null executor (`--load-format null`, a fixed step time): real scheduling
and tokenization, no model math, so two ranks fit the test machine's two cores."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from launcher import launch, stop
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"
NULL = ("--load-format", "null", "--null-step-ms", "10")
GROUPS, PER_GROUP, PREFIX_LEN, SUFFIX_LEN = 4, 8, 256, 16


class Server:
    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("dp2") / "server.log"
    flags = ("--dp-size", "2", "--load-balance-method", "cache_aware", "--log-requests")
    proc, url = launch(log, *NULL, *flags)
    yield Server(url, log)
    stop(proc, log)


def ranks(url: str) -> list[dict[str, Any]]:
    """Each rank's latest statistics (sent every second), with its pid and liveness."""
    states: list[dict[str, Any]] = httpx.get(f"{url}/server_info", timeout=10).json()[
        "internal_states"
    ]
    return states


def wait_ranks(url: str, check: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 15
    while True:
        states = ranks(url)
        if check(states):
            return states
        if time.monotonic() > deadline:
            pytest.fail(f"the ranks never got there: {states}")
        time.sleep(0.2)


def metric_samples(url: str, name: str) -> list[Any]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_64_concurrent_requests_complete_split_over_both_ranks(dp2: Server) -> None:
    before = wait_ranks(dp2.url, lambda rs: all("requests" in r for r in rs))
    client = openai.AsyncOpenAI(base_url=f"{dp2.url}/v1", api_key="none", max_retries=0)

    async def burst() -> list[Any]:
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL, prompt=f"Request {i}: {'abcd'[i % 4] * (i + 1)}", max_tokens=8
                )
                for i in range(64)
            )
        )

    done = asyncio.run(burst())
    assert len(done) == 64
    assert all(c.usage is not None and c.usage.completion_tokens > 0 for c in done)

    def moved(rs: list[dict[str, Any]]) -> list[int]:
        return [int(r["requests"]) - int(b["requests"]) for r, b in zip(rs, before, strict=True)]

    after = wait_ranks(dp2.url, lambda rs: sum(moved(rs)) == 64)
    assert all(m > 0 for m in moved(after)), moved(after)
    # Each rank's gauges carry its dp_rank.
    running = metric_samples(dp2.url, "rsgl_num_running_reqs")
    assert sorted(s.labels["dp_rank"] for s in running) == ["0", "1"]
    (alive,) = metric_samples(dp2.url, "rsgl_dp_ranks_alive")
    assert alive.value == 2
    loads = httpx.get(f"{dp2.url}/get_load", timeout=10).json()
    assert [load["dp_rank"] for load in loads] == [0, 1]


def shared_prefix_requests() -> list[tuple[str, list[int]]]:
    """GROUPS prefixes of PREFIX_LEN tokens, PER_GROUP prompts each (a distinct suffix)."""
    rng = random.Random(14)
    out = []
    for g in range(GROUPS):
        prefix = [rng.randrange(1000, 40000) for _ in range(PREFIX_LEN)]
        for i in range(PER_GROUP):
            out.append((f"g{g}-{i}", prefix + [rng.randrange(1000, 40000) for _ in range(16)]))
    return out


def run_shared_prefix(url: str) -> dict[str, int]:
    """Sends the workload: each group's first prompt alone (it fills the cache), then the
    rest at once. Returns each request's cached tokens."""
    requests = shared_prefix_requests()

    async def one(client: httpx.AsyncClient, rid: str, ids: list[int]) -> tuple[str, int]:
        body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 4}}
        resp = await client.post(f"{url}/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return rid, int(resp.json()["meta_info"]["cached_tokens"])

    async def workload() -> dict[str, int]:
        async with httpx.AsyncClient() as client:
            firsts = [r for r in requests if r[0].endswith("-0")]
            cached = [await one(client, rid, ids) for rid, ids in firsts]
            rest = [r for r in requests if not r[0].endswith("-0")]
            cached += await asyncio.gather(*(one(client, rid, ids) for rid, ids in rest))
            return dict(cached)

    return asyncio.run(workload())


@pytest.fixture
def one_replica(tmp_path: Path) -> Iterator[str]:
    log = tmp_path / "server.log"
    proc, url = launch(log, *NULL)
    yield url
    stop(proc, log)


def test_cache_aware_keeps_each_prefix_group_on_one_rank(dp2: Server, one_replica: str) -> None:
    cached = run_shared_prefix(dp2.url)
    # Where each request went: the frontend logs it (--log-requests).
    sent = re.findall(r"request (g\d+)-\d+: \d+ prompt tokens, rank (\d)", dp2.log.read_text())
    assert len(sent) == GROUPS * PER_GROUP
    groups: dict[str, set[str]] = {}
    for group, rank in sent:
        groups.setdefault(group, set()).add(rank)
    assert len(groups) == GROUPS and all(len(r) == 1 for r in groups.values()), groups
    assert set().union(*groups.values()) == {"0", "1"}  # the groups are spread over both
    single = run_shared_prefix(one_replica)
    assert sum(single.values()) >= (GROUPS * (PER_GROUP - 1)) * PREFIX_LEN
    assert sum(cached.values()) >= sum(single.values()), (cached, single)


# Bounded JSON (so a walk over the null model's allowed tokens ends), a regex and EBNF.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
CODE = r"[A-Z]{2}-\d{3}"
EBNF = 'root ::= "yes" | "no" | "maybe"'


def constrained_body(i: int) -> dict[str, Any]:
    kind = [("json_schema", json.dumps(PERSON)), ("regex", CODE), ("ebnf", EBNF)][i % 3]
    params = {kind[0]: kind[1], "max_new_tokens": 256, "temperature": 0}
    return {"text": f"Constrained request {i}:", "rid": f"gram-{i}", "sampling_params": params}


def run_constrained(url: str, count: int) -> dict[str, dict[str, Any]]:
    """`count` constrained /generate requests at once, by rid."""

    async def burst() -> list[dict[str, Any]]:
        async with httpx.AsyncClient() as client:
            posts = [
                client.post(f"{url}/generate", json=constrained_body(i), timeout=120)
                for i in range(count)
            ]
            responses = await asyncio.gather(*posts)
        for r in responses:
            assert r.status_code == 200, r.text
        return [r.json() for r in responses]

    return {f"gram-{i}": out for i, out in enumerate(asyncio.run(burst()))}


def test_constrained_requests_on_both_ranks_validate_and_match_one_replica(
    dp2: Server, one_replica: str
) -> None:
    before = wait_ranks(dp2.url, lambda rs: all("requests" in r for r in rs))
    outs = run_constrained(dp2.url, 24)
    for i, out in enumerate(outs.values()):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        if i % 3 == 0:
            jsonschema.validate(json.loads(out["text"]), PERSON)
        elif i % 3 == 1:
            assert re.fullmatch(CODE, out["text"]), out["text"]
        else:
            assert out["text"] in ("yes", "no", "maybe"), out["text"]

    def moved(rs: list[dict[str, Any]]) -> list[int]:
        return [int(r["requests"]) - int(b["requests"]) for r, b in zip(rs, before, strict=True)]

    after = wait_ranks(dp2.url, lambda rs: sum(moved(rs)) == 24)
    assert all(m > 0 for m in moved(after)), moved(after)
    # The null model's tokens hang on the prompt and position only, so whichever rank ran a
    # request, its constrained tokens are those one replica gives.
    single = run_constrained(one_replica, 24)
    assert {r: o["output_ids"] for r, o in outs.items()} == {
        r: o["output_ids"] for r, o in single.items()
    }
    idle = wait_ranks(dp2.url, lambda rs: all(int(r["live"]) == 0 for r in rs))
    for rank in idle:
        assert rank["held"] == 0 and rank["protected"] == 0, rank
        assert rank["grammar_waiting"] == 0 and rank["grammar_mask_fills"] > 0, rank


class Stream:
    """A long streaming /generate in a thread: its events land in `events`; setting
    `disconnect` makes the client hang up."""

    def __init__(self, url: str, rid: str, dp_rank: int | None = None) -> None:
        self.events: list[Any] = []
        self.disconnect = threading.Event()
        started = threading.Event()
        body: dict[str, Any] = {
            "text": "Tell me a very long story.",
            "rid": rid,
            "stream": True,
            "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True},
        }
        if dp_rank is not None:
            body["data_parallel_rank"] = dp_rank

        def run() -> None:
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[6:]))
                        started.set()
                    if self.disconnect.is_set():
                        return
            started.set()

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert started.wait(30)

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive()


def running(states: list[dict[str, Any]]) -> list[int]:
    return [int(r.get("running", -1)) for r in states]


def test_an_abort_reaches_the_rank_serving_the_request(dp2: Server) -> None:
    wait_ranks(dp2.url, lambda rs: running(rs) == [0, 0])
    on0 = Stream(dp2.url, "long-0", dp_rank=0)
    on1 = Stream(dp2.url, "long-1", dp_rank=1)
    wait_ranks(dp2.url, lambda rs: running(rs) == [1, 1])
    resp = httpx.post(f"{dp2.url}/abort_request", json={"rid": "long-1"}, timeout=10)
    assert resp.json() == {"aborted": True}
    on1.join()
    assert on1.events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    # Rank 1 freed it (nothing running or held there); rank 0's request runs on.
    wait_ranks(dp2.url, lambda rs: running(rs) == [1, 0] and int(rs[1]["live"]) == 0)
    # A client that hangs up aborts its request on its rank too.
    on0.disconnect.set()
    on0.join()
    wait_ranks(dp2.url, lambda rs: running(rs) == [0, 0] and int(rs[0]["live"]) == 0)


def test_a_dead_rank_fails_its_requests_and_the_other_keeps_serving(dp2: Server) -> None:
    wait_ranks(dp2.url, lambda rs: running(rs) == [0, 0])
    doomed = Stream(dp2.url, "doomed")  # the dispatcher picks its rank
    states = wait_ranks(dp2.url, lambda rs: sorted(running(rs)) == [0, 1])
    rank = running(states).index(1)
    pid = int(states[rank]["scheduler_pid"])
    os.kill(pid, signal.SIGKILL)
    doomed.join()
    error = doomed.events[-1]["error"]
    assert error["code"] == 503 and f"data-parallel rank {rank} died" in error["message"]

    client = openai.OpenAI(base_url=f"{dp2.url}/v1", api_key="none", max_retries=0)
    for i in range(8):
        out = client.completions.create(model=MODEL, prompt=f"After {i}", max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens > 0

    health = httpx.get(f"{dp2.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {
        "status": "degraded",
        "dp_size": 2,
        "dp_ranks_alive": 1,
        "dead_dp_ranks": [{"dp_rank": rank, "exit_code": -9}],
    }
    info = httpx.get(f"{dp2.url}/server_info", timeout=10).json()
    assert info["dp_ranks_alive"] == 1
    assert info["internal_states"][rank]["alive"] is False
    assert [load["dp_rank"] for load in httpx.get(f"{dp2.url}/get_load").json()] == [1 - rank]
    (alive,) = metric_samples(dp2.url, "rsgl_dp_ranks_alive")
    assert alive.value == 1
    log = dp2.log.read_text()
    assert (
        f"the scheduler process exited unexpectedly (exit code -9): data-parallel rank {rank} "
        f"(pid {pid}); 1 request(s) on it failed; 1 of 2 rank(s) left" in log
    )


def test_per_rank_metrics_carry_dp_rank_and_a_dead_rank_leaves() -> None:
    from rsgl.server.metrics import ServerMetrics

    metrics = ServerMetrics(MODEL, "sglang", dp_size=2)
    load = {"capacity": 100, "available": 50, "evictable": 10, "prompt_tokens": 8}
    for rank, running in ((0, 3), (1, 5)):
        stats = dict(load, running=running, waiting=0, cached_tokens=4, retractions=rank)
        metrics.observe_stats(stats, rank)

    def samples(name: str) -> dict[str, float]:
        text = metrics.render().decode()
        families = text_string_to_metric_families(text)
        found = [s for f in families for s in f.samples if s.name == name]
        return {s.labels["dp_rank"]: s.value for s in found}

    assert samples("rsgl_num_running_reqs") == {"0": 3, "1": 5}
    assert samples("sglang:num_running_reqs") == {"0": 3, "1": 5}
    assert samples("rsgl_retractions_total") == {"1": 1}
    metrics.rank_died(1, alive=1)
    assert samples("rsgl_num_running_reqs") == {"0": 3}
    assert samples("sglang:num_running_reqs") == {"0": 3}


def test_data_parallel_over_several_nodes_is_refused_with_the_alternative() -> None:
    from rsgl.args import EngineArgs
    from rsgl.server.ranks import check_data_parallel

    multi = EngineArgs(dp_size=2, tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500")
    with pytest.raises(ValueError, match="sglang-router"):
        check_data_parallel(multi)
    check_data_parallel(EngineArgs(dp_size=2, tp_size=2))
