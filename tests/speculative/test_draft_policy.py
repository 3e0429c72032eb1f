"""DraftPolicy: each batch-size group climbs the draft limits of its ladder while the next
could still win, then runs the one with the least expected seconds per committed token
(seconds per request at that limit over 1 + the shares of requests reaching each draft),
tries its neighbours on the ladder less often while the tries confirm the choice and within
a budget of what they waste, and follows a changed workload."""

from __future__ import annotations

import pytest

from rsgl.speculative.policy import TRY_STEPS, DraftPolicy, ladder

# Seconds per request of a step at each draft limit (plain steps overlap: cheapest).
SECONDS = {0: 1.0, 1: 1.3, 2: 1.5, 4: 2.2}


def test_groups_are_power_of_two_ceilings() -> None:
    sizes = (1, 2, 3, 4, 5, 8, 9, 64, 65)
    assert [DraftPolicy.group_of(b) for b in sizes] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_the_ladder_is_plain_the_powers_of_two_below_the_maximum_and_the_maximum() -> None:
    assert ladder(1) == [0, 1]
    assert ladder(2) == [0, 1, 2]
    assert ladder(4) == [0, 1, 2, 4]
    assert ladder(7) == [0, 1, 2, 4, 7]
    assert ladder(8) == [0, 1, 2, 4, 8]


def _steps(
    policy: DraftPolicy, batch: int, accepts: int, n: int, seconds: dict[int, float] = SECONDS
) -> list[int]:
    """Runs n decode steps of `batch` requests in which every request accepts `accepts`
    drafts (or as many as the step's limit allows); a step's seconds are fixed by its limit."""
    limits = []
    for _ in range(n):
        limit = policy.draft_limit()
        limits.append(limit)
        accepted = [min(limit, accepts)] * batch if limit else None
        policy.observe(batch, limit, seconds[limit] * batch, accepted)
    return limits


def _shadowed_steps(
    policy: DraftPolicy, batch: int, accepts: int, n: int, seconds: dict[int, float] = SECONDS
) -> list[int]:
    """`_steps` where every plain step also reports a shadow draft per request that would
    have accepted `accepts` drafts (as many as the configured most allows)."""
    limits = []
    for _ in range(n):
        limit = policy.draft_limit()
        limits.append(limit)
        accepted = [min(limit, accepts)] * batch if limit else None
        shadow = [0] * (policy.max_drafts + 1)
        shadow[min(accepts, policy.max_drafts)] = batch
        policy.observe(
            batch, limit, seconds[limit] * batch, accepted, shadow if not limit else None
        )
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


def test_a_cost_is_seconds_per_request_over_one_plus_the_reach_of_each_draft() -> None:
    policy = DraftPolicy(max_drafts=4)
    # Four requests accept 3, 0, 1 and 0 drafts: half reach the first draft, a quarter the
    # second and the third, none the fourth; a request commits 2 tokens on average.
    policy.observe(4, 4, 4.0, [3, 0, 1, 0])
    assert policy.summary()["4"] == {"4": pytest.approx(1.0 / 2.0)}
    # A limit below the one in use is costed from the same reaches once its seconds are
    # known: 2 drafts would commit 1 + 0.5 + 0.25 tokens per request.
    policy.observe(4, 2, 3.0, [2, 0, 1, 0])
    costs = policy.summary()["4"]
    assert costs["2"] == pytest.approx(0.75 / (1 + 0.5 + 0.25))


def test_climbs_the_ladder_then_keeps_the_cheapest_and_tries_its_neighbours() -> None:
    policy = DraftPolicy(max_drafts=4, explore_every=8, explore_budget=1.0)
    # Every request accepts 2 drafts: costs 1.0 plain, 0.65 at 1, 0.5 at 2, 0.73 at 4.
    limits = _steps(policy, 1, accepts=2, n=80)
    # Bottom up, a try of TRY_STEPS each; 4 could still win after 2 (if the drafts 3 and 4
    # were accepted as often as the second: 1.5 / 5 a token), so it is measured too.
    assert limits[: 4 * TRY_STEPS] == [r for r in (0, 1, 2, 4) for _ in range(TRY_STEPS)]
    rest = limits[4 * TRY_STEPS :]
    assert rest[0] == 2 and set(rest) == {1, 2, 4}  # plain is no neighbour of the choice
    tries = _runs(rest, 1) + _runs(rest, 4)
    assert len(tries) >= 3 and all(length == TRY_STEPS for _, length in tries)
    assert abs(len(_runs(rest, 1)) - len(_runs(rest, 4))) <= 1  # above and below in turn
    assert rest.count(2) > 0.7 * len(rest)


