"""The loop's own cost per step: the whole in-process stack around a null forward.

    rsgl bench overhead --running 256 --output-len 512 --json
    rsgl bench overhead --running 256 --null-step-ms 5      # is it hidden behind a forward?

`running` requests with random prompts generate `output-len` tokens each (ignore_eos) through
`rsgl.Engine(load_format="null")`: the Rust core plans and commits, the loop launches and
reads steps, ids become text (stop strings checked) and reach the caller, who merges them as
`Engine.generate` does. Only the forward is missing (or is a fixed sleep, `--null-step-ms`,
standing in for an accelerator's). Step times are the intervals between step ends while
every request decodes (prefill steps and the last few are left out).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from rsgl.bench.cpu import cpu_description
from rsgl.engine import Engine

# Prompt ids come from this range: ordinary text tokens of the embedded model's vocabulary.
PROMPT_ID_RANGE = (1000, 40000)


def measure(
    running: int,
    output_len: int,
    input_len: int = 100,
    null_step_ms: float = 0.0,
    overlap: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """One run; returns the figures `--json` prints."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(*PROMPT_ID_RANGE, size=input_len).tolist() for _ in range(running)]
    engine = Engine(
        load_format="null",
        null_step_ms=null_step_ms,
        max_running_requests=running,
        max_total_tokens=running * (input_len + output_len) + 4096,
        max_prefill_tokens=max(16384, running * input_len),
        disable_overlap_schedule=not overlap,
        seed=seed,
    )
    step_ends: list[float] = []
    engine._loop.on_step_end = lambda: step_ends.append(time.perf_counter())
    params = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    try:
        start = time.perf_counter()
        outputs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        engine.check_integrity()
    finally:
        engine.shutdown()
    tokens = sum(len(o["output_ids"]) for o in outputs)
    assert tokens == running * output_len, f"{tokens} tokens, expected {running * output_len}"
    # Decode steps only: prefill needs ceil(prompt tokens / chunk) steps; the last steps
    # finish and hand back requests.
    prefill_steps = -(-running * input_len // engine.args.chunked_prefill_size) + 2
    intervals = np.diff(np.asarray(step_ends[prefill_steps:-3]))
    if len(intervals) == 0:
        raise ValueError("too few decode steps to measure; raise --output-len")
    p50 = float(np.percentile(intervals, 50)) * 1e6
    result: dict[str, Any] = {
        "running": running,
        "steps": len(step_ends),
        "us_per_step_p50": round(p50, 1),
        "us_per_step_p99": round(float(np.percentile(intervals, 99)) * 1e6, 1),
        "us_per_request_token": round(p50 / running, 3),
        "output_tokens_per_s": round(tokens / elapsed, 1),
    }
    if null_step_ms > 0:
        # The ideal: every step costs only its forward, `running` tokens per step.
        ideal = running / (null_step_ms / 1000)
        decode_rate = running / (p50 / 1e6)
        result["null_step_ms"] = null_step_ms
        result["decode_tokens_per_s"] = round(decode_rate, 1)
        result["ideal_tokens_per_s"] = round(ideal, 1)
        result["of_ideal"] = round(decode_rate / ideal, 4)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rsgl bench overhead", description=__doc__)
    parser.add_argument("--running", type=int, nargs="+", default=[256])
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--null-step-ms", type=float, default=0.0)
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON line per run")
    args = parser.parse_args(argv)
    if not args.json:
        print(f"cpu: {cpu_description()}")
    for running in args.running:
        result = measure(
            running,
            args.output_len,
            args.input_len,
            args.null_step_ms,
            overlap=not args.disable_overlap_schedule,
            seed=args.seed,
        )
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print("  ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
