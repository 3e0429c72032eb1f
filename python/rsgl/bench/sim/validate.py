"""`rsgl bench simulate --validate`: the calibrated simulation against real serving runs.

For three workloads (random prompts, shared-prefix `gsp`, long prompts with short outputs)
at two loads each, one `rsgl serve` (the engine options given, so the same pool, chunking
and policy as the simulation) is measured with `rsgl bench serving`'s own client, its prefix
cache flushed before every run, and the simulation predicts the same run with the cost model
given (`--cost-model`, from `--calibrate` on this machine). One table compares throughput,
median TTFT and median ITL, measured and predicted, with the relative error, and the decode
steps' mean batch in the server's step log and in the simulation. No run sends the client's
warm-up request (it would leave the run's first prompt cached): the server is warmed once.

The loads are shares of each workload's capacity on the calibrated machine (`LOADS`: the
simulation's throughput when every request arrives at once), so that every machine is
validated in the same regimes, light and busy, rather than at fixed rates that one machine
serves idly and another cannot keep up with. Past capacity a queue grows for as long as the
run lasts: its TTFT measures the run's length, and a simulation a few percent off in
capacity is off by any amount there.

`--validate-rounds N` measures every cell N times, the cells in turn and their order
reversed every other round, so that a machine whose speed drifts over minutes weighs on
every cell alike: the table gives each measured metric's median over the rounds and its
spread (max - min, over the median), the machine's own noise, which no model can beat.
Real runs take minutes each at `--validate-scale 1`: run it on a quiet machine.
`--validate-scale` multiplies the number of prompts (a small one checks the plumbing).
`--max-concurrency N` caps both sides alike: the real client holds arrivals while N
requests are in flight, the simulation does the same, and the table says so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rsgl.args import EngineArgs
from rsgl.bench import serving
from rsgl.bench.serve_process import start_server
from rsgl.bench.sim.cluster import Deployment
from rsgl.bench.sim.cost import CostModel, TableCost, decodes_since_extend
from rsgl.bench.sim.workload import WorkloadSpec
from rsgl.scheduler.step_shape import idles_of_log, steps_of_log

METRICS = (
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("median_itl_ms", "ITL p50 ms"),
)

# The steps a real run took (the server's --step-log), as it timed them against the cost
# model's price of those very steps: (measured, priced, label), all steps and decode steps
# alone. Where they disagree, the machine ran at another speed than when it was calibrated
# (or the model misprices those shapes), and the latencies predicted are off by as much
# whatever the simulation's scheduling gets right.
STEP_METRICS = (
    ("step_seconds", "model_step_seconds", "steps s"),
    ("decode_step_seconds", "model_decode_step_seconds", "decode s"),
)

# One run of a workload at a rate (req/s) under a concurrency cap: `rsgl bench serving`'s
# summary of it.
Measure = Callable[[WorkloadSpec, float, int | None], dict[str, Any]]


# Each workload's loads: shares of its capacity here (light, busy).
LOADS = (0.25, 0.5)


@dataclass(frozen=True, slots=True)
class Case:
    """One workload of the validation."""

    name: str
    spec: WorkloadSpec


def cases(scale: float, seed: int, vocab_size: int) -> list[Case]:
    def n(full: int) -> int:
        return max(2, round(full * scale))

    base = WorkloadSpec(vocab_size=vocab_size, seed=seed)
    groups = max(1, round(8 * scale**0.5))
    return [
        Case("random", dataclasses.replace(base, num_prompts=n(64), random_input_len=256)),
        Case(
            "gsp",
            dataclasses.replace(
                base,
                dataset="gsp",
                gsp_num_groups=groups,
                gsp_prompts_per_group=max(1, n(64) // groups),
                gsp_system_prompt_len=512,
                gsp_question_len=64,
                gsp_output_len=64,
            ),
        ),
        Case(
            "long-prompt",
            dataclasses.replace(
                base, num_prompts=n(32), random_input_len=1536, random_output_len=16
            ),
        ),
    ]


def server_flags(engine: EngineArgs) -> list[str]:
    """`rsgl serve` flags for every engine option that differs from its default."""
    flags: list[str] = []
    default = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        value = getattr(engine, f.name)
        if value == getattr(default, f.name):
            continue
        flag = f"--{f.name.replace('_', '-')}"
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def bench_requests(tokenizer: Any, spec: WorkloadSpec) -> list[serving.BenchRequest]:
    """`rsgl bench serving`'s dataset of the same shape as `spec`."""
    if spec.dataset == "gsp":
        return serving.gsp_requests(
            tokenizer,
            spec.gsp_num_groups,
            spec.gsp_prompts_per_group,
            spec.gsp_system_prompt_len,
            spec.gsp_question_len,
            spec.gsp_output_len,
            spec.seed,
        )
    return serving.random_requests(
        tokenizer, spec.num_prompts, spec.random_input_len, spec.random_output_len, spec.seed
    )


