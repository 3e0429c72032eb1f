"""`--dtype auto`: float32 on a CPU without bfloat16 units, bfloat16 where the units exist and
the calibration measures it faster, float32 where it measures slower; a forced dtype wins;
bad names are refused; the choice and the threads show in get_server_info."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rsgl.args import EngineArgs
from rsgl.cpu_features import cpu_bf16_features
from rsgl.engine import Engine
from rsgl.model_executor.executor import run_on_compute_thread
from rsgl.models.dtype_choice import (
    MIN_BF16_SPEEDUP,
    Bf16Speedup,
    choose_dtype,
    measure_bf16_speedup,
)
from rsgl.server.launch import build_parser

CPU = torch.device("cpu")
AMX = frozenset({"amx_bf16"})


def never_calibrate() -> Bf16Speedup:
    raise AssertionError("the calibration was not meant to run")


def measured(decode: float, prefill: float) -> Bf16Speedup:
    return Bf16Speedup(decode=decode, prefill=prefill)


def test_a_cpu_without_bf16_units_runs_float32_without_calibrating() -> None:
    choice = choose_dtype("auto", CPU, features=frozenset(), calibrate=never_calibrate)
    assert choice.chosen == "float32" and choice.torch_dtype == torch.float32
    assert "no bfloat16 matrix units" in choice.reason
    assert choice.bf16_speedup_decode is None and choice.cpu_bf16_features == ()
    assert choice.calibration_ms is None


def test_bf16_units_and_a_faster_calibration_choose_bfloat16() -> None:
    choice = choose_dtype("auto", CPU, features=AMX, calibrate=lambda: measured(3.0, 5.5))
    assert choice.chosen == "bfloat16" and choice.torch_dtype == torch.bfloat16
    assert (choice.bf16_speedup_decode, choice.bf16_speedup_prefill) == (3.0, 5.5)
    assert choice.cpu_bf16_features == ("amx_bf16",)
    assert choice.calibration_ms is not None and choice.calibration_ms >= 0


@pytest.mark.parametrize(
    ("decode", "prefill"), [(0.4, 0.6), (0.9, 4.0), (4.0, 1.0), (MIN_BF16_SPEEDUP - 0.01, 3.0)]
)
def test_bf16_units_with_a_slower_or_tied_calibration_keep_float32(
    decode: float, prefill: float
) -> None:
    choice = choose_dtype("auto", CPU, features=AMX, calibrate=lambda: measured(decode, prefill))
    assert choice.chosen == "float32"
    assert (choice.bf16_speedup_decode, choice.bf16_speedup_prefill) == (decode, prefill)


@pytest.mark.parametrize("forced", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("features", [frozenset(), AMX])
def test_a_forced_dtype_wins_without_calibrating(forced: str, features: frozenset[str]) -> None:
    choice = choose_dtype(forced, CPU, features=features, calibrate=never_calibrate)
    assert (choice.chosen, choice.requested, choice.reason) == (forced, forced, "forced by --dtype")


def test_cuda_runs_bfloat16_without_calibrating() -> None:
    choice = choose_dtype("auto", torch.device("cuda"), calibrate=never_calibrate)
    assert choice.chosen == "bfloat16"


def test_invalid_dtype_names_are_refused_naming_the_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="invalid dtype 'fp64'.*auto, float32, bfloat16"):
        EngineArgs(dtype="fp64")
    with pytest.raises(ValueError, match="invalid dtype 'bf16'"):
        choose_dtype("bf16", CPU)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "double"])
    assert "--dtype: invalid choice: 'double'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cpu_threads must be at least 1"):
        EngineArgs(cpu_threads=0)


def test_the_real_calibration_measures_both_shapes() -> None:
    # Its cost is in the start-up log and in `dtype_choice.calibration_ms`, not bounded here.
    speedup = measure_bf16_speedup()
    assert speedup.decode > 0 and speedup.prefill > 0


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """The Engine sets the intra-op threads of the compute thread, where its torch ops run
    (OpenMP's thread count is per thread)."""
    threads = run_on_compute_thread(torch.get_num_threads)
    yield
    run_on_compute_thread(lambda: torch.set_num_threads(threads))


@pytest.mark.usefixtures("restore_threads")
def test_server_info_reports_a_forced_dtype_and_the_threads_set() -> None:
    with Engine(load_format="null", dtype="bfloat16", cpu_threads=1) as engine:
        info = engine.get_server_info()
        assert run_on_compute_thread(torch.get_num_threads) == 1
    assert info["dtype"] == "bfloat16" and info["cpu_threads"] == 1
    assert info["dtype_choice"] == {
        "chosen": "bfloat16",
        "reason": "forced by --dtype",
        "requested": "bfloat16",
        "bf16_speedup_decode": None,
        "bf16_speedup_prefill": None,
        "cpu_bf16_features": [],
        "calibration_ms": None,
    }


@pytest.mark.usefixtures("restore_threads")
def test_the_null_load_format_runs_no_calibration() -> None:
    with Engine(load_format="null") as engine:
        choice = engine.get_server_info()["dtype_choice"]
    assert (choice["chosen"], choice["reason"]) == ("float32", "load format null runs no model")


@pytest.mark.usefixtures("restore_threads")
def test_server_info_reports_the_auto_choice_on_this_cpu() -> None:
    with Engine(max_total_tokens=1024) as engine:
        info = engine.get_server_info()
        model_dtype = engine.runner.dtype  # type: ignore[union-attr]
    choice = info["dtype_choice"]
    assert info["dtype"] == choice["chosen"] == str(model_dtype).removeprefix("torch.")
    assert choice["requested"] == "auto"
    assert choice["cpu_bf16_features"] == sorted(cpu_bf16_features())
    if choice["cpu_bf16_features"]:
        assert choice["bf16_speedup_decode"] > 0 and choice["bf16_speedup_prefill"] > 0
        assert choice["calibration_ms"] > 0
    else:
        assert choice["chosen"] == "float32" and choice["calibration_ms"] is None
