"""`rsgl bench simulate --calibrate-hardware`: a spec of this CPU from measured rates,
priced through the roofline, sizing the pool and choosing the dtype as the server does on
a CPU."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from rsgl.args import EngineArgs
from rsgl.bench.sim import cpu_spec
from rsgl.bench.sim.cluster import Deployment
from rsgl.bench.sim.cost import HardwareSpec, spec_as_dict
from rsgl.bench.simulate import main
from rsgl.models.config import ModelConfig
from rsgl.scheduler.step_shape import StepShape
from rsgl.stack import _pool_tokens

LLAMA3_8B = Path(__file__).resolve().parents[2] / "benches" / "configs" / "llama3-8b"

# A CPU as a spec file would have it.
CPU = HardwareSpec(
    name="test cpu",
    memory_bytes=64 << 30,
    memory_bandwidth=20e9,
    peak_flops={"float32": 0.5e12, "bfloat16": 1e12, "float16": 1e12},
    interconnect_bandwidth=10e9,
    efficiency={"memory": 1.0, "compute": 1.0, "interconnect": 1.0},
    allreduce_latency_s=5e-5,
    step_overhead_s=0.0,
    device="cpu",
)


def test_a_cpu_spec_sizes_the_pool_by_the_servers_rule_and_picks_bf16_by_its_gemms() -> None:
    config = ModelConfig.from_model_dir(LLAMA3_8B)
    here = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spec = dataclasses.replace(CPU, memory_bytes=here)
    # bfloat16 multiplies 2x faster on this spec: auto runs it, as the server would.
    dep = Deployment(EngineArgs(), config, spec=spec)
    assert dep.dtype == "bfloat16"
    import torch

    assert dep.max_total_tokens() == _pool_tokens(EngineArgs(), config, torch.bfloat16)
    slow_bf16 = dataclasses.replace(spec, peak_flops=dict(spec.peak_flops, bfloat16=0.55e12))
    assert Deployment(EngineArgs(), config, spec=slow_bf16).dtype == "float32"


def test_the_cli_measures_this_cpu_into_a_spec_that_prices_another_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The measurement is real, at small sizes to keep the test short.
    real_measure = cpu_spec.measure
    monkeypatch.setattr(
        cpu_spec,
        "measure",
        lambda threads=None: real_measure(threads, bandwidth_bytes=64 << 20, gemm_size=256),
    )
    out = tmp_path / "cpu.json"
    argv = ["--model-path", str(LLAMA3_8B), "--calibrate-hardware", "--hardware-output", str(out)]
    assert main([*argv, "--cpu-threads", "1"]) == 0
    spec = HardwareSpec.load(str(out))
    assert spec.device == "cpu" and "1 threads" in spec.name
    assert spec.memory_bandwidth > 0 and spec.peak_flops["float32"] > 0
    assert spec.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert spec.efficiency == {"memory": 1.0, "compute": 1.0, "interconnect": 1.0}
    assert spec_as_dict(spec) == json.loads(out.read_text())
    # A decode step of an 8B model costs at least reading its weights at that rate.
    dep = Deployment(EngineArgs(dtype="bfloat16"), ModelConfig.from_model_dir(LLAMA3_8B), spec=spec)
    weights = dep.footprint().weight_bytes
    decode = dep.cost_model().step_seconds(StepShape(1, 1, 0, 16, 0, 16.0))
    assert decode >= weights / spec.memory_bandwidth
    # It prices that model through --hardware.
    assert main(["--model-path", str(LLAMA3_8B), "--hardware", str(out), "--num-prompts", "4",
                 "--random-input-len", "64", "--random-output-len", "4"]) == 0  # fmt: skip


def test_the_shipped_cpu_spec_loads_by_name() -> None:
    spec = HardwareSpec.load("amd-epyc-zen4-2c")
    assert spec.device == "cpu" and spec.efficiency["memory"] == 1.0
    assert "family 25 model 17" in spec.name


def test_the_ranks_on_one_cpu_share_its_bandwidth_and_cores() -> None:
    config = ModelConfig.from_model_dir(LLAMA3_8B)
    decode = StepShape(1, 1, 0, 512, 0, 512.0)
    prefill = StepShape(1, 2048, 1, 2048, 0, 2048 * 2049 / 2)

    def cost(dp: int, tp: int, shape: StepShape) -> float:
        args = EngineArgs(dtype="bfloat16", dp_size=dp, tp_size=tp)
        return Deployment(args, config, spec=CPU).cost_model().step_seconds(shape)

    # Two replicas each read all the weights at half the bandwidth, and compute at half
    # the FLOP/s; two tensor-parallel ranks each read and compute half, at half the rate,
    # and all-reduce on top: on one CPU neither is faster than one rank.
    for shape in (decode, prefill):
        assert cost(2, 1, shape) == pytest.approx(2 * cost(1, 1, shape))
        assert cost(1, 2, shape) > cost(1, 1, shape)
    # A GPU spec's ranks each have a device.
    h100 = Deployment(EngineArgs(dp_size=2), config, spec=HardwareSpec.load("h100"))
    assert h100.rank_spec() == HardwareSpec.load("h100")
