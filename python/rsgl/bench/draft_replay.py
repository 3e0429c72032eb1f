"""Replaying a model's outputs through n-gram drafters: the tokens a verify step would commit.

A greedy request's output is fixed, so how many drafts a verify step would accept does not
depend on timing: walk each output from its first token, propose drafts from the request's
committed tokens (prompt and output so far), keep the longest run of them that the output
continues with, commit that run and the next token (the verify's bonus), and go on. The mean
committed per step is what speculation multiplies a decode step's tokens by, before what a
verify step costs more than a decode step (`rsgl bench speculative --parts verify-cost`).

Drafters compared at the same number of drafted tokens k (a verify step's rows):
- `chain`: the scheduler's own (`rsgl._core.NgramDrafter`): the k tokens that followed the
  most recent earlier occurrence of the longest matching suffix;
- `tree`: k tokens as a tree (SGLang's NGRAM verifies trees): the continuations of up to
  `TREE_OCCURRENCES` recent occurrences of every matching suffix, merged by their common
  prefixes, each node weighted by the lengths of the matches through it, the k heaviest
  kept (a node weighs at least its children, so they form a tree from the root); the step
  keeps the deepest node on the output's path;
- `shared`: the chain over the request's tokens after those of the requests before it (with
  other prompts), as an index shared across requests (SGLang's) would draft.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rsgl._core import NgramDrafter

# Recent occurrences of each matching suffix that a tree draws its branches from.
TREE_OCCURRENCES = 8
# The longest suffix the scheduler's drafter matches (`crate::drafter::MAX_WINDOW`).
MAX_WINDOW = 64
# Ends a request in a shared index: no n-gram holding it is indexed, so none spans two
# requests, and no continuation runs past a request's end.
_SEPARATOR = -1
DRAFTERS = ("chain", "tree", "shared")


class OccurrenceIndex:
    """Every earlier occurrence of each n-gram of `min_window..=max_window` tokens of one
    sequence (the scheduler's drafter keeps only the most recent; the windows are clamped
    as it clamps them), or of several requests' sequences one after another."""

    def __init__(self, min_window: int = 1, max_window: int = 12) -> None:
        self.min = min(max(min_window, 1), MAX_WINDOW)
        self.max = min(max(max_window, self.min), MAX_WINDOW)
        self.tokens: list[int] = []
        self.starts: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)

    def push(self, token: int) -> None:
        end = len(self.tokens)
        for n in range(1, min(self.max, end) + 1):
            if self.tokens[end - n] == _SEPARATOR:
                break  # this window and every longer one reach into an earlier request
            if n >= self.min:
                self.starts[tuple(self.tokens[end - n :])].append(end)
        self.tokens.append(token)

    def end_request(self) -> None:
        """Ends the sequence so far as one request's: what follows is another's."""
        self.tokens.append(_SEPARATOR)

    def matches(self) -> list[tuple[int, list[int]]]:
        """(n, where the continuations start, most recent first) for every suffix of n
        tokens that occurred before, the longest first."""
        end = len(self.tokens)
        found = []
        for n in range(min(self.max, end), self.min - 1, -1):
            starts = self.starts.get(tuple(self.tokens[end - n :]))
            if starts:
                found.append((n, starts[::-1]))
        return found

    def chain(self, k: int) -> list[int]:
        """What the scheduler's drafter proposes (`NgramDrafter.propose`)."""
        found = self.matches()
        if not found or k == 0:
            return []
        return _to_separator(self.tokens[found[0][1][0] :][:k])

    def tree(self, k: int) -> set[tuple[int, ...]]:
        """k drafted tokens as a tree: each node the path of tokens to it from the root."""
        weight: defaultdict[tuple[int, ...], float] = defaultdict(float)
        rank: dict[tuple[int, ...], int] = {}
        seen: set[int] = set()
        for n, starts in self.matches():
            for start in starts[:TREE_OCCURRENCES]:
                if start in seen:
                    continue
                seen.add(start)
                branch = _to_separator(self.tokens[start : start + k])
                for depth in range(1, len(branch) + 1):
                    node = tuple(branch[:depth])
                    weight[node] += n
                    rank.setdefault(node, len(rank))
        # Ties: the shallower node (its parent first), then the one met first (longer and
        # more recent matches are met first).
        heaviest = sorted(weight, key=lambda node: (-weight[node], len(node), rank[node]))
        return set(heaviest[:k])


