"""The whole stack (core, loop, output path) over the null executor, across the core's
options. The null model's tokens depend only on (prompt, position), so every option must
give exactly the same outputs: batching, chunking, caching, retraction and overlap are
invisible to a request, or they are broken."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rsgl.engine import Engine
from rsgl.scheduler.loop import MAX_CONSECUTIVE_STEP_FAILURES, StepFailed

PROMPTS = 24
BASELINE: dict[str, Any] = {"disable_overlap_schedule": True, "disable_radix_cache": True}
# A pool too small for everyone's outputs: decode retracts requests and resumes them.
RETRACTING: dict[str, Any] = {
    "max_total_tokens": 400,
    "chunked_prefill_size": 64,
    "schedule_conservativeness": 0.05,
}
OPTIONS: dict[str, dict[str, Any]] = {
    "overlap": {},
    "radix": {"disable_overlap_schedule": True},
    "no-radix": {"disable_radix_cache": True},
    "chunked": {"chunked_prefill_size": 16},
    "mixed": {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    "paged": {"page_size": 16},
    "small-batch": {"max_running_requests": 3},
    "retraction": RETRACTING,
    "retraction-no-overlap": {**RETRACTING, "disable_overlap_schedule": True},
    "lpm": {"schedule_policy": "lpm"},
}


def requests() -> tuple[list[list[int]], list[dict[str, Any]]]:
    rng = np.random.default_rng(7)
    shared = rng.integers(1000, 40000, size=40).tolist()
    prompts, params = [], []
    for i in range(PROMPTS):
        tail = rng.integers(1000, 40000, size=int(rng.integers(5, 60))).tolist()
        prompts.append(shared + tail if i % 2 else tail)
        p: dict[str, Any] = {"max_new_tokens": int(rng.integers(1, 48))}
        if i % 5 == 0:
            p["stop"] = ["e"]  # a stop string the random text will meet
        if i % 7 == 0:
            p["min_new_tokens"] = min(3, p["max_new_tokens"])
        params.append(p)
    return prompts, params


def run(rounds: int = 1, **options: Any) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    """Each round generates every request again (the later ones meet the prefix cache)."""
    prompts, params = requests()
    with Engine(
        load_format="null", max_running_requests=options.pop("max_running_requests", 32), **options
    ) as engine:
        outs = []
        for _ in range(rounds):
            outs.append(engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False))
            engine.check_integrity()
        return outs, engine.core.stats()


@pytest.fixture(scope="module")
def baseline() -> list[dict[str, Any]]:
    return run(**BASELINE)[0][0]


def test_the_baseline_is_well_formed(baseline: list[dict[str, Any]]):
    _, params = requests()
    stopped = 0
    for out, p in zip(baseline, params, strict=True):
        meta = out["meta_info"]
        assert len(out["output_ids"]) == meta["completion_tokens"] <= p["max_new_tokens"]
        reason = meta["finish_reason"]
        if reason["type"] == "length":
            assert meta["completion_tokens"] == p["max_new_tokens"]
        else:
            assert reason == {"type": "stop", "matched": "e"} and "e" not in out["text"]
            stopped += 1
    assert stopped > 0, "the stop string never matched; the test would not cover it"


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_option_gives_the_baselines_outputs(name: str, baseline: list[dict[str, Any]]):
    rounds, stats = run(2, **OPTIONS[name])
    for outs in rounds:
        for got, want in zip(outs, baseline, strict=True):
            assert (got["text"], got["output_ids"]) == (want["text"], want["output_ids"])
            assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    if name.startswith("retraction"):
        assert stats["retractions"] > 0, "the pool was not small enough to retract"
    elif name == "no-radix":
        assert stats["cached_tokens"] == 0, "a disabled prefix cache still matched"
    else:
        assert stats["cached_tokens"] > 0, "the second round never met the prefix cache"


def test_a_stream_interval_streams_n_tokens_per_chunk() -> None:
    prompt = list(range(1000, 1010))
    with Engine(load_format="null", stream_interval=4) as engine:
        whole = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10})
        chunks = list(
            engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10}, stream=True)
        )
        engine.check_integrity()
    sizes = [len(c["output_ids"]) for c in chunks]
    # Multiples of 4 (two intervals when the reader is late), the rest with the finish.
    assert all(s % 4 == 0 for s in sizes[:-1]) and sum(sizes) == 10
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    with pytest.raises(ValueError, match="stream_interval"):
        Engine(load_format="null", stream_interval=0)


def test_a_request_may_ask_for_its_own_stream_interval() -> None:
    prompt = list(range(1000, 1010))
    # 10 ms steps: the reader keeps up, so chunks are not merged while they wait for it.
    with Engine(load_format="null", stream_interval=4, null_step_ms=10) as engine:
        params = {"max_new_tokens": 10, "stream_interval": 3}
        chunks = list(engine.generate(input_ids=prompt, sampling_params=params, stream=True))
    sizes = [len(c["output_ids"]) for c in chunks]
    assert all(s % 3 == 0 for s in sizes[:-1]) and sum(sizes) == 10
    assert any(s % 4 for s in sizes[:-1]), sizes  # not the engine's interval


def failure_of(out: dict[str, Any]) -> str:
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500, reason
    return str(reason["message"])


def test_a_run_of_failed_steps_stops_the_loop_and_no_request_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RSGL_FAULT_INJECTION", "probability=1")
    # Without overlap each request below is one step: the failures count one by one.
    with Engine(load_format="null", disable_overlap_schedule=True) as engine:
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
            out = engine.generate(input_ids=[1000 + i, 2000], sampling_params={"max_new_tokens": 4})
            assert "injected fault (random)" in failure_of(out)
            assert engine._loop.error is None  # each failure is isolated so far
        last = engine.generate(input_ids=[3000, 2000], sampling_params={"max_new_tokens": 4})
        assert f"{MAX_CONSECUTIVE_STEP_FAILURES} steps failed in a row" in failure_of(last)
        assert isinstance(engine._loop.error, StepFailed)
        assert engine._loop.step_failures == MAX_CONSECUTIVE_STEP_FAILURES
        # The loop is gone: a new request is an error at once, not a wait.
        with pytest.raises(RuntimeError, match="the engine loop is not running: StepFailed"):
            engine.generate(input_ids=[1000], sampling_params={"max_new_tokens": 4})


def test_a_cuda_error_stops_the_loop_at_its_first_step() -> None:
    with Engine(load_format="null") as engine:
        engine.generate(input_ids=[1000, 2000], sampling_params={"max_new_tokens": 4})

        def device_assert(prepared: Any) -> Any:
            raise RuntimeError("CUDA error: device-side assert triggered")

        engine._loop.runner.execute = device_assert  # type: ignore[method-assign]
        outs = engine.generate(
            input_ids=[[1000, 3000], [1000, 4000]], sampling_params={"max_new_tokens": 4}
        )
        for out in outs:
            assert "left the device unusable" in failure_of(out)
        assert isinstance(engine._loop.error, StepFailed)
        assert engine._loop.step_failures == 1
        with pytest.raises(RuntimeError, match="not running"):
            engine.generate(input_ids=[1000], sampling_params={"max_new_tokens": 4})


@pytest.mark.parametrize(
    "options",
    [{}, {"disable_overlap_schedule": True}, {"page_size": 16}],
    ids=["overlap", "no-overlap", "paged"],
)
def test_a_request_sent_while_another_decodes_shares_its_prompt(options: dict[str, Any]) -> None:
    # As SGLang (cache_unfinished_req after every completed prefill), a prompt enters the
    # prefix cache once its prefill step has committed, not when its request finishes.
    shared = list(range(1000, 1320))  # 320 tokens: whole pages of 16
    params = {"max_new_tokens": 200, "ignore_eos": True}
    with Engine(load_format="null", null_step_ms=5, stream_interval=1, **options) as engine:
        first = engine.generate(input_ids=[*shared, 7, 8], sampling_params=params, stream=True)
        head = next(first)  # its prefill has committed; it decodes for about a second more
        second = engine.generate(
            input_ids=[*shared, 9], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
        )
        assert second["meta_info"]["cached_tokens"] >= len(shared)
        rest = list(first)
        engine.check_integrity()
    assert len(head["output_ids"]) + sum(len(c["output_ids"]) for c in rest) == 200
    assert rest[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("overlap", [True, False])
def test_the_step_log_has_every_step_with_its_shape(tmp_path: Path, overlap: bool) -> None:
    log = tmp_path / "steps.jsonl"
    prompts = [list(range(1000, 1000 + n)) for n in (5, 7, 9)]
    params = {"max_new_tokens": 4, "ignore_eos": True}
    with Engine(
        load_format="null", step_log=str(log), disable_overlap_schedule=not overlap
    ) as engine:
        engine.generate(prompts, [params] * 3)
        steps = engine.get_server_info()["steps"]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == steps
    assert all(line["dp_rank"] == 0 and line["seconds"] > 0 for line in lines)
    # One prefill of the three prompts, then three decode steps of three rows each, their
    # context growing by a token a row.
    prefill, *decodes = lines
    assert prefill["num_extends"] == 3 and prefill["new_tokens"] == 21
    assert prefill["attention_pairs"] == sum(n * (n + 1) / 2 for n in (5, 7, 9))
    assert [d["batch_size"] for d in decodes] == [3, 3, 3]
    assert [d["context_tokens"] for d in decodes] == [24, 27, 30]
    assert all(d["num_extends"] == 0 and d["new_tokens"] == 3 for d in decodes)


def test_the_step_log_records_the_idle_before_each_step(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    params = {"max_new_tokens": 4, "ignore_eos": True}
    # Steps of 20 ms: the overlapped loop plans each decode step while the one before runs.
    with Engine(load_format="null", step_log=str(log), null_step_ms=20.0) as engine:
        engine.generate([list(range(1000, 1010))], [params])
        time.sleep(0.3)
        engine.generate([list(range(2000, 2010))], [params])
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(steps) == 8 and [s["num_extends"] for s in steps] == [1, 0, 0, 0] * 2
    # The second prompt's prefill followed the sleep; a step planned while the step before
    # it ran logs no idle (the first step's idle is the time since start-up).
    assert steps[4]["idle_s"] >= 0.3
    assert min(s["idle_s"] for s in steps[2:4] + steps[6:8]) == 0.0
    assert all(s["idle_s"] < 0.3 for s in steps[1:4] + steps[5:])
