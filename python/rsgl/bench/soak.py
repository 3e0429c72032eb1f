"""Soak test of a running server: a long seeded mix of requests, then a leak check when idle.

    rsgl bench soak --base-url http://127.0.0.1:30000 --num-requests 1000 \\
        --max-concurrency 128 --disconnect-fraction 0.2 --seed 0 --warmup

The mix covers what clients do to a server: completions, chat and native /generate, streamed
and not, n of 1 or 2, stop strings, logprobs, greedy and seeded sampling, max_tokens 4-64,
prompts that share a prefix (radix cache hits) and exact repeats. Besides requests read to
their end, --disconnect-fraction of them are dropped by the client (a stream after a few
chunks, a whole response after a short wait) and --abort-fraction are sent with an explicit
`rid` and cancelled shortly after through POST /abort_request.

Every request ends in one of four classes:
  completed  HTTP 200 and every choice finished with "stop" or "length"
  dropped    the client disconnected on purpose before the end
  aborted    we called /abort_request; "abort", or a normal finish when the abort lost the race
  failed     anything else: 4xx/5xx, a connection error, an error event inside a stream, a
             stream without `data: [DONE]`, a missing choice or finish_reason

After the run the server must go idle (no live, running or waiting requests); its stats are
then read from GET /get_server_info. A correct server has failed == 0 and, when idle, holds
no KV in requests or in locked radix nodes: `leak_free` is held == 0, protected == 0 and
free + evictable == capacity. With --warmup the same mix runs once first, untimed, and the
scheduler's RSS after it is compared with the RSS after the measured run (`rss_ratio`; a
server that does not leak stays within 10%). Prints one JSON object; the exit code is 0
whatever the result, since this is a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from rsgl.bench.serving import served_model

Api = Literal["completions", "chat", "generate"]
Action = Literal["complete", "drop", "abort"]
OutcomeKind = Literal["completed", "dropped", "aborted", "failed"]

# Distinct error strings kept in the report; a broken server repeats a few errors many times.
MAX_ERRORS = 20
# Finish reasons of a request that ran to its end (OpenAI names; native meta_info types).
NORMAL_FINISHES = frozenset({"stop", "length"})
# The scheduler reports its stats once a second, so a reading taken this long after the
# server went idle describes the idle server, RSS included.
STATS_SETTLE_S = 1.5
IDLE_POLL_S = 0.5
KEEPALIVE_S = 2.0
# A request that exceeds any of these failed; it must not take the whole run down. The last
# three come from well-formed JSON of an unexpected shape.
_REQUEST_ERRORS = (
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
)

_SUBJECTS = (
    "a lighthouse keeper",
    "the old library",
    "a small robot",
    "my neighbour's cat",
    "the river",
    "a travelling musician",
    "the winter market",
    "an astronomer",
    "the mountain village",
    "a paper boat",
    "the night train",
    "a retired baker",
)
_TOPICS = (
    "gardening",
    "the weather",
    "cooking",
    "mathematics",
    "music",
    "travel",
    "friendship",
    "history",
    "the sea",
    "learning a language",
)
_TASKS = (
    "Write a short story about {s}.",
    "Describe {s} in three sentences.",
    "Explain why {s} matters to {t}.",
    "List three facts about {s}.",
    "Write a haiku about {s} and {t}.",
    "What would {s} say to {t}?",
    "Summarize a day in the life of {s}.",
    "Give {s} some advice about {topic}.",
    "Tell me something surprising about {topic}.",
    "Continue the sentence: {S} woke up early because",
)
_GUIDELINES = (
    "Answer briefly and clearly.",
    "Prefer plain words to jargon, and explain any term a child would not know.",
    "When a question has several parts, answer each part in order.",
    "If you are unsure of a fact, say so instead of guessing.",
    "Keep lists short: three items are usually enough.",
    "Be polite, but do not apologise for things that are not your fault.",
    "Use examples from everyday life: cooking, walking, the weather.",
    "Numbers should be written as digits, and units should always be given.",
    "Stories should have a beginning, a middle and an end.",
    "Never repeat the question back to the user.",
)
_STOP_STRINGS = (".", "\n", ",", " the", "!", "\n\n", " and", "?")


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """Where to send the mix, how much of it, and how the client misbehaves."""

    base_url: str
    num_requests: int = 1000
    max_concurrency: int = 128
    disconnect_fraction: float = 0.2
    abort_fraction: float = 0.05
    seed: int = 0
    api_key: str | None = None
    warmup: bool = False
    idle_timeout_s: float = 120.0
    request_timeout_s: float = 600.0


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the mix: the API, its sampling fields and what the client does with it.

    `system` is a shared preamble (a chat system message, or the start of the prompt
    elsewhere). A dropped stream is closed after `drop_after_chunks` data events, a dropped
    whole response after `drop_after_s`; an aborted request gets /abort_request after
    `abort_after_s`.
    """

    index: int
    api: Api
    stream: bool
    system: str
    prompt: str
    n: int
    max_tokens: int
    stop: tuple[str, ...]
    top_logprobs: int | None  # None: no logprobs asked
    temperature: float
    sampling_seed: int | None
    ignore_eos: bool
    include_usage: bool
    action: Action
    drop_after_chunks: int = 0
    drop_after_s: float = 0.0
    abort_after_s: float = 0.0

    def label(self) -> str:
        """A short description for error reports: `chat/stream/n2/abort`."""
        parts = [self.api, "stream" if self.stream else "whole", f"n{self.n}"]
        if self.stop:
            parts.append("stop")
        if self.top_logprobs is not None:
            parts.append("logprobs")
        if self.action != "complete":
            parts.append(self.action)
        return "/".join(parts)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended; `error` says why when it failed, `cut_short` whether an
    aborted request ended with finish_reason "abort" (rather than winning the race)."""

    kind: OutcomeKind
    error: str = ""
    cut_short: bool = False


# ---------------------------------------------------------------------------------------------
# The mix


def _prompt(rng: random.Random) -> str:
    subject, other = rng.sample(_SUBJECTS, 2)
    topic = rng.choice(_TOPICS)
    return rng.choice(_TASKS).format(s=subject, S=subject.capitalize(), t=other, topic=topic)


def build_mix(config: SoakConfig) -> list[RequestSpec]:
    """The seeded request mix: the same config gives the same requests, in the same order."""
    rng = random.Random(config.seed)
    # A few long preambles shared by many prompts, so the radix cache holds prefixes that
    # live requests lock and unlock while others are dropped or aborted.
    preambles = [
        "You are a helpful assistant. " + " ".join(rng.sample(_GUIDELINES, 6)) + "\n\n"
        for _ in range(4)
    ]
    specs: list[RequestSpec] = []
    for index in range(config.num_requests):
        api: Api = rng.choices(("completions", "chat", "generate"), weights=(45, 40, 15))[0]
        if specs and rng.random() < 0.1:
            # An exact repeat of an earlier prompt: a full-prefix cache hit.
            earlier = rng.choice(specs)
            system, prompt = earlier.system, earlier.prompt
        else:
            system = rng.choice(preambles) if rng.random() < 0.4 else ""
            prompt = _prompt(rng)
        u = rng.random()
        action: Action = "complete"
        if u < config.abort_fraction:
            action = "abort"
        elif u < config.abort_fraction + config.disconnect_fraction:
            action = "drop"
        greedy = rng.random() < 0.5
        specs.append(
            RequestSpec(
                index=index,
                api=api,
                stream=rng.random() < 0.5,
                system=system,
                prompt=prompt,
                n=2 if rng.random() < 0.25 else 1,
                max_tokens=rng.randint(4, 64),
                stop=tuple(rng.sample(_STOP_STRINGS, rng.randint(1, 2)))
                if rng.random() < 0.3
                else (),
                top_logprobs=rng.randint(0, 3) if rng.random() < 0.25 else None,
                temperature=0.0 if greedy else round(rng.uniform(0.5, 1.0), 2),
                sampling_seed=None if greedy else rng.randrange(1 << 31),
                ignore_eos=rng.random() < 0.25,
                include_usage=rng.random() < 0.5,
                action=action,
                drop_after_chunks=rng.randint(1, 4),
                drop_after_s=round(rng.uniform(0.05, 1.5), 3),
                abort_after_s=round(rng.uniform(0.0, 0.5), 3),
            )
        )
    return specs


def request_body(
    spec: RequestSpec, model: str | None, rid: str | None
) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body of `spec`; `rid` names it for /abort_request."""
    if spec.api == "generate":
        params: dict[str, Any] = {
            "max_new_tokens": spec.max_tokens,
            "temperature": spec.temperature,
            "n": spec.n,
            "ignore_eos": spec.ignore_eos,
        }
        if spec.stop:
            params["stop"] = list(spec.stop)
        if spec.top_logprobs is not None:
            params.update(return_logprob=True, top_logprobs_num=spec.top_logprobs)
        if spec.sampling_seed is not None:
            params["seed"] = spec.sampling_seed
        native: dict[str, Any] = {
            "text": spec.system + spec.prompt,
            "sampling_params": params,
            "stream": spec.stream,
        }
        if rid is not None:
            native["rid"] = rid
        return "/generate", native

    body: dict[str, Any] = {
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "n": spec.n,
        "stream": spec.stream,
        "ignore_eos": spec.ignore_eos,
    }
    if model is not None:
        body["model"] = model
    if spec.stop:
        body["stop"] = list(spec.stop)
    if spec.sampling_seed is not None:
        body["seed"] = spec.sampling_seed
    if spec.stream and spec.include_usage:
        body["stream_options"] = {"include_usage": True}
    if rid is not None:
        body["rid"] = rid
    if spec.api == "completions":
        body["prompt"] = spec.system + spec.prompt
        if spec.top_logprobs is not None:
            body["logprobs"] = spec.top_logprobs
        return "/v1/completions", body
    messages = [{"role": "user", "content": spec.prompt}]
    if spec.system:
        messages.insert(0, {"role": "system", "content": spec.system})
    body["messages"] = messages
    if spec.top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=spec.top_logprobs)
    return "/v1/chat/completions", body


