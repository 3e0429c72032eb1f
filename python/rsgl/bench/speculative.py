"""`rsgl bench speculative`: what verifying drafts costs, and what speculation gives.

`--parts verify-cost` times one model step of B requests that each compute 1 + k tokens
(their last token and k drafts, as a verify step does) against a plain decode step of the same
B requests, for every batch size and k asked, in one process: the ratio is what a verify step
costs relative to the decode it replaces, so k drafts pay when more than `ratio - 1` of them
are accepted on average.

    rsgl bench speculative --parts verify-cost --batches 1,4,16,64 --drafts 1,2,4,8

`--parts workloads` serves a copy-heavy workload (`copy_heavy_messages`: passages, functions
and JSON documents echoed with one edit) and a free-writing one (open questions) through two
engines in one process, speculation off and on, greedy and at temperature 0.7 (seeded), at
each concurrency: output tokens per second of each (medians of `--rounds` alternated
runs), their ratio (the median of the rounds' ratios; the medians' ratio beside it), the
average accept length and drafts per verify step, and whether the outputs were identical.
Every cell runs twice, on engines built plain first and speculating first (a process's
first engine serves slower here, `ENGINE_ORDERS`): each order's cells go to stderr as they
end, and the cells that combine both (the geometric mean of their ratios) to stdout.
A copy request ends where the model ends its answer (at most `--copy-max-len` tokens), as an
echo with edits does: forced on past its end (`ignore_eos`) the model writes new text that
no draft predicts, and a long document is cut short. `--copy-max-len 0` gives copy requests
`--output-len` tokens each, as free writing has (`ignore_eos`), so both engines run the same
batches however their tokens compare: in float32 they are identical; in bfloat16 too where a
verify step's tokens fit the decode stack (each token a decode row: the low-bit rows,
`rsgl.layers.quant_linear`), but a larger verify's logits (an extend's kernels) round
otherwise than a decode step's, so a near-tie may go the other way and the text diverge
from there.

    rsgl bench speculative --parts workloads --concurrency 1,4,16,64

`--parts drafts` serves each workload's `--replay-requests` greedy with speculation off and
replays the outputs through the scheduler's n-gram drafter, a tree of as many drafted tokens
and a drafter indexing the requests before it too (`rsgl.bench.draft_replay`): the tokens
a verify step of each `--drafts` k would commit, which do not depend on the machine's speed
(with `verify-cost`, also over what such a step costs at batch 1: the most that drafting
every step could give one request).

    rsgl bench speculative --parts verify-cost,drafts --batches 1 --drafts 1,2,4,7
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import statistics
import sys
import textwrap
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any

import numpy as np
import torch

from rsgl._core import Plan
from rsgl.args import QUANTIZATIONS
from rsgl.bench.draft_replay import DRAFTERS, replay
from rsgl.bench.one_batch import DTYPES, _prefill_plan
from rsgl.engine import Engine
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.models.dtype_choice import choose_dtype
from rsgl.sampling_params import SamplingParams
from rsgl.validation import tokenize_prompt


def _step_plan(batch: int, position: int, width: int, capacity: int, vocab: int) -> Plan:
    """Each of `batch` requests (KV at `position` tokens) computes `width` tokens: a decode
    step for width 1, a verify step of width - 1 drafts otherwise (random draft ids)."""
    slots = np.arange(batch, dtype=np.int64)
    cols = position + np.arange(width, dtype=np.int64)
    kv = (1 + slots[:, None] * capacity + cols[None, :]).reshape(-1)
    pos = np.full(batch, position, dtype=np.int64)
    ids = np.random.default_rng(position).integers(100, vocab - 100, size=batch * width)
    return Plan(
        forward_mode="decode" if width == 1 else "extend",
        rids=slots,
        req_slots=slots,
        prefix_lens=pos,
        extend_lens=np.full(batch, width, dtype=np.int64),
        seq_lens=pos + width,
        input_ids=ids.astype(np.int64),
        positions=np.tile(cols, batch),
        out_cache_loc=kv,
        write_rows=np.repeat(slots, width),
        write_cols=np.tile(cols, batch),
        write_slots=kv,
        # A verify step's plan: its logits at every position, as the loop's verify steps.
        draft_lens=np.full(batch, width - 1, dtype=np.int64) if width > 1 else None,
    )


# Stand-ins for free writing: open requests whose answers do not quote the prompt.
FREE_WRITING_TOPICS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a ten-year-old.",
    "Describe a walk through a busy market on a rainy morning.",
    "Give advice to someone starting their first job as a teacher.",
    "Write a letter from a sailor to his sister about life at sea.",
    "Explain why the sky is blue and sunsets are red.",
    "Describe the history of a small mountain village over one hundred years.",
    "Write a dialogue between a chess player and her coach before a final.",
    "Explain how to plan a vegetable garden for the first time.",
    "Write a travel diary entry about crossing a desert by train.",
    "Describe what a day in the life of a beekeeper looks like.",
    "Write a speech for the opening of a new public library.",
]


def _passages() -> list[str]:
    """Paragraphs of the text `rsgl bench quality` ships (written for rsgl)."""
    text = resources.files("rsgl.bench").joinpath("quality_text.txt").read_text()
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]


def _code_files() -> list[tuple[str, str]]:
    """(function name, source) of standard-library functions of a few dozen lines."""
    import json as json_module
    import shutil
    import textwrap as textwrap_module

    found = []
    for module in (json_module.encoder, shutil, textwrap_module):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ != module.__name__ or name.startswith("_"):
                continue
            source = inspect.getsource(fn)
            if 12 <= source.count("\n") <= 45:
                found.append((name, textwrap.dedent(source)))
    return found


def _json_document(rng: np.random.Generator) -> dict[str, object]:
    """An order record with a few nested items (seeded)."""
    words = ["alpha", "harbour", "copper", "meadow", "signal", "orbit", "lantern", "quartz"]
    items = [
        {
            "sku": f"{words[int(rng.integers(len(words)))]}-{int(rng.integers(1000, 9999))}",
            "quantity": int(rng.integers(1, 20)),
            "unit_price": round(float(rng.uniform(1, 200)), 2),
        }
        for _ in range(int(rng.integers(3, 7)))
    ]
    return {
        "order_id": int(rng.integers(100000, 999999)),
        "customer": {"name": words[int(rng.integers(len(words)))].title(), "tier": "gold"},
        "status": "pending",
        "items": items,
        "notes": "deliver to the side entrance",
    }


def copy_heavy_messages(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat requests whose answers mostly quote the prompt: repeat a passage with one word
    changed, rewrite a function with a name changed, echo a JSON document with one edit."""
    rng = np.random.default_rng(seed)
    passages, code = _passages(), _code_files()
    out = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            text = passages[int(rng.integers(len(passages)))]
            ask = (
                "Copy the following passage exactly, but write 'harbor' instead of "
                f"'harbour'.\n\n{text}"
            )
        elif kind == 1:
            name, source = code[int(rng.integers(len(code)))]
            ask = (
                f"Rewrite this Python function in full, renaming `{name}` to "
                f"`{name}_v2` and changing nothing else.\n\n```python\n{source}```"
            )
        else:
            doc = json.dumps(_json_document(rng), indent=2)
            ask = (
                'Return this JSON document unchanged, except that "status" becomes '
                f'"shipped".\n\n{doc}'
            )
        out.append([{"role": "user", "content": ask}])
    return out


