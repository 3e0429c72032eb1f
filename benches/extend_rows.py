"""Extends as rows of the decode kernel against torch's SDPA, the choice
`token_rows_max_extend` (`rsgl/layers/attention/torch_native.py`) makes per CPU and dtype.

One model runs the same extend step (a prompt, or new tokens over a cached prefix) both ways,
the two in alternation, each first in turn, and prints the median ms of each:

    python benches/extend_rows.py --dtype bfloat16 --shapes 32:1024,64:512,512:0

A shape is `tokens:cached` (the extend's tokens over that many cached ones), for `--batch`
requests at once. On a 2-core Xeon with AMX (/proc/cpuinfo family 6 model 167) in bfloat16,
rows vs SDPA, ms: 8 tokens over 1,024 cached 24.5 vs 37.1, 24 over 1,024 53.0 vs 54.9, 32
over 1,024 64.9 vs 62.4, 128 over 512 100.3 vs 75.0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from kv_locality import plan

from rsgl.bench.one_batch import DTYPES
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.sampling_params import SamplingParams

WAYS = {"rows": None, "sdpa": 0}  # the backend's `token_rows_max_extend` for each


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        tokens, _, cached = part.partition(":")
        shapes.append((int(tokens), int(cached or 0)))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32:1024,64:512,128:512,512:0,2048:4096")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes)
    batch = args.batch
    width = max(tokens + cached for tokens, cached in shapes)
    runner = ModelRunner.from_pretrained(
        None,
        kv_buffer_size=1 + batch * width,
        max_running_requests=batch,
        context_len=width + 1,
        dtype=DTYPES[args.dtype],
    )
    backend = runner.attn
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    rows = np.arange(batch, dtype=np.int64)
    slots = 1 + np.arange(batch * width).reshape(batch, width)
    ids = rng.integers(100, vocab - 100, size=(batch, width))
    params = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    for row in rows.tolist():
        runner.admit(row, params, ids[row].tolist())
    # Every position's KV once, so any extend's cached prefix is there.
    for start in range(0, width, 512):
        cols = np.arange(start, min(width, start + 512))
        runner.step(plan(rows, slots, cols, ids[:, cols]))
    for tokens, cached in shapes:
        cols = np.arange(cached, cached + tokens)
        step = plan(rows, slots, cols, ids[:, cols])
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        names = list(WAYS)
        for repeat in range(args.repeats):
            for way in names[repeat % 2 :] + names[: repeat % 2]:
                backend.token_rows_max_extend = WAYS[way]
                t0 = time.perf_counter()
                runner.step(step)
                times[way].append(time.perf_counter() - t0)
        ms = {way: round(1e3 * statistics.median(t), 1) for way, t in times.items()}
        row = {"dtype": args.dtype, "batch": batch, "tokens": tokens, "cached": cached, "ms": ms}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
