"""Online serving benchmark against any OpenAI-compatible (or SGLang-native) HTTP server.

    rsgl bench serving --base-url http://127.0.0.1:30000 --dataset random \\
        --num-prompts 128 --random-input-len 100 --random-output-len 128 \\
        --request-rate inf --max-concurrency 16
    rsgl bench serving --backend rsgl --dataset gsp --output-file results.jsonl

Requests arrive as a Poisson process at --request-rate (inf: all at once) and at most
--max-concurrency are in flight. Every request streams, is greedy and ignores EOS (unless
--disable-ignore-eos), so each produces exactly its output length on a conforming server.

Backends:
  openai  POST {base}/v1/completions, SSE chunks `data: {"choices": [{"text": ...}]}` ending
          with a usage chunk (stream_options.include_usage) and `data: [DONE]`.
  rsgl    POST {base}/generate (SGLang native), SSE events `data: {"text": ...,
          "meta_info": {"completion_tokens": ...}}`; text may be cumulative (SGLang) or
          incremental (rsgl), the token count always comes from meta_info.

Metrics follow SGLang's bench_serving: TTFT = first non-empty chunk - send time; ITL = gaps
between consecutive non-empty chunks (one chunk is one arrival, whatever it holds); TPOT =
(E2E - TTFT) / (output tokens - 1) per request; throughputs are totals over the wall time from
the first arrival to the last completion. The prefix-cache hit rate is the servers' own
count: prompt tokens served from the cache (usage.prompt_tokens_details.cached_tokens, or
meta_info.cached_tokens) over the prompt tokens of the requests that report it. Prints a
table and one JSON line, and appends that JSON line to --output-file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

BACKENDS = ("openai", "rsgl")
# Streams of long outputs may be quiet for a long time under load; only connects time out.
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30)
# A request that meets any of these failed; it must not take the whole run down. The last
# three come from well-formed JSON of an unexpected shape.
_REQUEST_ERRORS = (
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One prompt to send: its text, its length in tokens, and how many tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are seconds; `itl` holds inter-chunk gaps."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    # Prompt tokens the server took from its prefix cache (None: it does not say).
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Where and how to send the requests (the CLI's options minus the dataset)."""

    base_url: str
    backend: str = "openai"
    model: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    ignore_eos: bool = True
    seed: int = 0
    warmup_requests: int = 1
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class BenchRun:
    """The per-request results of a run, its wall time (first arrival to last completion), and
    the model name sent (openai backend; looked up in /v1/models when not given)."""

    results: list[RequestResult]
    duration: float
    model: str | None = None


# ---------------------------------------------------------------------------------------------
# Datasets


def _exact_len_text(
    tokenizer: Any, ids: list[int], n: int, draw: Callable[[int], list[int]]
) -> str:
    """Text that re-tokenizes to `n` tokens, starting from the token ids `ids`.

    Decoding random ids and encoding the text again merges or splits tokens at their seams, so
    the length is corrected a few times (truncate or top up) until it holds.
    """
    text = str(tokenizer.decode(ids))
    for _ in range(10):
        encoded = list(tokenizer.encode(text, add_special_tokens=False))
        if len(encoded) == n:
            break
        ids = encoded[:n] if len(encoded) > n else encoded + draw(n - len(encoded))
        text = str(tokenizer.decode(ids))
    return text


