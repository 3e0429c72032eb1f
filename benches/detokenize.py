"""Per-step cost of turning every running request's new token into text, several ways.

R requests each receive one token per step for S steps; every step is timed alone. Ways:

- `output_processor`: rsgl's output path as the Engine and the server run it
  (`OutputProcessor.process` over one step's `TokenUpdate`s: byte-table detokenization in one
  Rust call for the step, stop-string checks, request records, one `Output` per request into
  its streaming `OutputQueue`; the consumers drain the queues between steps, untimed);
- `detokenizer`: only its detokenizer, one `rsgl._core.Detokenizer.step` per step;
- `window`: rsgl's path for tokenizers that are not byte-level BPE, one
  `IncrementalDetokenizer` per request decoding short windows;
- `batch_decode`: the classic prefix/read-offset method (vLLM, SGLang's detokenizer) with one
  `tokenizer.batch_decode` per step over every request's two windows (transformers decodes
  them one by one in Python);
- `decode_batch`: the same, through the Rust backend's `Tokenizer.decode_batch` (one call);
- `decode_stream`: one `tokenizers.decoders.DecodeStream` per request (where installed).

Tokens are the embedded SmolLM2 tokenizer's: seeded random ids from its whole vocabulary
(special tokens and stray UTF-8 fragments included), or real text (this repository's README
and a multilingual sample) cut at a different place for each request. Each request's last
token is ".", so no way ends holding half a character (a DecodeStream cannot be flushed).
Every way's final text must equal `tokenizer.decode` of the request's tokens; the run fails
otherwise. Prints one JSON line per (tokens, requests). Each way's costs are also given at
output lengths 512, 4,096 and 32,768 (`--at`): the median of the 256 steps before each, in
the same run, and how far the largest is above the smallest (`spread`): a way whose cost
grows with the output shows it there. Every figure is the lowest of `--repeat` runs: on a
shared machine another process can slow a whole stretch of steps.

    python benches/detokenize.py                                  # 32,768 tokens each
    python benches/detokenize.py --steps 512 --ways output_processor batch_decode decode_batch
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rsgl._core import FinishReason
from rsgl.models.loader import resolve_model_dir
from rsgl.outputs import TokenUpdate
from rsgl.sampling_params import SamplingParams
from rsgl.tokenizer.detokenizer import CONTEXT_TOKENS, ByteTable, IncrementalDetokenizer
from rsgl.tokenizer.loader import load_tokenizer
from rsgl.tokenizer.output_processor import OutputProcessor, OutputQueue, RequestRecord

try:
    from tokenizers.decoders import DecodeStream

    HAS_DECODE_STREAM = True
except ImportError:  # tokenizers < 0.21
    HAS_DECODE_STREAM = False

PROMPT = "Write a long answer:"
MULTILINGUAL = (
    "東京は日本の首都です。Ελληνικά, русский текст, émigré naïve café — “quotes” and "
    "emoji 🎉🚀👩‍💻. हिन्दी और العربية. "
)
# Per-step seconds and each request's final text.
Result = tuple[list[float], list[str]]


def request_tokens(tokenizer: Any, kind: str, requests: int, steps: int, seed: int) -> np.ndarray:
    """(requests, steps) token ids; the last column is "."."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        tokens = rng.integers(0, len(tokenizer), size=(requests, steps))
    else:
        readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
        text = np.asarray(tokenizer.encode(MULTILINGUAL + readme + MULTILINGUAL))
        starts = rng.integers(0, len(text), size=requests)
        tokens = text[(starts[:, None] + np.arange(steps)) % len(text)]
    tokens[:, -1] = tokenizer.convert_tokens_to_ids(".")
    return tokens


def timed_steps(
    steps: int, step: Callable[[int], None], between: Callable[[int], None] = lambda s: None
) -> list[float]:
    """Times `step(s)` for every step; `between(s)` runs untimed after it."""
    gc.collect()
    times = []
    for s in range(steps):
        start = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - start)
        between(s)
    return times


