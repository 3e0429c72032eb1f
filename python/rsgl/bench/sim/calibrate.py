"""`rsgl bench simulate --calibrate`: time the real model's steps here and fit a LinearCost.

The model is built as the server builds it (`rsgl.stack.build_stack`: same dtype choice,
threads, attention backend) and its steps are the core's own plans: for each decode batch B
and context C of the grid, B requests of C random prompt tokens are queued, their prefill
(chunked as the server chunks it) and a few decode steps run, and every step's shape and
time (prepare + forward + sampling + the host copy of the tokens, on the CPU compute thread
as the loop runs them) is a sample. The least-squares fit of those samples
(`LinearCost.fit`) is saved as JSON for `--cost-model`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np

from rsgl.args import EngineArgs, from_cli
from rsgl.bench.sim.cost import LinearCost, StepShape
from rsgl.model_executor.executor import run_on_compute_thread
from rsgl.sampling_params import SamplingParams

# Decode steps timed per grid point (after the prefill steps).
DECODE_STEPS = 4


def parse_grid(text: str) -> tuple[list[int], list[int]]:
    """ "1,8,32:64,256" -> ([1, 8, 32], [64, 256]) (decode batches : contexts)."""
    batches, _, contexts = text.partition(":")
    return [int(x) for x in batches.split(",")], [int(x) for x in contexts.split(",")]


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
    engine: EngineArgs, batches: list[int], contexts: list[int], seed: int = 0
) -> tuple[list[StepShape], list[float], dict[str, Any]]:
    """Every timed step's shape and seconds over the grid, and what ran them."""
    from rsgl.stack import build_stack

    stack = build_stack(engine)
    core = stack.core
    runner: Any = stack.runner  # a ModelRunner (a NullRunner with --load-format null)
    rng = np.random.default_rng(seed)
    vocab = stack.config.vocab_size
    shapes: list[StepShape] = []
    seconds: list[float] = []
    next_id = 0

    def run_point(batch: int, context: int, record: bool) -> None:
        nonlocal next_id
        params = SamplingParams(max_new_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
        prompts = {}
        for _ in range(batch):
            prompt = rng.integers(10, vocab, context)
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

    def grid() -> None:
        run_point(batches[0], contexts[0], record=False)  # warm-up
        for context in contexts:
            for batch in batches:
                run_point(batch, context, record=True)

    run_on_compute_thread(grid)
    meta = {
        "machine": cpu_name(),
        "device": engine.device,
        "cpu_threads": stack.cpu_threads,
        "model": stack.model_dir.name,
        "dtype": stack.dtype_choice.chosen,
        "batches": batches,
        "contexts": contexts,
        "chunked_prefill_size": engine.chunked_prefill_size,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return shapes, seconds, meta


def calibrate(engine: EngineArgs, grid: str, seed: int = 0) -> LinearCost:
    """Times the grid (`parse_grid`) and fits the cost model."""
    batches, contexts = parse_grid(grid)
    shapes, seconds, meta = time_steps(engine, batches, contexts, seed)
    return LinearCost.fit(shapes, seconds, meta)


def calibrate_main(args: argparse.Namespace) -> int:
    """`--calibrate`: fit, save to --calibrate-output, print the fit's summary."""
    engine: EngineArgs = from_cli(EngineArgs, args)
    model = calibrate(engine, args.calibrate_grid, args.seed)
    with open(args.calibrate_output, "w", encoding="utf-8") as f:
        json.dump(model.to_json(), f, indent=1)
    meta = model.meta or {}
    print(
        f"calibrated on {meta.get('machine')} ({meta.get('samples')} steps): mean relative "
        f"error {meta.get('fit_mean_rel_error')}, worst {meta.get('fit_max_rel_error')}; "
        f"wrote {args.calibrate_output}",
        file=sys.stderr,
    )
    print(json.dumps(model.to_json()))
    return 0
