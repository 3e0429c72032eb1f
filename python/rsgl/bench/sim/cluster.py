"""A simulated deployment: the model, its replicas' cores and the cost of their steps.

`Layout` is what capacity planning varies (data-parallel replicas x tensor-parallel ranks
per replica); `Deployment` turns the engine options plus a cost source into what the
`Simulation` needs: a core factory sized as the server sizes its pool, and a cost model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rsgl._core import Scheduler
from rsgl.args import EngineArgs
from rsgl.bench.sim.cost import (
    DTYPE_BYTES,
    CalibratedCost,
    CostModel,
    FixedCost,
    HardwareSpec,
    ModelFootprint,
    RooflineCost,
)
from rsgl.bench.sim.driver import Simulation
from rsgl.bench.sim.workload import WorkloadSpec, make_workload
from rsgl.distributed.sharding import TPShard
from rsgl.model_executor.kv_cache import KVCache, resolve_kv_cache_dtype
from rsgl.models.config import ModelConfig
from rsgl.models.dtype_choice import MIN_BF16_SPEEDUP
from rsgl.stack import _pool_tokens, build_core, cpu_pool_tokens, device_pool_tokens

# The model dtype a GPU deployment runs when --dtype is auto (as the loader picks on CUDA).
GPU_DEFAULT_DTYPE = "bfloat16"


@dataclass(frozen=True, slots=True)
class Layout:
    """`dp` replicas of `tp` tensor-parallel ranks each."""

    dp: int
    tp: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        """ "DPxTP", e.g. "4x2"."""
        dp, _, tp = text.lower().partition("x")
        return cls(int(dp), int(tp or 1))

    def __str__(self) -> str:
        return f"{self.dp}x{self.tp}"


@dataclass(frozen=True, slots=True)
class Deployment:
    """The engine options and model a simulation runs, and where step costs come from:
    exactly one of `fixed_step_s`, `calibrated` (a calibration) or `spec` (a roofline)."""

    args: EngineArgs
    config: ModelConfig
    fixed_step_s: float | None = None
    calibrated: CalibratedCost | None = None
    spec: HardwareSpec | None = None

    def with_layout(self, layout: Layout) -> Deployment:
        return dataclasses.replace(
            self, args=dataclasses.replace(self.args, dp_size=layout.dp, tp_size=layout.tp)
        )

    @property
    def context_length(self) -> int:
        return self.args.context_length or self.config.max_position_embeddings

    @property
    def dtype(self) -> str:
        if self.args.dtype != "auto":
            return self.args.dtype
        if self.calibrated is not None:  # what the calibrated engine chose
            return str((self.calibrated.meta or {}).get("dtype") or "float32")
        if self.spec is not None and self.spec.device == "cpu":
            # The server's threshold on the spec's GEMMs: bfloat16 where it multiplies that
            # much faster.
            flops = self.spec.peak_flops
            fast = flops["bfloat16"] >= MIN_BF16_SPEEDUP * flops["float32"]
            return "bfloat16" if fast else "float32"
        return GPU_DEFAULT_DTYPE if self.spec is not None else "float32"

    def kv_heads_per_rank(self) -> int:
        """The KV heads of the tensor-parallel rank that holds the most (it sizes the pool
        on a GPU, as `rsgl.stack._pool_tokens` does)."""
        tp = self.args.tp_size
        if tp == 1:
            return self.config.num_key_value_heads
        return max(TPShard.of(self.config, tp, r).num_kv_heads for r in range(tp))

    def footprint(self) -> ModelFootprint:
        return ModelFootprint.of(
            self.config, self.dtype, self.args.tp_size, self.kv_heads_per_rank()
        )

    def max_total_tokens(self) -> int:
        """The KV pool of one replica: --max-total-tokens, else sized as the server sizes it
        (a GPU spec: its memory minus this rank's weights, `device_pool_tokens`; a CPU spec:
        the CPU rule over its memory; otherwise this machine's CPU rule)."""
        args = self.args
        if args.max_total_tokens:
            return args.max_total_tokens
        torch_dtype = getattr(torch, self.dtype)
        if self.spec is None:
            return _pool_tokens(args, self.config, torch_dtype)
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, torch_dtype)
        if self.spec.device == "cpu":  # the ranks share the machine: their heads together
            # (replicated heads count on every rank, as `stack._pool_tokens` counts them)
            per_token = KVCache.bytes_per_slot(self.config, kv_dtype)
            if args.tp_size > 1:
                shards = [TPShard.of(self.config, args.tp_size, r) for r in range(args.tp_size)]
                per_token = sum(
                    KVCache.bytes_per_slot(self.config, kv_dtype, s.num_kv_heads) for s in shards
                )
            return cpu_pool_tokens(
                self.spec.memory_bytes, args.mem_fraction, per_token, args.page_size
            )
        per_token = KVCache.bytes_per_slot(self.config, kv_dtype, self.kv_heads_per_rank())
        c = self.config
        embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        weights = self.footprint().weight_bytes + embedding * DTYPE_BYTES[self.dtype] / args.tp_size
        return device_pool_tokens(
            self.spec.memory_bytes, int(weights), args.mem_fraction, per_token, args.page_size
        )

    @property
    def request_latency_s(self) -> float:
        """What a request spends outside the steps (a server calibration measures it;
        none otherwise)."""
        if self.calibrated is None:
            return 0.0
        return float((self.calibrated.meta or {}).get("request_latency_s", 0.0))

    def core_factory(self) -> Callable[[], Scheduler]:
        tokens = self.max_total_tokens()
        return lambda: build_core(self.args, tokens, self.context_length, self.config)

    def cost_model(self) -> CostModel:
        if self.fixed_step_s is not None:
            return FixedCost(self.fixed_step_s)
        if self.calibrated is not None:
            return self.calibrated
        if self.spec is None:
            raise ValueError("no cost model: give --hardware, --cost-model or --fixed-step-ms")
        return RooflineCost(self.rank_spec(), self.footprint(), self.dtype, self.args.tp_size)

    def rank_spec(self) -> HardwareSpec:
        """What one rank has of the spec's device: a GPU each, but a CPU's ranks (dp x tp of
        them, as the server splits the cores) share its bandwidth and its cores."""
        spec = self.spec
        assert spec is not None
        ranks = self.args.dp_size * self.args.tp_size
        if spec.device != "cpu" or ranks == 1:
            return spec
        return dataclasses.replace(
            spec,
            memory_bandwidth=spec.memory_bandwidth / ranks,
            peak_flops={k: v / ranks for k, v in spec.peak_flops.items()},
        )

    def describe(self) -> dict[str, Any]:
        source: Any = "fixed" if self.fixed_step_s is not None else None
        if self.calibrated is not None:
            source = {"calibration": self.calibrated.meta}
        if self.spec is not None:
            source = {"hardware": self.spec.name}
        return {
            "dp_size": self.args.dp_size,
            "tp_size": self.args.tp_size,
            "dtype": self.dtype,
            "cost_model": source,
            "max_total_tokens": self.max_total_tokens(),
            "load_balance_method": self.args.load_balance_method,
        }

    def simulate(
        self,
        spec: WorkloadSpec,
        rate: float,
        duration_s: float | None = None,
        max_concurrency: int | None = None,
    ) -> dict[str, Any]:
        """One simulation of `spec` at `rate` (at most `max_concurrency` requests in flight,
        as `rsgl bench serving --max-concurrency`): its report, with this deployment and the
        simulator's own speed (events, wall seconds, events per second)."""
        workload = make_workload(spec, rate, duration_s)
        sim = Simulation(
            self.core_factory(),
            self.cost_model(),
            workload,
            dp_size=self.args.dp_size,
            load_balance_method=self.args.load_balance_method,
            context_length=self.context_length,
            overlap=not self.args.disable_overlap_schedule,
            max_concurrency=max_concurrency,
            request_latency_s=self.request_latency_s,
        )
        started = time.perf_counter()
        summary = sim.run()
        wall = time.perf_counter() - started
        summary["sim_wall_s"] = round(wall, 3)
        summary["events_per_s"] = round(sim.events / wall, 1) if wall > 0 else None
        summary["steps_per_s"] = round(summary["steps"] / wall, 1) if wall > 0 else None
        return {
            "dataset": spec.dataset,
            "num_prompts": len(workload),
            "request_rate": "inf" if math.isinf(rate) else rate,
            "max_concurrency": max_concurrency,
            **self.describe(),
            **summary,
        }
