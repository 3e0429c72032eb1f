"""The loop's own cost per step: the whole in-process stack around a null forward.

    rsgl bench overhead --running 256 --output-len 512 --json
    rsgl bench overhead --running 256 --null-step-ms 5      # is it hidden behind a forward?
    rsgl bench overhead --server --running 256              # through `rsgl serve`

`running` requests with random prompts generate `output-len` tokens each (ignore_eos) through
`rsgl.Engine(load_format="null")`: the Rust core plans and commits, the loop launches and
reads steps, ids become text (stop strings checked) and reach the caller, who merges them as
`Engine.generate` does. Only the forward is missing (or is a fixed sleep, `--null-step-ms`,
standing in for an accelerator's). Step times are the intervals between step ends while
every request decodes (prefill steps and the last few are left out).

`--server` starts `rsgl serve --load-format null --incremental-streaming-output` and
streams `running` native `/generate` requests at once from as many concurrent clients on
loopback: it reports streamed tokens per second and the frontend process's CPU seconds per
1,000 streamed tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rsgl.bench.cpu import cpu_description
from rsgl.bench.serve_process import start_server
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
    emit = engine._loop.emit

    def timed_emit(updates: list[Any]) -> None:  # the loop emits once per step
        emit(updates)
        step_ends.append(time.perf_counter())

    engine._loop.emit = timed_emit
    # When the executor runs each step: the gaps between steps are what the loop failed to
    # hide (overlap hides the loop completely when the next step is always queued).
    runs: list[tuple[float, float]] = []
    step: Callable[..., Any] = engine.runner.step  # the null runner's

    def timed_step(plan: Any, vocab_mask: Any = None) -> Any:
        t0 = time.perf_counter()
        out = step(plan, vocab_mask)
        runs.append((t0, time.perf_counter()))
        return out

    engine.runner.step = timed_step  # type: ignore[method-assign]
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
    decode_runs = np.asarray(runs[prefill_steps:-3])
    if len(decode_runs) > 1:
        span = decode_runs[-1, 1] - decode_runs[0, 0]
        gaps = decode_runs[1:, 0] - decode_runs[:-1, 1]
        result["executor_idle_fraction"] = round(float(gaps.sum() / span), 4)
    if null_step_ms > 0:
        # The ideal: every step costs only its forward, `running` tokens per step.
        ideal = running / (null_step_ms / 1000)
        decode_rate = running / (p50 / 1e6)
        result["null_step_ms"] = null_step_ms
        result["decode_tokens_per_s"] = round(decode_rate, 1)
        result["ideal_tokens_per_s"] = round(ideal, 1)
        result["of_ideal"] = round(decode_rate / ideal, 4)
        # What one sleep of that length takes here (timer slack and wake-up): the part of
        # a step the emulated forward itself adds, which no overlap can hide.
        sleep_us = _sleep_baseline_us(null_step_ms)
        result["sleep_baseline_us"] = round(sleep_us, 1)
        result["of_sleep_baseline"] = round(sleep_us / p50, 4)
    return result


def _sleep_baseline_us(step_ms: float, repeats: int = 50) -> float:
    """Median wall time of `time.sleep(step_ms)` on this machine, in µs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        time.sleep(step_ms / 1000)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream_all(url: str, prompts: list[list[int]], output_len: int) -> int:
    """Streams every prompt at once from its own client; the tokens received."""
    import aiohttp

    params = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}

    async def one(session: aiohttp.ClientSession, ids: list[int]) -> int:
        body = {"input_ids": ids, "sampling_params": params, "stream": True}
        received = 0
        async with session.post(f"{url}/generate", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.strip()
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    received += len(json.loads(line[5:])["output_ids"])
        return received

    connector = aiohttp.TCPConnector(limit=len(prompts))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        counts = await asyncio.gather(*(one(session, ids) for ids in prompts))
    return sum(counts)


def measure_server(
    running: int, output_len: int, input_len: int = 100, null_step_ms: float = 0.0, seed: int = 0
) -> dict[str, Any]:
    """One run through `rsgl serve` (started here, stopped after)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(*PROMPT_ID_RANGE, size=input_len).tolist() for _ in range(running)]
    with tempfile.TemporaryDirectory() as tmp:
        # Deltas: SGLang's default stream resends the text and ids so far (O(n^2) bytes).
        flags = ["--load-format", "null", "--null-step-ms", str(null_step_ms)]
        flags += ["--incremental-streaming-output"]
        flags += ["--max-running-requests", str(running)]
        proc, url = start_server(Path(tmp) / "serve.log", *flags)
        try:
            asyncio.run(_stream_all(url, prompts[:8], 8))  # warm up connections and paths
            cpu0, start = _cpu_seconds(proc.pid), time.perf_counter()
            tokens = asyncio.run(_stream_all(url, prompts, output_len))
            elapsed, cpu = time.perf_counter() - start, _cpu_seconds(proc.pid) - cpu0
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    assert tokens == running * output_len, f"{tokens} tokens, expected {running * output_len}"
    return {
        "running": running,
        "server": True,
        "streamed_tokens_per_s": round(tokens / elapsed, 1),
        "frontend_cpu_s_per_1k_tokens": round(1000 * cpu / tokens, 4),
        "seconds": round(elapsed, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rsgl bench overhead", description=__doc__)
    parser.add_argument("--running", type=int, nargs="+", default=[256])
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--null-step-ms", type=float, default=0.0)
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server", action="store_true", help="through `rsgl serve`")
    parser.add_argument("--json", action="store_true", help="one JSON line per run")
    args = parser.parse_args(argv)
    if not args.json:
        print(f"cpu: {cpu_description()}")
    for running in args.running:
        if args.server:
            result = measure_server(
                running, args.output_len, args.input_len, args.null_step_ms, args.seed
            )
        else:
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
