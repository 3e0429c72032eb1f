"""Replay a shared-prefix trace through rsgl._core's radix tree and KV pool.

Semantics: ../shared/traces/README.md (one request at a time: match prompt[:-1], lock, evict
what the new tokens need, allocate, insert prompt + output[:-1] page-aligned, free duplicates
and the unaligned tail, unlock). Prints one JSON line; `matched_tokens` and `evicted_tokens`
depend only on the semantics, so they equal SGLang's RadixCache figures on the same trace.

    python benches/radix_replay.py ../shared/traces/gsp.jsonl.gz --page-size 1
    python benches/radix_replay.py ../shared/traces/gsp.jsonl.gz --pool-size 32768 --compare-default

`--pool-size` shrinks the KV pool below the trace's own (eviction-heavy); `--compare-default`
replays both pools in the same process, interleaved, and prints their ratio.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import numpy as np

from rsgl._core import RadixTree, TokenPool


def load(path: str) -> tuple[int, list[tuple[np.ndarray, int]]]:
    """Pool size from the header and, per request, `prompt + output[:-1]` and the prompt length."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        header = json.loads(f.readline())
        requests = []
        for line in f:
            r = json.loads(line)
            key = np.asarray(r["prompt"] + r["output"][:-1], dtype=np.uint32)
            requests.append((key, len(r["prompt"])))
    return int(header["pool_tokens"]), requests


def replay(pool_tokens: int, requests: list[tuple[np.ndarray, int]], page_size: int) -> dict:
    tree = RadixTree(page_size)
    pool = TokenPool(pool_tokens, 1)  # slot granularity is one token, whatever the page size
    # Views prepared with the tokens, before the timed loop: what to match and what to insert.
    work = []
    for key, prompt_len in requests:
        aligned = len(key) // page_size * page_size
        work.append((key[: prompt_len - 1], key[:aligned], len(key), aligned))
    buffer = np.empty(max(len(k) for k, _ in requests), dtype=np.uint32)
    skipped = matched_tokens = evicted_tokens = 0
    start = time.perf_counter()
    for match_key, insert_key, key_len, aligned in work:
        # values = matched slots + new slots, assembled in one buffer (no concatenation).
        matched, node, _ = tree.match_prefix(match_key, out=buffer)
        tree.lock(node)
        need = key_len - matched
        new_slots = buffer[matched:key_len]
        if need > pool.available:  # short: evict into the pool first
            evicted_tokens += tree.evict(need - pool.available, pool=pool)
        if pool.alloc(need, out=new_slots) is None:
            skipped += 1
            tree.unlock(node)
            continue
        matched_tokens += matched
        present = tree.insert(insert_key, buffer[:aligned])
        if present > matched:
            pool.free(buffer[matched:present])
        if aligned < key_len:
            pool.free(buffer[aligned:key_len])
        tree.unlock(node)
    seconds = time.perf_counter() - start
    tree.check()
    return {
        "page_size": page_size,
        "requests": len(requests),
        "skipped": skipped,
        "matched_tokens": matched_tokens,
        "evicted_tokens": evicted_tokens,
        "seconds": round(seconds, 6),
        "us_per_request": round(seconds / len(requests) * 1e6, 3),
    }


def median_run(runs: list[dict]) -> dict:
    runs = sorted(runs, key=lambda r: r["seconds"])
    return runs[len(runs) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--pool-size", type=int, help="KV pool tokens (default: the trace's)")
    parser.add_argument(
        "--compare-default", action="store_true", help="also replay the trace's own pool"
    )
    parser.add_argument("--repeat", type=int, default=15, help="report the median of N replays")
    parser.add_argument(
        "--warmup", type=int, default=10, help="untimed replays first (allocator warm-up)"
    )
    args = parser.parse_args()
    trace_pool, requests = load(args.trace)
    pools = {"pool": args.pool_size or trace_pool}
    if args.compare_default:
        pools["default"] = trace_pool
    for _ in range(args.warmup):
        for tokens in pools.values():
            replay(tokens, requests, args.page_size)
    runs: dict[str, list[dict]] = {name: [] for name in pools}
    for _ in range(args.repeat):  # interleaved, so drift hits both alike
        for name, tokens in pools.items():
            runs[name].append(replay(tokens, requests, args.page_size))
    result = dict(median_run(runs["pool"]), pool_tokens=pools["pool"])
    if args.compare_default:
        default = median_run(runs["default"])
        result["default_pool_tokens"] = trace_pool
        result["default_us_per_request"] = default["us_per_request"]
        result["ratio_to_default"] = round(result["us_per_request"] / default["us_per_request"], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
