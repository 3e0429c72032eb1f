"""Capacity search: the highest request rate each layout holds within a latency SLO.

An SLO is a comma-separated list of `METRIC_STAT<LIMIT` with METRIC one of ttft, itl, tpot,
e2e, STAT one of p99, median (or p50), mean, and LIMIT in s or ms ("ttft_p99<2s,itl_p99<100ms").
Holding is monotone in the rate (more traffic never lowers latency much), so the search
doubles the rate until the SLO breaks (or halves it until it holds), then bisects between the
last rate that held and the first that broke until they are within `tolerance` of each other.
Every probe is one simulation; the report plots each layout's latency percentiles against the
rate, as a PNG and an HTML page (the PNG inline, the tables under it), with the JSON beside.

With `max_concurrency` (as `rsgl bench serving --max-concurrency`), an arrival waits
client-side while the cap is full and its latencies count from sending, so past the
layout's capacity the latencies stop growing and the client-side queue grows instead. A
rate then holds only if, besides the SLO, the client kept up: it had sent at least
`MIN_KEEP_UP_RATIO` of the requests by the time the last one arrived (the simulation's
`keep_up_ratio`: the throughput over the arrival window against the offered rate). The
report states the cap and the threshold, and tabulates and plots the ratio and the
client-side wait.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rsgl.bench.sim.cluster import Deployment, Layout
from rsgl.bench.sim.workload import WorkloadSpec

Slo = list[tuple[str, float]]  # (report key, limit in ms)

_STATS = {"p99": "p99", "median": "median", "p50": "median", "mean": "mean"}
_METRICS = ("ttft", "itl", "tpot", "e2e")
_TERM = re.compile(r"^\s*(\w+?)_(\w+)\s*<\s*([0-9.eE+-]+)\s*(ms|s)\s*$")
MAX_PROBES = 24
# Under a concurrency cap, the least share of the requests the client must have sent by
# the last arrival for a rate to hold: the rest is the backlog the cap left behind, and a
# few percent of it allows for the queue a Poisson burst leaves even below capacity.
MIN_KEEP_UP_RATIO = 0.95


def parse_slo(text: str) -> Slo:
    """`"ttft_p99<2s,itl_p99<100ms"` -> `[("p99_ttft_ms", 2000.0), ("p99_itl_ms", 100.0)]`."""
    out: Slo = []
    for term in text.split(","):
        m = _TERM.match(term)
        if m is None or m.group(1) not in _METRICS or m.group(2) not in _STATS:
            raise ValueError(
                f"bad SLO term {term.strip()!r}: expected METRIC_STAT<LIMIT(s|ms), METRIC in "
                f"{_METRICS}, STAT in {tuple(_STATS)}"
            )
        limit = float(m.group(3)) * (1000.0 if m.group(4) == "s" else 1.0)
        out.append((f"{_STATS[m.group(2)]}_{m.group(1)}_ms", limit))
    return out


def keeps_up(record: dict[str, Any]) -> bool:
    """Without a cap every request is sent on arrival; with one, the client sent at least
    `MIN_KEEP_UP_RATIO` of the requests by the last arrival."""
    return record["max_concurrency"] is None or record["keep_up_ratio"] >= MIN_KEEP_UP_RATIO


def slo_holds(record: dict[str, Any], slo: Slo) -> bool:
    """Every request succeeded, every SLO term is met and the client kept up."""
    return (
        record["failures"] == 0
        and all(record[key] < limit for key, limit in slo)
        and keeps_up(record)
    )


@dataclass(slots=True)
class CapacityResult:
    """One layout's probes (simulation records, by rate) and the best rate that held."""

    layout: Layout
    points: list[dict[str, Any]] = field(default_factory=list)
    best_rate: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"layout": str(self.layout), "best_rate": self.best_rate, "points": self.points}


def find_capacity(
    dep: Deployment,
    spec: WorkloadSpec,
    slo: Slo,
    layout: Layout,
    *,
    duration_s: float | None,
    tolerance: float = 0.05,
    start_rate: float | None = None,
    max_concurrency: int | None = None,
) -> CapacityResult:
    """Bisects the highest rate `layout` holds within `slo`, at most `max_concurrency`
    requests in flight (see the module docstring)."""
    dep = dep.with_layout(layout)
    result = CapacityResult(layout)

    def holds(rate: float) -> bool:
        record = dep.simulate(spec, rate, duration_s, max_concurrency)
        result.points.append(record)
        return slo_holds(record, slo)

    rate = start_rate or float(layout.dp)
    lo, hi = 0.0, math.inf
    for _ in range(MAX_PROBES):
        if holds(rate):
            lo = rate
            if math.isinf(hi):
                rate *= 2
            else:
                rate = (lo + hi) / 2
        else:
            hi = rate
            rate = rate / 2 if lo == 0 else (lo + hi) / 2
        if lo > 0 and not math.isinf(hi) and (hi - lo) <= tolerance * hi:
            break
    result.best_rate = lo if lo > 0 else None
    result.points.sort(key=lambda p: float(p["request_rate"]))
    return result


