"""When speculation pays, and how far: a per-batch-size choice of the drafts per request,
from what the loop measures.

A verify step computes 1 + k tokens per drafting request and commits each one's accepted
drafts plus one token; a plain decode step computes and commits one token per request. Which
k is cheapest per committed token depends on the machine (on a CPU a verify of 5 tokens per
request costs ~1.5x a decode at batch 1 but ~3.8x at batch 4, where 2 tokens per request
cost ~1.5x), on the batch size and on how often the workload's drafts are accepted, so it is
measured rather than assumed. Decode steps are grouped by batch size (powers of two), and
each group chooses among the draft limits of a ladder (0, the powers of two below the
configured maximum, the maximum) the one whose expected seconds per committed token,

    cost(k) = seconds per request of a step at limit k / (1 + reach_1 + ... + reach_k),

is least (plain unless drafting saves `DRAFT_MARGIN` of its cost: the two are measured at
different times, on machines whose speed drifts; `DENSE_MARGIN` where the rung's verify
steps leave the low-bit weights that plain steps read). The seconds are an exponential average
per limit (they depend on the machine and
the batch, and hardly vary from step to step; a try of a rung measures it afresh, so a
speed measured minutes earlier, when the VM or another process slowed every step, cannot
keep the choice where it was); reach_j is the share of requests that accept
at least j drafts at steps that allow j, averaged over every such step and capped by
each earlier draft's (`_Group.reaches`; a request accepts
its j-th draft under a limit of k >= j exactly when it would under any other: n-gram and
draft-model proposals of a lower limit are a prefix of a higher one's). So the acceptance
that decides between the limits up to the one in use is measured on every step, not only
when each limit runs, and a share per request varies far less than a step's committed tokens
(1 to k + 1 at batch 1). Requests that do not draft (paused after rejections, constrained,
no match) count as accepting none.

While plain runs, n-gram drafting still measures every draft's reach: the core proposes
each request the drafts a verify would carry and checks them against the tokens plain steps
commit (shadow drafts, `Scheduler.take_shadow_accepts`), which is what the verify would
have accepted (the same greedy tokens; for sampled ones, the same probability). So a group
whose shadows (`SHADOWS_KNOWN` of them at least) say that no rung could save its margin
does not climb to the rungs, and while plain is its choice it does not try them for their
seconds more often than every `max_refresh_every` steps (a rung measured once is judged as
if its steps had become `SECONDS_DRIFT` cheaper since); a workload whose drafts start to be
accepted is seen on the next steps. A draft model has no shadows (its drafts cost a
forward), and its groups try their rungs as described below.

A rung's steps count as costing at least plain's (`_Group.step_seconds`): a verify computes
what a plain step does and more, and does not overlap.

Steps planned with a draft limit wait for the step before them (whether or not any request
found drafts); plain steps (limit 0) overlap. A step just after a change between the two
adds no seconds: it pays the change (a plain step after a verify has nothing to overlap
with).

Measuring a rung costs what it wastes when it loses: at batch 64 on a 2-core Zen 3 a verify
of 3 drafts a request costs ~6x a plain step, and trying every rung once cost a short
serving run 10% of its time. So a group climbs its ladder from the bottom (`TRY_STEPS`
steps each: plain, then 1 draft), and measures the next rung only while it or a rung above
it could still win: their steps cost at least the rung below's, and the drafts they add can
be accepted at most as often as the last one measured, so the top rung is the one to ask.
Asking only the next rung stops the climb too early where a step's cost jumps: on a 2-core
Zen 3 at batch 4, 1 draft a request took the projections past their low-bit rows to the
dense copy (`low_bit_max_rows`: 91 ms a step against 33.8 plain; since the blocks serve up
to 24 rows on AVX2, about 21 against 18), 2 drafts cost 99 ms and 4
drafts 120 ms, so where 91% of every draft is accepted 1 and 2 lose (11.9 and 8.8 ms a token
against 8.45) while 4 wins (6.5); after 1, the next rung could win only at 8.07 ms a token,
not by the margin. It then runs the cheapest rung, and tries a neighbour of it
(above and below in turn) now and then, so that the reach above the choice and the seconds
of its neighbours stay fresh and a change in the workload is followed a rung at a time. A
try that leaves the choice as it was doubles the group's interval (up to
`max_explore_every`), and the interval before a try of a drafting rung is at least what
keeps the try's waste (its extra seconds per committed token over the choice's) within
`explore_budget` of the group's steps (a try of plain, the way back to no speculation, is
never put off longer); a turn of the choice resets it. While the choice drafts, plain is
tried besides, as often as a budget of what those tries would waste allows
(`_plain_every`): it is the baseline every rung is judged against.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import ceil, sqrt

# Weight of the newest step in a limit's seconds, and in a reach: a share of the step's
# requests, as noisy as 1 / sqrt(batch), so a step of one request weighs REACH_ALPHA and
# one of 16 or more ALPHA (a workload that stops accepting is followed within a few steps
# of 64 requests, each of which may cost a few plain ones). A new average weighs its first
# steps 1/n each.
ALPHA = 0.2
REACH_ALPHA = 0.05
# How much cheaper, relative to plain's, a rung's steps may have become since they were
# last measured (the VM's drift within a minute, `DRAFT_MARGIN`'s): a rung that shadow
# drafts say would lose even so is not tried for its seconds (`_Group.could_win`).
SECONDS_DRIFT = 0.1
# Would-be verifies (shadow drafts) a group's reaches must rest on before they, rather than
# the best case of drafts not measured yet, decide whether the climb goes on. On a Xeon,
# copying at concurrency 1 judged 7 drafts by the reaches of the 3 plain steps before its
# climb (the answer's preamble, which drafts nothing) and stayed at 2 and 4 drafts: 2.7x
# plain's tok/s, where 7 drafts made 3.5x.
SHADOWS_KNOWN = 32
# Steps of a try of a draft limit (the first is the change between drafting and plain, if
# it is one).
TRY_STEPS = 3
# The share of plain's cost per committed token that drafting must be expected to save to be
# chosen. Plain's seconds and a drafting limit's are measured at different times (a try
# every 64-256 steps), and a VM's speed drifts by 5-10% within a minute: on a 2-core Zen 3,
# free writing at temperature 0.7 and concurrency 16 measured drafting 0.2% cheaper than
# plain (steps ~3% dearer, 2.8% of requests accepting a draft) while it served 7% fewer
# tokens per second than no speculation. A gain within the margin is not worth risking a
# loss as large.
DRAFT_MARGIN = 0.05
# The share of plain's cost per token a rung must save when its verify steps leave the
# low-bit weights for the dense copy where plain's steps read them (`low_bit_max_rows`).
# Such a rung's steps are bound by arithmetic where plain's are bound by memory, so the
# machine's drift moves the two apart, and what it can save is small: on a 2-core Zen 3 at
# batch 4 (when the dense copy took over at 5 rows), copying, a verify of up to 4 drafts a
# request cost 3.1-3.6x a plain step and committed 3.0-3.9 tokens a request (step logs of
# two runs): 7.70 ms a token against plain's 8.44 in one, 6.49 against 6.37 in the other,
# where the policy chose it for stretches of 20 steps (the bench measured speculation 16%
# slower there).
DENSE_MARGIN = 0.15
# The share of a group's time that tries of a losing rung may waste.
EXPLORE_BUDGET = 0.02


def ladder(max_drafts: int) -> list[int]:
    """The draft limits a policy chooses among: 0, the powers of two below `max_drafts`,
    and `max_drafts`."""
    rungs = [0]
    while 2 * rungs[-1] < max_drafts:
        rungs.append(max(1, 2 * rungs[-1]))
    return sorted({*rungs, max_drafts}) if max_drafts > 0 else [0]


@dataclass(slots=True)
class _Average:
    """An exponential average that weighs its first samples 1/n each (no bias to 0)."""

    value: float = 0.0
    count: int = 0

    def add(self, sample: float, alpha: float) -> None:
        self.count += 1
        self.value += max(alpha, 1.0 / self.count) * (sample - self.value)


@dataclass(slots=True)
class _Group:
    """One batch-size group's seconds per request by draft limit and its reaches
    (`reach[j]`: the share of requests accepting more than j drafts), the steps between
    tries of a neighbour of its choice (0: `explore_every`), the steps since the last try,
    the limit under a try (None: none) and the try's steps left, whether the try judges the
    choice (a neighbour's try, not a first measurement) and whether the choice turned during
    it, and which neighbour (above or below) the next try takes."""

    margins: dict[int, float]  # by drafting rung: the share of plain's cost it must save
    seconds: dict[int, _Average] = field(default_factory=dict)
    reach: list[_Average] = field(default_factory=list)
    interval: int = 0
    since_try: int = 0
    since_plain: int = 0
    trial: int | None = None
    trying: int = 0
    judging: bool = False
    turned: bool = False
    upward: bool = True
    shadows: int = 0  # the would-be verifies that measured its reaches (n-gram drafts)
    # `cost` by limit since its seconds and reaches last changed (`observe` clears it): a
    # step's choice asks for each rung's cost about 37 times (with it, `draft_limit` and
    # `observe` took 24 us a step on random streams of observations, 45 without; a Zen 4).
    costs: dict[int, float | None] = field(default_factory=dict)

    @property
    def shadowed(self) -> bool:
        """Whether shadow drafts measure its reaches."""
        return self.shadows > 0

    def reaches(self, limit: int) -> list[float]:
        """The reaches of the first `limit` drafts, none above an earlier one's. A request
        accepts draft j + 1 only if it accepts draft j, but the reaches are averaged over
        different steps: those of the drafts above the limits in use change only when a
        higher limit runs, and may be another workload's. On a 2-core Zen 4 at concurrency
        64, free writing after copying kept the copy's reaches of drafts 2-7 while tries of
        1 measured the first's at 0.07, and 7 drafts (steps 2.2x plain's) were chosen after
        every few tries."""
        capped, ceiling = [], 1.0
        for r in self.reach[:limit]:
            ceiling = min(ceiling, r.value)
            capped.append(ceiling)
        return capped

    def step_seconds(self, limit: int) -> float | None:
        """Seconds per request of a step at `limit` (None: not measured yet): at least
        plain's, once that is measured. A verify computes what a plain step computes and
        more, and does not overlap: measured cheaper, it was measured at a faster moment
        (on a Xeon at batch 1, free writing chose 1 draft for 14-43% of its ~880 steps and
        accepted 6-21 drafts, while that rung's steps cost 0-16% more than plain's)."""
        seconds = self.seconds.get(limit)
        if seconds is None:
            return None
        plain = self.seconds.get(0)
        return seconds.value if limit == 0 or plain is None else max(seconds.value, plain.value)

    def cost(self, limit: int) -> float | None:
        """Expected seconds per committed token at `limit` (None: not measured yet)."""
        if limit in self.costs:
            return self.costs[limit]
        seconds = self.step_seconds(limit)
        cost = None
        if seconds is not None and len(self.reach) >= limit:
            cost = seconds / (1.0 + sum(self.reaches(limit)))
        self.costs[limit] = cost
        return cost

    def target(self, rungs: list[int], rung: int) -> float:
        """The cost per token below which `rung` would be chosen: the choice's cost, or
        plain's less the rung's margin while plain is the choice (plain is measured)."""
        cheapest = self.cheapest(rungs)
        best = self.cost(cheapest)
        assert best is not None
        return best if cheapest > 0 else (1.0 - self.margins[rung]) * best

    def could_win(self, rungs: list[int], rung: int) -> bool:
        """Whether a try of drafting rung `rung` could turn the choice to it: while plain
        is the choice and shadow drafts keep every draft's reach current, whether it would
        win were its steps `SECONDS_DRIFT` cheaper than last measured (no cheaper than
        plain's; unknown: plain's). Otherwise it could: reaches of drafts above a drafting
        choice are measured only by tries, and a draft model has no shadows."""
        seconds, plain = self.seconds.get(rung), self.seconds.get(0)
        if not self.shadowed or plain is None or self.cheapest(rungs) > 0:
            return True
        low = plain.value if seconds is None else (1.0 - SECONDS_DRIFT) * seconds.value
        low = max(low, plain.value)
        return low / (1.0 + sum(self.reaches(rung))) < self.target(rungs, rung)

    def chosen(self, rungs: list[int]) -> int | None:
        """The measured rung that costs least per committed token of those that save their
        margin of plain's cost, else plain (None: a rung is still to be measured first).
        `rungs[0]` is plain."""
        if self.to_measure(rungs) is not None:
            return None
        return self.cheapest(rungs)

    def cheapest(self, rungs: list[int]) -> int:
        """`chosen` among the rungs measured (plain must be): the cheapest of those that
        save their margin of plain's cost, else plain."""
        plain = self.cost(rungs[0])
        assert plain is not None
        costs = {
            r: c
            for r in rungs[1:]
            if (c := self.cost(r)) is not None and c < (1.0 - self.margins[r]) * plain
        }
        return min(costs, key=costs.__getitem__) if costs else rungs[0]

    def to_measure(self, rungs: list[int]) -> int | None:
        """The lowest rung not measured yet, if it or a rung above it could still be the
        cheapest (None: every such rung is measured)."""
        if self.cost(rungs[0]) is None:
            return rungs[0]
        top = rungs[-1]
        # Every draft's reach is known once enough shadows measured it (a group's first few
        # at batch 1 may come from a copy's preamble, before anything is copied).
        known = self.shadows >= SHADOWS_KNOWN
        for below, rung in zip(rungs, rungs[1:], strict=False):
            if self.cost(rung) is not None:
                continue
            if below == 0 and not known:
                return rung  # nothing is known of the drafts' acceptance yet
            # Against plain: the smallest margin of the rungs still to measure.
            target = max(self.target(rungs, r) for r in rungs if r >= rung)
            # At best: the steps of this rung and those above it cost the rung below's, and
            # the top rung's drafts are accepted as often as measured (unknown: every added
            # draft reaches as far as the last one measured). The top rung adds the most.
            if known:
                tokens = 1.0 + sum(self.reaches(top))
            else:
                reaches = self.reaches(below)
                tokens = 1.0 + sum(reaches) + (top - below) * reaches[-1]
            seconds = self.step_seconds(below)
            assert seconds is not None
            return rung if seconds / tokens < target else None
        return None


