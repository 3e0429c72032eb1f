"""DraftPolicy: each batch-size group drafts while its verify steps cost less per committed
token than its plain steps, measures both ways first (not the step that changes ways), and
re-tries the losing way, less often while the tries confirm the choice."""

from __future__ import annotations

import pytest

from rsgl.speculative.policy import TRY_STEPS, DraftPolicy


def test_groups_are_power_of_two_ceilings() -> None:
    assert [DraftPolicy.group_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        64,
        128,
    ]


def _steps(
    policy: DraftPolicy, batch: int, verify_cost: float, plain_cost: float, n: int
) -> list[int]:
    """Runs n decode steps of `batch` requests; a step's cost per token is fixed by its kind."""
    limits = []
    for _ in range(n):
        limit = policy.draft_limit()
        limits.append(limit)
        drafted = limit > 0
        cost = verify_cost if drafted else plain_cost
        policy.observe(batch, drafted, cost * batch, batch)
    return limits


def _runs(limits: list[int], value: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `value` in `limits`."""
    runs: list[tuple[int, int]] = []
    for i, limit in enumerate(limits):
        if limit != value:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def test_measures_both_ways_then_keeps_the_cheaper_and_explores() -> None:
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    limits = _steps(policy, 1, verify_cost=0.5, plain_cost=1.0, n=40)
    # Drafting first, then plain: the change (not measured), then a measured step.
    assert limits[:4] == [4, 0, 0, 4]
    tries = _runs(limits[3:], 0)
    assert tries and all(length == TRY_STEPS for _, length in tries)  # only the tries
    # Drafting now costs more per token: the group stops drafting (but still explores).
    limits = _steps(policy, 1, verify_cost=2.0, plain_cost=1.0, n=40)
    assert limits[-16:].count(4) <= TRY_STEPS


def test_tries_grow_rarer_while_they_confirm_the_choice_and_reset_when_it_turns() -> None:
    policy = DraftPolicy(max_drafts=4, explore_every=8, max_explore_every=64)
    limits = _steps(policy, 1, verify_cost=0.5, plain_cost=1.0, n=320)
    starts = [start for start, _ in _runs(limits, 0)][1:]  # after the first measurement
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[:3] == sorted(gaps[:3]) and gaps[1] >= 2 * gaps[0] - TRY_STEPS
    assert max(gaps) <= 64 + TRY_STEPS and gaps[-1] == gaps[-2]  # capped
    # Drafts stop paying: the choice turns within a few steps, and the tries of drafting
    # come within `explore_every` steps again, then rarer as they confirm the new choice.
    limits = _steps(policy, 1, verify_cost=2.0, plain_cost=1.0, n=200)
    drafting = _runs(limits, 4)
    turned = drafting[0][0] + drafting[0][1]  # the end of the drafting it was doing
    assert turned <= 6
    tries = drafting[1:]
    assert tries[0][0] - turned <= 8 + TRY_STEPS
    assert all(length == TRY_STEPS for _, length in tries[:-1])  # the last may be cut off
    starts = [start for start, _ in tries]
    assert starts[2] - starts[1] > starts[1] - starts[0]


def test_steps_after_a_change_of_way_are_not_measured() -> None:
    # A plain step right after a verify has nothing to overlap: its cost is not plain's.
    policy = DraftPolicy(max_drafts=4)
    policy.observe(1, True, 1.0, 2)
    policy.observe(1, False, 100.0, 1)  # the change: ignored
    assert policy.summary()["1"] == {"verify_s_per_token": 0.5, "plain_s_per_token": None}
    policy.observe(1, False, 0.4, 1)
    assert policy.summary()["1"]["plain_s_per_token"] == 0.4


def test_each_batch_size_group_decides_for_itself() -> None:
    policy = DraftPolicy(max_drafts=2, explore_every=1000)
    _steps(policy, 1, verify_cost=0.5, plain_cost=1.0, n=4)
    _steps(policy, 64, verify_cost=3.0, plain_cost=1.0, n=4)
    policy.observe(1, False, 1.0, 1)
    assert policy.draft_limit() == 2  # batch 1: drafting is cheaper
    policy.observe(64, False, 64.0, 64)
    assert policy.draft_limit() == 0  # batch 64: plain is cheaper
    assert set(policy.summary()) == {"1", "64"}


def test_a_step_that_committed_nothing_changes_no_average() -> None:
    policy = DraftPolicy(max_drafts=3)
    policy.observe(4, True, 1.0, 0)
    assert policy.summary() == {}
    assert policy.batch == 4


def test_a_policy_that_is_not_adaptive_always_drafts() -> None:
    policy = DraftPolicy(max_drafts=3, adaptive=False)
    assert _steps(policy, 8, verify_cost=5.0, plain_cost=1.0, n=100) == [3] * 100


def test_a_way_costs_its_seconds_over_its_tokens_not_an_average_of_step_ratios() -> None:
    # Drafting: a verify committing 5 tokens in 50 ms, then a step whose request paused its
    # drafts (1 token, 40 ms, nothing to overlap): 90 ms for 6 tokens, 15 ms each, cheaper
    # than plain's 20 ms (the mean of the steps' ratios, 25 ms, would say otherwise).
    policy = DraftPolicy(max_drafts=4, explore_every=1000)
    for _ in range(20):
        policy.observe(1, True, 0.050, 5)
        policy.observe(1, True, 0.040, 1)
    policy.observe(1, False, 0.020, 1)  # the change of way: not measured
    for _ in range(5):
        policy.observe(1, False, 0.020, 1)
    costs = policy.summary()["1"]
    assert costs["plain_s_per_token"] == pytest.approx(0.020)
    assert 0.013 < costs["verify_s_per_token"] < 0.017  # type: ignore[operator]
    assert policy.draft_limit() == 4


def test_steps_planned_to_draft_without_drafts_count_only_until_a_verify_is_seen() -> None:
    # Nobody drafts (every request constrained, say): those steps are the drafting way's
    # cost, which loses to overlapped plain steps, so the group turns plain.
    policy = DraftPolicy(max_drafts=4)
    policy.observe(8, True, 0.030, 8, drafted=False)
    policy.observe(8, False, 0.020, 8)  # the change
    policy.observe(8, False, 0.020, 8)
    policy.batch = 8
    assert policy.draft_limit() == 0
    # Once a verify is measured, a step whose requests all paused their drafts does not
    # dilute it.
    policy = DraftPolicy(max_drafts=4)
    policy.observe(8, True, 0.040, 32, drafted=True)
    verify = policy.summary()["8"]["verify_s_per_token"]
    policy.observe(8, True, 0.030, 8, drafted=False)
    assert policy.summary()["8"]["verify_s_per_token"] == verify