def test_acceptance_seen_at_a_higher_limit_turns_the_choice_down_without_a_try() -> None:
    policy = DraftPolicy(max_drafts=4, explore_every=10_000)
    _steps(policy, 1, accepts=2, n=4 * TRY_STEPS + 1)
    assert policy.draft_limit() == 2
    # Requests now accept one draft: at limit 2 the reach of the second draft falls, and
    # limit 1 (seconds 1.3 for 2 tokens against 1.5) wins on the steps at limit 2 alone.
    limits = _steps(policy, 1, accepts=1, n=60)
    turned = limits.index(1)
    assert 5 < turned < 40 and set(limits[turned:]) == {1}


def test_a_large_batch_follows_acceptance_that_stops_within_a_few_steps() -> None:
    # A share of 64 requests is a far steadier sample than one request's count: the
    # choice leaves drafting within a few of its (dear) steps, where one request takes ~25
    # (with no try of plain, whose cost would show it sooner).
    turned_at = {}
    for batch in (1, 64):
        policy = DraftPolicy(max_drafts=4, explore_every=10_000, baseline_budget=1e-9)
        _steps(policy, batch, accepts=2, n=4 * TRY_STEPS + 20)
        assert policy.draft_limit() == 2
        limits = _steps(policy, batch, accepts=0, n=60)
        turned_at[batch] = limits.index(0)
    assert turned_at[64] <= 8 < 20 <= turned_at[1]


def test_a_changed_workload_is_followed_to_the_new_cheapest_rung() -> None:
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    _steps(policy, 1, accepts=4, n=40)
    assert policy.draft_limit() == 4  # 2.2 / 5 = 0.44 a token
    # Drafts stop being accepted: plain wins, and only its neighbour is tried.
    limits = _steps(policy, 1, accepts=0, n=200)
    settled = limits[-60:]
    assert set(settled) <= {0, 1} and settled.count(0) >= 60 - 3 * TRY_STEPS
    # And back: every draft accepted again. The tries of limit 1 see it, then 2's, then 4's.
    limits = _steps(policy, 1, accepts=4, n=400)
    assert limits[-60:].count(4) >= 60 - 3 * TRY_STEPS


def test_a_try_measures_its_rung_afresh() -> None:
    # Plain steps timed while something else slowed the machine look three times dearer
    # than they are, so drafting is chosen (and a try of plain would waste so much that the
    # budget would put the next one off for 500 steps); then drafts stop being accepted and
    # the machine is itself again. The next try of plain sees its true cost, and the choice
    # turns once the reach of a draft has fallen: where a try only nudged the old average
    # (to 2.3 from 3.0), drafting at 1.3 would have stayed the choice.
    policy = DraftPolicy(max_drafts=1, explore_every=8)
    _steps(policy, 64, accepts=1, n=30, seconds={0: 3.0, 1: 1.3})
    limits = _steps(policy, 64, accepts=0, n=60, seconds={0: 1.0, 1: 1.3})
    assert policy.summary()["64"]["0"] == pytest.approx(1.0)
    assert limits[-30:].count(1) <= TRY_STEPS


def test_a_plain_cost_from_another_workload_does_not_keep_a_group_drafting() -> None:
    # Copying: plain steps (long contexts) cost 1.2, a verify of 4 drafts 2.2, every draft
    # accepted. Then free writing: plain steps cost 1.0, and a verify 1.1 (few requests
    # carry drafts), none accepted. Judged against the copy's plain cost, drafting would
    # stay the choice for good (1.1 < 0.95 x 1.2); tries of plain, due sooner as the
    # choice's saving over plain shrinks, measure plain's cost now and the choice turns.
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    _steps(policy, 64, accepts=4, n=100, seconds={0: 1.2, 1: 1.4, 2: 1.6, 4: 2.2})
    assert policy.draft_limit() == 4
    cheap = {0: 1.0, 1: 1.1, 2: 1.1, 4: 1.1}
    limits = _steps(policy, 64, accepts=0, n=200, seconds=cheap)
    assert policy.summary()["64"]["0"] == pytest.approx(1.0)
    turned = next(i for i in range(len(limits)) if set(limits[i:]) <= {0, 1})
    assert turned < 40
    # Without those tries (a budget that puts them off for good) the group still turns: a
    # verify's seconds count as at least plain's, so drafts that are never accepted cannot
    # look cheaper than plain, however stale plain's cost.
    stale = DraftPolicy(
        max_drafts=4, explore_every=8, max_explore_every=10_000, baseline_budget=1e-9
    )
    _steps(stale, 64, accepts=4, n=100, seconds={0: 1.2, 1: 1.4, 2: 1.6, 4: 2.2})
    limits = _steps(stale, 64, accepts=0, n=200, seconds=cheap)
    assert limits[-60:].count(0) >= 60 - TRY_STEPS  # a try of 1 at most


