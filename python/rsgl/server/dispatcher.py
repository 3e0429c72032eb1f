"""Which data-parallel rank serves a request (`--load-balance-method`).

With `--dp-size N` the frontend feeds N scheduler processes, each a full replica (its own
core, KV pool and model). It asks the `Dispatcher` for a rank when it sends a request and
tells it when the request is over, so the dispatcher knows what is in flight where without
asking the ranks (SGLang's DataParallelController counts on dispatch the same way: the
ranks' own statistics arrive once a second, far too late for a burst of requests).

Methods (SGLang's names):
- `round_robin`: the next live rank in turn.
- `total_requests`: the rank with the fewest requests in flight.
- `total_tokens`: the rank with the fewest tokens in flight, ties broken by requests, then
  by the lower rank. A request counts `prompt + max_new_tokens` tokens (at most the
  context): the KV it may come to hold, which is what fills a rank's pool and decides
  when its scheduler must queue or retract. Counting only prompts would send every long
  generation to the same rank; counting generated tokens as they come would need a
  message per step.
- `cache_aware`: sglang-router's policy inside one server. Each rank has an approximate
  record of the prompts it was sent (`PrefixRecord`); a request goes to the rank holding
  the longest prefix of its prompt when that prefix covers at least `cache_threshold` of
  the prompt, otherwise to the least-loaded rank (fewest requests in flight, then the
  smallest record: the rank with the most cache to spare for a new prefix). When the load
  is badly skewed (the busiest rank has more than `balance_abs_threshold` requests more
  than the idlest and more than `balance_rel_threshold` times as many) locality yields to
  balance and the idlest rank gets the request.

The module knows nothing of processes or sockets: it is exercised directly by the tests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from rsgl import _core
from rsgl.args import LOAD_BALANCE_METHODS

# Tokens per block of the prefix record: matches are counted in whole blocks. 16 keeps
# the record small (one hash per 16 prompt tokens) while a prefix shorter than a block is
# too short to be worth routing for anyway.
BLOCK_TOKENS = 16
# sglang-router's cache-aware defaults, in requests in flight per rank: the cache threshold
# of its first releases (0.5: at least half the prompt already cached on the rank), and the
# balance thresholds of its current ones (64 / 1.5); the absolute one is halved here since a
# rank is one CPU or GPU replica, not a whole server.
CACHE_THRESHOLD = 0.5
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.5


@dataclass(slots=True)
class RankLoad:
    """What one rank has in flight, as the dispatcher counted it."""

    requests: int = 0
    tokens: int = 0


class PrefixRecord:
    """An approximate, bounded record of the prompts one rank was sent.

    A prompt is cut into blocks of BLOCK_TOKENS tokens and each block is named by a hash
    chained from its predecessors, so one hash stands for the whole prefix up to it, as a
    node of the rank's radix tree would. The record keeps at most `capacity_blocks` hashes,
    the least recently used leaving first. A prompt is recorded deepest block first: the
    blocks near its root are then the most recently used and outlive its tail, as a radix
    cache evicts leaves before the nodes they hang from.

    Records of several ranks may share `holders`, a map from each block to the ranks
    (bit `rank` of a mask) whose records hold it: one lookup a block then matches a prompt
    against every rank at once (`Dispatcher._cache_aware`).
    """

    def __init__(
        self, capacity_blocks: int, holders: dict[int, int] | None = None, rank: int = 0
    ) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._holders = holders
        self._bit = 1 << rank

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[int]:
        """The recorded blocks, least recently used first."""
        return iter(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (given by its chained hashes) are recorded."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Records a prompt's blocks, evicting the least recently used beyond capacity."""
        blocks, holders, bit = self._blocks, self._holders, self._bit
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                if holders is not None:
                    holders[h] = holders.get(h, 0) | bit
        while len(blocks) > self.capacity_blocks:
            self._forget(blocks.popitem(last=False)[0])

    def clear(self) -> None:
        for h in self._blocks:
            self._forget(h)
        self._blocks.clear()

    def _forget(self, h: int) -> None:
        """`h` left this record: this rank no longer holds it."""
        holders = self._holders
        if holders is not None:
            left = holders[h] & ~self._bit
            if left:
                holders[h] = left
            else:
                del holders[h]


def block_hashes(prompt_ids: Sequence[int] | np.ndarray, block: int = BLOCK_TOKENS) -> list[int]:
    """The chained hashes of a prompt's whole blocks (a partial last block is left out),
    computed by the core (`rsgl._core.block_hashes`): the same in every process."""
    return _core.block_hashes(prompt_ids, block)


class NoLiveRank(RuntimeError):
    """Every rank has died: there is nowhere to send a request."""


