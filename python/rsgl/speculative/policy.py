"""When speculation pays: a per-batch-size choice from the step costs the loop measures.

A verify step computes 1 + k tokens per drafting request and commits each one's accepted
drafts plus one token; a plain decode step computes and commits one token per request. Which
is cheaper per committed token depends on the machine (on a CPU a verify of 5 tokens at batch
1 costs ~1.3-2.4x a decode, at batch 64 ~3x), on the batch size and on how often the
workload's drafts are accepted, so it is measured rather than assumed: decode steps are
grouped by batch size (powers of two), and for each group an exponential average of seconds
per committed token is kept for steps with drafts and for steps without. A group drafts while
its verify steps cost less per token; a group without both figures tries each, and the
losing way is tried again every `explore_every` steps of the group, so that a change in the
workload (drafts accepted more or less often) is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest step in a group's averages.
ALPHA = 0.2


@dataclass(slots=True)
class _Group:
    """One batch-size group's averages (None: not measured yet) and its step count."""

    verify: float | None = None
    plain: float | None = None
    steps: int = 0


@dataclass(slots=True)
class DraftPolicy:
    """Chooses each decode step's draft limit (`max_drafts` or 0) from measured costs."""

    max_drafts: int
    explore_every: int = 64
    groups: dict[int, _Group] = field(default_factory=dict)
    batch: int = 1  # the last decode step's batch size: the next one's best guess

    @staticmethod
    def group_of(batch: int) -> int:
        """The group of a batch size: its power-of-two ceiling (1, 2, 4, 8, ...)."""
        return 1 << max(0, batch - 1).bit_length()

    def draft_limit(self) -> int:
        """The drafts per request the next step may carry."""
        group = self.groups.setdefault(self.group_of(self.batch), _Group())
        group.steps += 1
        if group.verify is None:
            return self.max_drafts
        if group.plain is None:
            return 0
        speculate = group.verify < group.plain
        if group.steps % self.explore_every == 0:
            speculate = not speculate  # keep the other figure fresh
        return self.max_drafts if speculate else 0

    def observe(self, batch: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A decode step of `batch` requests (with drafts or not) took `seconds` and
        committed `tokens`."""
        self.batch = batch
        if tokens <= 0:
            return
        group = self.groups.setdefault(self.group_of(batch), _Group())
        cost = seconds / tokens
        old = group.verify if drafted else group.plain
        new = cost if old is None else old + ALPHA * (cost - old)
        if drafted:
            group.verify = new
        else:
            group.plain = new

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Each group's seconds per committed token with and without drafts."""
        return {
            str(size): {"verify_s_per_token": g.verify, "plain_s_per_token": g.plain}
            for size, g in sorted(self.groups.items())
        }


__all__ = ["DraftPolicy"]