def free_writing_messages(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat requests whose answers are new text (ShareGPT-like open questions)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(count) % len(FREE_WRITING_TOPICS)
    return [[{"role": "user", "content": FREE_WRITING_TOPICS[int(i)]}] for i in order]


WORKLOADS = {"copy": copy_heavy_messages, "free": free_writing_messages}


def verify_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median step time of B x (1 + k) tokens against B x 1, per batch size and k."""
    batches = [int(b) for b in args.batches.split(",")]
    drafts = [int(k) for k in args.drafts.split(",")]
    steps = args.steps
    capacity = args.input_len + steps * (1 + max(drafts))
    runner = ModelRunner.from_pretrained(
        args.model,
        kv_buffer_size=1 + max(batches) * capacity,
        max_running_requests=max(batches),
        context_len=capacity + 1,
        dtype=choose_dtype(args.dtype, torch.device("cpu")).torch_dtype,
        quantization=args.quantization,
    )
    vocab = runner.config.vocab_size
    params = SamplingParams(temperature=0.0, max_new_tokens=capacity, ignore_eos=True)
    prompts = np.random.default_rng(args.seed).integers(
        100, vocab - 100, size=(max(batches), args.input_len)
    )
    for slot in range(max(batches)):
        runner.admit(slot, params, prompts[slot].tolist())
    runner.step(_prefill_plan(prompts, capacity))
    rows: list[dict[str, Any]] = []
    for batch in batches:
        timings: dict[int, list[float]] = {w: [] for w in [1] + [1 + k for k in drafts]}
        # Interleaved, so that a neighbour's burst slows every width alike; every step
        # rewrites the same positions, so the context stays `input_len` long.
        for _ in range(steps):
            for width, times in timings.items():
                plan = _step_plan(batch, args.input_len, width, capacity, vocab)
                t0 = time.perf_counter()
                runner.step(plan)
                times.append(time.perf_counter() - t0)
        decode = statistics.median(timings[1])
        for k in drafts:
            verify = statistics.median(timings[1 + k])
            rows.append(
                {
                    "batch": batch,
                    "drafts": k,
                    "decode_ms": round(decode * 1e3, 3),
                    "verify_ms": round(verify * 1e3, 3),
                    "verify_vs_decode": round(verify / decode, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def draft_replays(
    args: argparse.Namespace, costs: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Tokens a verify step of k drafts would commit, per drafter (`rsgl.bench.draft_replay`),
    over the workloads' greedy outputs: no timing, so the drafters compare exactly. With
    `verify_cost`'s rows (`costs`), each drafter's tokens a step over what a verify step of k
    drafts costs at batch 1 in decode steps: the most speculation could give one request
    drafting every step, as a multiple of plain decoding's tokens per second."""
    batch1 = {c["drafts"]: c["verify_vs_decode"] for c in costs if c["batch"] == 1}
    options: dict[str, Any] = {"dtype": args.dtype, "max_total_tokens": args.max_total_tokens}
    if args.quantization:
        options["quantization"] = args.quantization
    engine = Engine(**options, speculative_algorithm="none")
    rows: list[dict[str, Any]] = []
    try:
        for name in args.workloads.split(","):
            messages = WORKLOADS[name](args.replay_requests, args.seed)
            _, outputs = _serve_wave(engine, messages, _greedy_params(name, args), 16)
            prompts = [
                tokenize_prompt(engine.tokenizer, engine.limits, messages=m) for m in messages
            ]
            requests = list(zip(prompts, outputs, strict=True))
            for k in [int(k) for k in args.drafts.split(",")]:
                row: dict[str, Any] = {
                    "workload": name,
                    "drafts": k,
                    "requests": len(requests),
                    "output_tokens": sum(map(len, outputs)),
                }
                for drafter in DRAFTERS:
                    result = replay(requests, k, drafter, args.ngram_min)
                    row[f"{drafter}_tokens_per_step"] = round(result.tokens_per_step, 3)
                    row[f"{drafter}_drafted_share"] = round(result.drafted_share, 3)
                    if k in batch1:
                        gain = result.tokens_per_step / batch1[k]
                        row[f"{drafter}_vs_plain_at_batch_1"] = round(gain, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        engine.shutdown()
    return rows


def _greedy_params(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """A workload's sampling parameters at temperature 0 (`_order_cells`' for each)."""
    until_eos = workload == "copy" and args.copy_max_len > 0
    return {
        "temperature": 0.0,
        "max_new_tokens": args.copy_max_len if until_eos else args.output_len,
        "ignore_eos": not until_eos,
    }


def _serve_wave(
    engine: Engine, messages: list[list[dict[str, str]]], params: dict[str, Any], concurrency: int
) -> tuple[float, list[list[int]]]:
    """Seconds to serve every request with at most `concurrency` in flight, and each
    request's output ids."""

    def one(i: int) -> list[int]:
        p = dict(params, seed=params["seed"] + i) if "seed" in params else params
        ids: list[int] = engine.generate(messages=messages[i], sampling_params=p)["output_ids"]
        return ids

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(one, range(len(messages))))
    return time.perf_counter() - t0, outputs


def workloads(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Output tok/s with speculation off and on, per workload, temperature and concurrency:
    every cell measured under both engine orders (`ENGINE_ORDERS`), then combined."""
    by_order = [_order_cells(args, spec_first) for spec_first in ENGINE_ORDERS]
    rows = [combine_orders(cells) for cells in zip(*by_order, strict=True)]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


# The order the two engines are built in: plain first, then speculation first. On the 2-core
# VMs here, whichever engine a process builds first serves slower, whatever it is, and the
# rounds' alternation cannot cancel that (it belongs to the engine, not to the minute): on a
# Xeon (AMX), free writing at concurrency 1 measured speculation 1.068x (greedy) and 1.057x
# (0.7) built second and 0.867x and 0.848x built first. On one greedy prompt, two plain
# engines differed by 1-4% (10% with the default pools), and a plain and a speculating one
# with drafting forced off (the same steps) by 15-22% either way. The cause is not known
# (with transparent huge pages for every allocation both engines ran faster and the orders'
# gap shrank). So each cell runs under both orders, on fresh engines.
ENGINE_ORDERS = (False, True)


def combine_orders(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its measurements under each engine order: the ratio is the geometric
    mean of the orders' ratios (an engine's slowness for being built first divides one and
    multiplies the other), the rates their means, the accept figures their means over the
    orders that verified drafts (0: neither did; an order whose requests never drafted has
    no accept length, not one of 0), and the outputs identical only if they were under
    every order."""
    first = cells[0]
    ratios = [float(c["ratio"]) for c in cells]
    combined = {k: first[k] for k in ("workload", "temperature", "concurrency", "requests")}
    combined |= {
        "output_tokens": first["output_tokens"],
        "off_tok_s": round(statistics.fmean(float(c["off_tok_s"]) for c in cells), 1),
        "on_tok_s": round(statistics.fmean(float(c["on_tok_s"]) for c in cells), 1),
        "ratio": round(statistics.geometric_mean(ratios), 3),
        "ratio_by_order": {c["order"]: c["ratio"] for c in cells},
        "identical_outputs": all(c["identical_outputs"] for c in cells),
        "accept_length": round(_mean_of_verified(cells, "accept_length"), 3),
        "drafts_per_verify_step": round(_mean_of_verified(cells, "drafts_per_verify_step"), 2),
    }
    return combined


def _mean_of_verified(cells: Sequence[dict[str, Any]], key: str) -> float:
    """The mean of `key` over the cells whose engine verified drafts (0.0 if none did)."""
    verified = [float(c[key]) for c in cells if float(c["drafts_per_verify_step"]) > 0]
    return statistics.fmean(verified) if verified else 0.0


def _order_cells(args: argparse.Namespace, spec_first: bool) -> list[dict[str, Any]]:
    """`workloads`' cells with the engines built in one order (`ENGINE_ORDERS`)."""
    options: dict[str, Any] = {"dtype": args.dtype, "max_total_tokens": args.max_total_tokens}
    if args.quantization:
        options["quantization"] = args.quantization
    spec_options = {
        "speculative_algorithm": "NGRAM",
        "speculative_ngram_min_match_window_size": args.ngram_min,
    }
    if args.num_draft_tokens is not None:
        spec_options["speculative_num_draft_tokens"] = args.num_draft_tokens
    plain_options = {**options, "speculative_algorithm": "none"}  # not auto's choice
    if spec_first:
        spec = Engine(**options, **spec_options)
        plain = Engine(**plain_options)
    else:
        plain = Engine(**plain_options)
        spec = Engine(**options, **spec_options)
    order = "spec_first" if spec_first else "plain_first"
    rows: list[dict[str, Any]] = []
    try:
        for name in args.workloads.split(","):
            make = WORKLOADS[name]
            for temperature in (0.0, 0.7):
                params = _greedy_params(name, args) | {"temperature": temperature}
                if temperature:
                    params["seed"] = args.seed
                for concurrency in [int(c) for c in args.concurrency.split(",")]:
                    messages = make(max(concurrency, args.min_requests), args.seed)
                    # Both engines warmed alike: a prompt in one radix cache only would be
                    # prefilled in other pieces by the two, which in bfloat16 rounds otherwise.
                    for engine in (plain, spec):
                        _serve_wave(engine, messages[:1], dict(params, max_new_tokens=4), 1)
                    before = spec.get_server_info()["speculative"]
                    off_rates: list[float] = []
                    on_rates: list[float] = []
                    off_ids: list[list[int]] = []
                    on_ids: list[list[int]] = []
                    for r in range(args.rounds):
                        # Alternated, and each engine first every other round: drifting
                        # load and the second run's warmer caches favour neither.
                        for engine in (plain, spec) if r % 2 == 0 else (spec, plain):
                            seconds, ids = _serve_wave(engine, messages, params, concurrency)
                            rate = sum(map(len, ids)) / seconds
                            if engine is plain:
                                off_rates.append(rate)
                                off_ids = ids
                            else:
                                on_rates.append(rate)
                                on_ids = ids
                    off_rate, on_rate = statistics.median(off_rates), statistics.median(on_rates)
                    # Each round's pair ran within a minute of itself: the median of the
                    # rounds' ratios leaves out the drift between rounds that a ratio of the
                    # medians keeps (a VM's speed moves by a third within minutes).
                    ratios = [a / b for a, b in zip(on_rates, off_rates, strict=True)]
                    after = spec.get_server_info()["speculative"]
                    delta = {k: after[k] - before[k] for k in after}
                    drafted = delta["spec_drafted_rows"]
                    verify = delta["spec_verify_steps"]
                    rows.append(
                        {
                            "order": order,
                            "workload": name,
                            "temperature": temperature,
                            "concurrency": concurrency,
                            "requests": len(messages),
                            "output_tokens": sum(map(len, off_ids)),
                            "off_tok_s": round(off_rate, 1),
                            "on_tok_s": round(on_rate, 1),
                            "ratio": round(statistics.median(ratios), 3),
                            "ratio_runs": [round(r, 3) for r in ratios],
                            "medians_ratio": round(on_rate / off_rate, 3),
                            "identical_outputs": on_ids == off_ids,
                            "accept_length": round(
                                delta["spec_committed_tokens"] / drafted if drafted else 0, 3
                            ),
                            "drafts_per_verify_step": round(
                                delta["spec_draft_tokens"] / verify if verify else 0, 2
                            ),
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
    finally:
        plain.shutdown()
        spec.shutdown()
    return rows


def main(argv: list[str]) -> int:
    """Entry point of `rsgl bench speculative`."""
    parser = argparse.ArgumentParser(prog="rsgl bench speculative", description=__doc__)
    parser.add_argument("--parts", default="verify-cost,workloads")
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--drafts", default="1,2,4,8", help="draft counts k to time")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per shape")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="model dtype (auto: as rsgl serve chooses)",
    )
    parser.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", default="1,4,16,64", help="workloads: in flight")
    # Eight: with four requests of 128 tokens (3.5 s an engine on a 2-core Zen 4), one round's
    # ratio at concurrency 1 ranged 0.79-1.25 and a whole run's cell missed 1.0x by 9%.
    parser.add_argument("--min-requests", type=int, default=8, help="workloads: per cell")
    parser.add_argument("--workloads", default="copy,free", help="workloads: which to serve")
    parser.add_argument("--output-len", type=int, default=128, help="workloads: free's tokens")
    parser.add_argument(
        "--copy-max-len", type=int, default=512, help="workloads: copy's limit (0: --output-len)"
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=None, help="workloads: spec on (engine default)"
    )
    parser.add_argument("--ngram-min", type=int, default=1, help="workloads, drafts: min window")
    parser.add_argument(
        "--replay-requests", type=int, default=24, help="drafts: greedy outputs per workload"
    )
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument(
        "--rounds", type=int, default=3, help="workloads: off/on runs per cell (medians)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    if unknown := set(parts) - {"verify-cost", "workloads", "drafts"}:
        parser.error(f"unknown parts {sorted(unknown)}: expected verify-cost, workloads, drafts")
    if unknown := set(args.workloads.split(",")) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}: expected {', '.join(WORKLOADS)}")
    costs = verify_cost(args) if "verify-cost" in parts else []
    if "workloads" in parts:
        workloads(args)
    if "drafts" in parts:
        draft_replays(args, costs)
    return 0