def run_output_processor(tokenizer: Any, prompt: list[int], tokens: np.ndarray) -> Result:
    requests, steps = tokens.shape
    processor = OutputProcessor(tokenizer, on_stop=lambda rid, matched: None)
    queues = [OutputQueue() for _ in range(requests)]
    for r, queue in enumerate(queues):
        params = SamplingParams(max_new_tokens=steps)
        processor.add(RequestRecord(str(r), prompt, params, queue))
    finish = FinishReason.max_length(steps)
    rids = [str(r) for r in range(requests)]
    texts = [io.StringIO() for _ in range(requests)]

    def updates(s: int) -> list[TokenUpdate]:
        """What the loop hands over at step `s`."""
        last = finish if s == steps - 1 else None
        column = tokens[:, s].tolist()
        return [TokenUpdate(r, [t], finish=last) for r, t in zip(rids, column, strict=True)]

    # Each step's updates are built before it is timed (the loop's cost, not this one).
    pending = [updates(0)]

    def between(s: int) -> None:
        for queue, text in zip(queues, texts, strict=True):
            if queue.qsize():
                text.write(next(iter(queue)).text)
        if s + 1 < steps:
            pending[0] = updates(s + 1)

    times = timed_steps(steps, lambda s: processor.process(pending[0]), between)
    return times, [t.getvalue() for t in texts]


def run_detokenizer(tokenizer: Any, prompt: list[int], tokens: np.ndarray) -> Result:
    requests, steps = tokens.shape
    table = ByteTable.of(tokenizer)
    assert table is not None
    detok = table.detokenizer()
    handles = [detok.add() for _ in range(requests)]
    texts = [io.StringIO() for _ in range(requests)]
    # Step s's tokens, one list per request, built untimed before it (as the loop's updates).
    pending = [[[t] for t in tokens[:, 0].tolist()]]
    deltas: list[list[str]] = [[]]

    def step(s: int) -> None:
        deltas[0] = detok.step(handles, pending[0])[0]

    def between(s: int) -> None:
        for text, delta in zip(texts, deltas[0], strict=True):
            text.write(delta)
        if s + 1 < steps:
            pending[0] = [[t] for t in tokens[:, s + 1].tolist()]

    times = timed_steps(steps, step, between)
    return times, [t.getvalue() + detok.finish(h) for t, h in zip(texts, handles, strict=True)]


def run_window(tokenizer: Any, prompt: list[int], tokens: np.ndarray) -> Result:
    requests, steps = tokens.shape
    detoks = [IncrementalDetokenizer(tokenizer, prompt, []) for _ in range(requests)]
    texts = [io.StringIO() for _ in range(requests)]
    pending = [tokens[:, 0].tolist()]
    deltas: list[list[str]] = [[]]

    def step(s: int) -> None:
        deltas[0] = [detok.add(token) for detok, token in zip(detoks, pending[0], strict=True)]

    def between(s: int) -> None:
        for text, delta in zip(texts, deltas[0], strict=True):
            text.write(delta)
        if s + 1 < steps:
            pending[0] = tokens[:, s + 1].tolist()

    times = timed_steps(steps, step, between)
    return times, [t.getvalue() + d.finish() for t, d in zip(texts, detoks, strict=True)]


def run_offsets(
    decode_batch: Callable[[list[list[int]]], list[str]], prompt: list[int], tokens: np.ndarray
) -> Result:
    """The prefix/read-offset method: per request, the text of `ids[prefix:read]` (already
    emitted) and of `ids[prefix:]`; what the second adds is new once it no longer ends in
    U+FFFD. Both windows of every request go through one `decode_batch` call per step."""
    requests, steps = tokens.shape
    ids = [prompt[-CONTEXT_TOKENS:] for _ in range(requests)]
    prefix = [0] * requests
    read = [len(i) for i in ids]
    rows = tokens.T.tolist()
    texts: list[list[str]] = [[] for _ in range(requests)]

    def step(s: int) -> None:
        for own, token in zip(ids, rows[s], strict=True):
            own.append(token)
        windows = [own[p:r] for own, p, r in zip(ids, prefix, read, strict=True)]
        windows += [own[p:] for own, p in zip(ids, prefix, strict=True)]
        decoded = decode_batch(windows)
        for r in range(requests):
            old, new = decoded[r], decoded[requests + r]
            if len(new) > len(old) and not new.endswith("\ufffd"):
                texts[r].append(new[len(old) :])
                prefix[r], read[r] = read[r], len(ids[r])

    times = timed_steps(steps, step)
    for r in range(requests):  # the rest, as at a request's end
        old, new = decode_batch([ids[r][prefix[r] : read[r]], ids[r][prefix[r] :]])
        if len(new) > len(old):
            texts[r].append(new[len(old) :].rstrip("\ufffd"))
    return times, ["".join(parts) for parts in texts]


def run_batch_decode(tokenizer: Any, prompt: list[int], tokens: np.ndarray) -> Result:
    return run_offsets(
        lambda windows: tokenizer.batch_decode(windows, skip_special_tokens=True), prompt, tokens
    )