def _to_separator(tokens: list[int]) -> list[int]:
    """`tokens` up to the end of their request in a shared index."""
    return tokens[: tokens.index(_SEPARATOR)] if _SEPARATOR in tokens else tokens


@dataclass
class Replay:
    """One drafter over a set of outputs at k drafts a step."""

    steps: int = 0
    tokens: int = 0
    drafted_steps: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def drafted_share(self) -> float:
        """The share of steps that carried drafts."""
        return self.drafted_steps / self.steps if self.steps else 0.0

    def walk(self, index: Index, output: Sequence[int], propose: Proposer) -> None:
        """Replays one output (its first token came from the prefill) into `index`."""
        index.push(output[0])
        i = 1
        while i < len(output):
            drafted, accepted = propose(index, output[i:])
            # The bonus token: the output's next one, unless the drafts reached its end.
            run = min(accepted + 1, len(output) - i)
            for token in output[i : i + run]:
                index.push(token)
            i += run
            self.steps += 1
            self.tokens += run
            self.drafted_steps += drafted


class CoreChain:
    """The scheduler's drafter itself, as the replay's index of one request."""

    def __init__(self, min_window: int, max_window: int) -> None:
        self.core = NgramDrafter(min_window, max_window)

    def push(self, token: int) -> None:
        self.core.extend([token])


Index = OccurrenceIndex | CoreChain
# (index, the output from here) -> (whether anything was drafted, drafts the output keeps)
Proposer = Callable[[Index, Sequence[int]], tuple[bool, int]]


def _kept(drafts: Sequence[int], future: Sequence[int]) -> tuple[bool, int]:
    kept = 0
    while kept < min(len(drafts), len(future)) and drafts[kept] == future[kept]:
        kept += 1
    return bool(drafts), kept


def chain_proposer(k: int) -> Proposer:
    def propose(index: Index, future: Sequence[int]) -> tuple[bool, int]:
        if isinstance(index, CoreChain):
            return _kept(index.core.propose(k), future)
        return _kept(index.chain(k), future)

    return propose


def tree_proposer(k: int) -> Proposer:
    def propose(index: Index, future: Sequence[int]) -> tuple[bool, int]:
        assert isinstance(index, OccurrenceIndex)
        nodes = index.tree(k)
        kept = 0
        while kept < len(future) and tuple(future[: kept + 1]) in nodes:
            kept += 1
        return bool(nodes), kept

    return propose


def replay(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    k: int,
    drafter: str,
    min_window: int = 1,
    max_window: int = 12,
) -> Replay:
    """`requests`' (prompt, output) pairs replayed with `drafter` (one of `DRAFTERS`: see
    the module) proposing k drafts a step."""
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}: expected one of {', '.join(DRAFTERS)}")
    result = Replay()
    propose = tree_proposer(k) if drafter == "tree" else chain_proposer(k)
    for j, (prompt, output) in enumerate(requests):
        if not output:
            continue
        index: Index
        if drafter == "chain":
            index = CoreChain(min_window, max_window)
        else:
            index = OccurrenceIndex(min_window, max_window)
            if drafter == "shared":
                for other_prompt, other_output in requests[:j]:
                    if list(other_prompt) != list(prompt):  # the same prompt: the same output
                        for token in [*other_prompt, *other_output]:
                            index.push(token)
                        index.end_request()
        for token in prompt:
            index.push(token)
        result.walk(index, output, propose)
    return result
