"""A short demonstration of the scheduling core, used by `rsgl serve` until the server lands.

It pushes a batch of shared-prefix requests through rsgl._core with a null model (sampled
tokens come from a seeded RNG) and prints what the core did: steps by mode, cache hits,
and the per-step scheduling cost.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rsgl._core import Scheduler


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="rsgl serve (demo)", description=__doc__)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args, _ = parser.parse_known_args(argv)

    rng = np.random.default_rng(0)
    core = Scheduler(1 << 16, max_running_requests=64, context_len=4096, eos_token_ids=[2])
    system_prompts = [rng.integers(10, 32000, size=512) for _ in range(8)]
    for rid in range(args.num_requests):
        question = rng.integers(10, 32000, size=int(rng.integers(16, 64)))
        prompt = np.concatenate((system_prompts[rid % 8], question))
        core.add_request(rid, prompt, args.max_new_tokens)
    steps, spent, finished = 0, 0.0, 0
    while core.has_work:
        start = time.perf_counter()
        plan = core.schedule()
        tokens = rng.integers(3, 32000, size=plan.batch_size)
        outcome = core.commit(plan.id, tokens) if plan.forward_mode != "idle" else None
        spent += time.perf_counter() - start
        steps += 1
        finished += len(outcome.finished) if outcome else 0
    core.check()
    stats = core.stats()
    print("rsgl: the HTTP server is not built yet; this is a demo of the scheduling core.")
    print(
        f"{finished} requests finished in {steps} steps "
        f"(extend {stats['extend_steps']}, decode {stats['decode_steps']}); "
        f"{stats['cached_tokens']} of {stats['prompt_tokens']} prompt tokens came from the "
        f"radix cache; schedule + commit took {spent / steps * 1e6:.1f} us per step."
    )
    return 0
