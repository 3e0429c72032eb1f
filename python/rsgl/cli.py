"""The `rsgl` command line: `rsgl serve ...`, `rsgl bench NAME ...` and `rsgl cpu-features`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Benchmark name -> module with a `main(argv: list[str]) -> int`.
BENCHMARKS: dict[str, str] = {
    "one-batch": "rsgl.bench.one_batch",
    "offline": "rsgl.bench.offline",
    "serving": "rsgl.bench.serving",
    "soak": "rsgl.bench.soak",
    "overhead": "rsgl.bench.overhead",
    "collectives": "rsgl.bench.collectives",
    "grammar": "rsgl.bench.grammar",
    "simulate": "rsgl.bench.simulate",
    "quality": "rsgl.bench.quality",
    "speculative": "rsgl.bench.speculative",
}


def run_bench(argv: list[str]) -> int:
    """Dispatch `rsgl bench NAME ARGS...` to the benchmark module named NAME."""
    if not argv or argv[0] not in BENCHMARKS:
        names = ", ".join(sorted(BENCHMARKS))
        print(f"usage: rsgl bench NAME [ARGS...]; NAME is one of: {names}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return int(module.main(argv[1:]))


def run_serve(argv: list[str]) -> int:
    """`rsgl serve ...`: the OpenAI-compatible HTTP server (bound to its parent when rsgl
    started it: `rsgl.parent_death.PARENT_LINK_ENV`)."""
    from rsgl.parent_death import die_with_environment_parent

    die_with_environment_parent()
    from rsgl.server.launch import main as serve_main

    return serve_main(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rsgl` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rsgl", description="rsgl LLM serving engine")
    parser.add_argument("command", choices=["serve", "bench", "cpu-features"])
    args = parser.parse_args(argv[:1])
    if args.command == "bench":
        return run_bench(argv[1:])
    if args.command == "cpu-features":
        from rsgl.cpu_features import main as cpu_features_main

        return cpu_features_main(argv[1:])
    return run_serve(argv[1:])