def plot_png(results: list[CapacityResult], slo: Slo, capped: bool = False) -> bytes:
    """Latency percentiles (TTFT, ITL, E2E: p50 dashed, p99 solid) against the request rate,
    one colour per layout, with the SLO limits as horizontal lines; `capped`, a fourth
    panel plots the keep-up ratio against its threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("ttft", "itl", "e2e")
    panels = len(metrics) + (1 if capped else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.5))
    for ax, metric in zip(axes[: len(metrics)], metrics, strict=True):
        for i, res in enumerate(results):
            color = f"C{i}"
            rates = [float(p["request_rate"]) for p in res.points]
            for stat, style in (("median", "--"), ("p99", "-")):
                ys = [p[f"{stat}_{metric}_ms"] for p in res.points]
                label = f"{res.layout} {stat}" if stat == "p99" or metric == "ttft" else None
                ax.plot(rates, ys, style, color=color, marker="o", markersize=3, label=label)
            if res.best_rate is not None:
                ax.axvline(res.best_rate, color=color, alpha=0.3)
        for key, limit in slo:
            if key.endswith(f"_{metric}_ms"):
                ax.axhline(limit, color="black", linestyle=":", label=f"SLO {key} < {limit:g}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{metric.upper()} vs request rate")
    if capped:
        ax = axes[-1]
        for i, res in enumerate(results):
            rates = [float(p["request_rate"]) for p in res.points]
            ratios = [p["keep_up_ratio"] for p in res.points]
            ax.plot(rates, ratios, "-", color=f"C{i}", marker="o", markersize=3)
            if res.best_rate is not None:
                ax.axvline(res.best_rate, color=f"C{i}", alpha=0.3)
        label = f"keep_up_ratio >= {MIN_KEEP_UP_RATIO:g}"
        ax.axhline(MIN_KEEP_UP_RATIO, color="black", linestyle=":", label=label)
        ax.legend(fontsize=7)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("requests sent by the last arrival (share)")
        ax.grid(True, alpha=0.3)
        ax.set_title("keep-up ratio vs request rate")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def report_html(
    results: list[CapacityResult],
    slo: Slo,
    png: bytes,
    title: str,
    max_concurrency: int | None = None,
) -> str:
    """The PNG inline, a table of the best rate per layout, and every probe."""
    slo_text = ", ".join(f"{k} &lt; {v:g} ms" for k, v in slo)
    if max_concurrency is not None:
        slo_text += (
            f"; at most {max_concurrency} requests in flight (arrivals wait client-side), and "
            f"keep_up_ratio &ge; {MIN_KEEP_UP_RATIO:g} (the share of the requests sent by the "
            "last arrival)"
        )
    rows = "".join(
        f"<tr><td>{r.layout}</td><td>{r.layout.dp * r.layout.tp}</td>"
        f"<td>{'none' if r.best_rate is None else f'{r.best_rate:.3g}'}</td></tr>"
        for r in results
    )
    cols: tuple[str, ...] = ("request_rate", "request_throughput", "median_ttft_ms", "p99_ttft_ms")
    cols += ("median_itl_ms", "p99_itl_ms", "p99_e2e_ms", "retractions", "cache_hit_rate")
    if max_concurrency is not None:
        cols += ("keep_up_ratio", "median_client_wait_ms", "p99_client_wait_ms")
    head = "".join(f"<th>{c}</th>" for c in ("layout", *cols))
    probes = "".join(
        "<tr>"
        + f"<td>{r.layout}</td>"
        + "".join(f"<td>{html.escape(str(p.get(c)))}</td>" for c in cols)
        + "</tr>"
        for r in results
        for p in r.points
    )
    image = base64.b64encode(png).decode("ascii")
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>SLO: {slo_text}</p>"
        f"<img alt='latency vs request rate' src='data:image/png;base64,{image}'>"
        "<h2>Highest rate held</h2><table><tr><th>layout (DPxTP)</th><th>devices</th>"
        f"<th>req/s</th></tr>{rows}</table>"
        f"<h2>Probes</h2><table><tr>{head}</tr>{probes}</table></body></html>"
    )


def capacity_main(
    dep: Deployment,
    spec: WorkloadSpec,
    slo_text: str,
    layouts: list[Layout],
    report_dir: Path,
    duration_s: float | None,
    max_concurrency: int | None = None,
) -> int:
    """`rsgl bench simulate --slo ...`: search every layout, print and write the report."""
    try:
        slo = parse_slo(slo_text)
    except ValueError as exc:
        print(f"rsgl bench simulate: {exc}", file=sys.stderr)
        return 2
    results = []
    for layout in layouts:
        res = find_capacity(
            dep, spec, slo, layout, duration_s=duration_s, max_concurrency=max_concurrency
        )
        results.append(res)
        best = "none" if res.best_rate is None else f"{res.best_rate:.3g} req/s"
        print(f"layout {layout}: {best} ({len(res.points)} probes)", file=sys.stderr)
    report_dir.mkdir(parents=True, exist_ok=True)
    png = plot_png(results, slo, capped=max_concurrency is not None)
    (report_dir / "capacity.png").write_bytes(png)
    title = f"rsgl capacity: {spec.dataset}, " + ", ".join(str(r.layout) for r in results)
    page = report_html(results, slo, png, title, max_concurrency)
    (report_dir / "capacity.html").write_text(page)
    condition: dict[str, Any] = {"slo": slo_text, "max_concurrency": max_concurrency}
    if max_concurrency is not None:
        condition["min_keep_up_ratio"] = MIN_KEEP_UP_RATIO
    record = {**condition, "layouts": [r.to_json() for r in results]}
    (report_dir / "capacity.json").write_text(json.dumps(record, indent=1))
    summary = {str(r.layout): r.best_rate for r in results}
    print(json.dumps({**condition, "best_rate": summary, "report_dir": str(report_dir)}))
    return 0
