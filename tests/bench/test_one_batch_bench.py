"""`rsgl bench one-batch` on tiny sizes: `--low-bit-max-rows` moves a step of the embedded
GGUF between its low-bit blocks and the dense copy, whatever limit this CPU would choose."""

from __future__ import annotations

import json
from typing import Any

import pytest
from torch import nn

from rsgl.bench import one_batch
from rsgl.layers.quant_linear import force_low_bit_max_rows
from rsgl.models import dtype_choice


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    argv = ["--batch", "3", "--input-len", "8", "--output-len", "3", "--dtype", "float32"]
    assert one_batch.main([*argv, *extra]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return result


def test_low_bit_max_rows_moves_a_step_between_the_blocks_and_the_dense_copy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocks = _run(capsys, "--low-bit-max-rows", "3")
    dense = _run(capsys, "--low-bit-max-rows", "2")
    assert blocks["quantization"] == dense["quantization"] == "gguf"
    assert (blocks["low_bit_max_rows"], dense["low_bit_max_rows"]) == (3, 2)
    # SmolLM2's Q4_1 projections and Q8_0 LM head (96 MB) against their float32 copy (538
    # MB): a 3-row step reads one or the other
    assert blocks["weight_mb_per_step"] < 100 < 500 < dense["weight_mb_per_step"]


def test_forcing_the_limit_counts_low_bit_modules_and_refuses_a_negative() -> None:
    assert force_low_bit_max_rows(nn.Sequential(nn.Linear(4, 4)), 8) == 0
    with pytest.raises(ValueError, match="must be >= 0"):
        force_low_bit_max_rows(nn.Linear(4, 4), -1)


@pytest.mark.parametrize(
    ("units", "speedup", "chosen"),
    [((), None, "float32"), (("amx_bf16",), 2.0, "bfloat16"), (("amx_bf16",), 1.0, "float32")],
)
def test_dtype_auto_runs_the_dtype_rsgl_serve_would_choose(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    units: tuple[str, ...],
    speedup: float | None,
    chosen: str,
) -> None:
    # Another CPU's bfloat16 units and calibration stand in for this one's (as `rsgl serve`'s
    # own choice is tested): `auto` meant float32 here whatever the machine, until it asked.
    monkeypatch.setattr(dtype_choice, "cpu_bf16_features", lambda: frozenset(units))
    if speedup is not None:
        measured = dtype_choice.Bf16Speedup(decode=speedup, prefill=speedup)
        monkeypatch.setattr(dtype_choice, "measure_bf16_speedup", lambda: measured)
    argv = ["--batch", "2", "--input-len", "8", "--output-len", "2", "--dtype", "auto"]
    assert one_batch.main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == chosen