# ---------------------------------------------------------------------------------------------
# Sending


def _judge(spec: RequestSpec, reasons: dict[int, str]) -> Outcome:
    """The outcome of a response read to its end, from its choices' finish reasons."""
    if set(reasons) != set(range(spec.n)):
        return Outcome("failed", f"expected {spec.n} finished choices, got {sorted(reasons)}")
    allowed = NORMAL_FINISHES | {"abort"} if spec.action == "abort" else NORMAL_FINISHES
    unexpected = sorted({r for r in reasons.values() if r not in allowed})
    if unexpected:
        return Outcome("failed", f"unexpected finish_reason {unexpected}")
    if spec.action == "abort":
        return Outcome("aborted", cut_short="abort" in reasons.values())
    return Outcome("completed")


def _native_reason(event: dict[str, Any]) -> str:
    reason = event["meta_info"]["finish_reason"]
    return str(reason["type"] if isinstance(reason, dict) else reason)


def _event_error(event: Any) -> str:
    """The message of an error object (OpenAI `{"error": ...}`), or "" when `event` is not one."""
    error = event.get("error") if isinstance(event, dict) else None
    if not error:
        return ""
    return str(error.get("message", error) if isinstance(error, dict) else error)


async def _http_error(response: aiohttp.ClientResponse) -> str:
    text = await response.text()
    try:
        message = _event_error(json.loads(text)) or text
    except ValueError:
        message = text
    return f"HTTP {response.status}: {message[:300]}"


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The payloads of an SSE stream's `data:` lines, `[DONE]` included."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


