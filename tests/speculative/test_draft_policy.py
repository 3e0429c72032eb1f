"""DraftPolicy: each batch-size group drafts while its verify steps cost less per committed
token than its plain steps, measures both ways first, and re-tries the losing way, less
often while the tries confirm the choice."""

from __future__ import annotations

from rsgl.speculative.policy import DraftPolicy


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


def test_measures_both_ways_then_keeps_the_cheaper_and_explores() -> None:
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    limits = _steps(policy, 1, verify_cost=0.5, plain_cost=1.0, n=32)
    assert limits[:2] == [4, 0]  # verify first, then a plain step to compare
    later = limits[2:]
    assert 1 <= later.count(0) <= 2  # only the tries
    # Verify steps now cost more per token: the group stops drafting (but still explores).
    limits = _steps(policy, 1, verify_cost=2.0, plain_cost=1.0, n=40)
    assert limits[-16:].count(4) <= 2


def _gaps(limits: list[int], value: int) -> list[int]:
    at = [i for i, limit in enumerate(limits) if limit == value]
    return [b - a for a, b in zip(at, at[1:], strict=False)]


def test_tries_grow_rarer_while_they_confirm_the_choice_and_reset_when_it_turns() -> None:
    policy = DraftPolicy(max_drafts=4, explore_every=8, max_explore_every=64)
    limits = _steps(policy, 1, verify_cost=0.5, plain_cost=1.0, n=300)[2:]
    assert _gaps(limits, 0) == [16, 32, 64, 64, 64]  # tries of plain steps, each confirming
    # Drafts stop paying: the choice turns within a few steps, and the tries of drafting
    # come every 8 steps again, then rarer as they confirm the new choice.
    limits = _steps(policy, 1, verify_cost=2.0, plain_cost=1.0, n=200)
    first_plain = limits.index(0)
    assert first_plain <= 4
    tries = [i for i, limit in enumerate(limits) if limit == 4 and i > first_plain]
    assert tries[0] - first_plain < 8
    assert _gaps(limits[first_plain:], 4)[:3] == [16, 32, 64]


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
