"""What the placement of a batch's KV slots costs a decode step.

The same model decodes the same tokens for three groups of requests whose KV sits in the
pool three ways, and times each group's decode steps in alternation:

- `contiguous`: each request's context in one run of slots;
- `strided`: as an engine without churn hands slots out, a prompt in one run, then each
  decode step one slot per request, the batch's requests side by side;
- `scattered`: every slot anywhere in the pool, as a last-in, first-out free list hands
  them out after requests finish out of order, or verify steps give back rejected drafts.

    python benches/kv_locality.py --batch 64 --context 200 --dtype bfloat16

On a 2-core Zen 4 (AMD EPYC family 25 model 17) in bfloat16 at batch 64, ms a step (medians
of 40): contiguous 78.2, strided 86.3, scattered 96.1 at 200 tokens of context; 106.6, 120.7
and 143.9 at 600.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from rsgl._core import Plan
from rsgl.bench.one_batch import DTYPES
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.sampling_params import SamplingParams

PROMPT_RUN = 40  # `strided`: the prompt tokens in one run; the rest decode-step slots


def layouts(batch: int, width: int, pool: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each layout's [batch, width] slots, in disjoint parts of a pool of `pool` slots (slot 0
    is the padding slot)."""
    region = batch * width
    contiguous = 1 + np.arange(region).reshape(batch, width)
    base = 1 + region
    prompt = min(PROMPT_RUN, width)
    strided = np.empty((batch, width), dtype=np.int64)
    strided[:, :prompt] = base + np.arange(batch * prompt).reshape(batch, prompt)
    steps = np.arange(width - prompt)[None, :] * batch + np.arange(batch)[:, None]
    strided[:, prompt:] = base + batch * prompt + steps
    rest = np.arange(1 + 2 * region, pool)
    scattered = rng.permutation(rest)[:region].reshape(batch, width)
    return {"contiguous": contiguous, "strided": strided, "scattered": scattered}


def plan(rows: np.ndarray, slots: np.ndarray, cols: np.ndarray, ids: np.ndarray) -> Plan:
    """`rows` compute positions `cols`, their KV at `slots[:, cols]`."""
    batch, width = len(rows), len(cols)
    kv = slots[:, cols].reshape(-1).astype(np.int64)
    return Plan(
        forward_mode="decode" if width == 1 else "extend",
        rids=rows,
        req_slots=rows,
        prefix_lens=np.full(batch, cols[0], dtype=np.int64),
        extend_lens=np.full(batch, width, dtype=np.int64),
        seq_lens=np.full(batch, cols[-1] + 1, dtype=np.int64),
        input_ids=ids.reshape(-1).astype(np.int64),
        positions=np.tile(cols, batch).astype(np.int64),
        out_cache_loc=kv,
        write_rows=np.repeat(rows, width),
        write_cols=np.tile(cols, batch).astype(np.int64),
        write_slots=kv,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--pool", type=int, default=164_000, help="KV slots (rsgl serve's here)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    batch, context = args.batch, args.context
    width = context + 1
    rng = np.random.default_rng(0)
    placed = layouts(batch, width, args.pool, rng)
    runner = ModelRunner.from_pretrained(
        None,
        kv_buffer_size=args.pool,
        max_running_requests=len(placed) * batch,
        context_len=width + 1,
        dtype=DTYPES[args.dtype],
    )
    vocab = runner.config.vocab_size
    prompts = rng.integers(100, vocab - 100, size=(batch, context))
    params = SamplingParams(temperature=0.0, max_new_tokens=width, ignore_eos=True)
    groups = {}
    for i, (name, slots) in enumerate(placed.items()):
        rows = np.arange(i * batch, (i + 1) * batch, dtype=np.int64)
        for row, prompt in zip(rows.tolist(), prompts, strict=True):
            runner.admit(row, params, prompt.tolist())
        runner.step(plan(rows, slots, np.arange(context), prompts))
        groups[name] = (rows, slots)
    ids = rng.integers(100, vocab - 100, size=(batch, 1))
    times: dict[str, list[float]] = {name: [] for name in groups}
    names = list(groups)
    for step in range(args.steps):
        # Alternated, each group first in turn: a burst of drift slows all alike.
        for name in names[step % len(names) :] + names[: step % len(names)]:
            rows, slots = groups[name]
            decode = plan(rows, slots, np.array([context]), ids)
            t0 = time.perf_counter()
            runner.step(decode)
            times[name].append(time.perf_counter() - t0)
    medians = {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}
    print(json.dumps({"batch": batch, "context": context, "dtype": args.dtype, "ms": medians}))


if __name__ == "__main__":
    main()
