"""`rsgl bench grammar`: what constrained decoding costs, per backend.

- `masks`: the time to fill one step's allowed-token bitmasks for a batch of requests (1, 16,
  64, 256), each on a schema of the corpus (`grammar_schemas.json`), at the states a
  generation passes through (each step accepts one allowed token, preferring ones that close
  what is open, so the walk goes through keys, strings, numbers and the end), p50 / p99 in µs.
- `compile`: compile time per schema, cold (a new compiler each time) and cached (a hit in
  rsgl's compiler cache), p50 / p99 in ms.
- `ttft` (an engine per backend): time to first token of a request whose grammar is a cache
  miss (each corpus schema the first time) against a hit (the same schema again, another
  prompt so the radix cache does not help), and of a free request; p50 in ms. The first
  grammar an engine sees also builds the backend (its tokenizer tables): reported apart.
- `interference`: `--decode-requests` free requests decode while a pathological regex (one
  that xgrammar takes seconds to compile, `pathological_regex`) compiles, against the same
  decode with no compile, alternated `--rounds` times: the step times (the gaps between one
  streamed request's tokens) while the compile was in flight, p50 / p99 in ms, and the p99
  ratio; a third decode without a compile in each round gives the ratio of two runs that
  differ in nothing (`control_p99_ratio`: the machine's own noise). The issue asks p99
  within 10%.
- `throughput` (with `--model`, the embedded model by default): `--num-prompts` requests
  generated at once, each constrained by a corpus schema, against the same requests free with
  the same output lengths (each free request generates exactly as many tokens as its
  constrained twin, `ignore_eos`), alternated `--rounds` times in one process: output
  tokens/s of both (medians) and the ratio of each pair.

    rsgl bench grammar --backends xgrammar llguidance --json
    rsgl bench grammar --parts masks compile
    rsgl bench grammar --backends xgrammar --parts ttft interference
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rsgl.grammar.backend import GrammarBackend, GrammarOptions, Matcher
from rsgl.grammar.compiler import GrammarCompiler
from rsgl.grammar.constraint import Constraint
from rsgl.grammar.registry import make_backend

CORPUS = Path(__file__).with_name("grammar_schemas.json")


def load_corpus(path: Path = CORPUS) -> dict[str, Any]:
    """The benchmark's (and the tests') JSON schemas, by name."""
    corpus: dict[str, Any] = json.loads(path.read_text())
    return corpus


def _constraints(corpus: dict[str, Any]) -> list[Constraint]:
    out = []
    for schema in corpus.values():
        c = Constraint.of({"json_schema": schema})
        assert c is not None
        out.append(c)
    return out


def _percentiles(values: list[float], scale: float) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50": round(statistics.median(ordered) * scale, 2), "p99": round(p99 * scale, 2)}


class _Walker:
    """Picks each matcher's next token from its mask row: a closing token when allowed
    (so generations end), else a seeded random allowed one."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        names = ['"', "}", "]", "0", "1", "a"]
        self.closing = [int(tokenizer.eos_token_id)]
        self.closing += [int(tokenizer.convert_tokens_to_ids(t)) for t in names]

    def pick(self, row: np.ndarray, vocab: int) -> int:
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
        for t in self.closing:
            if bits[t] and self.rng.random() < 0.7:
                return t
        allowed = np.flatnonzero(bits)
        return int(self.rng.choice(allowed))


