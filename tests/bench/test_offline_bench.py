"""`rsgl bench offline` on a tiny run: a comparison of two engines is measured under both
orders of building them, and its speedup is the geometric mean of the two orders' ratios."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from rsgl.bench import offline


def test_each_comparison_runs_under_both_orders(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[dict[str, Any]] = []
    run = offline.run_rsgl

    def recorded(prompts: list[list[int]], output_len: int, *a: Any, **options: Any) -> Any:
        built.append(options)
        return run(prompts, output_len, *a, **options)

    monkeypatch.setattr(offline, "run_rsgl", recorded)
    argv = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4"]
    assert offline.main([*argv, "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The bench's engine, then the one without overlap twice, then the bench's again.
    assert [o.get("disable_overlap_schedule", False) for o in built] == [0, 1, 1, 0]
    assert {o["dtype"] for o in built} == {"float32"}
    first, second = result["overlap_speedup_by_order"]
    assert first > 0 and second > 0
    assert result["overlap_speedup"] == pytest.approx(math.sqrt(first * second), abs=2e-3)
    # The first order's ratio is the bench's first run against the other's first.
    tok_s = result["rsgl_output_tok_s"]
    assert result["overlap_speedup_by_order"][0] == pytest.approx(
        tok_s / result["rsgl_no_overlap_output_tok_s"], abs=1e-3
    )