def test_a_fresh_reach_caps_the_stale_reaches_of_the_drafts_after_it() -> None:
    # Copying at batch 64: every draft accepted, 4 is the choice. Then free writing, where
    # one request in 16 accepts one draft, measured by steps at 1 only (tries of plain's
    # neighbour, after the choice turned within a step or two at 4): they refresh the
    # first draft's reach, and the reaches of drafts 2-4 stay the copy's. A request
    # accepts a second draft only if it accepted the first, so no reach can exceed an
    # earlier one: taken as measured, the stale reaches make 4 cost 1.6 / 4.06 a token,
    # far below plain's 1.0, and have it chosen (on a 2-core Zen 4, at concurrency 64, 3
    # steps at 7 drafts after every few tries of 1, each 2.2x a plain step); capped at the
    # first's (1 in 16, once its average settles), it costs 1.6 / 1.25.
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    seconds = {0: 1.0, 1: 1.3, 2: 1.45, 4: 1.6}
    _steps(policy, 64, accepts=4, n=100, seconds=seconds)
    assert policy.draft_limit() == 4
    for _ in range(6 * TRY_STEPS):
        policy.observe(64, 1, 1.3 * 64, [1] * 4 + [0] * 60)
    for _ in range(TRY_STEPS):
        policy.observe(64, 0, 1.0 * 64)
    first = policy.groups[64].reach[0].value
    assert first < 0.1 and policy.groups[64].reach[3].value == pytest.approx(1.0)
    assert policy.summary()["64"]["4"] == pytest.approx(1.6 / (1 + 4 * first))
    assert set(_steps(policy, 64, accepts=0, n=40, seconds=seconds)) <= {0, 1}


def test_where_drafting_saves_much_tries_of_plain_are_rare() -> None:
    # Every draft accepted: 4 drafts cost 2.2 for 5 tokens against plain's 1.0. A try of
    # plain wastes 3 x (1.0 / 0.44 - 1) steps' worth: within 2% of the group's steps, the
    # tries come every 192 steps or so (at most every `max_explore_every`).
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    limits = _steps(policy, 64, accepts=4, n=1000)
    plain = _runs(limits[4 * TRY_STEPS :], 0)
    assert 2 <= len(plain) <= 6 and all(length == TRY_STEPS for _, length in plain)


def test_tries_grow_rarer_while_they_confirm_the_choice_and_reset_when_it_turns() -> None:
    seconds = {0: 1.0, 1: 1.2}
    # Only the neighbours' tries (plain is the choice's neighbour; no tries of it besides).
    policy = DraftPolicy(
        max_drafts=1,
        explore_every=8,
        max_explore_every=64,
        explore_budget=1.0,
        baseline_budget=1e-9,
    )
    limits = _steps(policy, 1, accepts=1, n=400, seconds=seconds)  # 0.6 a token drafting
    starts = [start for start, _ in _runs(limits, 0)][1:]  # after the first measurement
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[:3] == sorted(gaps[:3]) and gaps[1] >= 2 * gaps[0] - TRY_STEPS
    assert max(gaps) <= 64 + TRY_STEPS and gaps[-1] == gaps[-2]  # capped
    # Drafts stop paying: the choice turns within a few steps, and the tries of drafting
    # come within `explore_every` steps again, then rarer as they confirm the new choice.
    limits = _steps(policy, 1, accepts=0, n=300, seconds=seconds)
    drafting = _runs(limits, 1)
    turned = drafting[0][0] + drafting[0][1]  # the end of the drafting it was doing
    assert turned <= 40  # the reach of a draft falls from 1 to 0.2 in ~31 steps
    tries = drafting[1:]
    assert tries[0][0] - turned <= 8 + TRY_STEPS
    assert all(length == TRY_STEPS for _, length in tries[:-1])  # the last may be cut off
    starts = [start for start, _ in tries]
    assert starts[2] - starts[1] > starts[1] - starts[0]


