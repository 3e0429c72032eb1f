"""The typed boundary: FinishReason and a hand-built Plan."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from rsgl._core import FinishReason, Plan

REASONS = [
    (FinishReason.stop_token(2), {"type": "stop", "matched": 2}, "FinishReason.stop_token(2)"),
    (FinishReason.stop_str("\n\n"), {"type": "stop", "matched": "\n\n"}, "stop_str('\\n\\n')"),
    (FinishReason.max_length(7), {"type": "length", "length": 7}, "max_length(7)"),
    (FinishReason.abort("bye"), {"type": "abort", "message": "bye"}, "abort('bye')"),
    (
        FinishReason.abort("boom", 500),
        {"type": "abort", "message": "boom", "status_code": 500},
        "abort('boom', status_code=500)",
    ),
]


@pytest.mark.parametrize(("reason", "as_dict", "shown"), REASONS)
def test_each_kind_round_trips_through_its_api_dict(reason: FinishReason, as_dict, shown):
    assert reason.to_dict() == as_dict
    assert FinishReason.from_dict(as_dict) == reason
    assert hash(FinishReason.from_dict(as_dict)) == hash(reason)
    assert pickle.loads(pickle.dumps(reason)) == reason
    assert shown in repr(reason)
    assert reason.kind == as_dict["type"]


def test_fields_say_what_ended_it():
    token, text = FinishReason.stop_token(5), FinishReason.stop_str("x")
    assert (token.matched_token, token.matched_str) == (5, None)
    assert (text.matched_token, text.matched_str) == (None, "x")
    assert FinishReason.abort("m").status_code is None
    assert FinishReason.stop_token(5) != FinishReason.stop_str("5")


@pytest.mark.parametrize(
    "bad",
    [{}, {"type": "done"}, {"type": "stop"}, {"type": "stop", "matched": 1.5}, {"type": "length"}],
)
def test_from_dict_refuses_what_is_not_a_finish_reason(bad: dict):
    with pytest.raises(ValueError, match="not a finish_reason"):
        FinishReason.from_dict(bad)


def test_a_hand_built_plan_checks_its_arrays():
    plan = Plan(
        id=3,
        forward_mode="mixed",
        num_extends=1,
        rids=[7, 8],
        req_slots=np.array([0, 1]),
        prefix_lens=[0, 4],
        extend_lens=[2, 1],
        seq_lens=[2, 5],
        input_ids=[11, 12, 13],
        positions=[0, 1, 4],
        out_cache_loc=[20, 21, 22],
    )
    assert (plan.id, plan.batch_size, plan.num_tokens, plan.num_extends) == (3, 2, 3, 1)
    assert plan.sample.tolist() == [True, True]
    assert plan.rids.dtype == np.int64 and plan.write_rows.size == 0
    with pytest.raises(ValueError, match="forward_mode"):
        Plan(forward_mode="prefill")
    with pytest.raises(ValueError, match="num_extends"):
        Plan(forward_mode="mixed", rids=[1])
    with pytest.raises(ValueError, match="seq_lens has 1 entries, expected 2"):
        Plan(rids=[1, 2], req_slots=[0, 1], prefix_lens=[0, 0], extend_lens=[1, 1], seq_lens=[1])
    with pytest.raises(ValueError, match="positions"):
        Plan(input_ids=[1, 2], positions=[0], out_cache_loc=[1, 2])