def run_decode_batch(tokenizer: Any, prompt: list[int], tokens: np.ndarray) -> Result:
    backend = tokenizer.backend_tokenizer
    return run_offsets(
        lambda windows: backend.decode_batch(windows, skip_special_tokens=True), prompt, tokens
    )


def run_decode_stream(tokenizer: Any, prompt: list[int], tokens: np.ndarray) -> Result:
    requests, steps = tokens.shape
    backend = tokenizer.backend_tokenizer
    context = prompt[-CONTEXT_TOKENS:]
    streams = [DecodeStream(context, skip_special_tokens=True) for _ in range(requests)]
    rows = tokens.T.tolist()
    texts: list[list[str]] = [[] for _ in range(requests)]

    def step(s: int) -> None:
        for stream, parts, token in zip(streams, texts, rows[s], strict=True):
            chunk = stream.step(backend, token)
            if chunk is not None:
                parts.append(chunk)

    times = timed_steps(steps, step)
    return times, ["".join(parts) for parts in texts]


WAYS: dict[str, Callable[[Any, list[int], np.ndarray], Result]] = {
    "output_processor": run_output_processor,
    "detokenizer": run_detokenizer,
    "window": run_window,
    "batch_decode": run_batch_decode,
    "decode_batch": run_decode_batch,
}
if HAS_DECODE_STREAM:
    WAYS["decode_stream"] = run_decode_stream


# rsgl's own ways: what the default run measures.
RSGL_WAYS = ["output_processor", "detokenizer", "window"]
# Output lengths at which a run reports its cost: the steps of a window ending there.
AT = [512, 4096, 32768]
WINDOW = 256


def measure(
    tokenizer: Any,
    kind: str,
    requests: int,
    steps: int,
    seed: int = 0,
    ways: list[str] | None = None,
    at: list[int] | None = None,
    repeat: int = 1,
) -> dict[str, Any]:
    """The `ways` (all by default) over the same tokens, `repeat` times each; raises
    AssertionError if any final text differs from `tokenizer.decode` of the request's
    tokens. Each figure is the lowest of the repeats (other processes only ever add time).
    With `at`, each way also gives its median cost in the WINDOW steps before each of those
    output lengths (within a run), and how far the largest is above the smallest."""
    tokens = request_tokens(tokenizer, kind, requests, steps, seed)
    want = tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)
    prompt = tokenizer.encode(PROMPT)
    lengths = [n for n in at or [] if n <= steps]
    result: dict[str, Any] = {"tokens": kind, "requests": requests, "steps": steps, "ways": {}}
    for name in ways or list(WAYS):
        runs = []
        for _ in range(repeat):
            times, texts = WAYS[name](tokenizer, prompt, tokens)
            wrong = [r for r in range(requests) if texts[r] != want[r]]
            if wrong:
                r = wrong[0]
                raise AssertionError(
                    f"{name} ({kind}): {len(wrong)} requests' texts differ from the decode, "
                    f"request {r}: {texts[r]!r} != {want[r]!r}"
                )
            runs.append(times)
        us = 1e6 / requests  # seconds per step -> µs per request-token
        figures: dict[str, Any] = {
            "us_per_step": round(min(map(statistics.fmean, runs)) * 1e6, 1),
            "us_per_step_p50": round(min(map(statistics.median, runs)) * 1e6, 1),
            "us_per_request_token": round(min(map(statistics.fmean, runs)) * us, 3),
            "us_per_request_token_p50": round(min(map(statistics.median, runs)) * us, 3),
        }
        if lengths:
            # The last step finishes every request: not a decode step like the others.
            cost = {
                n: min(statistics.median(t[max(0, n - WINDOW) : min(n, steps - 1)]) for t in runs)
                * us
                for n in lengths
            }
            figures["us_per_request_token_p50_at"] = {n: round(c, 3) for n, c in cost.items()}
            figures["spread"] = round(max(cost.values()) / min(cost.values()) - 1, 3)
        result["ways"][name] = figures
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=max(AT))
    parser.add_argument(
        "--tokens", nargs="+", choices=["random", "text"], default=["random", "text"]
    )
    parser.add_argument("--ways", nargs="+", choices=list(WAYS), default=RSGL_WAYS)
    parser.add_argument(
        "--at", type=int, nargs="*", default=AT, help="output lengths to report the cost at"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per way; the lowest counts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(resolve_model_dir(None))
    for kind in args.tokens:
        for requests in args.requests:
            result = measure(
                tokenizer, kind, requests, args.steps, args.seed, args.ways, args.at, args.repeat
            )
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