async def send_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], spec: RequestSpec
) -> Outcome:
    """Streams one request; a dropped one is closed after a few data events."""
    reasons: dict[int, str] = {}
    saw_usage = False
    saw_done = False
    events = 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return Outcome("failed", await _http_error(response))
        async for data in _sse_data(response):
            if data == "[DONE]":
                saw_done = True
                break
            event = json.loads(data)
            if error := _event_error(event):
                return Outcome("failed", f"error event in stream: {error[:300]}")
            if spec.api == "generate":
                meta = event.get("meta_info") or {}
                if meta.get("finish_reason") is not None:
                    # Every native chunk has meta_info; its finish_reason is set once.
                    reasons[int(event.get("index", len(reasons)))] = _native_reason(event)
            else:
                for choice in event.get("choices") or []:
                    if choice.get("finish_reason") is not None:
                        reasons[int(choice["index"])] = str(choice["finish_reason"])
                saw_usage = saw_usage or event.get("usage") is not None
            events += 1
            unfinished = len(reasons) < spec.n
            if spec.action == "drop" and events >= spec.drop_after_chunks and unfinished:
                # Closing (not releasing) the response drops the connection mid-stream, as a
                # client that goes away does; the server must notice and free the request.
                response.close()
                return Outcome("dropped")
    if not saw_done:
        return Outcome("failed", "the stream ended without data: [DONE]")
    outcome = _judge(spec, reasons)
    asked_usage = spec.include_usage and spec.api != "generate"
    if outcome.kind == "completed" and asked_usage and not saw_usage:
        return Outcome("failed", "stream_options.include_usage but no usage chunk")
    return outcome


