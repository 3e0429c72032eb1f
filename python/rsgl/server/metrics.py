"""Prometheus metrics of the server (prometheus_client, one registry per server).

rsgl's own series are `rsgl_*`, labelled by `model_name`. With `--enable-metrics-compat
sglang` the server also exports the series an SGLang dashboard reads, under SGLang 0.5's
names and label sets (`sglang:num_running_reqs`, ..., with `engine_type`, the ranks and
`is_streaming` where SGLang has them), fed by the same observations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5)
METRICS_COMPAT = ("sglang",)


@dataclass(frozen=True, slots=True)
class _TokenSeries:
    """The children one token observation moves (looked up once: `labels()` costs)."""

    ttft: tuple[Any, ...]
    itl: tuple[Any, ...]
    generated: tuple[Any, ...]


class ServerMetrics:
    """Request-level metrics measured by the frontend, and the scheduler's load gauges."""

    def __init__(self, model_name: str, compat: str | None = None) -> None:
        if compat is not None and compat not in METRICS_COMPAT:
            raise ValueError(f"unknown metrics compatibility {compat!r}: expected sglang")
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("rsgl_num_running_reqs", "Requests in the running batch")
        self.queued = gauge("rsgl_num_queue_reqs", "Requests waiting to be scheduled")
        self.kv_usage = gauge("rsgl_kv_cache_usage", "Fraction of the KV pool in use")
        self.cache_hit_rate = gauge(
            "rsgl_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens"
        )
        self.gen_throughput = gauge(
            "rsgl_gen_throughput", "Tokens generated per second since the previous statistics"
        )
        self.prompt_tokens = counter("rsgl_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("rsgl_generation_tokens", "Generated tokens")
        self.requests = counter("rsgl_requests", "Finished requests (any reason)")
        self.aborts = counter("rsgl_aborted_requests", "Aborted requests")
        self.retractions = counter("rsgl_retractions", "Requests retracted under memory pressure")
        self.step_failures = counter(
            "rsgl_step_failures", "Steps whose execution raised (their requests were aborted)"
        )
        self.ttft = histogram(
            "rsgl_time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS
        )
        self.itl = histogram("rsgl_inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS)
        self.e2e = histogram(
            "rsgl_e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "rsgl_queue_time_seconds", "Time from arrival to first scheduling", LATENCY_BUCKETS
        )
        self.model = model_name
        self._seen = {"retractions": 0, "step_failures": 0, "generated_tokens": 0}
        self._stats_at: float | None = None
        self.sglang = _SGLangSeries(r, model_name) if compat == "sglang" else None
        m = model_name
        self._tokens = {
            streaming: _TokenSeries(
                ttft=(self.ttft.labels(m), *self._sglang("ttft", streaming)),
                itl=(self.itl.labels(m), *self._sglang("itl", streaming)),
                generated=(self.generation_tokens.labels(m), *self._sglang("generated", streaming)),
            )
            for streaming in (False, True)
        }

    def _sglang(self, series: str, streaming: bool) -> tuple[Any, ...]:
        return () if self.sglang is None else (self.sglang.child(series, streaming),)

    def observe_tokens(
        self, first_latency: float | None, gap: float | None, count: int, *, streaming: bool
    ) -> None:
        """`count` new tokens of one request: its time to first token or the gap since its
        previous tokens."""
        series = self._tokens[streaming]
        if first_latency is not None:
            for h in series.ttft:
                h.observe(first_latency)
        if gap is not None:
            for h in series.itl:
                h.observe(gap)
        for c in series.generated:
            c.inc(count)

    def observe_stats(self, stats: dict[str, Any]) -> None:
        """Updates gauges from the scheduler's periodic stats."""
        m = self.model
        now = time.perf_counter()
        capacity = max(1, int(stats["capacity"]))
        usage = 1 - (stats["available"] + stats["evictable"]) / capacity
        prompt = stats["prompt_tokens"]
        hit_rate = stats["cached_tokens"] / prompt if prompt else 0.0
        generated = int(stats.get("generated_tokens", 0))
        throughput = 0.0
        if self._stats_at is not None and now > self._stats_at:
            throughput = (generated - self._seen["generated_tokens"]) / (now - self._stats_at)
        self._stats_at, self._seen["generated_tokens"] = now, generated
        gauges = {
            "running": stats["running"],
            "queued": stats["waiting"],
            "kv_usage": usage,
            "cache_hit_rate": hit_rate,
            "gen_throughput": throughput,
        }
        for name, value in gauges.items():
            getattr(self, name).labels(m).set(value)
            if self.sglang is not None:
                self.sglang.gauges[name].set(value)
        # The scheduler reports running totals; the counters move by the difference.
        for key, counter in (
            ("retractions", self.retractions),
            ("step_failures", self.step_failures),
        ):
            total = int(stats.get(key, 0))
            if total > self._seen[key]:
                counter.labels(m).inc(total - self._seen[key])
                self._seen[key] = total

    def observe_finish(self, meta: dict[str, Any], aborted: bool, *, streaming: bool) -> None:
        """Counts a finished request."""
        m = self.model
        self.requests.labels(m).inc()
        prompt_tokens = meta.get("prompt_tokens", 0)
        e2e = meta.get("e2e_latency", 0.0)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.e2e.labels(m).observe(e2e)
        if self.sglang is not None:
            self.sglang.child("prompt", streaming).inc(prompt_tokens)
            self.sglang.child("e2e", streaming).observe(e2e)
        if meta.get("queue_time") is not None:
            self.queue_time.labels(m).observe(meta["queue_time"])
        if aborted:
            self.aborts.labels(m).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SGLangSeries:
    """SGLang 0.5's series (names, documentation and label sets of its metrics collectors)
    for one unified engine: tensor, pipeline and expert rank 0."""

    ENGINE_TYPE = "unified"

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r = registry
        sched = {
            "model_name": model_name,
            "engine_type": self.ENGINE_TYPE,
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        front = {"model_name": model_name, "engine_type": self.ENGINE_TYPE}
        with_stream = [*front, "is_streaming"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"sglang:{name}", doc, list(sched), registry=r).labels(**sched)

        self.gauges = {
            "running": gauge("num_running_reqs", "The number of running requests."),
            "queued": gauge("num_queue_reqs", "The number of requests in the waiting queue."),
            "kv_usage": gauge("token_usage", "The token usage."),
            "cache_hit_rate": gauge("cache_hit_rate", "The prefix cache hit rate."),
            "gen_throughput": gauge("gen_throughput", "The generation throughput (token/s)."),
        }
        prompt = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", with_stream, registry=r
        )
        generated = Counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            with_stream,
            registry=r,
        )
        ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            with_stream,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            list(front),
            buckets=ITL_BUCKETS,
            registry=r,
        )
        e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            with_stream,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._children: dict[tuple[str, bool], Any] = {}
        for streaming in (False, True):
            labels = dict(front, is_streaming=str(streaming).lower())
            self._children[("prompt", streaming)] = prompt.labels(**labels)
            self._children[("generated", streaming)] = generated.labels(**labels)
            self._children[("ttft", streaming)] = ttft.labels(**labels)
            self._children[("e2e", streaming)] = e2e.labels(**labels)
            self._children[("itl", streaming)] = itl.labels(**front)

    def child(self, series: str, streaming: bool) -> Any:
        return self._children[(series, streaming)]
