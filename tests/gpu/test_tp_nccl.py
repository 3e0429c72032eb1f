"""The tensor-parallel path on CUDA with one rank: an NCCL group starts, and the sharded
model (row-parallel projections, vocab-parallel embedding and LM head, all through NCCL)
computes the plain model's logits."""

from __future__ import annotations

import datetime
import socket
from typing import Any

import numpy as np
import torch

# torch.distributed re-exports TCPStore without declaring it (mypy's strict re-export rule).
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from rsgl._core import Plan
from rsgl.distributed.group import TPGroup, TPRank
from rsgl.distributed.sharding import TPShard
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.models.config import ModelConfig
from rsgl.models.loader import load_model, resolve_model_dir


def _extend_plan(ids: list[int]) -> Plan:
    n = len(ids)
    arange = np.arange(n, dtype=np.int64)
    return Plan(
        forward_mode="extend",
        rids=np.zeros(1, dtype=np.int64),
        req_slots=np.zeros(1, dtype=np.int64),
        prefix_lens=np.zeros(1, dtype=np.int64),
        extend_lens=np.asarray([n], dtype=np.int64),
        seq_lens=np.asarray([n], dtype=np.int64),
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=arange,
        out_cache_loc=arange + 64,  # past the padding page
        write_rows=np.zeros(n, dtype=np.int64),
        write_cols=arange,
        write_slots=arange + 64,
    )


def test_a_one_rank_nccl_group_runs_the_sharded_model(gpu_model: dict[str, Any]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    timeout = datetime.timedelta(seconds=60)
    store = TCPStore("127.0.0.1", port, 1, True, timeout)
    group = TPGroup.create(store, 0, 1, torch.device("cuda"), timeout)
    config = ModelConfig.from_model_dir(resolve_model_dir(gpu_model["model_path"]))
    options: dict[str, Any] = {
        "device": "cuda",
        "dtype": torch.float32,
        "load_format": gpu_model["load_format"],
        "seed": 7,
    }
    sharded = load_model(
        gpu_model["model_path"], **options, tp=TPRank(TPShard.of(config, 1, 0), group)
    )
    plain = load_model(gpu_model["model_path"], **options)
    ids = [int(t) for t in np.random.default_rng(0).integers(100, 4000, size=24)]
    logits = []
    for loaded in (sharded, plain):
        runner = ModelRunner(
            loaded, kv_buffer_size=4096, max_running_requests=8, context_len=512, seed=7
        )
        out = runner.step(_extend_plan(ids), return_logits=True)
        assert out.logits is not None
        logits.append(out.logits.float().cpu())
        runner.close()
    group.close()
    diff = (logits[0] - logits[1]).abs().max().item()
    assert diff <= 1e-4 * logits[1].abs().max().item(), diff