async def _read_whole(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], spec: RequestSpec
) -> Outcome:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return Outcome("failed", await _http_error(response))
        payload = await response.json()
    if spec.api == "generate":
        outs = payload if isinstance(payload, list) else [payload]
        return _judge(spec, {i: _native_reason(out) for i, out in enumerate(outs)})
    choices = payload["choices"]
    return _judge(spec, {int(c["index"]): str(c["finish_reason"]) for c in choices})


async def send_whole(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], spec: RequestSpec
) -> Outcome:
    """Sends one request for a whole response; a dropped one is cancelled after a short wait,
    which closes its connection while the server is still generating."""
    if spec.action != "drop":
        return await _read_whole(session, url, body, spec)
    # Not asyncio.wait_for: its TimeoutError would be indistinguishable from aiohttp's own.
    task = asyncio.ensure_future(_read_whole(session, url, body, spec))
    done, _ = await asyncio.wait({task}, timeout=spec.drop_after_s)
    if done:
        return task.result()  # finished before the client lost patience
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Outcome("dropped")


async def send_abort(
    session: aiohttp.ClientSession, base_url: str, rid: str, delay_s: float
) -> str:
    """Asks the server to abort `rid` after `delay_s`; returns an error message, or ""."""
    await asyncio.sleep(delay_s)
    async with session.post(f"{base_url}/abort_request", json={"rid": rid}) as response:
        if response.status != 200:
            return "abort_request " + await _http_error(response)
        await response.read()
    return ""


async def send_one(
    session: aiohttp.ClientSession,
    config: SoakConfig,
    model: str | None,
    spec: RequestSpec,
    rid: str | None,
) -> Outcome:
    """Sends `spec` (and its abort, if it has one) and classifies how it ended."""
    path, body = request_body(spec, model, rid)
    url = config.base_url + path
    send = send_stream if spec.stream else send_whole
    try:
        if rid is None:
            return await send(session, url, body, spec)
        outcome, abort_error = await asyncio.gather(
            send(session, url, body, spec),
            send_abort(session, config.base_url, rid, spec.abort_after_s),
        )
    except _REQUEST_ERRORS as exc:
        return Outcome("failed", f"{type(exc).__name__}: {str(exc)[:300]}")
    return Outcome("failed", abort_error) if abort_error else outcome


