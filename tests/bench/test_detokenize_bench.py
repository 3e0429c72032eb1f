"""benches/detokenize.py on tiny sizes: every way of detokenizing gives the tokenizer's own
decode of each request, on random ids and on real text, and a way that does not is caught."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from rsgl.models.loader import resolve_model_dir
from rsgl.tokenizer.loader import load_tokenizer

BENCH = Path(__file__).resolve().parents[2] / "benches" / "detokenize.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_detokenize", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_way_gives_the_same_text(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--requests", "3", "5", "--steps", "40", "--ways", *bench.WAYS, "--at", "--repeat", "1"]
    assert bench.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tokens"], r["requests"]) for r in lines] == [
        ("random", 3),
        ("random", 5),
        ("text", 3),
        ("text", 5),
    ]
    for r in lines:
        assert set(r["ways"]) == set(bench.WAYS) >= {"output_processor", "batch_decode", "window"}
        for figures in r["ways"].values():
            assert figures["us_per_step"] > 0 and figures["us_per_request_token"] > 0


def test_each_way_reports_its_cost_at_several_output_lengths(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--requests", "2", "--steps", "32", "--at", "8", "32", "64", "--tokens", "text"]
    argv += ["--repeat", "2"]
    assert bench.main(argv) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert set(line["ways"]) == set(bench.RSGL_WAYS)
    for way in line["ways"].values():
        assert set(way["us_per_request_token_p50_at"]) == {"8", "32"}  # 64: beyond the run
        assert way["spread"] >= 0


def test_a_way_that_loses_a_token_is_caught(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(resolve_model_dir(None))

    def lossy(tokenizer: Any, prompt: list[int], tokens: np.ndarray) -> Any:
        return bench.run_detokenizer(tokenizer, prompt, tokens[:, 1:])

    monkeypatch.setattr(bench, "WAYS", {"lossy": lossy})
    with pytest.raises(AssertionError, match="lossy"):
        bench.measure(tokenizer, "text", 2, 10)