@dataclass(slots=True)
class DraftPolicy:
    """Chooses each decode step's draft limit (a rung of `ladder(max_drafts)`) from
    measured costs."""

    max_drafts: int
    adaptive: bool = True  # False: every step may draft `max_drafts` (SGLang's behaviour)
    # Steps of up to this many rows read the low-bit weights; larger ones the dense copy,
    # bound by arithmetic (`low_bit_max_rows`; None: no low-bit weights): a group whose
    # verify steps would cross it where its plain steps do not judges those rungs by
    # DENSE_MARGIN.
    low_bit_rows: int | None = None
    explore_every: int = 64
    max_explore_every: int = 256
    # Most steps between tries of a rung that shadow drafts say would lose (`could_win`):
    # its seconds, relative to plain's, are measured afresh this often all the same.
    max_refresh_every: int = 1024
    explore_budget: float = EXPLORE_BUDGET
    baseline_budget: float = EXPLORE_BUDGET  # the same for tries of plain (`_plain_every`)
    groups: dict[int, _Group] = field(default_factory=dict)
    batch: int = 1  # the last decode step's batch size: the next one's best guess
    rungs: list[int] = field(init=False)
    _last_limit: int | None = None  # the draft limit the last observed step was planned with

    def __post_init__(self) -> None:
        self.rungs = ladder(self.max_drafts)

    @staticmethod
    def group_of(batch: int) -> int:
        """The group of a batch size: its power-of-two ceiling (1, 2, 4, 8, ...)."""
        return 1 << max(0, batch - 1).bit_length()

    def draft_limit(self) -> int:
        """The drafts per request the next step may carry."""
        if not self.adaptive:
            return self.max_drafts
        group = self._group(self.group_of(self.batch))
        if group.trying > 0:
            group.trying -= 1
            assert group.trial is not None
            return group.trial
        if group.trial is not None:  # a try ended: did it leave the choice as it was?
            if group.judging and not group.turned:
                interval = min(2 * (group.interval or self.explore_every), self.max_explore_every)
                # A try of plain is the way back to speculation off's cost: its waste is not
                # budgeted (a slowdown while plain ran would put the next try off for good).
                if group.trial > 0:
                    interval = max(interval, self._budgeted(group, group.trial))
                group.interval = interval
            group.trial = None
        unmeasured = group.to_measure(self.rungs)
        if unmeasured is not None:
            return self._try(group, unmeasured, judging=False)
        chosen = group.cheapest(self.rungs)
        group.since_try += 1
        group.since_plain += 1
        if group.since_try < (group.interval or self.explore_every):
            if chosen > 0 and group.since_plain >= self._plain_every(group, chosen):
                # Every rung is judged against plain's cost: measure it now (the tries of
                # the choice's neighbours keep their schedule).
                return self._try(group, 0, judging=False, reschedule=False)
            return chosen
        at = self.rungs.index(chosen)
        neighbours = self.rungs[max(0, at - 1) : at] + self.rungs[at + 1 : at + 2]
        trial = neighbours[-1] if group.upward else neighbours[0]
        group.upward = not group.upward
        if (
            trial > 0
            and not group.could_win(self.rungs, trial)
            and group.since_try < self.max_refresh_every
        ):
            return chosen  # shadow drafts say it would lose: its steps need no new measure
        return self._try(group, trial, judging=True)

    def _group(self, size: int) -> _Group:
        """The group of batch-size group `size` (batches size / 2 + 1 .. size), made on first
        use with its margins: a rung whose verify rows (up to size x (1 + drafts)) leave the
        low-bit weights that a batch of the group reads on plain steps needs DENSE_MARGIN,
        the others DRAFT_MARGIN."""
        group = self.groups.get(size)
        if group is None:
            rows = self.low_bit_rows

            def dense(rung: int) -> bool:
                return rows is not None and size // 2 + 1 <= rows < size * (1 + rung)

            margins = {r: DENSE_MARGIN if dense(r) else DRAFT_MARGIN for r in self.rungs[1:]}
            group = self.groups[size] = _Group(margins)
        return group

    def _budgeted(self, group: _Group, trial: int) -> int:
        """The fewest steps between tries of `trial` that keep what a try of it wastes (its
        extra cost per token over the choice's, for `TRY_STEPS` steps) within the budget."""
        tried, chosen = group.cost(trial), group.cost(group.cheapest(self.rungs))
        if tried is None or chosen is None or tried <= chosen:
            return 0
        return ceil(TRY_STEPS * (tried / chosen - 1.0) / self.explore_budget)

    def _plain_every(self, group: _Group, chosen: int) -> int:
        """The steps between tries of plain while the choice drafts (besides the tries of
        its neighbours): what a try wastes if the choice is as cheap as measured (its
        saving over plain, for `TRY_STEPS` steps) kept within the budget, and at most
        `max_explore_every`. Plain's cost is the baseline every rung must beat by its
        margin, and the plain steps of a workload may cost less than those measured before
        it (shorter contexts, or one slow step in the average): after copying at batch 64 on
        a 2-core Zen 3, free writing drafted through a wave of 128 steps (0.79x plain's
        tok/s) against plain's cost in the copy's steps (230 ms a step, not 180), where no
        neighbour of the choice (4 or 7 drafts) was plain."""
        plain, best = group.cost(0), group.cost(chosen)
        if plain is None or best is None or best >= plain:
            return 0
        steps = ceil(TRY_STEPS * (plain / best - 1.0) / self.baseline_budget)
        return min(steps, self.max_explore_every)

    @staticmethod
    def _try(group: _Group, limit: int, judging: bool, reschedule: bool = True) -> int:
        """Starts a try of `limit` and returns it (`reschedule`: the next try of a neighbour
        counts its steps from this one). The try measures the rung's seconds afresh: its
        first step replaces the average (the machine's speed then is not its speed now),
        which the choice's own steps keep current."""
        group.trial, group.trying = limit, TRY_STEPS - 1
        group.judging, group.turned = judging, False
        if reschedule:
            group.since_try = 0
        if limit == 0:
            group.since_plain = 0
        seconds = group.seconds.get(limit)
        if seconds is not None:
            seconds.count = 0
        return limit

    def observe(
        self,
        batch: int,
        limit: int,
        seconds: float,
        accepted: Sequence[int] | None = None,
        shadow: Sequence[int] | None = None,
    ) -> None:
        """A decode step of `batch` requests, planned with draft limit `limit`, took
        `seconds`, and its requests accepted `accepted` drafts each (None: none). `shadow`
        (a plain step's): how many would-be verifies resolved since the last step accepted
        each number of drafts (`Scheduler.take_shadow_accepts`), which measure the reach of
        every draft while none is verified."""
        self.batch = batch
        last, self._last_limit = self._last_limit, limit
        if batch <= 0:
            return
        group = self._group(self.group_of(batch))
        before = group.chosen(self.rungs)
        group.costs.clear()  # its seconds and reaches change below
        counts = sorted(accepted) if accepted is not None else [0] * batch
        while len(group.reach) < limit:
            group.reach.append(_Average())
        steady = min(ALPHA, REACH_ALPHA * sqrt(batch))
        for j in range(limit):  # the share of requests that accepted more than j drafts
            # Reaches above the choice are measured by tries only: their steps weigh more.
            alpha = ALPHA if before is not None and j >= before else steady
            group.reach[j].add(1.0 - bisect_right(counts, j) / batch, alpha)
        counted = list(shadow or ()) if limit == 0 else []
        if resolved := sum(counted):
            group.shadows += resolved
            while len(group.reach) < self.max_drafts:
                group.reach.append(_Average())
            counted += [0] * self.max_drafts
            beyond, alpha = resolved, min(ALPHA, REACH_ALPHA * sqrt(resolved))
            for j in range(self.max_drafts):
                beyond -= counted[j]  # would-be verifies accepting more than j drafts
                group.reach[j].add(beyond / resolved, alpha)
        if last is None or (last > 0) == (limit > 0):  # not the step of a change of way
            group.seconds.setdefault(limit, _Average()).add(seconds / batch, ALPHA)
        after = group.chosen(self.rungs)
        if before is not None and after != before:  # the choice turns: watch it closely
            group.interval, group.since_try, group.turned = self.explore_every, 0, True

    def summary(self) -> dict[str, dict[str, float]]:
        """Each group's expected seconds per committed token at each measured draft limit."""
        summary: dict[str, dict[str, float]] = {}
        for size, group in sorted(self.groups.items()):
            costs = {r: group.cost(r) for r in self.rungs}
            summary[str(size)] = {str(r): c for r, c in costs.items() if c is not None}
        return summary


__all__ = ["DraftPolicy", "ladder"]
