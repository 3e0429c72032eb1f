"""The draft replay (`rsgl.bench.draft_replay`): its chain is the scheduler's drafter, its trees
are trees of the earlier continuations, and a replay commits what verify steps would."""

from __future__ import annotations

import random

import pytest

from rsgl._core import NgramDrafter
from rsgl.bench.draft_replay import (
    OccurrenceIndex,
    chain_proposer,
    replay,
    tree_proposer,
)


def _brute(seq: list[int], min_window: int, max_window: int, k: int) -> list[int]:
    """The drafter's definition: the longest suffix that occurred before, its latest occurrence."""
    for n in range(min(max_window, len(seq)), min_window - 1, -1):
        suffix = seq[len(seq) - n :]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


def check_chain(tokens: list[int], k: int, min_window: int, max_window: int) -> None:
    """`OccurrenceIndex.chain` (the shared index's drafts) proposes what the scheduler's
    drafter does after every prefix of `tokens`."""
    ours = OccurrenceIndex(min_window, max_window)
    core = NgramDrafter(min_window, max_window)
    for t in tokens:
        ours.push(t)
        core.extend([t])
        assert ours.chain(k) == core.propose(k), (len(ours.tokens), ours.chain(k))


# The last two: windows the drafter clamps (min raised to 1; max raised to min).
WINDOWS = [(1, 12, 4), (2, 5, 2), (1, 1, 7), (0, 3, 2), (4, 2, 3)]


@pytest.mark.parametrize(("min_window", "max_window", "k"), WINDOWS)
def test_the_core_drafter_and_the_chain_follow_the_definition(
    min_window: int, max_window: int, k: int
) -> None:
    rng = random.Random(min_window * 100 + max_window)
    for _ in range(20):
        seq = [rng.randrange(5) for _ in range(rng.randrange(1, 120))]
        check_chain(seq, k, min_window, max_window)
        drafter = NgramDrafter(min_window, max_window)
        drafter.extend(seq)
        assert len(drafter) == len(seq)
        low = max(min_window, 1)
        assert drafter.propose(k) == _brute(seq, low, max(max_window, low), k)


def _index(tokens: list[int]) -> OccurrenceIndex:
    index = OccurrenceIndex()
    for t in tokens:
        index.push(t)
    return index


def test_a_tree_is_closed_small_and_made_of_earlier_continuations() -> None:
    rng = random.Random(7)
    for _ in range(50):
        seq = [rng.randrange(4) for _ in range(rng.randrange(2, 80))]
        index = _index(seq)
        continuations = [seq[s:] for _, starts in index.matches() for s in starts]
        for k in (1, 3, 6):
            nodes = index.tree(k)
            assert len(nodes) <= k
            for node in nodes:
                assert len(node) == 1 or node[:-1] in nodes  # its parent is drafted too
                assert any(c[: len(node)] == list(node) for c in continuations)
            # Whenever the chain drafts, so does the tree.
            assert bool(nodes) == bool(index.chain(k))


def test_a_tree_votes_where_the_chain_takes_the_latest() -> None:
    # [1, 2] was followed by 3, 1, 2 twice, then by 4, 1, 2: the chain drafts the latest (4),
    # the tree the continuation of most matches first (3, then 3's own), then the other branch.
    index = _index([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    assert index.chain(1) == [4]
    assert index.tree(1) == {(3,)}
    assert index.tree(2) == {(3,), (3, 1)}
    assert index.tree(4) == {(3,), (3, 1), (3, 1, 2), (4,)}


def test_a_step_keeps_the_drafts_on_the_outputs_path() -> None:
    index = _index([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    # The output goes on 3, 1, 7: the tree's two drafts (3, then 3's 1) are both kept, the
    # chain's (4, 1) neither.
    assert tree_proposer(2)(index, [3, 1, 7]) == (True, 2)
    assert chain_proposer(2)(index, [3, 1, 7]) == (True, 0)
    assert tree_proposer(2)(index, [4, 1]) == (True, 0)  # 4 is not among the two drafts
    assert tree_proposer(4)(index, [4, 1]) == (True, 1)
    assert chain_proposer(2)(_index([5, 6]), [5]) == (False, 0)


def test_a_shared_index_keeps_each_requests_own_matches() -> None:
    # The earlier request ends with [6, 7]; this one's suffix [6, 7] must not match there
    # (its continuation is the end of that request) and hide this request's own [7] -> 4.
    own = [2, 3, 7, 4, 9, 6, 7]
    shared = _index([1, 5, 6, 7])
    shared.end_request()
    for t in own:
        shared.push(t)
    assert shared.chain(3) == _index(own).chain(3) == [4, 9, 6]
    # No n-gram reaches across the end of a request (ids are never negative: the marker
    # is), and none is followed by it ([6, 7] ends the first); [5, 6] is followed by 7.
    assert all(min(ngram) >= 0 for ngram in shared.starts)
    assert (6, 7) not in shared.starts and shared.starts[(5, 6)] == [3]


def test_an_unknown_drafter_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown drafter 'trie'"):
        replay([([1], [2])], 1, "trie")


def test_a_copy_commits_k_plus_one_tokens_a_step() -> None:
    prompt = list(range(100, 120))
    output = list(range(100, 120))  # the prompt again: every draft is accepted
    for k in (1, 3, 7):
        result = replay([(prompt, output)], k, "chain")
        # 19 tokens after the prefill's, k + 1 a step (the last step what is left).
        assert result.tokens == 19
        assert result.steps == -(-19 // (k + 1))
        assert result.drafted_steps == result.steps


def test_only_a_shared_index_drafts_from_other_requests() -> None:
    first = ([1, 2, 3], list(range(200, 230)))
    second = ([4, 5, 6], list(range(200, 230)))  # another prompt, the same answer
    alone = replay([first, second], 4, "chain")
    shared = replay([first, second], 4, "shared")
    assert alone.tokens == shared.tokens == 58
    assert alone.steps == 58  # nothing repeats within a request: one token a step
    assert shared.steps == 29 + -(-29 // 5)  # the second copies the first
    # The same prompt gives the same greedy answer: not a draft source.
    assert replay([first, first], 4, "shared").steps == 58
