"""`--speculative-algorithm auto` (rsgl.speculative.choice): NGRAM only where it was measured
to pay (bfloat16 on AMX tiles, one rank of one replica), off elsewhere, a forced value kept
as given; and an Engine reports the choice and runs its core as chosen."""

from __future__ import annotations

import dataclasses

import pytest

from rsgl.args import EngineArgs
from rsgl.engine import Engine
from rsgl.models.dtype_choice import DtypeChoice
from rsgl.speculative.choice import choose_speculation, resolved

AMX = ("amx_bf16", "avx512_bf16")
BF16_ON_AMX = DtypeChoice("bfloat16", "calibration", cpu_bf16_features=AMX)


def test_auto_speculates_with_bfloat16_on_amx_tiles() -> None:
    args = EngineArgs()
    assert args.speculative_algorithm == "auto" and not args.speculates  # until resolved
    choice = choose_speculation(args, "cpu", BF16_ON_AMX)
    assert (choice.chosen, choice.requested) == ("NGRAM", "auto")
    on = resolved(args, choice)
    assert on.speculates and on.verified_tokens == 8  # NGRAM's default draft tokens


@pytest.mark.parametrize(
    ("options", "device", "dtype", "why"),
    [
        ({}, "cpu", DtypeChoice("float32", "forced", cpu_bf16_features=AMX), "bfloat16 on AMX"),
        # AVX512-BF16 without AMX (a Zen 4): three whole runs each missed a bar; off until two hold.
        ({}, "cpu", DtypeChoice("bfloat16", "x", cpu_bf16_features=("avx512_bf16",)), "AMX"),
        ({}, "cuda", DtypeChoice("bfloat16", "accelerator"), "cuda: not measured"),
        ({"tp_size": 2}, "cpu", BF16_ON_AMX, "one rank of one replica"),
        ({"dp_size": 2}, "cpu", BF16_ON_AMX, "one rank of one replica"),
        ({"load_format": "null"}, "cpu", BF16_ON_AMX, "no model"),
    ],
)
def test_auto_stays_off_where_it_was_not_measured_to_pay(
    options: dict[str, object], device: str, dtype: DtypeChoice, why: str
) -> None:
    args = EngineArgs(**options)  # type: ignore[arg-type]
    choice = choose_speculation(args, device, dtype)
    assert choice.chosen is None and why in choice.reason
    assert not resolved(args, choice).speculates


@pytest.mark.parametrize(
    ("requested", "chosen"), [("none", None), (None, None), ("NGRAM", "NGRAM")]
)
def test_a_forced_algorithm_is_kept_on_any_machine(
    requested: str | None, chosen: str | None
) -> None:
    args = EngineArgs(speculative_algorithm=requested)
    for device, dtype in (("cpu", BF16_ON_AMX), ("cuda", DtypeChoice("bfloat16", "gpu"))):
        choice = choose_speculation(args, device, dtype)
        assert choice.to_dict() == {
            "chosen": chosen,
            "reason": "forced by --speculative-algorithm",
            "requested": requested,
        }
        assert resolved(args, choice).speculates == (chosen is not None)


def test_an_unknown_algorithm_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="'EAGLE': expected one of auto, none, NGRAM"):
        EngineArgs(speculative_algorithm="EAGLE")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_reports_auto_s_choice_and_its_core_follows_it(dtype: str) -> None:
    """Whatever this CPU is: the engine's choice is the rule applied to its reported dtype
    choice, and its loop speculates exactly when the choice says."""
    with Engine(dtype=dtype, max_total_tokens=4096) as engine:
        info = engine.get_server_info()
        engine.check_integrity()
    dtype_facts = info["dtype_choice"]
    features = tuple(dtype_facts["cpu_bf16_features"])
    reported = DtypeChoice(**dict(dtype_facts, cpu_bf16_features=features))
    expected = choose_speculation(EngineArgs(dtype=dtype), "cpu", reported)
    assert info["speculation_choice"] == dataclasses.asdict(expected)
    assert info["speculative_algorithm"] == expected.chosen
    assert ("spec_draft_limit" in info["speculative"]) == (expected.chosen is not None)
