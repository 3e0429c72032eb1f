"""`rsgl bench simulate --calibrate`: time the real model's steps here and fit a TableCost.

The model is built as the server builds it (`rsgl.stack.build_stack`: same dtype choice,
threads, attention backend) and its steps are the core's own plans: for each decode batch B
and context C of the grid (up to `--calibrate-max-tokens` of B x C), B requests of C random
prompt tokens are queued, their prefill (chunked as the server chunks it) and a few decode
steps run, then the same again with each prompt extended (a prefill over a cached prefix);
after the grid, prompts of up to a chunk and a half are prefilled alone
(`PREFILL_FRACTIONS`). All of it runs `--calibrate-passes` times, the grid's points in
reverse order every other pass (`grid_points`); every step's shape and
time (prepare + forward + sampling + the host copy of the tokens, on the CPU compute thread
as the loop runs them) is a sample. The decode steps' medians per grid point and the
linear fit of the prefill steps (`TableCost.fit`) are saved as JSON for
`--cost-model`, with the timed steps themselves (`samples`: each step's `StepShape` fields and
seconds), so that another model can be fitted to them later. Where the model has low-bit
weights, the grid's batches gain the largest that reads them and the next
(`with_low_bit_switch`).

With `--calibrate-server` the steps are timed where they run when serving: an `rsgl serve`
(the same engine options) logs each step's shape and seconds in its loop (`--step-log`),
while `rsgl bench serving`'s client streams each grid point's requests from it, all sent
at once. Those times include what the model alone does not pay: on a machine whose cores
the model's threads fill, the frontend, the HTTP streams and the client take their share
of them, more the more requests stream. It also times what a request spends outside the
steps (`request_latency`), which the simulation adds to every request's TTFT and E2E, and
requests sent alone after set idle gaps and right after one another (`idle_sweep`,
`--calibrate-idle-gaps`; the step log records the idle before each step): what their
prefills took over the same prompts' sent back to back is fitted as `AfterIdle` (in
process the steps run back to back, and none is fitted).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rsgl.args import EngineArgs, from_cli
from rsgl.bench.sim.cost import AFTER_EXTEND_STEPS, AfterIdle, TableCost
from rsgl.model_executor.executor import run_on_compute_thread
from rsgl.sampling_params import SamplingParams
from rsgl.scheduler.step_shape import StepShape, idles_of_log, steps_of_log

# Decode steps timed per grid point (after the prefill steps): past the first
# AFTER_EXTEND_STEPS, which a CPU runs slower after a prefill, some steady ones for the table.
DECODE_STEPS = AFTER_EXTEND_STEPS + 5
# Tokens each request of a grid point generates through the server: a point's decode steps
# are fewer at the full batch (a request that finished prefilling decodes while the others
# still prefill), so more of them than in process.
SERVER_OUTPUT_LEN = 16
# Each grid point's requests are sent twice: the second time each prompt is extended by
# this many tokens, so that prefills over a cached prefix (a shared system prompt, a chat's
# history) are timed too.
PREFIX_EXTENSION = 32
# Prompts prefilled alone after the grid (one output token, so no decode step), at these
# fractions of the longest prefill chunk, each twice: a whole chunk, and a chunk that
# continues a prompt over its cached first chunk, are then among the fitted steps rather than
# extrapolated from the grid's prompts (SmolLM2's 1,536-token prefills on a 2-core Zen 4
# were priced 20% high by a grid whose prompts ended at 1,024 tokens).
PREFILL_FRACTIONS = (0.25, 0.5, 1.0, 1.5)
# Passes over the grid and the prefill sweep: each point's median then pools steps timed
# minutes apart (see `grid_points`).
PASSES = 2
# The most tokens (batch x context) a grid point prefills: the grid's points past it are
# priced from their batch's shorter contexts (`TableCost.fit`). The default grid's 2,048
# tokens at batch 64 would add 64 prefills of a chunk to each pass (2.5 minutes on a 2-core
# Zen 4 in bfloat16), and so many requests decode at such contexts only where long prompts
# come many at a time.
MAX_POINT_TOKENS = 65536
# Through a server, requests are also sent one at a time after each of these idle gaps
# (seconds; `idle_sweep`) and right after the one before, IDLE_REPEATS times with prompts of
# each of IDLE_PROMPT_LENS tokens and IDLE_OUTPUT_LEN output tokens, so that what a step
# costs after idle is fitted (`AfterIdle`).
IDLE_GAPS_S = (0.03, 0.1, 0.3, 1.0, 3.0)
IDLE_REPEATS = 4
IDLE_PROMPT_LENS = (32, 256)
IDLE_OUTPUT_LEN = 2
# Requests timed one at a time for `request_latency`, and their prompts' length.
LATENCY_REQUESTS = 8
LATENCY_PROMPT_LEN = 32


class IdleStep(NamedTuple):
    """A prefill of `idle_sweep`: the idle before it (the step log's), its tokens, its
    seconds."""

    idle_s: float
    new_tokens: int
    seconds: float


def parse_gaps(text: str) -> tuple[float, ...]:
    """`--calibrate-idle-gaps`: seconds, comma-separated (empty: none)."""
    try:
        gaps = tuple(float(g) for g in text.split(",") if g.strip())
    except ValueError:
        raise ValueError(f"--calibrate-idle-gaps: seconds, comma-separated, got {text!r}") from None
    if any(not 0 < g < 60 for g in gaps):
        raise ValueError(f"--calibrate-idle-gaps: each gap in (0, 60) seconds, got {text!r}")
    return gaps


def parse_grid(text: str) -> tuple[list[int], list[int]]:
    """ "1,8,32:64,256" -> ([1, 8, 32], [64, 256]) (decode batches : contexts)."""
    batches, _, contexts = text.partition(":")
    try:
        grid = [int(x) for x in batches.split(",")], [int(x) for x in contexts.split(",")]
    except ValueError:
        raise ValueError(
            f"--calibrate-grid: batches:contexts, e.g. 1,8:64,256, got {text!r}"
        ) from None
    if min(min(grid[0]), min(grid[1])) < 1:
        raise ValueError(f"--calibrate-grid: batches and contexts of at least 1, got {text!r}")
    return grid


def grid_points(
    batches: list[int], contexts: list[int], max_tokens: int, passes: int
) -> list[list[tuple[int, int]]]:
    """Each pass's (batch, context) points in the order they are timed: context by context,
    those whose batch x context is at most `max_tokens` (and every batch's two shortest
    contexts, from which `TableCost.fit` extends the rest), every other pass in reverse. A
    VM's speed drifts by a third within minutes: a point timed in one slow stretch priced its
    neighbourhood high (on a 2-core Zen 4, one calibration timed batch 1 at 1,048 tokens 9.9
    ms a step against 6.8 at 280: 4.1 us a token of context, where its larger batches' rows
    took 1.0-1.9), so each point's median pools steps from each pass, the two ends of the
    grid timed once early and once late."""
    shortest = sorted(contexts)[:2]
    points = [(b, c) for c in contexts for b in batches if b * c <= max_tokens or c in shortest]
    return [points if i % 2 == 0 else points[::-1] for i in range(passes)]


def with_low_bit_switch(batches: list[int], max_rows: int | None) -> list[int]:
    """The grid's decode batches and, within them, the largest that reads low-bit weights and
    the next (`low_bit_max_rows`): a step's cost jumps between the two (on an AVX2 CPU in
    float32, 25 to 50 ms from 4 rows to 5 where the dense copy took over at 5), a jump that
    interpolating between wider points would spread over every batch between them."""
    last = max_rows or 0
    switch = {b for b in (last, last + 1) if last and batches[0] < b < batches[-1]}
    return sorted(set(batches) | switch)


def prefill_lengths(chunk: int, contexts: list[int], context_length: int) -> list[int]:
    """The prompt lengths the prefill sweep times (`PREFILL_FRACTIONS` of the chunk, or of
    twice the grid's longest context where prefills are not chunked), each within the
    model's context."""
    longest = chunk if chunk > 0 else 2 * max(contexts)
    return sorted({min(context_length - 1, max(1, round(f * longest))) for f in PREFILL_FRACTIONS})


def cpu_name() -> str:
    """This machine's CPU model (/proc/cpuinfo), or the platform's word for it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_steps(
    engine: EngineArgs,
    batches: list[int],
    contexts: list[int],
    seed: int = 0,
    max_tokens: int = MAX_POINT_TOKENS,
    passes: int = PASSES,
    idle_gaps: tuple[float, ...] = (),
) -> tuple[list[StepShape], list[float], list[IdleStep], dict[str, Any]]:
    """Every timed step's shape and seconds over the grid's points (`grid_points`) and the
    prefill sweep, no steps after idle (in process the steps run back to back: `idle_gaps`
    apply through a server only), and what ran them."""
    from rsgl.stack import build_stack

    stack = build_stack(engine)
    info = stack.info()
    batches = with_low_bit_switch(batches, info["low_bit_max_rows"])
    core = stack.core
    runner: Any = stack.runner  # a ModelRunner (a NullRunner with --load-format null)
    rng = np.random.default_rng(seed)
    vocab = stack.config.vocab_size
    shapes: list[StepShape] = []
    seconds: list[float] = []
    next_id = 0

    def run_point(batch: int, context: int, record: bool) -> None:
        first = [rng.integers(10, vocab, context) for _ in range(batch)]
        run_requests(first, record)
        # Again, each prompt extended: prefills over a cached prefix.
        run_requests(
            [np.concatenate([p, rng.integers(10, vocab, PREFIX_EXTENSION)]) for p in first], record
        )

    def run_requests(
        batch_prompts: list[np.ndarray], record: bool, max_new_tokens: int = DECODE_STEPS + 1
    ) -> None:
        nonlocal next_id
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        prompts = {}
        for prompt in batch_prompts:
            core.add_request(next_id, prompt, params.max_new_tokens, ignore_eos=True)
            prompts[next_id] = prompt.tolist()
            next_id += 1
        while core.has_work:
            plan = core.schedule()
            if plan.forward_mode == "idle":
                break
            slot_of = dict(zip(plan.rids.tolist(), plan.req_slots.tolist(), strict=True))
            for rid in plan.admitted.tolist():
                runner.admit(slot_of[rid], params, prompts[rid])
            started = time.perf_counter()
            prepared = runner.prepare(plan)
            tokens = runner.execute(prepared).next_token_ids.numpy()
            elapsed = time.perf_counter() - started
            core.commit(plan.id, tokens)
            if record:
                shapes.append(StepShape.of(plan))
                seconds.append(elapsed)

    lengths = prefill_lengths(engine.chunked_prefill_size, contexts, stack.context_length)

    def grid() -> None:
        run_point(batches[0], contexts[0], record=False)  # warm-up
        for points in grid_points(batches, contexts, max_tokens, passes):
            for batch, context in points:
                run_point(batch, context, record=True)
            for length in lengths:
                run_requests([rng.integers(10, vocab, length)], record=True, max_new_tokens=1)

    run_on_compute_thread(grid)
    meta = _meta(
        engine,
        batches,
        contexts,
        max_tokens=max_tokens,
        passes=passes,
        prefill_lengths=lengths,
        cpu_threads=stack.cpu_threads,
        model=stack.model_dir.name,
        dtype=stack.dtype_choice.chosen,
        quantization=stack.info()["quantization"],
    )
    return shapes, seconds, [], meta


def _meta(
    engine: EngineArgs, batches: list[int], contexts: list[int], **ran: Any
) -> dict[str, Any]:
    """What a calibration timed: this machine, the grid, the engine's options and what the
    engine resolved (`ran`: its threads, model and dtype)."""
    return {
        "machine": cpu_name(),
        "device": engine.device,
        **ran,
        "batches": batches,
        "contexts": contexts,
        "chunked_prefill_size": engine.chunked_prefill_size,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def time_server_steps(
    engine: EngineArgs,
    batches: list[int],
    contexts: list[int],
    seed: int = 0,
    max_tokens: int = MAX_POINT_TOKENS,
    passes: int = PASSES,
    idle_gaps: tuple[float, ...] = IDLE_GAPS_S,
) -> tuple[list[StepShape], list[float], list[IdleStep], dict[str, Any]]:
    """Every step an `rsgl serve` of `engine` ran for the grid's requests (see the module
    doc), its shape and seconds; the prefills of `idle_sweep` over `idle_gaps`; and what
    ran them."""
    import httpx

    from rsgl.bench import serving
    from rsgl.bench.serve_process import start_server
    from rsgl.bench.sim.validate import server_flags
    from rsgl.models.loader import resolve_model_dir

    tokenizer = serving.load_tokenizer(engine.tokenizer_path or engine.model_path)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        flags = server_flags(dataclasses.replace(engine, step_log=str(log)))
        proc, url = start_server(Path(tmp) / "server.log", *flags)
        recorded: list[str] = []
        try:
            info = httpx.get(f"{url}/get_server_info", timeout=30).json()
            batches = with_low_bit_switch(batches, info.get("low_bit_max_rows"))
            lengths = prefill_lengths(
                engine.chunked_prefill_size, contexts, int(info["context_length"])
            )
            # A warm-up point first (the first requests pay for lazy set-up), not recorded;
            # each pass's prefill sweep after its points (None).
            points: list[tuple[int, int, bool] | None] = [(batches[0], contexts[0], False)]
            for grid in grid_points(batches, contexts, max_tokens, passes):
                points += [(b, c, True) for b, c in grid] + [None]
            config = serving.BenchConfig(base_url=url, backend="rsgl", warmup_requests=0)
            for i, point in enumerate(points):
                if point is None:
                    seeds = seed + 2 * len(points) + i * len(lengths)
                    recorded += prefill_sweep(url, tokenizer, log, lengths, seeds)
                    continue
                batch, context, record = point
                httpx.post(f"{url}/flush_cache", timeout=30)
                done = len(log.read_text().splitlines()) if log.exists() else 0
                first = serving.random_requests(
                    tokenizer, batch, context, SERVER_OUTPUT_LEN, seed + i
                )
                tails = serving.random_requests(
                    tokenizer, batch, PREFIX_EXTENSION, SERVER_OUTPUT_LEN, seed + len(points) + i
                )
                extended = [
                    dataclasses.replace(
                        r, prompt=r.prompt + t.prompt, prompt_len=r.prompt_len + t.prompt_len
                    )
                    for r, t in zip(first, tails, strict=True)
                ]
                for requests in (first, extended):
                    run = asyncio.run(serving.run_benchmark(config, requests))
                    failed = [r.error for r in run.results if r.error]
                    if failed:
                        raise RuntimeError(f"a calibration request failed: {failed[0]}")
                # Each step's line is written before its tokens are sent: all are there.
                if record:
                    recorded += log.read_text().splitlines()[done:]
            after_idle = idle_sweep(url, tokenizer, log, idle_gaps, seed + 4 * len(points))
            latency = request_latency(url, tokenizer, log, seed + 3 * len(points))
        finally:
            proc.terminate()
            proc.wait(60)
    shapes, seconds = steps_of_log(recorded)
    meta = _meta(
        engine,
        batches,
        contexts,
        max_tokens=max_tokens,
        passes=passes,
        prefill_lengths=lengths,
        idle_gaps_s=list(idle_gaps),
        through="rsgl serve",
        cpu_threads=info["cpu_threads"],
        model=resolve_model_dir(engine.model_path).name,
        dtype=info["dtype"],
        quantization=info["quantization"],
        request_latency_s=latency,
    )
    return shapes, seconds, after_idle, meta


def prefill_sweep(url: str, tokenizer: Any, log: Path, lengths: list[int], seed: int) -> list[str]:
    """The step-log lines of `lengths`' prompts, sent one at a
    time for one output token each, every one after a cache flush."""
    import httpx

    from rsgl.bench import serving

    config = serving.BenchConfig(base_url=url, backend="rsgl", warmup_requests=0)
    lines = []
    for i, length in enumerate(lengths):
        httpx.post(f"{url}/flush_cache", timeout=30)
        done = len(log.read_text().splitlines())
        requests = serving.random_requests(tokenizer, 1, length, 1, seed + i)
        (result,) = asyncio.run(serving.run_benchmark(config, requests)).results
        if not result.success:
            raise RuntimeError(f"a calibration request failed: {result.error}")
        lines += log.read_text().splitlines()[done:]
    return lines


def idle_sweep(
    url: str, tokenizer: Any, log: Path, gaps: tuple[float, ...], seed: int
) -> list[IdleStep]:
    """The prefill steps of requests sent one at a time, each right after the one before or
    after one of `gaps` seconds with nothing running: each gap (and none) and each prompt
    length IDLE_REPEATS times, shuffled so that a slow stretch of the VM does not fall on
    one gap. Nothing when `gaps` is empty."""
    from rsgl.bench import serving

    if not gaps:
        return []
    config = serving.BenchConfig(base_url=url, backend="rsgl", warmup_requests=0)
    trials = [(g, n) for g in (0.0, *gaps) for n in IDLE_PROMPT_LENS] * IDLE_REPEATS
    np.random.default_rng(seed).shuffle(trials)
    steps = []
    for i, (gap, length) in enumerate(trials):
        time.sleep(gap)
        done = len(log.read_text().splitlines())
        requests = serving.random_requests(tokenizer, 1, length, IDLE_OUTPUT_LEN, seed + i)
        (result,) = asyncio.run(serving.run_benchmark(config, requests)).results
        if not result.success:
            raise RuntimeError(f"a calibration request failed: {result.error}")
        lines = log.read_text().splitlines()[done:]
        (shape, *_), (took, *_) = steps_of_log(lines)
        steps.append(IdleStep(idles_of_log(lines)[0], shape.new_tokens, took))
    return steps


def request_latency(url: str, tokenizer: Any, log: Path, seed: int) -> float:
    """What a request spends outside the server's steps: the median, over requests of one
    output token sent one at a time, of the client's end-to-end time less the seconds of
    the steps the server logged meanwhile (the HTTP exchange, tokenizing, the hops between
    frontend and scheduler, the stream's end). The simulation adds it to every request's
    way in (`Simulation(request_latency_s=...)`): without it a prediction's TTFT and E2E
    miss it, most where prefills are short."""
    from rsgl.bench import serving

    config = serving.BenchConfig(base_url=url, backend="rsgl", warmup_requests=0)
    outside = []
    for i in range(LATENCY_REQUESTS):
        done = len(log.read_text().splitlines())
        requests = serving.random_requests(tokenizer, 1, LATENCY_PROMPT_LEN, 1, seed + i)
        (result,) = asyncio.run(serving.run_benchmark(config, requests)).results
        if not result.success:
            raise RuntimeError(f"a calibration request failed: {result.error}")
        _, seconds = steps_of_log(log.read_text().splitlines()[done:])
        outside.append(result.e2e - sum(seconds))
    return max(0.0, float(np.median(outside)))


def calibrate_main(args: argparse.Namespace) -> int:
    """`--calibrate`: fit, save to --calibrate-output, print the fit's summary."""
    try:
        batches, contexts = parse_grid(args.calibrate_grid)
        gaps = parse_gaps(args.calibrate_idle_gaps)
    except ValueError as exc:
        print(f"rsgl bench simulate: {exc}", file=sys.stderr)
        return 2
    engine: EngineArgs = from_cli(EngineArgs, args)
    if engine.dp_size > 1:
        # One replica's steps, in the order it ran them (a table prices one replica's).
        print("rsgl bench simulate: --calibrate times one replica (--dp-size 1)", file=sys.stderr)
        return 2
    timer = time_server_steps if args.calibrate_server else time_steps
    max_tokens, passes = args.calibrate_max_tokens, args.calibrate_passes
    shapes, seconds, idle_steps, meta = timer(
        engine, batches, contexts, args.seed, max_tokens, passes, gaps
    )
    # The batches timed: the grid's, and the low-bit switch's (`with_low_bit_switch`).
    model = TableCost.fit(shapes, seconds, meta["batches"], contexts, meta, max_tokens)
    if idle_steps:
        model = dataclasses.replace(model, after_idle=AfterIdle.fit(*zip(*idle_steps, strict=True)))
    saved = model.to_json()
    # The timed steps themselves, so that another model can be fitted to them later.
    saved["sample_fields"] = [*(f.name for f in dataclasses.fields(StepShape)), "seconds"]
    saved["samples"] = [[*dataclasses.astuple(s), t] for s, t in zip(shapes, seconds, strict=True)]
    saved["idle_step_fields"] = list(IdleStep._fields)
    saved["idle_steps"] = [list(step) for step in idle_steps]
    with open(args.calibrate_output, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=1)
    meta = model.meta or {}
    after = model.after_idle
    idle = (
        "none timed"
        if after is None
        else ", ".join(
            f"+{x * 1e3:.1f} ms after {g:.2f} s"
            for g, x in zip(after.gaps_s, after.extra_s, strict=True)
        )
    )
    print(
        f"calibrated on {meta.get('machine')} ({meta.get('samples')} steps): relative error "
        f"of decode steps mean {meta.get('decode_fit_mean_rel_error')}, worst "
        f"{meta.get('decode_fit_max_rel_error')}; of prefill steps mean "
        f"{meta.get('extend_fit_mean_rel_error')}, worst {meta.get('extend_fit_max_rel_error')}; "
        f"a step after idle: {idle}; wrote {args.calibrate_output}",
        file=sys.stderr,
    )
    print(json.dumps(model.to_json()))
    return 0