def _token_drawer(tokenizer: Any, rng: np.random.Generator) -> Callable[[int], list[int]]:
    """A function drawing `k` random ordinary token ids (special tokens left out)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = np.array([t for t in range(len(tokenizer)) if t not in special], dtype=np.int64)

    def draw(k: int) -> list[int]:
        return [int(t) for t in rng.choice(vocab, size=k)]

    return draw


def _prompt_len(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def random_requests(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """`num_prompts` prompts of `input_len` seeded random tokens, each to generate `output_len`."""
    rng = np.random.default_rng(seed)
    draw = _token_drawer(tokenizer, rng)
    out = []
    for _ in range(num_prompts):
        text = _exact_len_text(tokenizer, draw(input_len), input_len, draw)
        out.append(BenchRequest(text, _prompt_len(tokenizer, text), output_len))
    return out


def gsp_requests(
    tokenizer: Any,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[BenchRequest]:
    """Generated shared prefix: groups of prompts sharing a system prompt, shuffled together.

    Each prompt is its group's system prompt followed by its own question; the shuffle makes
    the groups arrive interleaved, as a prefix cache meets them in practice.
    """
    rng = np.random.default_rng(seed)
    draw = _token_drawer(tokenizer, rng)
    out = []
    for _ in range(num_groups):
        system = _exact_len_text(tokenizer, draw(system_prompt_len), system_prompt_len, draw)
        for _ in range(prompts_per_group):
            question = _exact_len_text(tokenizer, draw(question_len), question_len, draw)
            text = system + question
            out.append(BenchRequest(text, _prompt_len(tokenizer, text), output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


# ---------------------------------------------------------------------------------------------
# Backends


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The payloads of an SSE stream's `data:` lines, up to (not including) `[DONE]`."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments (": ping"), event names
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield data


def _http_error(status: int, body: str) -> str:
    return f"HTTP {status}: {body[:500]}"


def _stream_error(chunk: dict[str, Any]) -> str:
    """The message of an in-stream error event, or "" when `chunk` is not one."""
    error = chunk.get("error")
    if not error:
        return ""
    return str(error.get("message", error) if isinstance(error, dict) else error)


async def openai_completion(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    request: BenchRequest,
    count_tokens: Callable[[str], int] | None,
) -> RequestResult:
    """Stream one request from `/v1/completions` and time its chunks."""
    payload: dict[str, Any] = {
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": config.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        **config.extra_body,
    }
    if config.model is not None:
        payload["model"] = config.model
    result = RequestResult(prompt_len=request.prompt_len)
    usage_tokens: int | None = None
    pieces: list[str] = []
    start = time.perf_counter()
    last = start
    try:
        async with session.post(f"{config.base_url}/v1/completions", json=payload) as response:
            if response.status != 200:
                result.error = _http_error(response.status, await response.text())
                return result
            async for data in sse_data(response):
                chunk = json.loads(data)
                if error := _stream_error(chunk):
                    result.error = error
                    return result
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if cached is not None:
                        result.cached_tokens = int(cached)
                choices = chunk.get("choices") or []
                text = (choices[0].get("text") or "") if choices else ""
                if not text:
                    continue
                now = time.perf_counter()
                if not pieces:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                pieces.append(text)
    except _REQUEST_ERRORS as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.generated_text = "".join(pieces)
    if usage_tokens is not None:
        result.output_tokens = usage_tokens
    elif count_tokens is not None:
        result.output_tokens = count_tokens(result.generated_text)
    else:
        result.output_tokens = len(pieces)  # one chunk per token, as most servers stream
    result.success = True
    return result


async def rsgl_generate(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    request: BenchRequest,
    count_tokens: Callable[[str], int] | None,
) -> RequestResult:
    """Stream one request from the native `/generate` endpoint and time its events."""
    payload: dict[str, Any] = {
        "text": request.prompt,
        "sampling_params": {
            "max_new_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": config.ignore_eos,
        },
        "stream": True,
        **config.extra_body,
    }
    result = RequestResult(prompt_len=request.prompt_len)
    meta_tokens: int | None = None
    pieces: list[str] = []
    # SGLang streams the text so far, rsgl only the new piece. Cumulative streams are the ones
    # where every event extends the previous one; the last event is then the whole output.
    cumulative = True
    start = time.perf_counter()
    last = start
    try:
        async with session.post(f"{config.base_url}/generate", json=payload) as response:
            if response.status != 200:
                result.error = _http_error(response.status, await response.text())
                return result
            async for data in sse_data(response):
                event = json.loads(data)
                if error := _stream_error(event):
                    result.error = error
                    return result
                text = event.get("text") or ""
                meta = event.get("meta_info") or {}
                if meta.get("cached_tokens") is not None:
                    result.cached_tokens = int(meta["cached_tokens"])
                count = meta.get("completion_tokens")
                if count is not None:
                    # As SGLang's bench: an event whose token count did not move brought nothing.
                    arrived = int(count) > (meta_tokens or 0)
                    meta_tokens = int(count)
                else:
                    arrived = not (pieces and cumulative and text == pieces[-1])
                if not text or not arrived:
                    continue
                now = time.perf_counter()
                if not pieces:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                    cumulative = cumulative and text.startswith(pieces[-1])
                last = now
                pieces.append(text)
    except _REQUEST_ERRORS as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.generated_text = pieces[-1] if cumulative and pieces else "".join(pieces)
    if meta_tokens is not None:
        result.output_tokens = meta_tokens
    elif count_tokens is not None:
        result.output_tokens = count_tokens(result.generated_text)
    else:
        result.output_tokens = len(pieces)
    result.success = True
    return result


_REQUEST_FUNCS = {"openai": openai_completion, "rsgl": rsgl_generate}


# ---------------------------------------------------------------------------------------------
# The run


async def _arrivals(
    requests: Sequence[BenchRequest], rate: float, seed: int
) -> AsyncIterator[BenchRequest]:
    """Yield `requests` as a Poisson process of `rate` per second (all at once when inf)."""
    rng = np.random.default_rng(seed)
    for i, request in enumerate(requests):
        yield request
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The first model id from `GET /v1/models`, or None when the server does not list any."""
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            if response.status != 200:
                return None
            models = (await response.json()).get("data") or []
            return str(models[0]["id"]) if models else None
    except _REQUEST_ERRORS:
        return None