def test_the_climb_stops_where_no_rung_above_can_win() -> None:
    # Batch 64: a verify of one draft a request costs 2.5x a plain step, and a tenth of the
    # requests accept theirs. Even if every further draft were accepted as often, a step of
    # 4 drafts (at least 2.5x plain) would commit 1.375 tokens a request: 2 and 4 are not
    # measured.
    policy = DraftPolicy(max_drafts=4, explore_every=10_000)
    seconds = {0: 1.0, 1: 2.5, 2: 3.0, 4: 4.0}
    for _ in range(40):
        limit = policy.draft_limit()
        accepted = [1] * 6 + [0] * 58 if limit else None
        policy.observe(64, limit, seconds[limit] * 64, accepted)
    assert set(policy.summary()["64"]) == {"0", "1"}
    assert policy.draft_limit() == 0


def test_the_climb_goes_on_past_losing_rungs_while_the_top_one_could_win() -> None:
    # Batch 4 on a 2-core Zen 3: any draft takes the projections past their low-bit rows to
    # the dense copy, so a step's cost jumps at 1 draft and hardly grows above (seconds per
    # request, measured in ms). Here 10 requests with those costs, 9 of which accept every
    # draft (a share of 10 is finer than one of 4): 1 and 2 drafts lose
    # (22.75 / 1.9 and 24.75 / 2.8 a token against 8.45), 4 wins (30.1 / 4.6). After 1, the
    # next rung could win only at 22.75 / 2.8 (not by the margin); the top one at 22.75 / 4.6.
    policy = DraftPolicy(max_drafts=4, explore_every=10_000)
    seconds = {0: 8.45, 1: 22.75, 2: 24.75, 4: 30.1}
    policy.batch, limits = 10, []
    for _ in range(40):
        limit = policy.draft_limit()
        limits.append(limit)
        accepted = [limit] * 9 + [0] if limit else None
        policy.observe(10, limit, seconds[limit] * 10, accepted)
    assert limits[: 4 * TRY_STEPS] == [r for r in (0, 1, 2, 4) for _ in range(TRY_STEPS)]
    assert set(limits[4 * TRY_STEPS :]) == {4}


@pytest.mark.parametrize(("low_bit_rows", "chosen"), [(None, 4), (4, 0), (24, 4)])
def test_rungs_whose_verify_steps_leave_the_low_bit_weights_need_a_wider_margin(
    low_bit_rows: int | None, chosen: int
) -> None:
    # Batch 4, every draft accepted (copying), Zen 3's costs: any draft takes a verify step
    # past 4 rows to the dense copy; 4 drafts save 8.8% a token (7.7 against 8.44 ms), 2
    # drafts 2%. Enough by DRAFT_MARGIN, not by DENSE_MARGIN: with the low-bit weights read
    # up to 4 rows plain is kept; up to 24 rows (gguf_a8 on AVX2) a verify of 4 x 5 rows
    # still reads them.
    policy = DraftPolicy(max_drafts=4, explore_every=10_000, low_bit_rows=low_bit_rows)
    seconds = {0: 8.44, 1: 22.6, 2: 24.8, 4: 38.5}
    limits = _steps(policy, 4, accepts=4, n=4 * TRY_STEPS + 10, seconds=seconds)
    assert set(policy.summary()["4"]) == {"0", "1", "2", "4"}  # the climb measured them all
    assert set(limits[4 * TRY_STEPS :]) == {chosen}


def test_a_group_that_straddles_the_low_bit_rows_takes_the_wider_margin() -> None:
    # gguf_a8 on AVX2 reads the low-bit weights up to 24 rows: batch 20 (group 32) does on
    # plain steps, and any verify leaves them, though batch 32 plain does not.
    seconds = {0: 8.44, 1: 22.6, 2: 24.8, 4: 38.5}
    for rows, chosen in ((24, 0), (16, 4)):
        policy = DraftPolicy(max_drafts=4, explore_every=10_000, low_bit_rows=rows)
        limits = _steps(policy, 20, accepts=4, n=4 * TRY_STEPS + 10, seconds=seconds)
        assert set(limits[4 * TRY_STEPS :]) == {chosen}, rows