class Dispatcher:
    """Assigns requests to data-parallel ranks and counts what each has in flight.

    `capacities` are the ranks' KV pools in tokens (they bound the cache-aware records).
    All methods run on one thread (the frontend's event loop).
    """

    def __init__(
        self,
        dp_size: int,
        method: str = "round_robin",
        capacities: Sequence[int] = (),
        *,
        context_length: int | None = None,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
    ) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"unknown load balance method {method!r}: expected one of "
                + ", ".join(LOAD_BALANCE_METHODS)
            )
        if dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {dp_size}")
        self.dp_size = dp_size
        self.method = method
        self.context_length = context_length
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.loads = [RankLoad() for _ in range(dp_size)]
        self.alive = [True] * dp_size
        self._inflight: dict[str, tuple[int, int]] = {}  # rid -> (rank, tokens counted)
        self._next = 0
        self.records: list[PrefixRecord] = []
        # Every block some rank's record holds -> the mask of those ranks (cache_aware).
        self._holders: dict[int, int] = {}
        self._live_mask = (1 << dp_size) - 1
        if method == "cache_aware":
            caps = list(capacities) or [1 << 20] * dp_size
            self.records = [
                PrefixRecord(c // BLOCK_TOKENS, self._holders, rank) for rank, c in enumerate(caps)
            ]

    @property
    def live_ranks(self) -> list[int]:
        return [r for r in range(self.dp_size) if self.alive[r]]

    def rank_of(self, rid: str) -> int | None:
        """The rank a request in flight was sent to (None once it is released)."""
        entry = self._inflight.get(rid)
        return None if entry is None else entry[0]

    def cost(self, prompt_len: int, max_new_tokens: int) -> int:
        """The tokens a request counts for `total_tokens` (see the module docstring)."""
        tokens = prompt_len + max_new_tokens
        return tokens if self.context_length is None else min(tokens, self.context_length)

    def assign(
        self,
        rid: str,
        prompt_ids: Sequence[int] | np.ndarray,
        tokens: int,
        rank: int | None = None,
    ) -> int:
        """Picks the rank for a request (or takes `rank`, a live one the caller chose) and
        counts it there until `release`. Raises NoLiveRank when every rank is dead."""
        if rid in self._inflight:
            raise ValueError(f"request id {rid!r} is already in flight")
        hashes: list[int] | None = None
        if rank is None:
            if self.method == "cache_aware":
                hashes = block_hashes(prompt_ids)
            rank = self._choose(len(prompt_ids), tokens, hashes)
        elif not (0 <= rank < self.dp_size and self.alive[rank]):
            raise NoLiveRank(f"data-parallel rank {rank} is not serving")
        if self.records:
            self.records[rank].insert(hashes if hashes is not None else block_hashes(prompt_ids))
        load = self.loads[rank]
        load.requests += 1
        load.tokens += tokens
        self._inflight[rid] = (rank, tokens)
        return rank

    def release(self, rid: str) -> None:
        """The request is over (finished, aborted, or failed with its rank)."""
        entry = self._inflight.pop(rid, None)
        if entry is None:
            return
        rank, tokens = entry
        load = self.loads[rank]
        load.requests -= 1
        load.tokens -= tokens

    def remove_rank(self, rank: int) -> list[str]:
        """Stops sending work to a dead rank; returns the requests still in flight there
        (the caller ends them, and releases them as they end)."""
        self.alive[rank] = False
        self._live_mask &= ~(1 << rank)
        if self.records:
            self.records[rank].clear()
        return [rid for rid, (r, _) in self._inflight.items() if r == rank]

    def forget_prefixes(self, rank: int) -> None:
        """The rank's prefix cache was flushed: its record is void."""
        if self.records:
            self.records[rank].clear()

    def check(self) -> None:
        """Raises AssertionError unless the block index is exactly the ranks' records."""
        expected: dict[int, int] = {}
        for rank, record in enumerate(self.records):
            for h in record:
                expected[h] = expected.get(h, 0) | 1 << rank
        if self._holders != expected:
            raise AssertionError("the block index disagrees with the ranks' records")
        if self._live_mask != sum(1 << r for r in self.live_ranks):
            raise AssertionError("the live-rank mask disagrees with the live ranks")

    # ------------------------------------------------------------------ policies

    def _choose(self, prompt_len: int, tokens: int, hashes: list[int] | None) -> int:
        live = self.live_ranks
        if not live:
            raise NoLiveRank("every data-parallel rank has died")
        if self.method == "round_robin":
            for step in range(self.dp_size):
                rank = (self._next + step) % self.dp_size
                if self.alive[rank]:
                    self._next = rank + 1
                    return rank
        if self.method == "total_requests":
            return min(live, key=lambda r: (self.loads[r].requests, r))
        if self.method == "total_tokens":
            return min(live, key=lambda r: (self.loads[r].tokens, self.loads[r].requests, r))
        assert hashes is not None
        return self._cache_aware(live, prompt_len, hashes)

    def _least_loaded(self, live: list[int], requests: list[int]) -> int:
        """Of the live ranks (with `requests` in flight each): the fewest requests, then the
        smallest record, then the lower rank."""
        fewest = min(requests)
        tied = [r for r, n in zip(live, requests, strict=True) if n == fewest]
        if len(tied) == 1:
            return tied[0]
        records = self.records
        return min((len(records[r]), r) for r in tied)[1]

    def _cache_aware(self, live: list[int], prompt_len: int, hashes: list[int]) -> int:
        requests = [self.loads[r].requests for r in live]
        busiest, idlest = max(requests), min(requests)
        if (
            busiest - idlest > self.balance_abs_threshold
            and busiest > idlest * self.balance_rel_threshold
        ):
            return self._least_loaded(live, requests)
        matched, holders = self._deepest(hashes)
        if matched and matched * BLOCK_TOKENS / prompt_len >= self.cache_threshold:
            # Of the live ranks holding the longest prefix: the fewest in flight, then the
            # lower rank.
            return min(_ranks_of(holders), key=lambda r: (self.loads[r].requests, r))
        return self._least_loaded(live, requests)

    def _deepest(self, hashes: list[int]) -> tuple[int, int]:
        """The most leading blocks of a prompt any live rank's record holds, and the mask of
        the live ranks holding that many (0 blocks: every live rank)."""
        holders, ranks = self._holders, self._live_mask
        matched = 0
        for h in hashes:
            deeper = holders.get(h, 0) & ranks
            if not deeper:
                break
            matched, ranks = matched + 1, deeper
        return matched, ranks


def _ranks_of(mask: int) -> list[int]:
    """The ranks whose bits are set in `mask`, lowest first."""
    ranks = []
    while mask:
        low = mask & -mask
        ranks.append(low.bit_length() - 1)
        mask ^= low
    return ranks
