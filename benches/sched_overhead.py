"""Python-visible cost of the scheduling core per decode step (schedule + commit).

Drives rsgl._core with a null model: prompts and sampled tokens come from a seeded RNG,
ignore_eos, radix cache on. After the prompts are prefilled, every timed step is a decode of
all `--running` requests; the time covers `core.schedule()` and `core.commit(...)` together,
including the numpy arrays crossing the boundary.

    python benches/sched_overhead.py --running 256 --json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from rsgl._core import Scheduler


def measure(running: int, steps: int, input_len: int, page_size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    max_new = steps + 16
    core = Scheduler(
        running * (input_len + max_new + 2 * page_size) + 4 * page_size,
        page_size=page_size,
        max_running_requests=running,
        context_len=input_len + max_new + 1,
        max_prefill_tokens=running * (input_len + 1),
        chunked_prefill_size=-1,
        seed=seed,
    )
    for rid in range(running):
        prompt = rng.integers(10, 32000, size=input_len, dtype=np.int64)
        core.add_request(rid, prompt, max_new, ignore_eos=True)
    prefill = core.schedule()
    assert prefill.batch_size == running, "all requests must be admitted in one prefill"
    core.commit(prefill.id, rng.integers(10, 32000, size=running, dtype=np.int64))
    # The model's sampled tokens, drawn before timing: the RNG is not the scheduler's cost.
    sampled = rng.integers(10, 32000, size=(steps, running), dtype=np.int64)
    times = np.empty(steps)
    for i in range(steps):
        t0 = time.perf_counter()
        plan = core.schedule()
        core.commit(plan.id, sampled[i])
        times[i] = time.perf_counter() - t0
        assert plan.batch_size == running and plan.forward_mode == "decode"
    core.check()
    return {
        "running": running,
        "steps": steps,
        "us_per_step_p50": round(float(np.percentile(times, 50)) * 1e6, 2),
        "us_per_step_p99": round(float(np.percentile(times, 99)) * 1e6, 2),
        "us_per_request_p50": round(float(np.percentile(times, 50)) * 1e6 / running, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    result = measure(args.running, args.steps, args.input_len, args.page_size, args.seed)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