async def run_mix(
    session: aiohttp.ClientSession,
    config: SoakConfig,
    model: str | None,
    specs: Sequence[RequestSpec],
) -> list[Outcome]:
    """Sends every spec, at most `max_concurrency` at a time; one outcome per spec, in order."""
    semaphore = asyncio.Semaphore(config.max_concurrency)
    # Request ids must not collide with those of an earlier run against the same server.
    run_tag = uuid.uuid4().hex[:12]

    async def limited(spec: RequestSpec) -> Outcome:
        rid = f"soak_{run_tag}_{spec.index}" if spec.action == "abort" else None
        async with semaphore:
            return await send_one(session, config, model, spec, rid)

    return list(await asyncio.gather(*(limited(spec) for spec in specs)))


# ---------------------------------------------------------------------------------------------
# Idle stats


async def _server_stats(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any] | None:
    try:
        async with session.get(f"{base_url}/get_server_info") as response:
            if response.status != 200:
                return None
            stats = (await response.json()).get("stats")
            return dict(stats) if stats else None
    except _REQUEST_ERRORS:
        return None


def _is_idle(stats: dict[str, Any] | None) -> bool:
    if not stats:
        return False
    return all(stats.get(k) == 0 for k in ("live", "running", "waiting"))


async def wait_idle(
    session: aiohttp.ClientSession, config: SoakConfig
) -> tuple[dict[str, Any] | None, bool]:
    """The server's stats once it is idle, and whether it got there within the timeout.

    Idle must still hold after STATS_SETTLE_S: the stats are a periodic snapshot, and the
    reading that is returned must be one taken after the last request left (fresh RSS too).
    """
    deadline = time.monotonic() + config.idle_timeout_s
    stats: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        stats = await _server_stats(session, config.base_url)
        if _is_idle(stats):
            await asyncio.sleep(STATS_SETTLE_S)
            stats = await _server_stats(session, config.base_url)
            if _is_idle(stats):
                return stats, True
        await asyncio.sleep(IDLE_POLL_S)
    return stats, False


def _plain_numbers(stats: dict[str, Any]) -> dict[str, Any]:
    """The stats with whole floats as ints (the core reports every number as a float)."""
    return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in stats.items()}


# ---------------------------------------------------------------------------------------------
# The run


async def soak(config: SoakConfig) -> dict[str, Any]:
    """Runs the mix (after an untimed warm-up run of it, with --warmup) and summarizes."""
    specs = build_mix(config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=30)
    # One connection per in-flight request; aiohttp's default pool (100) would cap concurrency.
    # Idle connections are dropped before uvicorn's keep-alive timeout (5 s) closes them:
    # with aiohttp's default (15 s), a request sent on a connection the server is closing at
    # that moment fails with "Server disconnected", a client-side race, not a server fault.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        model = await served_model(session, config.base_url)
        warmup_stats: dict[str, Any] | None = None
        if config.warmup:
            await run_mix(session, config, model, specs)
            warmup_stats, _ = await wait_idle(session, config)
        start = time.perf_counter()
        outcomes = await run_mix(session, config, model, specs)
        seconds = time.perf_counter() - start
        idle_stats, idle = await wait_idle(session, config)
    return summarize(config, specs, outcomes, seconds, idle_stats, idle, warmup_stats)