def test_a_rung_within_the_low_bit_rows_keeps_the_usual_margin() -> None:
    # Batch 1, low-bit weights up to 4 rows: 1 draft saves nothing, 2 drafts (3 rows) 8%,
    # 4 drafts (5 rows, the dense copy) 12%: 2 drafts are chosen by DRAFT_MARGIN, 4 would
    # need DENSE_MARGIN.
    seconds = {0: 1.0, 1: 2.0, 2: 2.76, 4: 4.4}
    for rows, chosen in ((4, 2), (None, 4)):
        policy = DraftPolicy(max_drafts=4, explore_every=10_000, low_bit_rows=rows)
        limits = _steps(policy, 1, accepts=4, n=4 * TRY_STEPS + 10, seconds=seconds)
        assert set(limits[4 * TRY_STEPS :]) == {chosen}, rows


def test_tries_of_a_losing_rung_waste_at_most_the_budget() -> None:
    # Plain is chosen; a try of one draft costs 2.5 / 1.1 of plain a token. Its TRY_STEPS
    # steps waste ~3.8 plain steps, so tries come no more often than every 3.8 / 0.02 steps.
    policy = DraftPolicy(max_drafts=1, explore_every=8, max_explore_every=64)
    seconds = {0: 1.0, 1: 2.5}
    limits = []
    for _ in range(2000):
        limit = policy.draft_limit()
        limits.append(limit)
        accepted = [1] * 10 + [0] * 90 if limit else None
        policy.observe(100, limit, seconds[limit] * 100, accepted)
    tries = _runs(limits, 1)[1:]  # after the first measurement
    assert len(tries) >= 4
    starts = [start for start, _ in tries]
    assert min(b - a for a, b in zip(starts, starts[1:], strict=False)) >= 3.8 / 0.02
    between = limits[starts[0] : starts[-1]]  # whole periods: tries and the steps after
    wasted = sum(seconds[limit] / (1.1 if limit else 1.0) - 1.0 for limit in between)
    assert wasted <= 0.02 * len(between)


def test_steps_after_a_change_between_drafting_and_plain_add_no_seconds() -> None:
    # A plain step right after a verify has nothing to overlap: its cost is not plain's.
    policy = DraftPolicy(max_drafts=4)
    policy.observe(1, 4, 1.0, [1])
    policy.observe(1, 0, 100.0)  # the change: no seconds
    assert policy.summary()["1"] == {"4": 0.5}
    policy.observe(1, 0, 0.4)
    assert policy.summary()["1"] == {"0": 0.4, "4": 0.5}
    policy.observe(1, 2, 100.0, [1])  # the change back: its acceptance counts, not its time
    policy.observe(1, 1, 0.6, [1])  # between drafting limits: no change of way
    assert policy.summary()["1"] == {"0": 0.4, "1": 0.3, "4": 0.5}


@pytest.mark.parametrize(("accepting", "drafts"), [(3, False), (4, False), (7, True)])
def test_drafting_is_chosen_only_where_it_saves_a_margin_of_plains_cost(
    accepting: int, drafts: bool
) -> None:
    # Steps cost the same with and without a draft; `accepting` requests of 100 accept
    # theirs: drafting commits 1.03, 1.04 or 1.07 tokens a request for plain's 1, 2.9%,
    # 3.8% or 6.5% less a token (DRAFT_MARGIN: 5%).
    policy = DraftPolicy(max_drafts=1, explore_every=10_000)
    for _ in range(2 * TRY_STEPS + 10):
        limit = policy.draft_limit()
        accepted = [1] * accepting + [0] * (100 - accepting) if limit else None
        policy.observe(100, limit, 100.0, accepted)
    costs = policy.summary()["128"]
    assert costs["1"] < costs["0"]  # drafting is cheaper per token ...
    chosen = policy.groups[128].cheapest(policy.rungs)
    assert chosen == (1 if drafts else 0)  # ... but not always by enough


def test_each_batch_size_group_decides_for_itself() -> None:
    policy = DraftPolicy(max_drafts=2, explore_every=1000)
    _steps(policy, 1, accepts=2, n=3 * TRY_STEPS)  # 1.5 / 3 a token at limit 2
    _steps(policy, 64, accepts=2, n=3 * TRY_STEPS, seconds={0: 1.0, 1: 2.5, 2: 4.0})
    policy.batch = 1
    assert policy.draft_limit() == 2
    policy.batch = 64
    assert policy.draft_limit() == 0  # batch 64: plain is cheaper
    assert set(policy.summary()) == {"1", "64"}


def test_a_workload_that_never_drafts_turns_plain() -> None:
    # No request drafts (all constrained, say): a step planned to draft is a plain step
    # that did not overlap, and commits one token per request.
    policy = DraftPolicy(max_drafts=4)
    limits = _steps(policy, 8, accepts=0, n=40, seconds={0: 1.0, 1: 1.1, 2: 1.1, 4: 1.1})
    assert set(limits[4 * TRY_STEPS :]) <= {0, 1} and limits[-1] == 0


