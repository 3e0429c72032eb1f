"""`rsgl bench speculative`: its parts run end to end on the embedded model, and a copy
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
        # Measured under both engine orders, and the ratio is their geometric mean.
        by_order = r["ratio_by_order"]
        assert isinstance(by_order, dict) and set(by_order) == {"plain_first", "spec_first"}
        mean = (by_order["plain_first"] * by_order["spec_first"]) ** 0.5
        assert r["ratio"] == pytest.approx(mean, abs=1e-3)
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


def test_draft_replays_of_greedy_copies(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--parts", "verify-cost,drafts", "--workloads", "copy", "--replay-requests", "2"]
    argv += ["--drafts", "1,4", "--copy-max-len", "60", "--dtype", "float32"]
    argv += ["--batches", "1", "--steps", "2", "--input-len", "16"]
    assert speculative.main(argv) == 0
    costs, rows = _split(_rows(capsys))
    assert [r["drafts"] for r in costs] == [1, 4]
    assert [(r["workload"], r["drafts"], r["requests"]) for r in rows] == [
        ("copy", 1, 2),
        ("copy", 4, 2),
    ]
    for r in rows:
        assert 0 < r["output_tokens"] <= 120  # type: ignore[operator]
        for drafter in ("chain", "tree", "shared"):
            # A copy's drafts are mostly accepted, and never more than k + 1 tokens a step.
            per_step = r[f"{drafter}_tokens_per_step"]
            assert 1.3 < per_step <= 1 + r["drafts"]  # type: ignore[operator]
            assert 0 < r[f"{drafter}_drafted_share"] <= 1  # type: ignore[operator]
            # Over what such a verify step costs at batch 1, from the same run.
            cost = next(c["verify_vs_decode"] for c in costs if c["drafts"] == r["drafts"])
            assert r[f"{drafter}_vs_plain_at_batch_1"] == pytest.approx(
                per_step / cost,  # type: ignore[operator]
                abs=2e-3,
            )
    assert rows[1]["chain_tokens_per_step"] > rows[0]["chain_tokens_per_step"]  # type: ignore[operator]


def _split(
    rows: list[dict[str, object]],
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """verify-cost's rows, then the draft replays'."""
    return [r for r in rows if "verify_ms" in r], [r for r in rows if "verify_ms" not in r]


def test_the_orders_combine_into_one_cell() -> None:
    def cell(order: str, ratio: float, off: float, identical: bool) -> dict[str, object]:
        return {
            "order": order,
            "workload": "free",
            "temperature": 0.0,
            "concurrency": 4,
            "requests": 8,
            "output_tokens": 1024,
            "off_tok_s": off,
            "on_tok_s": off * ratio,
            "ratio": ratio,
            "identical_outputs": identical,
            "accept_length": 1.5,
            "drafts_per_verify_step": 2.0,
        }

    # Built first, an engine serves 20% slower: one order's ratio is 0.8x the truth, the
    # other's 1.25x, and the combined ratio is the truth.
    row = speculative.combine_orders(
        [cell("plain_first", 1.25, 80.0, True), cell("spec_first", 0.8, 100.0, False)]
    )
    assert row["ratio"] == 1.0
    assert row["ratio_by_order"] == {"plain_first": 1.25, "spec_first": 0.8}
    assert row["off_tok_s"] == 90.0 and row["on_tok_s"] == 90.0
    assert row["identical_outputs"] is False
    assert "order" not in row
    assert (row["accept_length"], row["drafts_per_verify_step"]) == (1.5, 2.0)


def test_an_order_that_never_verified_leaves_the_accept_figures_to_the_other() -> None:
    """Where one order's requests never drafted, the cell's accept length is the other
    order's, not halved by a 0 that measured nothing."""
    base = {"workload": "free", "temperature": 0.7, "concurrency": 16, "requests": 16}
    base |= {"output_tokens": 2048, "off_tok_s": 600.0, "on_tok_s": 600.0, "ratio": 1.0}
    base |= {"identical_outputs": True}
    drafted = base | {"order": "plain_first", "accept_length": 1.6, "drafts_per_verify_step": 11.0}
    idle = base | {"order": "spec_first", "accept_length": 0, "drafts_per_verify_step": 0}
    row = speculative.combine_orders([drafted, idle])
    assert (row["accept_length"], row["drafts_per_verify_step"]) == (1.6, 11.0)
    row = speculative.combine_orders([idle, idle])
    assert (row["accept_length"], row["drafts_per_verify_step"]) == (0.0, 0.0)


def test_an_unknown_workload_is_named() -> None:
    with pytest.raises(SystemExit) as exc:
        speculative.main(["--parts", "workloads", "--workloads", "copy,poetry"])
    assert exc.value.code == 2
