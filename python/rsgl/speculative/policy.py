"""When speculation pays: a per-batch-size choice from the step costs the loop measures.

A verify step computes 1 + k tokens per drafting request and commits each one's accepted
drafts plus one token; a plain decode step computes and commits one token per request. Which
is cheaper per committed token depends on the machine (on a CPU a verify of 5 tokens at batch
1 costs ~1.3-2.4x a decode, at batch 64 ~3x), on the batch size and on how often the
workload's drafts are accepted, so it is measured rather than assumed. Decode steps are
grouped by batch size (powers of two), and for each group the seconds per committed token of
each way of running are kept as an exponential average of step seconds over one of step
tokens (a ratio of averages: drafting steps commit 1 to k + 1 tokens each, and an average
of per-step ratios would weigh a step that committed one token as much as one that
committed five). The two ways: drafting (steps planned with a draft
limit, which wait for the step before them, whether or not any request found drafts) and
plain (steps that overlap). A step just after a change of way is not measured: it pays the
change (a plain step after a verify has nothing to overlap with). A group drafts while
drafting costs less per token; a group without both figures tries each, and the losing way
is tried again (two steps: the change, then one measured) every `explore_every` steps of the
group, so that a change in the workload (drafts accepted more or less often) is noticed. A
try that confirms the choice doubles the group's interval (up to `max_explore_every`: at
batch 64 a verify step costs ~3 plain ones); a turn of the choice resets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest step in a group's averages.
ALPHA = 0.2
# Steps of a try of the other way: the change, then one measured step.
TRY_STEPS = 2


@dataclass(slots=True)
class _Way:
    """The exponential averages of one way's step seconds and step tokens."""

    seconds: float
    tokens: float

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += ALPHA * (seconds - self.seconds)
        self.tokens += ALPHA * (tokens - self.tokens)

    @property
    def cost(self) -> float:
        """Seconds per committed token."""
        return self.seconds / self.tokens


@dataclass(slots=True)
class _Group:
    """One batch-size group's ways (None: not measured yet), the steps between tries of the
    way it does not choose (0: `explore_every`), the steps since the last try, and the steps
    left of a try under way."""

    drafting: _Way | None = None
    plain_way: _Way | None = None
    interval: int = 0
    since_try: int = 0
    trying: int = 0

    @property
    def verify(self) -> float | None:
        return None if self.drafting is None else self.drafting.cost

    @property
    def plain(self) -> float | None:
        return None if self.plain_way is None else self.plain_way.cost

    def add(self, drafting: bool, seconds: float, tokens: int) -> None:
        """One step, into the averages of its way."""
        way = self.drafting if drafting else self.plain_way
        if way is not None:
            way.add(seconds, tokens)
        elif drafting:
            self.drafting = _Way(seconds, tokens)
        else:
            self.plain_way = _Way(seconds, tokens)


@dataclass(slots=True)
class DraftPolicy:
    """Chooses each decode step's draft limit (`max_drafts` or 0) from measured costs."""

    max_drafts: int
    adaptive: bool = True  # False: every step may draft (SGLang's behaviour)
    explore_every: int = 64
    max_explore_every: int = 1024
    groups: dict[int, _Group] = field(default_factory=dict)
    batch: int = 1  # the last decode step's batch size: the next one's best guess
    _last_way: bool | None = None  # whether the last observed step was planned to draft

    @staticmethod
    def group_of(batch: int) -> int:
        """The group of a batch size: its power-of-two ceiling (1, 2, 4, 8, ...)."""
        return 1 << max(0, batch - 1).bit_length()

    def draft_limit(self) -> int:
        """The drafts per request the next step may carry."""
        if not self.adaptive:
            return self.max_drafts
        group = self.groups.setdefault(self.group_of(self.batch), _Group())
        if group.verify is None:
            return self.max_drafts
        if group.plain is None:
            return 0
        speculate = group.verify < group.plain
        if group.trying > 0:
            group.trying -= 1
            speculate = not speculate
        else:
            group.since_try += 1
            if group.since_try >= (group.interval or self.explore_every):
                group.since_try, group.trying = 0, TRY_STEPS - 1
                speculate = not speculate  # keep the other figure fresh
        return self.max_drafts if speculate else 0

    def observe(
        self, batch: int, drafting: bool, seconds: float, tokens: int, drafted: bool | None = None
    ) -> None:
        """A decode step of `batch` requests, planned to draft or not (and whether any
        request drafted; None: as planned), took `seconds` and committed `tokens`. A step
        planned to draft in which no request drafted (all paused, constrained or without a
        match) counts for the drafting way only until the group has seen a verify: so that
        a workload that never drafts turns plain (and overlaps), while a verify's cost is
        not diluted by its paused neighbours (each request's pause is its own decision)."""
        self.batch = batch
        changed = self._last_way is not None and drafting != self._last_way
        self._last_way = drafting
        if tokens <= 0 or changed:
            return
        group = self.groups.setdefault(self.group_of(batch), _Group())
        if drafting and drafted is False and group.verify is not None:
            return
        if group.verify is None or group.plain is None:
            group.add(drafting, seconds, tokens)
            return
        chosen = group.verify < group.plain  # whether the group drafts now
        group.add(drafting, seconds, tokens)
        if (group.verify < group.plain) != chosen:  # the choice turns: watch it closely
            group.interval, group.since_try, group.trying = self.explore_every, 0, 0
        elif drafting != chosen:  # a try of the other way confirmed the choice
            group.interval = min(2 * (group.interval or self.explore_every), self.max_explore_every)

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Each group's seconds per committed token drafting and plain."""
        return {
            str(size): {"verify_s_per_token": g.verify, "plain_s_per_token": g.plain}
            for size, g in sorted(self.groups.items())
        }


__all__ = ["DraftPolicy"]
