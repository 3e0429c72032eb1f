"""`rsgl bench simulate --calibrate-hardware`: a spec of this CPU from measured rates, its
efficiencies and step overhead fitted to a dense model's calibrated steps, priced through
the roofline and sizing the pool as the server sizes it on a CPU."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from rsgl.args import EngineArgs
from rsgl.bench.sim import cpu_spec
from rsgl.bench.sim.cluster import Deployment
from rsgl.bench.sim.cost import HardwareSpec, RooflineCost, spec_as_dict
from rsgl.bench.simulate import main
from rsgl.models.config import ModelConfig
from rsgl.scheduler.step_shape import StepShape
from rsgl.stack import _pool_tokens

LLAMA3_8B = Path(__file__).resolve().parents[2] / "benches" / "configs" / "llama3-8b"

# A CPU as a spec file would have it, its efficiencies and overhead still to be fitted.
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


def _timed_steps(truth: RooflineCost) -> tuple[list[StepShape], list[float]]:
    """Decode steps of 1-16 rows (memory-bound on this CPU) and prefills of 256-2048
    tokens (compute-bound), timed as `truth` prices them."""
    shapes = [StepShape(b, b, 0, b * c, 0, float(b * c)) for b in (1, 4, 16) for c in (64, 1024)]
    shapes += [StepShape(1, n, 1, n, 0, n * (n + 1) / 2) for n in (256, 1024, 2048)]
    return shapes, [truth.step_seconds(s) for s in shapes]


def test_the_fit_recovers_the_efficiencies_and_the_overhead() -> None:
    config = ModelConfig.from_model_dir(LLAMA3_8B)
    dep = Deployment(EngineArgs(dtype="bfloat16"), config, spec=CPU)
    footprint = dep.footprint()
    truth_spec = dataclasses.replace(
        CPU, efficiency=dict(CPU.efficiency, memory=0.7, compute=0.45), step_overhead_s=0.004
    )
    truth = RooflineCost(truth_spec, footprint, "bfloat16")
    shapes, seconds = _timed_steps(truth)
    fitted, report = cpu_spec.fit_to_steps(CPU, footprint, "bfloat16", shapes, seconds)
    assert fitted.efficiency["memory"] == pytest.approx(0.7, rel=1e-3)
    assert fitted.efficiency["compute"] == pytest.approx(0.45, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(0.004, rel=1e-3)
    assert report["decode_mean_rel_error"] < 1e-3
    assert report["prefill_steps"] == 3 and report["decode_steps"] == 6
    # Without prefills long enough to be compute-bound there is nothing to fit it to.
    with pytest.raises(ValueError, match="prefills of at least 256"):
        cpu_spec.fit_to_steps(CPU, footprint, "bfloat16", shapes[:6], seconds[:6])


def test_a_cpu_spec_sizes_the_pool_and_picks_the_dtype_as_the_server_does_here() -> None:
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


def test_the_cli_measures_this_cpu_and_fits_it_to_a_dense_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ModelConfig.from_model_dir(LLAMA3_8B)
    footprint = Deployment(EngineArgs(dtype="bfloat16"), config, spec=CPU).footprint()
    truth_spec = dataclasses.replace(
        CPU, efficiency=dict(CPU.efficiency, memory=0.6, compute=0.5), step_overhead_s=0.002
    )
    shapes, seconds = _timed_steps(RooflineCost(truth_spec, footprint, "bfloat16"))
    meta = {"quantization": "none", "dtype": "bfloat16", "cpu_threads": 1, "model": "x"}
    calibration = {
        "kind": "linear",
        "features": ["step", "batch_size", "new_tokens", "attention_pairs", "num_extends"],
        "coefficients": [0.0] * 5,
        "floor_s": 1e-5,
        "meta": meta,
        "sample_fields": [*(f.name for f in dataclasses.fields(StepShape)), "seconds"],
        "samples": [[*dataclasses.astuple(s), t] for s, t in zip(shapes, seconds, strict=True)],
    }
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps(calibration))
    # The measurement is real (small sizes, to keep the test short); the fit is to the
    # calibration's steps, priced at the measured rates as they were made at CPU's.
    real_measure = cpu_spec.measure
    measured: list[HardwareSpec] = []

    def measure(threads: int | None = None) -> HardwareSpec:
        spec = real_measure(threads, bandwidth_bytes=64 << 20, gemm_size=256)
        measured.append(spec)
        return dataclasses.replace(
            spec, memory_bandwidth=CPU.memory_bandwidth, peak_flops=CPU.peak_flops
        )

    monkeypatch.setattr(cpu_spec, "measure", measure)
    out = tmp_path / "cpu.json"
    argv = ["--model-path", str(LLAMA3_8B), "--calibrate-hardware", "--hardware-output", str(out)]
    assert main([*argv, "--cost-model", str(dense)]) == 0
    (raw,) = measured
    assert raw.memory_bandwidth > 0 and raw.peak_flops["float32"] > 0
    assert raw.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spec = HardwareSpec.load(str(out))
    assert spec.device == "cpu"
    assert spec.efficiency["memory"] == pytest.approx(0.6, rel=1e-3)
    assert spec.step_overhead_s == pytest.approx(0.002, rel=1e-3)
    assert spec.meta is not None and spec.meta["calibration"] == meta
    # It prices another model on this CPU through --hardware.
    assert main(["--model-path", str(LLAMA3_8B), "--hardware", str(out), "--num-prompts", "4",
                 "--random-input-len", "64", "--random-output-len", "4"]) == 0  # fmt: skip
    # A calibration of low-bit weights is refused: the roofline prices dtype-sized ones.
    dense.write_text(json.dumps(calibration | {"meta": meta | {"quantization": "gguf"}}))
    assert main([*argv, "--cost-model", str(dense)]) == 2
    # Without a calibration, the measured rates themselves (efficiency 1, no overhead).
    assert main(argv) == 0
    unfitted = json.loads(out.read_text())
    assert unfitted["efficiency"]["memory"] == 1.0 and unfitted["meta"] is None
    assert spec_as_dict(HardwareSpec.load(str(out))) == unfitted
