"""`rsgl bench overhead`: the whole stack around the null executor, in-process and served."""

from __future__ import annotations

import json

import pytest

from rsgl.bench import overhead


def test_the_in_process_run_reports_its_figures(capsys: pytest.CaptureFixture[str]):
    assert (
        overhead.main(["--running", "4", "8", "--output-len", "24", "--input-len", "10", "--json"])
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["running"] for r in lines] == [4, 8]
    for r in lines:
        assert r["steps"] >= 24
        assert 0 < r["us_per_step_p50"] <= r["us_per_step_p99"]
        assert r["us_per_request_token"] == pytest.approx(
            r["us_per_step_p50"] / r["running"], rel=0.01
        )


def test_a_fixed_step_time_bounds_the_decode_rate():
    r = overhead.measure(8, 24, input_len=10, null_step_ms=4)
    # Each decode step sleeps 4 ms: at most 8 tokens per 4 ms, whatever the overlap hides.
    assert r["decode_tokens_per_s"] <= r["ideal_tokens_per_s"] * 1.02
    assert 0 < r["of_ideal"] <= 1.02
    assert 0 <= r["executor_idle_fraction"] < 1


def test_the_served_run_streams_every_token():
    # 1,024 tokens: enough frontend CPU time to show at /proc's 10 ms resolution.
    r = overhead.measure_server(16, 64, input_len=10)
    assert r["server"] and r["streamed_tokens_per_s"] > 0
    assert r["frontend_cpu_s_per_1k_tokens"] > 0