def summarize(
    config: SoakConfig,
    specs: Sequence[RequestSpec],
    outcomes: Sequence[Outcome],
    seconds: float,
    idle_stats: dict[str, Any] | None,
    idle: bool,
    warmup_stats: dict[str, Any] | None,
) -> dict[str, Any]:
    """Counts per outcome, the distinct errors, the idle stats and the leak verdicts."""
    counts = dict.fromkeys(("completed", "dropped", "aborted", "failed"), 0)
    errors: list[str] = []
    for spec, outcome in zip(specs, outcomes, strict=True):
        counts[outcome.kind] += 1
        if outcome.kind == "failed":
            error = f"{spec.label()}: {outcome.error}"
            if error not in errors and len(errors) < MAX_ERRORS:
                errors.append(error)
    stats = _plain_numbers(idle_stats) if idle_stats else None
    leak_free = bool(
        idle
        and stats is not None
        and stats.get("held") == 0
        and stats.get("protected") == 0
        # Every page is free or in the radix tree: none was lost on the way.
        and stats.get("available", 0) + stats.get("evictable", 0) == stats.get("capacity")
    )
    rss_warmup = int(warmup_stats["rss_bytes"]) if warmup_stats else None
    rss_after = int(stats["rss_bytes"]) if stats and "rss_bytes" in stats else None
    rss_ratio = round(rss_after / rss_warmup, 4) if rss_warmup and rss_after else None
    return {
        "base_url": config.base_url,
        "seed": config.seed,
        "max_concurrency": config.max_concurrency,
        "disconnect_fraction": config.disconnect_fraction,
        "abort_fraction": config.abort_fraction,
        "requests": len(specs),
        **counts,
        # Aborted requests that the abort reached before they finished on their own.
        "aborted_mid_flight": sum(o.cut_short for o in outcomes),
        "errors": errors,
        "seconds": round(seconds, 3),
        "requests_per_s": round(len(specs) / max(seconds, 1e-9), 3),
        "idle": idle,
        "idle_stats": stats,
        "leak_free": leak_free,
        "rss_warmup_bytes": rss_warmup,
        "rss_after_bytes": rss_after,
        "rss_ratio": rss_ratio,
        "rss_within_10pct": None if rss_ratio is None else rss_ratio <= 1.10,
    }


# ---------------------------------------------------------------------------------------------
# CLI


def _fraction(value: str) -> float:
    fraction = float(value)
    if not 0.0 <= fraction <= 1.0:
        raise argparse.ArgumentTypeError("must be in [0, 1]")
    return fraction


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return number


def build_parser() -> argparse.ArgumentParser:
    """The `rsgl bench soak` argument parser."""
    parser = argparse.ArgumentParser(
        prog="rsgl bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--num-requests", type=_positive_int, default=1000)
    parser.add_argument("--max-concurrency", type=_positive_int, default=128)
    parser.add_argument(
        "--disconnect-fraction", type=_fraction, default=0.2, help="requests the client drops"
    )
    parser.add_argument(
        "--abort-fraction", type=_fraction, default=0.05, help="requests cancelled by rid"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument(
        "--warmup", action="store_true", help="run the mix once, untimed, first; compare RSS"
    )
    parser.add_argument(
        "--idle-timeout-s", type=float, default=120.0, help="how long to wait for an idle server"
    )
    parser.add_argument(
        "--request-timeout-s", type=float, default=600.0, help="a request taking longer failed"
    )
    parser.add_argument("--output", default=None, help="also write the JSON result here")
    return parser


def main(argv: list[str]) -> int:
    """`rsgl bench soak`: run the mix against the server and print the JSON summary."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.disconnect_fraction + args.abort_fraction > 1.0:
        parser.error("--disconnect-fraction plus --abort-fraction must be at most 1")
    config = SoakConfig(
        base_url=args.base_url.rstrip("/"),
        num_requests=args.num_requests,
        max_concurrency=args.max_concurrency,
        disconnect_fraction=args.disconnect_fraction,
        abort_fraction=args.abort_fraction,
        seed=args.seed,
        api_key=args.api_key,
        warmup=args.warmup,
        idle_timeout_s=args.idle_timeout_s,
        request_timeout_s=args.request_timeout_s,
    )
    result = asyncio.run(soak(config))
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0