def bench_masks(
    backend: GrammarBackend, tokenizer: Any, corpus: dict[str, Any], batch: int, steps: int
) -> dict[str, Any]:
    constraints = _constraints(corpus)
    compiled = [backend.compile(c) for c in constraints]
    eos = int(tokenizer.eos_token_id)
    walker = _Walker(tokenizer)

    def fresh(i: int) -> Matcher:
        return backend.matcher(compiled[i % len(compiled)])

    matchers = [fresh(i) for i in range(batch)]
    bitmask = torch.full((batch, backend.words), -1, dtype=torch.int32)
    times: list[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        backend.fill(matchers, bitmask)
        times.append(time.perf_counter() - start)
        rows = bitmask.numpy()
        for i, m in enumerate(matchers):
            token = walker.pick(rows[i], backend.vocab_size)
            m.accept(token)
            if token == eos or m.is_terminated():
                matchers[i] = fresh(i + batch)  # a new request takes the slot
    return {"batch": batch, "steps": steps, "fill_us": _percentiles(times, 1e6)}


def bench_compile(make: Any, corpus: dict[str, Any], rounds: int) -> dict[str, Any]:
    constraints = _constraints(corpus)
    cold: list[float] = []
    cached: list[float] = []
    for _ in range(rounds):
        compiler = GrammarCompiler(make)  # a new backend: no cache of xgrammar's either
        for c in constraints:
            start = time.perf_counter()
            compiler.submit(c).result()
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            compiler.submit(c).result()
            cached.append(time.perf_counter() - start)
        compiler.shutdown()
    return {
        "schemas": len(constraints),
        "cold_ms": _percentiles(cold, 1e3),
        "cached_ms": _percentiles(cached, 1e3),
    }


def bench_throughput(
    backend: str,
    corpus: dict[str, Any],
    num_prompts: int,
    max_new_tokens: int,
    model: str | None,
    rounds: int = 3,
) -> dict[str, Any]:
    from rsgl.engine import Engine

    schemas = list(corpus.values())
    prompts: list[str | list[int]] = [
        f"Record {i} of a database of people, as JSON:" for i in range(num_prompts)
    ]
    constrained = [
        {
            "json_schema": json.dumps(schemas[i % len(schemas)]),
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
        }
        for i in range(num_prompts)
    ]
    with Engine(model, grammar_backend=backend, max_total_tokens=65536) as engine:
        engine.generate(prompts[:2], constrained[:2], use_tqdm=False)  # compile, warm up
        outs = engine.generate(prompts, constrained, use_tqdm=False)  # every grammar compiled
        lengths = [o["meta_info"]["completion_tokens"] for o in outs]
        free = [{"max_new_tokens": n, "ignore_eos": True, "temperature": 0} for n in lengths]
        times: dict[str, list[float]] = {"constrained": [], "free": []}
        fills: list[float] = []
        for _ in range(rounds):  # alternating, so drifting load hits both alike
            fill_before = engine._loop.mask_fill_seconds
            start = time.perf_counter()
            engine.generate(prompts, constrained, use_tqdm=False)
            times["constrained"].append(time.perf_counter() - start)
            fills.append(engine._loop.mask_fill_seconds - fill_before)
            start = time.perf_counter()
            engine.generate(prompts, free, use_tqdm=False)
            times["free"].append(time.perf_counter() - start)
    tokens = sum(lengths)
    constrained_s = statistics.median(times["constrained"])
    free_s = statistics.median(times["free"])
    ratios = sorted(f / c for c, f in zip(times["constrained"], times["free"], strict=True))
    return {
        "num_prompts": num_prompts,
        "output_tokens": tokens,
        "rounds": rounds,
        "constrained_tok_s": round(tokens / constrained_s, 1),
        "free_tok_s": round(tokens / free_s, 1),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "mask_fill_ms_per_run": round(statistics.median(fills) * 1e3, 1),
    }


def bench_ttft(backend: str, corpus: dict[str, Any], model: str | None) -> dict[str, Any]:
    from rsgl.engine import Engine

    def ttft(engine: Engine, prompt: str, params: dict[str, Any]) -> float:
        # One token: the request's whole life is its time to first token.
        start = time.perf_counter()
        engine.generate(prompt, dict(params, max_new_tokens=1, temperature=0))
        return time.perf_counter() - start

    miss: list[float] = []
    hit: list[float] = []
    with Engine(model, grammar_backend=backend, max_total_tokens=65536) as engine:
        ttft(engine, "Warm up.", {})
        free = [ttft(engine, f"{i} Record of a person, as JSON:", {}) for i in range(5)]
        first = ttft(engine, "The first grammar:", {"regex": "[0-9]+"})
        for i, schema in enumerate(corpus.values()):
            params = {"json_schema": json.dumps(schema)}
            # Distinct leading words: no prompt shares a cached prefix with another.
            miss.append(ttft(engine, f"Miss {i}: record as JSON:", params))
            hit.append(ttft(engine, f"Hit {i}: record as JSON:", params))
    ratios = [m / h for m, h in zip(miss, hit, strict=True)]
    return {
        "schemas": len(miss),
        "free_ms": _percentiles(free, 1e3)["p50"],
        "first_grammar_ms": round(first * 1e3, 1),
        "miss_ms": _percentiles(miss, 1e3),
        "hit_ms": _percentiles(hit, 1e3),
        "miss_over_hit_median": round(statistics.median(ratios), 2),
    }


def pathological_regex(segments: int, tag: str) -> str:
    """A regex of `segments` runs of any character, each with its own upper bound, each
    ended by a literal: xgrammar (0.2.8 and 0.2.9 alike) builds every distinct bounded
    repetition of "any character" separately, about 0.75 s each on the Sapphire Rapids
    development machine, while llguidance compiles it in a millisecond. `tag` is in the
    literals, so each run's regex is a cache miss."""
    return "".join(f".{{10,{300 + i}}}{tag}{i}" for i in range(segments))


def bench_interference(
    backend: str,
    model: str | None,
    decode_requests: int,
    max_new_tokens: int,
    segments: int,
    rounds: int,
) -> dict[str, Any]:
    from rsgl.engine import Engine

    prompts: list[str | list[int]] = [
        f"Story {i}: once upon a time" for i in range(decode_requests)
    ]
    free = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}

    def run(engine: Engine, regex: str | None) -> tuple[list[float], float]:
        """One decode of the prompts (with `regex` submitted once it runs): the step times
        from then until that request's first token (all of them without one), and that
        span's seconds."""
        others = threading.Thread(
            target=engine.generate, args=(prompts[1:], [free] * (decode_requests - 1))
        )
        others.start()
        stamps: list[float] = []
        window = [0.0, float("inf")]
        compiling: threading.Thread | None = None

        def compile_now() -> None:
            assert regex is not None
            window[0] = time.perf_counter()
            params = {"regex": regex, "max_new_tokens": 1}
            engine.generate("Pathological:", params)
            window[1] = time.perf_counter()

        for _ in engine.generate(prompts[0], free, stream=True):
            stamps.append(time.perf_counter())
            if regex is not None and compiling is None and len(stamps) == 8:
                compiling = threading.Thread(target=compile_now)
                compiling.start()
        others.join()
        if compiling is not None:
            compiling.join()
        gaps = [
            b - a
            for a, b in zip(stamps[8:], stamps[9:], strict=False)
            if window[0] <= a and b <= window[1]
        ]
        return gaps, window[1] - window[0] if regex is not None else 0.0

    base: list[float] = []
    control: list[float] = []
    loaded: list[float] = []
    compile_s: list[float] = []
    with Engine(model, grammar_backend=backend, max_total_tokens=65536) as engine:
        engine.generate("Warm up:", {"regex": "[0-9]+", "max_new_tokens": 2})  # the backend
        for r in range(rounds):  # alternating, so drifting load hits all alike
            base += run(engine, None)[0]
            gaps, seconds = run(engine, pathological_regex(segments, f"R{r}T"))
            loaded += gaps
            compile_s.append(seconds)
            # The same decode again without a compile: the machine's own noise, the ratio
            # the compile's must be read against.
            control += run(engine, None)[0]
    without = _percentiles(base, 1e3)
    again = _percentiles(control, 1e3)
    out: dict[str, Any] = {
        "decode_requests": decode_requests,
        "compile_s": [round(c, 2) for c in compile_s],
        "steps_measured": {"without": len(base), "during_compile": len(loaded)},
        "step_ms_without": without,
        "step_ms_control": again,
        "control_p99_ratio": round(again["p99"] / without["p99"], 3),
    }
    if loaded:  # none: it compiled within a step (llguidance), nothing to compare
        during = _percentiles(loaded, 1e3)
        out["step_ms_during_compile"] = during
        out["p99_ratio"] = round(during["p99"] / without["p99"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rsgl bench grammar", description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["masks", "compile", "ttft", "interference", "throughput"],
        choices=["masks", "compile", "ttft", "interference", "throughput"],
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=200, help="mask fills per batch size")
    parser.add_argument("--compile-rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="constrained/free pairs, alternated")
    parser.add_argument("--decode-requests", type=int, default=16, help="for `interference`")
    parser.add_argument(
        "--pathological-segments",
        type=int,
        default=8,
        help="`interference`: bounded runs in the slow regex (most of a second each for xgrammar)",
    )
    parser.add_argument(
        "--model", default=None, help="model for `ttft`, `interference`, `throughput`"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    from rsgl.models.loader import resolve_model_dir
    from rsgl.tokenizer.loader import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    vocab = len(tokenizer)
    corpus = load_corpus()
    result: dict[str, Any] = {"cpu": _cpu_name()}
    for name in args.backends:

        def make(name: str = name) -> GrammarBackend:
            made = make_backend(name, tokenizer, vocab, [tokenizer.eos_token_id], GrammarOptions())
            assert made is not None
            return made

        entry: dict[str, Any] = {}
        if "masks" in args.parts:
            backend = make()
            entry["masks"] = [
                bench_masks(backend, tokenizer, corpus, b, args.steps) for b in args.batch_sizes
            ]
        if "compile" in args.parts:
            entry["compile"] = bench_compile(make, corpus, args.compile_rounds)
        if "ttft" in args.parts:
            entry["ttft"] = bench_ttft(name, corpus, args.model)
        if "interference" in args.parts:
            entry["interference"] = bench_interference(
                name,
                args.model,
                args.decode_requests,
                args.max_new_tokens,
                args.pathological_segments,
                args.rounds,
            )
        if "throughput" in args.parts:
            entry["throughput"] = bench_throughput(
                name, corpus, args.num_prompts, args.max_new_tokens, args.model, args.rounds
            )
        result[name] = entry
        if not args.json:
            print(name, json.dumps(entry, indent=1))
    if args.json:
        print(json.dumps(result))
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