def price_steps(lines: list[str], cost: CostModel) -> dict[str, float]:
    """`STEP_METRICS` of a run's --step-log lines: the seconds its steps took and the cost
    model's price of the same shapes (with what a step pays after the idle it logged, and a
    decode step after its replica's last extend), summed over every step and over decode
    steps; and `mean_decode_batch`, the rows of its decode steps over their number."""
    shapes, seconds = steps_of_log(lines)
    out = dict.fromkeys((key for m in STEP_METRICS for key in m[:2]), 0.0)
    decode_steps = decode_rows = 0
    # Each replica's decode steps after its own last extend (the log interleaves DP ranks).
    ranks = np.array([json.loads(line).get("dp_rank", 0) for line in lines])
    after_extend = np.zeros(len(shapes))
    for rank in np.unique(ranks):
        mine = np.flatnonzero(ranks == rank)
        numbers = decodes_since_extend([shapes[i] for i in mine])
        after_extend[mine] = cost.after_extend_seconds(numbers)
    steps = zip(shapes, seconds, idles_of_log(lines), after_extend, strict=True)
    for shape, took, idle, extra in steps:
        priced = cost.step_seconds(shape) + float(extra)
        if idle > 0:
            priced += cost.after_idle_seconds(idle, priced)
        out["step_seconds"] += took
        out["model_step_seconds"] += priced
        if shape.num_extends == 0:
            out["decode_step_seconds"] += took
            out["model_decode_step_seconds"] += priced
            decode_steps += 1
            decode_rows += shape.batch_size
    out["mean_decode_batch"] = decode_rows / decode_steps if decode_steps else 0.0
    return out


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def warm_up(url: str) -> None:
    """One short request, so that the first cell's run does not pay the server's first
    steps (the runs themselves send none: see `measure`)."""
    import httpx

    body = {"text": "Warm up.", "sampling_params": {"max_new_tokens": 8}}
    httpx.post(f"{url}/generate", json=body, timeout=300).raise_for_status()


def measure(
    url: str,
    tokenizer: Any,
    step_log: Path,
    cost: CostModel,
    spec: WorkloadSpec,
    rate: float,
    max_concurrency: int | None,
) -> dict[str, Any]:
    """One real run against the server at `url` (its prefix cache flushed first), with
    `price_steps` of the steps it logged to `step_log` during the run (when it logged any)."""
    import httpx

    httpx.post(f"{url}/flush_cache", timeout=30)
    # No warm-up request: it would leave the run's first prompt cached, which the
    # simulation, starting from an empty cache, does not have (the server was warmed once).
    config = serving.BenchConfig(
        base_url=url,
        backend="rsgl",
        request_rate=rate,
        max_concurrency=max_concurrency,
        seed=spec.seed,
        warmup_requests=0,
    )
    done = len(_lines(step_log))
    run = asyncio.run(serving.run_benchmark(config, bench_requests(tokenizer, spec)))
    summary = serving.summarize(run)
    # Each step's line is written before its tokens are sent: the run's are all there.
    steps = _lines(step_log)[done:]
    if steps:
        summary |= price_steps(steps, cost)
    return summary


@dataclass(frozen=True, slots=True)
class Cell:
    """One workload at one load: its rate (req/s) and the simulation's prediction."""

    case: Case
    load: float
    capacity: float
    rate: float
    predicted: dict[str, Any]


