"""Prometheus metrics of the server (prometheus_client, one registry per server)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5)


class ServerMetrics:
    """Request-level metrics measured by the frontend, and the scheduler's load gauges."""

    def __init__(self, model_name: str) -> None:
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
        self._seen = {"retractions": 0, "step_failures": 0}

    def observe_stats(self, stats: dict[str, Any]) -> None:
        """Updates gauges from the scheduler's periodic stats."""
        m = self.model
        self.running.labels(m).set(stats["running"])
        self.queued.labels(m).set(stats["waiting"])
        capacity = max(1, int(stats["capacity"]))
        self.kv_usage.labels(m).set(1 - (stats["available"] + stats["evictable"]) / capacity)
        prompt = stats["prompt_tokens"]
        self.cache_hit_rate.labels(m).set(stats["cached_tokens"] / prompt if prompt else 0.0)
        # The scheduler reports running totals; the counters move by the difference.
        for key, counter in (
            ("retractions", self.retractions),
            ("step_failures", self.step_failures),
        ):
            total = int(stats.get(key, 0))
            if total > self._seen[key]:
                counter.labels(m).inc(total - self._seen[key])
                self._seen[key] = total

    def observe_finish(self, meta: dict[str, Any], aborted: bool) -> None:
        """Counts a finished request."""
        m = self.model
        self.requests.labels(m).inc()
        self.prompt_tokens.labels(m).inc(meta.get("prompt_tokens", 0))
        self.e2e.labels(m).observe(meta.get("e2e_latency", 0.0))
        if meta.get("queue_time") is not None:
            self.queue_time.labels(m).observe(meta["queue_time"])
        if aborted:
            self.aborts.labels(m).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
