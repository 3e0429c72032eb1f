"""`rsgl bench simulate --validate`: the calibrated simulation against real serving runs.

For three workloads (random prompts, shared-prefix `gsp`, long prompts with short outputs)
at two request rates each, one `rsgl serve` (the engine options given, so the same pool,
chunking and policy as the simulation) is measured with `rsgl bench serving`'s own client,
its prefix cache flushed before every run, and the simulation predicts the same run with the
cost model given (`--cost-model`, from `--calibrate` on this machine). One table compares
throughput, median TTFT and median ITL, measured and predicted, with the relative error.
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
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rsgl.args import EngineArgs
from rsgl.bench import serving
from rsgl.bench.serve_process import start_server
from rsgl.bench.sim.cluster import Deployment
from rsgl.bench.sim.workload import WorkloadSpec

METRICS = (
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("median_itl_ms", "ITL p50 ms"),
)

# One run of a workload at a rate (req/s) under a concurrency cap: `rsgl bench serving`'s
# summary of it.
Measure = Callable[[WorkloadSpec, float, int | None], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Case:
    """One workload of the validation and its two request rates (req/s)."""

    name: str
    spec: WorkloadSpec
    rates: tuple[float, float]


def cases(scale: float, seed: int, vocab_size: int) -> list[Case]:
    def n(full: int) -> int:
        return max(2, round(full * scale))

    base = WorkloadSpec(vocab_size=vocab_size, seed=seed)
    groups = max(1, round(8 * scale**0.5))
    return [
        Case(
            "random",
            dataclasses.replace(base, num_prompts=n(64), random_input_len=256),
            (0.5, 2.0),
        ),
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
            (0.5, 2.0),
        ),
        Case(
            "long-prompt",
            dataclasses.replace(
                base, num_prompts=n(32), random_input_len=1536, random_output_len=16
            ),
            (0.25, 1.0),
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


def measure(
    url: str, tokenizer: Any, spec: WorkloadSpec, rate: float, max_concurrency: int | None
) -> dict[str, Any]:
    """One real run against the server at `url` (its prefix cache flushed first)."""
    import httpx

    httpx.post(f"{url}/flush_cache", timeout=30)
    config = serving.BenchConfig(
        base_url=url,
        backend="rsgl",
        request_rate=rate,
        max_concurrency=max_concurrency,
        seed=spec.seed,
    )
    run = asyncio.run(serving.run_benchmark(config, bench_requests(tokenizer, spec)))
    return serving.summarize(run)


def compare(
    dep: Deployment, measure: Measure, scale: float, seed: int, max_concurrency: int | None
) -> list[dict[str, Any]]:
    """Every case at both its rates, measured and predicted under the same cap: one row
    each (also printed to stderr as it comes)."""
    rows = []
    for case in cases(scale, seed, dep.config.vocab_size):
        for rate in case.rates:
            measured = measure(case.spec, rate, max_concurrency)
            predicted = dep.simulate(case.spec, rate, max_concurrency=max_concurrency)
            row = {
                "workload": case.name,
                "rate": rate,
                "max_concurrency": max_concurrency,
                "num_prompts": predicted["num_prompts"],
                "measured": measured,
                "predicted": predicted,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def format_rows(rows: list[dict[str, Any]], max_concurrency: int | None = None) -> str:
    """One table: a line per workload x rate x metric, measured, predicted, error, under a
    title that states the concurrency cap both sides ran under."""
    cap = "none" if max_concurrency is None else f"{max_concurrency} requests in flight"
    header = f"{'workload':<12}{'req/s':>7}  {'metric':<12}{'measured':>11}{'predicted':>11}"
    title = f"measured vs predicted, max concurrency: {cap}"
    lines = [title, header + f"{'error':>9}", "-" * (len(header) + 9)]
    for row in rows:
        for key, label in METRICS:
            m, p = row["measured"][key], row["predicted"][key]
            err = f"{(p - m) / m * 100:+.1f}%" if m else "n/a"
            lines.append(
                f"{row['workload']:<12}{row['rate']:>7g}  {label:<12}{m:>11.1f}{p:>11.1f}{err:>9}"
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
        proc, url = start_server(Path(tmp) / "server.log", *server_flags(dep.args))
        try:
            real = functools.partial(measure, url, tokenizer)
            rows = compare(dep, real, args.validate_scale, args.seed, cap)
        finally:
            proc.terminate()
            proc.wait(60)
    print(format_rows(rows, cap))
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0