async def run_benchmark(
    config: BenchConfig,
    requests: Sequence[BenchRequest],
    count_tokens: Callable[[str], int] | None = None,
) -> BenchRun:
    """Send `requests` as `config` says and collect one result per request, in input order.

    `count_tokens` counts output tokens when the server reports no count (no usage chunk or
    meta_info); without it each non-empty chunk counts as one token.
    """
    if config.backend not in _REQUEST_FUNCS:
        raise ValueError(f"unknown backend {config.backend!r}; choose from {BACKENDS}")
    send = _REQUEST_FUNCS[config.backend]
    # One connection per in-flight request; aiohttp's default pool (100) would cap concurrency.
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=_TIMEOUT) as session:
        if config.backend == "openai" and config.model is None:
            model = await served_model(session, config.base_url)
            config = dataclasses.replace(config, model=model)
        for request in requests[: config.warmup_requests]:
            warm = BenchRequest(request.prompt, request.prompt_len, min(request.output_len, 16))
            outcome = await send(session, config, warm, count_tokens)
            if not outcome.success:
                raise RuntimeError(f"warm-up request failed: {outcome.error}")

        limit = config.max_concurrency
        semaphore = asyncio.Semaphore(limit) if limit else None

        async def limited(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                return await send(session, config, request, count_tokens)
            async with semaphore:
                return await send(session, config, request, count_tokens)

        start = time.perf_counter()
        tasks = []
        async for request in _arrivals(requests, config.request_rate, config.seed):
            tasks.append(asyncio.create_task(limited(request)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return BenchRun(results, duration, config.model)


# ---------------------------------------------------------------------------------------------
# Metrics


def _ms_stats(name: str, seconds: Sequence[float] | np.ndarray) -> dict[str, float]:
    values = np.asarray(seconds, dtype=np.float64) * 1000.0
    if values.size == 0:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    return {
        f"mean_{name}_ms": round(float(values.mean()), 3),
        f"median_{name}_ms": round(float(np.median(values)), 3),
        f"p99_{name}_ms": round(float(np.percentile(values, 99)), 3),
    }


def summarize(run: BenchRun) -> dict[str, Any]:
    """Successes, failures, throughputs and latency statistics (ms) of a run.

    Only successful requests count towards tokens and latencies. TPOT is per request and
    needs at least two output tokens; ITL pools every gap of every request.
    """
    ok = [r for r in run.results if r.success]
    reported = [r.cached_tokens is not None for r in ok]
    return summarize_arrays(
        run.duration,
        prompt_lens=np.asarray([r.prompt_len for r in ok], dtype=np.int64),
        output_tokens=np.asarray([r.output_tokens for r in ok], dtype=np.int64),
        ttft=np.asarray([r.ttft for r in ok], dtype=np.float64),
        e2e=np.asarray([r.e2e for r in ok], dtype=np.float64),
        itl=np.asarray([gap for r in ok for gap in r.itl], dtype=np.float64),
        cached_tokens=np.asarray([r.cached_tokens or 0 for r in ok], dtype=np.int64),
        cache_reported=np.asarray(reported, dtype=bool),
        errors=[r.error for r in run.results if not r.success],
    )


def summarize_arrays(
    duration: float,
    *,
    prompt_lens: np.ndarray,
    output_tokens: np.ndarray,
    ttft: np.ndarray,
    e2e: np.ndarray,
    itl: np.ndarray,
    cached_tokens: np.ndarray,
    cache_reported: np.ndarray,
    errors: Sequence[str] = (),
) -> dict[str, Any]:
    """`summarize` over the successful requests' values as arrays (one entry per request,
    seconds; `itl` pools every gap), for callers that never hold one object per request
    (`rsgl bench simulate`). `cache_reported` marks the requests whose server reported
    `cached_tokens`."""
    safe = max(duration, 1e-9)
    input_total = int(prompt_lens.sum())
    output_total = int(output_tokens.sum())
    several = output_tokens > 1
    tpots = (e2e[several] - ttft[several]) / (output_tokens[several] - 1)
    summary: dict[str, Any] = {
        "successes": len(prompt_lens),
        "failures": len(errors),
        "duration_s": round(duration, 3),
        "total_input_tokens": input_total,
        "total_output_tokens": output_total,
        "request_throughput": round(len(prompt_lens) / safe, 3),
        "input_throughput": round(input_total / safe, 3),
        "output_throughput": round(output_total / safe, 3),
        "total_token_throughput": round((input_total + output_total) / safe, 3),
        # Little's law: the mean number of requests in flight over the run.
        "concurrency": round(float(e2e.sum()) / safe, 3),
    }
    summary |= _ms_stats("ttft", ttft)
    summary |= _ms_stats("tpot", tpots)
    summary |= _ms_stats("itl", itl)
    summary |= _ms_stats("e2e", e2e)
    cached = int(cached_tokens[cache_reported].sum())
    summary["total_cached_tokens"] = cached if cache_reported.any() else None
    reported_prompt = int(prompt_lens[cache_reported].sum())
    summary["cache_hit_rate"] = round(cached / reported_prompt, 4) if reported_prompt else None
    if errors:
        summary["first_error"] = errors[0]
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a human-readable table, SGLang bench_serving style."""
    rows = [
        ("Successful requests", summary["successes"]),
        ("Failed requests", summary["failures"]),
        ("Benchmark duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Input token throughput (tok/s)", summary["input_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Concurrency", summary["concurrency"]),
        ("Total cached prompt tokens", _or_na(summary.get("total_cached_tokens"))),
        ("Prefix cache hit rate", _or_na(summary.get("cache_hit_rate"))),
    ]
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            rows.append((f"{label} {title} (ms)", summary[f"{stat}_{key}_ms"]))
    width = max(len(name) for name, _ in rows) + 2
    lines = ["{s:=^{n}}".format(s=" Serving Benchmark Result ", n=width + 12)]
    lines += [f"{name:<{width}}{value:>12}" for name, value in rows]
    if "first_error" in summary:
        lines.append(f"first error: {summary['first_error']}")
    return "\n".join(lines)


def _or_na(value: Any) -> Any:
    return "n/a" if value is None else value


# ---------------------------------------------------------------------------------------------
# CLI


def _rate(value: str) -> float:
    rate = float(value)  # float("inf") parses "inf"
    if not rate > 0:
        raise argparse.ArgumentTypeError("request rate must be > 0 (or inf)")
    return rate


def add_workload_args(parser: argparse.ArgumentParser, datasets: Sequence[str]) -> None:
    """The dataset and arrival options (`rsgl bench serving`'s, shared by `rsgl bench
    simulate`, whose datasets add a recorded trace)."""
    parser.add_argument("--dataset", choices=list(datasets), default="random")
    parser.add_argument("--num-prompts", type=int, default=128, help="random dataset only")
    parser.add_argument("--random-input-len", type=int, default=100)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--gsp-num-groups", type=int, default=16)
    parser.add_argument("--gsp-prompts-per-group", type=int, default=16)
    parser.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    parser.add_argument("--gsp-question-len", type=int, default=128)
    parser.add_argument("--gsp-output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=_rate, default=math.inf, help="req/s, or inf")


def build_parser() -> argparse.ArgumentParser:
    """The `rsgl bench serving` argument parser."""
    parser = argparse.ArgumentParser(
        prog="rsgl bench serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--backend", choices=BACKENDS, default="openai")
    parser.add_argument(
        "--model", default=None, help="openai: model field (default: first of /v1/models)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="HF tokenizer dir or id (default: the embedded model's)"
    )
    add_workload_args(parser, ("random", "gsp"))
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disable-ignore-eos", action="store_true")
    parser.add_argument("--warmup-requests", type=int, default=1)
    parser.add_argument(
        "--extra-request-body", default=None, help="JSON object merged into every request body"
    )
    parser.add_argument("--output-file", default=None, help="append the JSON result line here")
    return parser


def load_tokenizer(name: str | None) -> Any:
    """The HF tokenizer `name` (a directory or hub id); None: the embedded model's, found
    without loading its weights."""
    from rsgl.models import loader

    return loader.load_tokenizer(name or loader.resolve_model_dir(None))


def main(argv: list[str]) -> int:
    """`rsgl bench serving`: build the dataset, run it against the server, report."""
    args = build_parser().parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset == "random":
        requests = random_requests(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, args.seed
        )
    else:
        requests = gsp_requests(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )
    config = BenchConfig(
        base_url=args.base_url.rstrip("/"),
        backend=args.backend,
        model=args.model,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=not args.disable_ignore_eos,
        seed=args.seed,
        warmup_requests=args.warmup_requests,
        extra_body=json.loads(args.extra_request_body) if args.extra_request_body else {},
    )

    def count_tokens(text: str) -> int:
        return _prompt_len(tokenizer, text)

    try:
        run = asyncio.run(run_benchmark(config, requests, count_tokens))
    except RuntimeError as exc:
        print(f"rsgl bench serving: {exc}", file=sys.stderr)
        return 1
    summary = result_record(
        args, dataclasses.replace(config, model=run.model), requests, summarize(run)
    )
    print(format_table(summary))
    line = json.dumps(summary)
    print(line)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0 if summary["failures"] == 0 else 1


def result_record(
    args: argparse.Namespace,
    config: BenchConfig,
    requests: Sequence[BenchRequest],
    summary: dict[str, Any],
) -> dict[str, Any]:
    """The run's settings followed by its summary: one self-describing JSON record."""
    rate = config.request_rate
    return {
        "backend": config.backend,
        "base_url": config.base_url,
        "model": config.model,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": config.max_concurrency,
        "ignore_eos": config.ignore_eos,
        "seed": config.seed,
        **summary,
    }
