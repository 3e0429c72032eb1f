"""The parallel layers and the group's collectives over two real gloo ranks, against the
whole computation: an uneven vocabulary split (6 + 5 rows), a row-parallel projection with a
bias (plain and oneDNN-packed), and an uneven all-gather. No model is loaded."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
from typing import Any

import torch

# torch.distributed re-exports TCPStore without declaring it (mypy's strict re-export rule).
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from rsgl.distributed.group import TPGroup
from rsgl.distributed.sharding import balanced_range
from rsgl.layers.parallel import RowParallelLinear, VocabParallelEmbedding, sharded_argmax

VOCAB, HIDDEN, IN_FEATURES = 11, 8, 10


def _rank_main(rank: int, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout)
    group = TPGroup.create(store, rank, 2, torch.device("cpu"), timeout)
    torch.manual_seed(0)  # the same "checkpoint" on both ranks
    table = torch.randn(VOCAB, HIDDEN)
    weight, bias, x = torch.randn(4, IN_FEATURES), torch.randn(4), torch.randn(3, IN_FEATURES)
    ids = torch.tensor([0, 5, 6, 10, 3, 6])
    rows, cols = balanced_range(VOCAB, 2, rank), balanced_range(IN_FEATURES, 2, rank)
    out: dict[str, Any] = {}
    with torch.no_grad():
        embedding = VocabParallelEmbedding(rows, HIDDEN, group)
        embedding.weight.copy_(table[rows.start : rows.stop])
        out["embedding"] = (embedding(ids) - table[ids]).abs().max().item()

        row = RowParallelLinear(len(cols), 4, True, group)
        assert row.weight is not None and row.bias is not None
        row.weight.copy_(weight[:, cols.start : cols.stop])
        row.bias.copy_(bias)
        expected = x @ weight.T + bias
        out["row_parallel"] = (row(x[:, cols.start : cols.stop]) - expected).abs().max().item()
        row.pack()
        out["row_parallel_packed"] = (
            (row(x[:, cols.start : cols.stop]) - expected).abs().max().item()
        )

        logits = torch.arange(3 * VOCAB, dtype=torch.float32).view(3, VOCAB)
        sizes = tuple(len(balanced_range(VOCAB, 2, r)) for r in range(2))
        gathered = group.all_gather(logits[:, rows.start : rows.stop], sizes)
        out["all_gather"] = (gathered - logits).abs().max().item()

        # Rows whose maximum sits on rank 0, on rank 1, on both (a tie: the first
        # occurrence, on rank 0), twice within rank 1, a NaN on rank 1 beating a larger
        # value on rank 0, and -inf everywhere.
        scores = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
        scores[0, 2] = scores[1, 9] = 50.0
        scores[2, 4] = scores[2, 7] = 50.0
        scores[3, 7] = scores[3, 10] = 50.0
        scores[4, 1], scores[4, 8] = 1e30, float("nan")
        scores[5] = float("-inf")
        local = scores[:, rows.start : rows.stop].contiguous()
        got = sharded_argmax(local, rows.start, group)
        out["sharded_argmax"] = got.tolist()
        out["argmax"] = scores.argmax(dim=1).tolist()
    results.put((rank, out))
    group.close()


def test_parallel_layers_over_two_ranks_equal_the_whole_computation() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for rank in (0, 1):
        diffs = got[rank]
        assert diffs["embedding"] == 0.0, diffs  # one rank contributes each row: exact
        assert diffs["all_gather"] == 0.0, diffs
        assert diffs["row_parallel"] < 1e-5, diffs
        assert diffs["row_parallel_packed"] < 1e-5, diffs
        assert diffs["sharded_argmax"] == diffs["argmax"] == [2, 9, 4, 7, 8, 0], diffs
