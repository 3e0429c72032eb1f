"""Prometheus metrics of the server (prometheus_client, one registry per server).

rsgl's own series are `rsgl_*`, labelled by `model_name`. With `--enable-metrics-compat
sglang` the server also exports the series an SGLang dashboard reads, under SGLang 0.5's
names and label sets (`sglang:num_running_reqs`, ..., with `engine_type`, the ranks and
`is_streaming` where SGLang has them), fed by the same observations.

With `--dp-size N > 1` the series fed by each scheduler's statistics (the load gauges, the
retraction and step-failure counters) carry a `dp_rank` label, as SGLang's do when it runs
data-parallel ranks; with one rank they carry none, as in SGLang. The request-level series
are measured by the one frontend and stay unlabelled.
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
    """Request-level metrics measured by the frontend, and the schedulers' load gauges."""

    def __init__(self, model_name: str, compat: str | None = None, dp_size: int = 1) -> None:
        if compat is not None and compat not in METRICS_COMPAT:
            raise ValueError(f"unknown metrics compatibility {compat!r}: expected sglang")
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        # The series each scheduler feeds: one child per rank when there are several.
        rank_labels = ["model_name", "dp_rank"] if dp_size > 1 else labels
        self.dp_size = dp_size
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, rank_labels, registry=r)

        def counter(name: str, doc: str, per_rank: bool = False) -> Counter:
            return Counter(name, doc, rank_labels if per_rank else labels, registry=r)

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
        self.retractions = counter(
            "rsgl_retractions", "Requests retracted under memory pressure", per_rank=True
        )
        self.step_failures = counter(
            "rsgl_step_failures",
            "Steps whose execution raised (their requests were aborted)",
            per_rank=True,
        )
        self.grammar_waiting = gauge(
            "rsgl_num_grammar_queue_reqs", "Requests waiting for their grammar to compile"
        )
        self.grammar_counters = {
            key: counter(f"rsgl_{key}", doc, per_rank=True)
            for key, doc in (
                ("grammar_compiles", "Grammars compiled (cache misses)"),
                ("grammar_cache_hits", "Requests whose grammar was cached or compiling"),
                ("grammar_compile_failures", "Constraints that did not compile (400)"),
                ("grammar_compile_seconds", "Seconds spent compiling grammars"),
                ("grammar_mask_fills", "Steps that filled grammar masks"),
                ("grammar_mask_seconds", "Seconds spent filling grammar masks"),
                ("spec_verify_steps", "Steps that verified speculative drafts"),
                ("spec_draft_tokens", "Draft tokens verified"),
                ("spec_committed_tokens", "Tokens committed by request rows with drafts"),
            )
        }
        self.spec_accept_length = gauge(
            "rsgl_spec_accept_length",
            "Average tokens committed per request row with drafts (accepted drafts + 1)",
        )
        self.ranks_alive = Gauge(
            "rsgl_dp_ranks_alive", "Data-parallel ranks serving (of --dp-size)", labels, registry=r
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
        self.ranks_alive.labels(model_name).set(dp_size)
        # Per rank: the running totals last reported, and when.
        self._seen: list[dict[str, float]] = [
            {"retractions": 0, "step_failures": 0, "generated_tokens": 0} for _ in range(dp_size)
        ]
        self._stats_at: list[float | None] = [None] * dp_size
        self.sglang = _SGLangSeries(r, model_name, dp_size) if compat == "sglang" else None
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

    def _rank_labels(self, dp_rank: int) -> tuple[str, ...]:
        return (self.model, str(dp_rank)) if self.dp_size > 1 else (self.model,)

    def observe_stats(self, stats: dict[str, Any], dp_rank: int = 0) -> None:
        """Updates gauges from one scheduler's periodic stats."""
        labels = self._rank_labels(dp_rank)
        seen = self._seen[dp_rank]
        now = time.perf_counter()
        capacity = max(1, int(stats["capacity"]))
        usage = 1 - (stats["available"] + stats["evictable"]) / capacity
        prompt = stats["prompt_tokens"]
        hit_rate = stats["cached_tokens"] / prompt if prompt else 0.0
        generated = int(stats.get("generated_tokens", 0))
        throughput = 0.0
        last = self._stats_at[dp_rank]
        if last is not None and now > last:
            throughput = (generated - seen["generated_tokens"]) / (now - last)
        self._stats_at[dp_rank], seen["generated_tokens"] = now, generated
        self.grammar_waiting.labels(*labels).set(stats.get("grammar_waiting", 0))
        self.spec_accept_length.labels(*labels).set(stats.get("spec_accept_length", 0))
        for key, series in self.grammar_counters.items():
            total = float(stats.get(key, 0))
            if total > seen.get(key, 0):
                series.labels(*labels).inc(total - seen.get(key, 0))
                seen[key] = total
        gauges = {
            "running": stats["running"],
            "queued": stats["waiting"],
            "kv_usage": usage,
            "cache_hit_rate": hit_rate,
            "gen_throughput": throughput,
        }
        for name, value in gauges.items():
            getattr(self, name).labels(*labels).set(value)
            if self.sglang is not None:
                self.sglang.gauge(name, dp_rank).set(value)
        # The scheduler reports running totals; the counters move by the difference.
        for key, counter in (
            ("retractions", self.retractions),
            ("step_failures", self.step_failures),
        ):
            total = int(stats.get(key, 0))
            if total > seen[key]:
                counter.labels(*labels).inc(total - seen[key])
                seen[key] = total

    def rank_died(self, dp_rank: int, alive: int) -> None:
        """A rank is gone: its load gauges leave (a dead rank has no load to report, and a
        stale one would read as a busy rank), and the count of live ranks drops."""
        self.ranks_alive.labels(self.model).set(alive)
        if self.dp_size == 1:
            return
        labels = self._rank_labels(dp_rank)
        for name in (
            "running",
            "queued",
            "kv_usage",
            "cache_hit_rate",
            "gen_throughput",
            "grammar_waiting",
            "spec_accept_length",
        ):
            getattr(self, name).remove(*labels)
        if self.sglang is not None:
            self.sglang.remove_rank(dp_rank)

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
    for one unified engine: tensor, pipeline and expert rank 0, and the data-parallel rank
    when there are several."""

    ENGINE_TYPE = "unified"

    def __init__(self, registry: CollectorRegistry, model_name: str, dp_size: int = 1) -> None:
        r = registry
        sched = {
            "model_name": model_name,
            "engine_type": self.ENGINE_TYPE,
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        self._sched = sched
        self.dp_size = dp_size
        front = {"model_name": model_name, "engine_type": self.ENGINE_TYPE}
        with_stream = [*front, "is_streaming"]
        self._sched_names = [*sched, "dp_rank"] if dp_size > 1 else list(sched)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, self._sched_names, registry=r)

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
        # Every rank's gauges exist (at 0) from the start, as SGLang's do.
        for rank in range(dp_size):
            for name in self.gauges:
                self.gauge(name, rank)

    def child(self, series: str, streaming: bool) -> Any:
        return self._children[(series, streaming)]

    def _labels(self, dp_rank: int) -> dict[str, str]:
        return dict(self._sched, dp_rank=str(dp_rank)) if self.dp_size > 1 else self._sched

    def gauge(self, name: str, dp_rank: int) -> Any:
        """The child of gauge `name` for one rank."""
        return self.gauges[name].labels(**self._labels(dp_rank))

    def remove_rank(self, dp_rank: int) -> None:
        labels = self._labels(dp_rank)
        for g in self.gauges.values():
            g.remove(*(labels[n] for n in self._sched_names))
