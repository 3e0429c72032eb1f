"""`rsgl bench simulate`: the real scheduler on a virtual clock, for capacity planning.

    rsgl bench simulate --hardware h100 --model-path benches/configs/llama3-8b \\
        --dataset random --request-rate 20 --num-prompts 2000 --dp-size 4 --tp-size 2
    rsgl bench simulate --calibrate --calibrate-output cpu.json       # time this machine
    rsgl bench simulate --cost-model cpu.json --dataset gsp --request-rate 4
    rsgl bench simulate --calibrate-hardware --hardware-output cpu-spec.json  # this CPU's rates
    rsgl bench simulate --hardware h200 --model-path benches/configs/llama3-8b \\
        --slo "ttft_p99<2s,itl_p99<100ms" --layouts 8x1,4x2,2x4 --report-dir capacity/
    rsgl bench simulate --validate --cost-model cpu.json              # against real runs

Every replica is a real `rsgl._core.Scheduler` built and sized as the server builds it,
requests reach replicas through the server's `Dispatcher` (`--dp-size`,
`--load-balance-method`), and each replica calls the core in the scheduling loop's order
(overlap unless `--disable-overlap-schedule`). Steps cost what the cost model says:
`--hardware` (a roofline from a shipped GPU spec, or this CPU's measured by
`--calibrate-hardware`, and the model config, `--tp-size` included),
`--cost-model` (a calibration of this machine saved by `--calibrate`) or `--fixed-step-ms`.
Requests arrive as a seeded Poisson process at `--request-rate` (or at a trace's own
timestamps); `--duration` simulates that many seconds of traffic; `--max-concurrency N`
holds an arrival client-side while N requests are in flight, as `rsgl bench serving`'s
does (its latencies count from when it is sent). The report has the fields
of `rsgl bench serving`'s (virtual times), plus retractions, steps, the simulator's events
and events per second of wall time (and, under a cap, the client-side wait). `--slo` and
`--validate` honour `--max-concurrency` too: a capped rate holds only if the client also
keeps up with it (`rsgl.bench.sim.capacity`), and the real runs and the predictions of the
validation both run under the cap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rsgl.args import EngineArgs, add_cli_args, from_cli
from rsgl.bench.serving import add_workload_args, format_table
from rsgl.bench.sim.calibrate import IDLE_GAPS_S, MAX_POINT_TOKENS, PASSES
from rsgl.bench.sim.cluster import Deployment, Layout
from rsgl.bench.sim.cost import HardwareSpec, load_cost_model
from rsgl.bench.sim.workload import WorkloadSpec

DATASETS = ("random", "gsp", "trace")


def build_parser() -> argparse.ArgumentParser:
    """`rsgl bench simulate`'s options: the workload (as `rsgl bench serving`'s), the cost
    model, the modes, and every engine option (`rsgl serve`'s, generated from EngineArgs)."""
    parser = argparse.ArgumentParser(
        prog="rsgl bench simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_args(parser, DATASETS)
    parser.add_argument("--trace", default=None, help="JSONL(.gz) trace (../shared/traces format)")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of traffic (overrides counts)"
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (as rsgl bench serving's): arrivals wait client-side",
    )
    c = parser.add_argument_group("cost model (one of)")
    c.add_argument(
        "--hardware",
        default=None,
        help="device spec: h100, h200 or a JSON file (a GPU's, or "
        "this CPU's from --calibrate-hardware)",
    )
    c.add_argument("--cost-model", default=None, help="a --calibrate JSON file")
    c.add_argument("--fixed-step-ms", type=float, default=None, help="every step takes this")
    m = parser.add_argument_group("modes")
    m.add_argument("--calibrate", action="store_true", help="time this machine's model steps")
    m.add_argument("--calibrate-output", default="rsgl-cost-model.json")
    m.add_argument(
        "--calibrate-server",
        action="store_true",
        help="--calibrate: time the steps of an rsgl serve streaming the grid's requests "
        "(what serving pays on this machine), not the model alone in this process",
    )
    m.add_argument(
        "--calibrate-hardware",
        action="store_true",
        help="measure this CPU's memory bandwidth, GEMM FLOP/s and memory into a --hardware spec",
    )
    m.add_argument("--hardware-output", default="rsgl-cpu-spec.json")
    m.add_argument(
        "--calibrate-grid",
        default="1,2,4,8,16,32,64:64,256,1024,2048",
        help="decode batches:contexts (prefills are timed at batch x context)",
    )
    m.add_argument(
        "--calibrate-max-tokens",
        type=int,
        default=MAX_POINT_TOKENS,
        help="--calibrate: grid points of more batch x context tokens are priced from their "
        "batch's shorter contexts, not timed",
    )
    m.add_argument(
        "--calibrate-passes",
        type=int,
        default=PASSES,
        help="--calibrate: times over the grid (every other one in reverse order) and the "
        "prefill sweep; each point's median pools them",
    )
    m.add_argument(
        "--calibrate-idle-gaps",
        default=",".join(f"{g:g}" for g in IDLE_GAPS_S),
        help="--calibrate-server: seconds of idle before the requests timed for what a step "
        "costs after idle (comma-separated; empty: none)",
    )
    m.add_argument("--slo", default=None, help='capacity search, e.g. "ttft_p99<2s,itl_p99<100ms"')
    m.add_argument("--layouts", default=None, help="DPxTP layouts to search, e.g. 8x1,4x2")
    m.add_argument("--report-dir", default="rsgl-capacity", help="--slo: PNG, HTML and JSON")
    m.add_argument("--validate", action="store_true", help="measured vs predicted table")
    m.add_argument("--validate-scale", type=float, default=1.0, help="shrinks the runs")
    m.add_argument(
        "--validate-rounds", type=int, default=1, help="--validate: runs of each cell (medians)"
    )
    parser.add_argument("--output-file", default=None, help="append the JSON result line here")
    add_cli_args(parser, EngineArgs)  # the engine's options, as rsgl serve's
    # The cost models price plain steps: the servers validated against (and the steps
    # calibrated) decode without speculation unless it is asked for.
    parser.set_defaults(speculative_algorithm="none")
    return parser


def workload_spec(args: argparse.Namespace, vocab_size: int) -> WorkloadSpec:
    return WorkloadSpec(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        gsp_num_groups=args.gsp_num_groups,
        gsp_prompts_per_group=args.gsp_prompts_per_group,
        gsp_system_prompt_len=args.gsp_system_prompt_len,
        gsp_question_len=args.gsp_question_len,
        gsp_output_len=args.gsp_output_len,
        trace=args.trace,
        vocab_size=vocab_size,
        seed=args.seed,
    )


def deployment(args: argparse.Namespace) -> Deployment:
    """The engine options, the model config and the one cost source the options name."""
    from rsgl.models.config import ModelConfig
    from rsgl.models.loader import resolve_model_dir

    engine: EngineArgs = from_cli(EngineArgs, args)
    config = ModelConfig.from_model_dir(resolve_model_dir(engine.model_path))
    given = [x is not None for x in (args.hardware, args.cost_model, args.fixed_step_ms)]
    if sum(given) > 1:
        raise ValueError("give one of --hardware, --cost-model and --fixed-step-ms")
    fixed = None if args.fixed_step_ms is None else args.fixed_step_ms / 1000
    calibrated = None if args.cost_model is None else load_cost_model(args.cost_model)
    spec = None
    if not any(given):
        spec = HardwareSpec.load("h100")
    elif args.hardware is not None:
        spec = HardwareSpec.load(args.hardware)
    return Deployment(engine, config, fixed_step_s=fixed, calibrated=calibrated, spec=spec)


def _emit(record: dict[str, Any], output_file: str | None) -> None:
    line = json.dumps(record)
    print(line)
    if output_file:
        with open(output_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def main(argv: list[str]) -> int:
    """`rsgl bench simulate` (see the module docstring)."""
    args = build_parser().parse_args(argv)
    if args.calibrate:
        from rsgl.bench.sim.calibrate import calibrate_main

        return calibrate_main(args)
    if args.calibrate_hardware:
        from rsgl.bench.sim.cpu_spec import hardware_main

        return hardware_main(args)
    try:
        dep = deployment(args)
    except (ValueError, OSError) as exc:
        print(f"rsgl bench simulate: {exc}", file=sys.stderr)
        return 2
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("rsgl bench simulate: --max-concurrency must be at least 1", file=sys.stderr)
        return 2
    spec = workload_spec(args, dep.config.vocab_size)
    if args.validate_rounds < 1:
        print("rsgl bench simulate: --validate-rounds must be at least 1", file=sys.stderr)
        return 2
    if args.validate:
        from rsgl.bench.sim.validate import validate_main

        return validate_main(args, dep)
    if args.slo:
        from rsgl.bench.sim.capacity import capacity_main

        layouts = [Layout.parse(x) for x in args.layouts.split(",")] if args.layouts else []
        layouts = layouts or [Layout(dep.args.dp_size, dep.args.tp_size)]
        report_dir = Path(args.report_dir)
        return capacity_main(
            dep, spec, args.slo, layouts, report_dir, args.duration, args.max_concurrency
        )
    record = dep.simulate(spec, args.request_rate, args.duration, args.max_concurrency)
    print(format_table(record), file=sys.stderr)
    if args.max_concurrency is not None:
        print(
            f"max concurrency {args.max_concurrency}: client-side wait "
            f"median {record['median_client_wait_ms']} ms, p99 {record['p99_client_wait_ms']} "
            f"ms; {record['keep_up_ratio']:.1%} of the requests sent by the last arrival",
            file=sys.stderr,
        )
    print(
        f"simulated {record['events']} events in {record['sim_wall_s']} s "
        f"({record['events_per_s']} events/s, {record['steps_per_s']} steps/s)",
        file=sys.stderr,
    )
    _emit(record, args.output_file)
    return 0 if record["failures"] == 0 else 1
