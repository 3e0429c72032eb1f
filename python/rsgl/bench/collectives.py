"""The tensor-parallel collectives alone: µs per all-reduce and all-gather, as a step uses them.

    python -m rsgl.bench.collectives --batch-sizes 1,16,64

Starts `--tp-size` processes (one thread each) in a `TPGroup` (gloo on CPU, NCCL with
`--device cuda`) and times, per batch size B, the all-reduce of a [B, hidden] activation
(two per layer plus the embedding's) and the all-gather of [B, vocab / tp] logits (one per
step). `rsgl bench offline --tp-size 2 --profile-collectives` prints these beside the
collectives' share of a real run. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import multiprocessing as mp
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

# torch.distributed re-exports TCPStore without declaring it (mypy's strict re-export rule).
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from rsgl.distributed.group import TPGroup
from rsgl.distributed.sharding import balanced_range


def _time_us(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean µs per call of the collective `fn`. The warm-up calls also line the ranks up:
    each waits in the collective for the others."""
    for _ in range(max(3, iters // 10)):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round((time.perf_counter() - start) / iters * 1e6, 1)


def _rank_main(rank: int, port: int, options: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    size = options["tp_size"]
    device = torch.device(options["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", port, size, rank == 0, datetime.timedelta(seconds=120))
    group = TPGroup.create(store, rank, size, device, datetime.timedelta(seconds=120))
    vocab_sizes = tuple(len(balanced_range(options["vocab"], size, r)) for r in range(size))
    rows = []
    for b in options["batch_sizes"]:
        x = torch.randn(b, options["hidden"], device=device)
        logits = torch.randn(b, vocab_sizes[rank], device=device)
        iters = options["iters"]
        reduce_us = _time_us(functools.partial(group.all_reduce, x), device, iters)
        gather = functools.partial(group.all_gather, logits, vocab_sizes)
        gather_us = _time_us(gather, device, iters)
        rows.append({"batch": b, "all_reduce_us": reduce_us, "all_gather_logits_us": gather_us})
    if rank == 0:
        results.put(rows)
    group.close()


def measure(
    *,
    tp_size: int = 2,
    hidden: int = 576,
    vocab: int = 49152,
    batch_sizes: tuple[int, ...] = (1, 16, 64),
    iters: int = 200,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Per batch size: µs per all-reduce of [B, hidden] and per all-gather of the logits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    options = {
        "tp_size": tp_size,
        "hidden": hidden,
        "vocab": vocab,
        "batch_sizes": list(batch_sizes),
        "iters": iters,
        "device": device,
    }
    procs = [
        ctx.Process(target=_rank_main, args=(rank, port, options, results), daemon=True)
        for rank in range(tp_size)
    ]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rsgl.bench.collectives", description=__doc__)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576, help="SmolLM2's hidden size")
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    rows = measure(
        tp_size=args.tp_size,
        hidden=args.hidden,
        vocab=args.vocab,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        iters=args.iters,
        device=args.device,
    )
    print(json.dumps({"tp_size": args.tp_size, "device": args.device, "collectives": rows}))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