def test_a_policy_that_is_not_adaptive_always_drafts_the_maximum() -> None:
    policy = DraftPolicy(max_drafts=4, adaptive=False)
    seconds = {0: 1.0, 4: 5.0}
    assert _steps(policy, 8, accepts=0, n=100, seconds=seconds) == [4] * 100


def test_shadow_drafts_that_would_lose_keep_plain_without_a_try() -> None:
    # Shadows say no draft would be accepted: no rung could save anything, so after
    # plain's first measure (48 would-be verifies) every step is plain, with no try of a
    # drafting rung (within the refresh interval).
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    policy.batch = 16
    limits = _shadowed_steps(policy, 16, accepts=0, n=600)
    assert set(limits) == {0}
    # Without shadows (a draft model), the same workload tries 1 now and then.
    blind = DraftPolicy(max_drafts=4, explore_every=8)
    assert 1 in _steps(blind, 16, accepts=0, n=600)


def test_a_measured_rung_that_shadows_say_would_lose_is_refreshed_rarely() -> None:
    # At batch 64, one draft a request makes a step cost twice plain's; shadows say one
    # request in ten would accept it. Measured once, that rung loses even 10% cheaper, so
    # it is tried again only at the refresh interval, not every 64-256 steps.
    seconds = {0: 1.0, 1: 2.0, 2: 2.2, 4: 2.6}
    policy = DraftPolicy(max_drafts=4, explore_every=8, max_refresh_every=400)
    policy.observe(64, 0, 64.0, None, [57, 7, 0, 0, 0])
    for _ in range(TRY_STEPS):  # the first measure of plain, then of 1 (forced here)
        policy.observe(64, 0, 64.0, None, [57, 7, 0, 0, 0])
    for _ in range(TRY_STEPS):
        policy.observe(64, 1, 128.0, [1] * 6 + [0] * 58)
    limits = []
    for _ in range(1000):
        limit = policy.draft_limit()
        limits.append(limit)
        shadow = [57, 7, 0, 0, 0] if limit == 0 else None
        accepted = [1] * 6 + [0] * 58 if limit else None
        policy.observe(64, limit, seconds[limit] * 64, accepted, shadow)
    tries = _runs(limits, 1)
    assert 1 <= len(tries) <= 3, tries
    assert all(start >= 390 for start, _ in tries), tries


def test_shadow_drafts_that_would_win_start_the_climb_and_turn_a_workload_to_drafting() -> None:
    # At batch 1 the first few shadows are too few to judge the drafts by (`SHADOWS_KNOWN`):
    # 1 is measured once, and loses.
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    limits = _shadowed_steps(policy, 1, accepts=0, n=200)
    assert limits[: 2 * TRY_STEPS] == [0] * TRY_STEPS + [1] * TRY_STEPS
    assert set(limits[2 * TRY_STEPS :]) == {0}
    # The workload turns to copying: shadows see every draft accepted, and the climb
    # measures the rungs at once, without waiting for a try.
    limits = _shadowed_steps(policy, 1, accepts=4, n=80)
    assert next(i for i, limit in enumerate(limits) if limit) <= 5
    assert limits[-20:].count(4) >= 20 - 2 * TRY_STEPS


def test_shadow_reaches_do_not_stop_the_climb_once_a_rung_drafts() -> None:
    # Shadows saw one draft a request accepted (a copy's preamble), then the verifies accept
    # every draft. Once a rung drafts, the reaches of the drafts above it are the shadows'
    # stale ones: the climb judges the rungs above as it does without shadows (every added
    # draft reaching as far as the last one measured), and reaches the top, which the tries
    # of it then choose (its first measure's reaches averaged with the stale ones).
    policy = DraftPolicy(max_drafts=4, explore_every=8)
    limits = []
    for _ in range(120):
        limit = policy.draft_limit()
        limits.append(limit)
        shadow = None if limit else [0, 1, 0, 0, 0]
        accepted = [limit] if limit else None
        policy.observe(1, limit, SECONDS[limit], accepted, shadow)
    assert limits[: 4 * TRY_STEPS] == [r for r in (0, 1, 2, 4) for _ in range(TRY_STEPS)]
    assert limits[-40:].count(4) >= 40 - 2 * TRY_STEPS