def plan_cells(dep: Deployment, scale: float, seed: int, cap: int | None) -> list[Cell]:
    """Every case at each of `LOADS` of the capacity the simulation predicts for it (every
    request arriving at once, under the same cap), with its prediction at that rate."""
    cells = []
    for case in cases(scale, seed, dep.config.vocab_size):
        burst = dep.simulate(case.spec, math.inf, max_concurrency=cap)
        capacity = float(burst["request_throughput"])
        for load in LOADS:
            rate = round(load * capacity, 3)
            predicted = dep.simulate(case.spec, rate, max_concurrency=cap)
            cells.append(Cell(case, load, capacity, rate, predicted))
    return cells


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric field's median over the runs, and each metric's spread (max - min over
    the median: `<metric>_spread`)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values = [float(run[key]) for run in runs]
            out[key] = statistics.median(values)
    for key, _ in METRICS:
        values = [float(run[key]) for run in runs]
        mid = statistics.median(values)
        out[f"{key}_spread"] = (max(values) - min(values)) / mid if mid else 0.0
    out["runs"] = len(runs)
    return out


def compare(
    dep: Deployment,
    measure: Measure,
    scale: float,
    seed: int,
    max_concurrency: int | None,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Every cell measured `rounds` times (in turn, the order reversed every other round)
    and predicted under the same cap: one row each, its medians over the rounds (each run
    also printed to stderr as it comes)."""
    cells = plan_cells(dep, scale, seed, max_concurrency)
    runs: list[list[dict[str, Any]]] = [[] for _ in cells]
    for r in range(rounds):
        order = range(len(cells)) if r % 2 == 0 else reversed(range(len(cells)))
        for i in order:
            cell = cells[i]
            runs[i].append(measure(cell.case.spec, cell.rate, max_concurrency))
            line = {"round": r, "workload": cell.case.name, "rate": cell.rate}
            print(json.dumps(line | {"measured": runs[i][-1]}), file=sys.stderr)
    rows = []
    for cell, measured in zip(cells, runs, strict=True):
        medians = median_of(measured)
        row = {
            "workload": cell.case.name,
            "load": cell.load,
            "capacity": round(cell.capacity, 3),
            "rate": cell.rate,
            "max_concurrency": max_concurrency,
            "num_prompts": cell.predicted["num_prompts"],
            "measured": medians,
            "predicted": cell.predicted,
            "measured_runs": measured,
        }
        # The machine's speed in the run against the calibration's: its logged steps' seconds
        # over their price. The cell simulated again with every price scaled by it sets the
        # drift of a VM's speed apart from what the simulation gets wrong.
        took, priced = medians.get("step_seconds"), medians.get("model_step_seconds")
        if dep.calibrated is not None and took and priced:
            speed = took / priced
            row["run_speed"] = speed
            scaled = dep.calibrated.scaled(speed)
            decode, extend = _speeds(measured)
            if isinstance(dep.calibrated, TableCost) and decode and extend:
                # A VM's neighbours can slow its decode steps and its prefills apart: a
                # table scales each by its own.
                scaled = dep.calibrated.scaled(decode, extend)
                row["run_speed_decode"], row["run_speed_extend"] = decode, extend
            at_speed = dataclasses.replace(dep, calibrated=scaled)
            row["predicted_at_run_speed"] = at_speed.simulate(
                cell.case.spec, cell.rate, max_concurrency=max_concurrency
            )
        rows.append(row)
    return rows


def _speeds(runs: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The median over a cell's runs of each run's decode steps' seconds over their price,
    and of its other steps' (None where a run logged none of them)."""
    decode, extend = [], []
    for run in runs:
        took, priced = run.get("step_seconds", 0.0), run.get("model_step_seconds", 0.0)
        d, d_priced = run.get("decode_step_seconds", 0.0), run.get("model_decode_step_seconds", 0.0)
        if d > 0 and d_priced > 0:
            decode.append(d / d_priced)
        if took - d > 0 and priced - d_priced > 0:
            extend.append((took - d) / (priced - d_priced))
    if len(decode) < len(runs) or len(extend) < len(runs):
        return None, None
    return statistics.median(decode), statistics.median(extend)


def format_rows(rows: list[dict[str, Any]], max_concurrency: int | None = None) -> str:
    """One table: a line per workload x load x metric, measured (the median over its
    rounds and their spread), predicted, error, under a title that states the concurrency
    cap both sides ran under."""
    cap = "none" if max_concurrency is None else f"{max_concurrency} requests in flight"
    runs = rows[0]["measured"]["runs"] if rows else 0
    header = (
        f"{'workload':<12}{'load':>5}{'req/s':>8}  {'metric':<12}"
        f"{'measured':>11}{'spread':>8}{'predicted':>11}{'error':>9}"
    )
    at_speed = any("predicted_at_run_speed" in row for row in rows)
    if at_speed:
        header += f"{'at speed':>10}{'error':>9}"
    title = (
        f"measured (median of {runs} runs) vs predicted, max concurrency: {cap}; "
        f"load: a share of the workload's capacity here"
    )
    lines = [title, header, "-" * len(header)]

    def error(m: float, p: float) -> str:
        return f"{(p - m) / m * 100:+.1f}%" if m else "n/a"

    for row in rows:
        for key, label in METRICS:
            m, p = row["measured"][key], row["predicted"][key]
            spread = f"{row['measured'][f'{key}_spread'] * 100:.0f}%"
            line = (
                f"{row['workload']:<12}{row['load']:>5g}{row['rate']:>8g}  {label:<12}"
                f"{m:>11.1f}{spread:>8}{p:>11.1f}{error(m, p):>9}"
            )
            if "predicted_at_run_speed" in row:
                q = row["predicted_at_run_speed"][key]
                line += f"{q:>10.1f}{error(m, q):>9}"
            lines.append(line)
        if "mean_decode_batch" in row["measured"]:
            m, p = row["measured"]["mean_decode_batch"], row["predicted"]["mean_decode_batch"]
            lines.append(
                f"{row['workload']:<12}{row['load']:>5g}{row['rate']:>8g}  {'decode rows':<12}"
                f"{m:>11.2f}{'':>8}{p:>11.2f}{error(m, p):>9}"
            )
        for key, priced, label in STEP_METRICS:
            if priced not in row["measured"]:
                continue
            m, p = row["measured"][key], row["measured"][priced]
            lines.append(
                f"{row['workload']:<12}{row['load']:>5g}{row['rate']:>8g}  {label:<12}"
                f"{m:>11.3f}{'':>8}{p:>11.3f}{error(m, p):>9}"
            )
    notes = (
        "decode rows: the mean batch of the decode steps, in the server's --step-log and in "
        "the simulation (where they differ, so do the batches whose steps the ITL spans); "
        "steps s / decode s: the seconds the server's steps took in the run (the step log; "
        "the median over the rounds), and the cost model's price of those same steps"
    )
    if any("model_step_seconds" in row["measured"] for row in rows):
        lines.append(notes)
    if at_speed:
        lines.append(
            "at speed: the simulation again with every step's price scaled by the run's "
            "steps s over their price (the machine's speed in the run against the "
            "calibration's; decode steps and prefills each by their own where the cost model "
            "is a table): what is left is the simulation's own error"
        )
    return "\n".join(lines)


def validate_main(args: argparse.Namespace, dep: Deployment) -> int:
    """`--validate` (see the module docstring)."""
    if dep.calibrated is None:
        print(
            "rsgl bench simulate --validate needs --cost-model (from --calibrate)", file=sys.stderr
        )
        return 2
    tokenizer = serving.load_tokenizer(dep.args.tokenizer_path or dep.args.model_path)
    cap = args.max_concurrency
    with tempfile.TemporaryDirectory() as tmp:
        step_log = Path(tmp) / "steps.jsonl"
        engine = dataclasses.replace(dep.args, step_log=str(step_log))
        proc, url = start_server(Path(tmp) / "server.log", *server_flags(engine))
        try:
            warm_up(url)
            real = functools.partial(measure, url, tokenizer, step_log, dep.calibrated)
            rows = compare(dep, real, args.validate_scale, args.seed, cap, args.validate_rounds)
        finally:
            proc.terminate()
            proc.wait(60)
    print(format_rows(rows, cap))
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0
