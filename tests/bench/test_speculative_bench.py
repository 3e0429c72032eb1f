"""`rsgl bench speculative`: its two parts run end to end on the embedded model, and a copy
request ends where the model ends its answer."""

from __future__ import annotations

import json

import pytest

from rsgl.bench import speculative


def _rows(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_copy_requests_end_with_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    # One request: seed 0's first is a passage of 85 tokens copied (SmolLM2, float32).
    argv = ["--parts", "workloads", "--workloads", "copy", "--concurrency", "1"]
    argv += ["--min-requests", "1", "--rounds", "1", "--dtype", "float32"]
    argv += ["--copy-max-len", "200", "--num-draft-tokens", "4"]
    assert speculative.main(argv) == 0
    rows = _rows(capsys)
    assert [(r["workload"], r["temperature"]) for r in rows] == [("copy", 0.0), ("copy", 0.7)]
    for r in rows:
        assert r["identical_outputs"] is True
        assert r["requests"] == 1
    # Greedy, the copy stops at the model's end of turn, well before the limit.
    assert 0 < rows[0]["output_tokens"] < 200  # type: ignore[operator]


def test_forced_lengths_and_the_verify_cost(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--parts", "verify-cost,workloads", "--workloads", "free", "--concurrency", "2"]
    argv += ["--min-requests", "2", "--rounds", "1", "--output-len", "12", "--dtype", "float32"]
    argv += ["--batches", "1,2", "--drafts", "1,3", "--steps", "2", "--input-len", "16"]
    assert speculative.main(argv) == 0
    rows = _rows(capsys)
    costs, served = rows[:4], rows[4:]
    assert [(r["batch"], r["drafts"]) for r in costs] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for r in costs:
        assert r["verify_ms"] > 0 and r["decode_ms"] > 0  # type: ignore[operator]
    # Free writing is forced to its length: two requests of 12 tokens, whatever they say.
    assert [r["output_tokens"] for r in served] == [24, 24]
    assert all(r["identical_outputs"] is True for r in served)


def test_an_unknown_workload_is_named() -> None:
    with pytest.raises(SystemExit) as exc:
        speculative.main(["--parts", "workloads", "--workloads", "copy,poetry"])
    assert exc.value.code == 2
