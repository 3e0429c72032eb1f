"""The data-parallel dispatcher on its own: each load-balance method sends work where it says,
under load the tests set up by hand, and a dead rank gets nothing more."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from rsgl.server.dispatcher import (
    BLOCK_TOKENS,
    Dispatcher,
    NoLiveRank,
    PrefixRecord,
    block_hashes,
)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(length)]


def test_round_robin_takes_the_live_ranks_in_turn() -> None:
    d = Dispatcher(3, "round_robin")
    ranks = [d.assign(f"r{i}", [1, 2, 3], 10) for i in range(6)]
    assert ranks == [0, 1, 2, 0, 1, 2]
    assert d.remove_rank(1) == ["r1", "r4"]
    assert [d.assign(f"s{i}", [1], 1) for i in range(4)] == [0, 2, 0, 2]


def test_total_requests_picks_the_rank_with_fewest_in_flight() -> None:
    d = Dispatcher(2, "total_requests")
    d.assign("a", [1], 1, rank=0)
    d.assign("b", [1], 1, rank=0)
    d.assign("c", [1], 1000, rank=1)
    assert d.assign("x", [1], 1) == 1  # 1 in flight on rank 1, 2 on rank 0
    d.release("a")
    d.release("b")
    assert d.loads[0].requests == 0
    assert d.assign("y", [1], 1) == 0
    assert d.rank_of("y") == 0 and d.rank_of("a") is None


def test_total_tokens_picks_fewest_tokens_then_fewest_requests_then_lowest_rank() -> None:
    d = Dispatcher(3, "total_tokens")
    d.assign("long", [1], 1000, rank=0)
    for i in range(3):
        d.assign(f"short{i}", [1], 10, rank=1)
    d.assign("mid", [1], 30, rank=2)
    # Rank 1 and 2 both hold 30 tokens; rank 2 has one request to rank 1's three.
    assert d.assign("next", [1], 5) == 2
    d.release("next")
    d.release("mid")
    # Rank 2 is empty now: fewest tokens wins whatever the requests elsewhere.
    assert d.assign("n2", [1], 5) == 2
    d.release("n2")
    d.release("long")
    # Ranks 0 and 2 both empty: the lower rank.
    assert d.assign("n3", [1], 5) == 0


def test_total_tokens_counts_prompt_and_max_new_tokens_capped_by_the_context() -> None:
    d = Dispatcher(2, "total_tokens", context_length=100)
    assert d.cost(10, 20) == 30
    assert d.cost(90, 1000) == 100


def test_cache_aware_lands_each_shared_prefix_group_on_one_rank() -> None:
    d = Dispatcher(2, "cache_aware", [100_000, 100_000])
    prefixes = [prompt(g, 256) for g in range(4)]
    requests = [(g, i) for g in range(4) for i in range(8)]
    random.Random(0).shuffle(requests)
    placed: dict[int, set[int]] = {g: set() for g in range(4)}
    for g, i in requests:
        ids = prefixes[g] + prompt(1000 + 10 * g + i, 16)
        placed[g].add(d.assign(f"{g}-{i}", ids, len(ids) + 32))
    assert all(len(ranks) == 1 for ranks in placed.values()), placed
    # New prefixes went to the less loaded rank, so the groups are spread.
    assert {next(iter(r)) for r in placed.values()} == {0, 1}


def test_cache_aware_sends_a_short_match_to_the_least_loaded_rank() -> None:
    d = Dispatcher(2, "cache_aware", [100_000, 100_000])
    shared = prompt(1, 64)
    first = shared + prompt(2, 64)
    d.assign("a", first, 200)
    assert d.rank_of("a") == 0
    d.assign("b", prompt(3, 32), 100, rank=0)  # rank 0 is the busier one
    # 64 of 256 prompt tokens match rank 0's record: 25% < the 50% threshold.
    assert d.assign("c", shared + prompt(4, 192), 300) == 1
    # 96 of 128 (75%) match rank 0 (64 match rank 1): locality wins although rank 0 is
    # busier.
    assert d.assign("d", first[:96] + prompt(5, 32), 300) == 0


def test_cache_aware_gives_way_to_balance_when_the_load_is_very_uneven() -> None:
    d = Dispatcher(
        2, "cache_aware", [100_000, 100_000], balance_abs_threshold=4, balance_rel_threshold=1.5
    )
    shared = prompt(7, 128)
    first = shared + prompt(100, 16)
    for i in range(5):
        assert d.assign(f"g{i}", shared + prompt(100 + i, 16), 200) == 0
    # Five in flight on rank 0, none on rank 1: 5 - 0 > 4 and 5 > 0 * 1.5.
    assert d.assign("over", shared + prompt(200, 16), 200) == 1
    # One on rank 1 now: 5 - 1 is not > 4, so the longer match pulls back to rank 0.
    assert d.assign("back", first + prompt(201, 16), 200) == 0


def test_a_dead_rank_gets_no_more_work_and_its_requests_are_named() -> None:
    for method in ("round_robin", "total_requests", "total_tokens", "cache_aware"):
        d = Dispatcher(2, method, [10_000, 10_000])
        d.assign("on1", prompt(1, 40), 50, rank=1)
        assert d.remove_rank(1) == ["on1"]
        assert {d.assign(f"x{i}", prompt(1, 40), 50) for i in range(4)} == {0}, method
        with pytest.raises(NoLiveRank):
            d.assign("pinned", [1], 1, rank=1)
        d.remove_rank(0)
        with pytest.raises(NoLiveRank):
            d.assign("none", [1], 1)


def test_the_prefix_record_is_bounded_and_evicts_tails_before_roots() -> None:
    record = PrefixRecord(capacity_blocks=8)
    first = block_hashes(prompt(1, 6 * BLOCK_TOKENS))
    record.insert(first)
    assert record.match(first) == 6
    second = block_hashes(prompt(2, 4 * BLOCK_TOKENS))
    record.insert(second)
    assert len(record) == 8
    # The first prompt lost its two deepest blocks, not its root.
    assert record.match(first) == 4
    assert record.match(second) == 4
    # Hashes chain: the same block after a different prefix is a different block.
    tail = prompt(3, BLOCK_TOKENS)
    assert block_hashes(prompt(1, 16) + tail)[1] != block_hashes(prompt(2, 16) + tail)[1]
    assert block_hashes(prompt(1, BLOCK_TOKENS - 1)) == []


def reference_cache_aware(
    d: Dispatcher, records: list[PrefixRecord], ids: list[int], branches: Counter[str]
) -> int:
    """The cache-aware rule written out rank by rank: each live rank's own record matched
    against the prompt, the longest match winning (fewest in flight, then the lower rank)
    when it covers the threshold, else the least-loaded rank (fewest in flight, smallest
    record, lower rank); balance first when the load is badly skewed. Counts the branch
    taken in `branches`."""
    live = d.live_ranks

    def least_loaded() -> int:
        return min(live, key=lambda r: (d.loads[r].requests, len(records[r]), r))

    requests = [d.loads[r].requests for r in live]
    if (
        max(requests) - min(requests) > d.balance_abs_threshold
        and max(requests) > min(requests) * d.balance_rel_threshold
    ):
        branches["balance"] += 1
        return least_loaded()
    hashes = block_hashes(ids)
    matched = {r: records[r].match(hashes) for r in live}
    best = max(live, key=lambda r: (matched[r], -d.loads[r].requests, -r))
    if matched[best] and matched[best] * BLOCK_TOKENS / len(ids) >= d.cache_threshold:
        tied = sum(matched[r] == matched[best] for r in live)
        branches["prefix, one rank" if tied == 1 else "prefix, ranks tied"] += 1
        return best
    branches["short match" if matched[best] else "no match"] += 1
    return least_loaded()


@pytest.mark.parametrize("seed", range(4))
def test_cache_aware_matches_every_rank_at_once_as_rank_by_rank(seed: int) -> None:
    """The dispatcher matches a prompt against one index of every rank's blocks; its
    choices are those of matching each rank's record in turn, through evictions (records of
    a few prompts), releases, a flushed cache and a dead rank, and the index stays exactly
    the records after every call."""
    rng = random.Random(seed)
    ranks, capacity = 7, 40 * BLOCK_TOKENS
    d = Dispatcher(ranks, "cache_aware", [capacity] * ranks, balance_abs_threshold=6)
    mirror = [PrefixRecord(capacity // BLOCK_TOKENS) for _ in range(ranks)]
    prefixes = [prompt(seed * 100 + g, rng.randrange(1, 12) * BLOCK_TOKENS) for g in range(12)]
    in_flight: list[str] = []
    branches: Counter[str] = Counter()
    for i in range(600):
        if rng.random() < 0.8:
            ids = rng.choice(prefixes)[: rng.randrange(BLOCK_TOKENS, 12 * BLOCK_TOKENS)]
        else:
            ids = []
        ids = ids + prompt(seed * 10_000 + i, rng.randrange(1, 3 * BLOCK_TOKENS))
        expected = reference_cache_aware(d, mirror, ids, branches)
        assert d.assign(str(i), ids, len(ids) + 16) == expected, i
        mirror[expected].insert(block_hashes(ids))
        in_flight.append(str(i))
        while in_flight and rng.random() < 0.45:
            d.release(in_flight.pop(rng.randrange(len(in_flight))))
        if i == 200:
            d.forget_prefixes(3)
            mirror[3].clear()
        if i == 400:
            for rid in d.remove_rank(5):
                d.release(rid)
                in_flight.remove(rid)
            mirror[5].clear()
        d.check()
        assert [len(r) for r in d.records] == [len(r) for r in mirror]
    # Every way the rule can decide was taken.
    assert set(branches) == {
        "balance",
        "prefix, one rank",
        "prefix, ranks tied",
        "short match",
        "no match",
    }, branches
