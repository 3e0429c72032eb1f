"""`rsgl bench simulate`: the simulator makes the server's scheduling decisions (the real
loop over the null runner plans the same steps for the same arrivals), virtual times follow
the cost model, the cost models price shapes as their inputs say, replicas sit behind the
real dispatcher, the capacity search finds the rate where the SLO breaks (under a
concurrency cap, where the client stops keeping up), and the validation runs the real
client and the simulation under the same cap."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from word_tokenizer import WordTokenizer

from rsgl._core import Plan
from rsgl.args import EngineArgs
from rsgl.bench import serving
from rsgl.bench.sim import calibrate, validate
from rsgl.bench.sim.capacity import (
    MIN_KEEP_UP_RATIO,
    find_capacity,
    keeps_up,
    parse_slo,
    slo_holds,
)
from rsgl.bench.sim.cluster import Deployment, Layout
from rsgl.bench.sim.cost import (
    NO_EXTEND_YET,
    AfterExtend,
    AfterIdle,
    FixedCost,
    HardwareSpec,
    LinearCost,
    TableCost,
    decodes_since_extend,
    load_cost_model,
    min_step_seconds,
)
from rsgl.bench.sim.driver import Simulation
from rsgl.bench.sim.validate import LOADS, median_of
from rsgl.bench.sim.workload import Workload, WorkloadSpec, make_workload, read_trace
from rsgl.bench.simulate import main
from rsgl.model_executor.null_runner import NullRunner
from rsgl.models.config import ModelConfig
from rsgl.scheduler.loop import SchedulerLoop
from rsgl.scheduler.step_shape import StepShape
from rsgl.server.dispatcher import Dispatcher
from rsgl.stack import build_core

LLAMA3_8B = Path(__file__).resolve().parents[2] / "benches" / "configs" / "llama3-8b"
# CI clones the repository next to ../shared.
GSP_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "gsp.jsonl.gz"


def _config() -> ModelConfig:
    return ModelConfig.from_model_dir(LLAMA3_8B)


def _mixed_requests(n: int, seed: int = 1) -> list[tuple[np.ndarray, int]]:
    """Prompts of many lengths, some sharing a prefix, with outputs long enough that a
    small pool must retract."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(10, 30000, 96)
    out = []
    for i in range(n):
        own = rng.integers(10, 30000, int(rng.integers(8, 200)))
        prompt = np.concatenate([shared, own]) if i % 3 == 0 else own
        out.append((prompt, int(rng.integers(32, 160))))
    return out


ARGS = EngineArgs(
    load_format="null",
    max_total_tokens=1400,
    chunked_prefill_size=128,
    max_running_requests=16,
)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_simulator_plans_the_steps_the_real_loop_plans(overlap: bool) -> None:
    config = _config()
    requests = _mixed_requests(40)
    # Repeats, prefilled once their first copy is cached: their commits move rows, so both
    # loops commit them before planning on (`commit_moves_rows`), and the plan after such a
    # commit rewrites the repeat's row (counted among each plan's req_to_token writes).
    requests += [requests[2], requests[4], requests[2]]

    def composition(p: Plan) -> tuple:
        return (p.forward_mode, tuple(p.rids.tolist()), tuple(p.extend_lens.tolist()),
                len(p.write_rows))  # fmt: skip

    # The simulator: every request arrives at time 0, every step takes 1 ms.
    simulated: list[tuple] = []
    workload = Workload(np.zeros(len(requests)), WorkloadSpec(), recorded=requests)
    sim = Simulation(
        lambda: build_core(ARGS, 1400, 8192, config),
        FixedCost(0.001),
        workload,
        overlap=overlap,
        on_launch=lambda r, p: simulated.append(composition(p)),
    )
    report = sim.run()
    assert report["successes"] == len(requests)
    assert report["retractions"] > 0  # the pool is small enough to make it retract

    # The real loop over the null runner, the same requests queued before it starts.
    real: list[tuple] = []

    class RecordingRunner(NullRunner):
        def prepare(self, plan):  # type: ignore[no-untyped-def]
            real.append(composition(plan))
            return super().prepare(plan)

    from rsgl.sampling_params import SamplingParams

    done = threading.Event()
    finished: list[str] = []

    def emit(updates) -> None:  # type: ignore[no-untyped-def]
        finished.extend(u.rid for u in updates if u.finish is not None)
        if len(finished) == len(requests):
            done.set()

    core = build_core(ARGS, 1400, 8192, config)
    runner = RecordingRunner(config, max_running_requests=16)
    loop = SchedulerLoop(core, runner, emit, overlap=overlap)
    for i, (prompt, out_len) in enumerate(requests):
        params = SamplingParams(max_new_tokens=out_len, ignore_eos=True)
        loop.submit(str(i), prompt.tolist(), params)
    loop.start()
    try:
        assert done.wait(60)
    finally:
        loop.shutdown()
    assert simulated == real
    decode_batches = [len(rids) for mode, rids, *_ in real if mode == "decode"]
    assert report["mean_decode_batch"] == pytest.approx(np.mean(decode_batches))


def test_virtual_times_follow_the_cost_model() -> None:
    config = _config()
    # One request of 5 output tokens, 10 ms a step: its first token after one step, then
    # one per step, in overlap mode as without it.
    for overlap in (True, False):
        workload = Workload(np.zeros(1), WorkloadSpec(), recorded=[(np.arange(10, 30), 5)])
        sim = Simulation(
            lambda: build_core(ARGS, 1400, 8192, config),
            FixedCost(0.010),
            workload,
            overlap=overlap,
        )
        report = sim.run()
        assert report["mean_ttft_ms"] == pytest.approx(10.0)
        assert report["median_itl_ms"] == pytest.approx(10.0)
        assert report["mean_e2e_ms"] == pytest.approx(50.0)
        assert report["total_output_tokens"] == 5


def test_a_request_latency_delays_every_first_token_and_no_gap_between_tokens() -> None:
    # Requests spaced out (each alone): the latency adds to each TTFT and E2E exactly; with
    # two replicas behind a dispatcher that reads releases, and a burst sharing one.
    config = _config()
    requests = [(np.arange(10 + i, 40 + i), 4 + i % 3) for i in range(6)]

    def run(arrivals: np.ndarray, dp: int, latency: float, cap: int | None = None) -> Simulation:
        sim = Simulation(
            lambda: build_core(ARGS, 1400, 8192, config),
            FixedCost(0.010),
            Workload(arrivals, WorkloadSpec(), recorded=requests),
            dp_size=dp,
            load_balance_method="total_requests",
            request_latency_s=latency,
            max_concurrency=cap,
        )
        sim.run()
        return sim

    spaced, burst = np.arange(6) * 1.0, np.zeros(6)
    for arrivals, dp in ((spaced, 1), (spaced, 2), (burst, 1)):
        runs = []
        for latency in (0.0, 0.0125):
            sim = run(arrivals, dp, latency)
            itl = np.sort(np.concatenate(sim._itl))
            runs.append((sim.first_token - sim.sent, sim.finish - sim.sent, itl))
        (ttft0, e2e0, itl0), (ttft1, e2e1, itl1) = runs
        np.testing.assert_allclose(ttft1, ttft0 + 0.0125)
        np.testing.assert_allclose(e2e1, e2e0 + 0.0125)
        np.testing.assert_allclose(itl1, itl0)
    # Two at a time: each later one is sent when one is released, and reaches the replica a
    # latency later (where the steps stand then), so no TTFT is below a lone request's.
    capped = run(burst, 1, 0.0125, cap=2)
    ttft = capped.first_token - capped.sent
    assert ttft[:2] == pytest.approx([0.0225] * 2)
    assert (ttft >= 0.0225 - 1e-12).all() and (capped.sent[2:] > 0).all()
    # A calibration's measured latency is the deployment's.
    table = TableCost((1,), (16.0,), ((0.01,),), LinearCost((0.01, 0, 0, 0, 0, 0)),
                      meta={"request_latency_s": 0.02})  # fmt: skip
    dep = Deployment(EngineArgs(max_total_tokens=4000), config, calibrated=table)
    spec = WorkloadSpec(num_prompts=3, random_input_len=16, random_output_len=2)
    assert dep.simulate(spec, 0.5)["mean_ttft_ms"] == pytest.approx(20.0 + 10.0)
    with pytest.raises(ValueError, match="request_latency_s"):
        Simulation(
            dep.core_factory(), FixedCost(0.01), make_workload(spec, 1.0), request_latency_s=-1
        )


def test_a_request_arriving_mid_step_waits_for_the_running_steps() -> None:
    config = _config()
    # B arrives while A's prefill runs: in overlap mode A's first decode is already planned,
    # so B is planned after it and its prefill runs third (ends at 30 ms, 25 ms after it came).
    requests = [(np.arange(10, 30), 20), (np.arange(40, 60), 2)]
    workload = Workload(np.array([0.0, 0.005]), WorkloadSpec(), recorded=requests)
    sim = Simulation(lambda: build_core(ARGS, 1400, 8192, config), FixedCost(0.010), workload)
    sim.run()
    assert sim.first_token[1] == pytest.approx(0.030)


def test_replicas_sit_behind_the_real_dispatcher() -> None:
    config = _config()
    requests = _mixed_requests(30, seed=3)
    for method in ("round_robin", "total_requests", "total_tokens", "cache_aware"):
        seen: set[int] = set()
        workload = Workload(np.arange(30) * 0.002, WorkloadSpec(), recorded=requests)
        sim = Simulation(
            lambda: build_core(ARGS, 1400, 8192, config),
            FixedCost(0.005),
            workload,
            dp_size=3,
            load_balance_method=method,
            on_launch=lambda r, p, seen=seen: seen.add(r),
        )
        report = sim.run()
        assert report["successes"] == 30, method
        assert seen == {0, 1, 2}, method
        assert all(load.requests == 0 for load in sim.dispatcher.loads), method


@pytest.mark.parametrize("method", ["total_requests", "total_tokens", "cache_aware"])
def test_each_rank_is_the_dispatchers_pick_after_every_earlier_release(method: str) -> None:
    # Replicas are played out of time order (each only as far as an arrival needs), yet
    # every rank must be the one the dispatcher picks having seen exactly the releases
    # before that arrival: replay a dispatcher alone over the run's own finish times.
    config = _config()
    requests = _mixed_requests(240, seed=7)
    arrivals = np.sort(np.random.default_rng(4).uniform(0, 4.0, len(requests)))
    dep = Deployment(EngineArgs(), config, spec=HardwareSpec.load("h100"))
    sim = Simulation(
        lambda: build_core(ARGS, 3000, 8192, config),
        dep.cost_model(),
        Workload(arrivals, WorkloadSpec(), recorded=requests),
        dp_size=4,
        load_balance_method=method,
    )
    report = sim.run()
    assert report["successes"] == len(requests)
    capacities = [int(r.core.config["max_total_tokens"]) for r in sim.replicas]
    oracle = Dispatcher(4, method, capacities)
    by_finish = np.argsort(sim.finish, kind="stable")
    released = 0
    for k, (prompt, output_len) in enumerate(requests):
        while released < len(by_finish) and sim.finish[by_finish[released]] < arrivals[k]:
            oracle.release(str(by_finish[released]))
            released += 1
        rank = oracle.assign(str(k), prompt.tolist(), oracle.cost(len(prompt), output_len))
        assert rank == sim.rank[k], k
    assert set(sim.rank.tolist()) == {0, 1, 2, 3}
    # Finishes interleave with arrivals, so the picks did depend on the releases.
    assert 0 < int((sim.finish < arrivals[-1]).sum()) < len(requests)


def _in_flight_peak(sent: np.ndarray, finish: np.ndarray) -> int:
    """Most requests sent and not yet finished at any moment (a request sent at the time of
    a finish takes the place it freed)."""
    events = sorted([(t, 1) for t in sent] + [(t, -1) for t in finish])  # -1 sorts first
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_max_concurrency_holds_arrivals_client_side() -> None:
    # A burst of 40 requests on 2 replicas, with and without a cap of 6 in flight.
    config = _config()
    requests = _mixed_requests(40, seed=9)
    arrivals = np.zeros(len(requests))
    dep = Deployment(EngineArgs(), config, spec=HardwareSpec.load("h100"))
    runs = {}
    for limit in (None, 6):
        sim = Simulation(
            lambda: build_core(ARGS, 3000, 8192, config),
            dep.cost_model(),
            Workload(arrivals, WorkloadSpec(), recorded=requests),
            dp_size=2,
            load_balance_method="total_requests",
            max_concurrency=limit,
        )
        runs[limit] = (sim.run(), sim)
    (free, free_sim), (capped, sim) = runs[None], runs[6]
    assert capped["successes"] == free["successes"] == len(requests)
    assert _in_flight_peak(free_sim.sent, free_sim.finish) == len(requests)
    assert _in_flight_peak(sim.sent, sim.finish) == 6
    # The first six go at once; every later one is sent the moment a request finishes.
    assert (sim.sent[:6] == 0).all()
    assert np.isin(sim.sent[6:], sim.finish).all()
    assert (np.diff(sim.sent) >= 0).all()
    # Latencies count from sending: less queueing in the servers, a longer run.
    assert capped["mean_ttft_ms"] < free["mean_ttft_ms"]
    assert capped["mean_e2e_ms"] < free["mean_e2e_ms"]
    assert capped["duration_s"] > free["duration_s"]
    assert capped["concurrency"] <= 6 < free["concurrency"]
    # The client-side wait is sending minus arriving; of a burst at t = 0, only the first
    # six were sent by the last arrival.
    assert capped["mean_client_wait_ms"] == pytest.approx(sim.sent.mean() * 1000, abs=1e-3)
    assert capped["p99_client_wait_ms"] > capped["median_client_wait_ms"] > 0
    assert capped["keep_up_ratio"] == 6 / len(requests)
    assert "keep_up_ratio" not in free and "p99_client_wait_ms" not in free


def _random_shapes(n: int, seed: int) -> list[StepShape]:
    rng = np.random.default_rng(seed)
    return [
        StepShape(int(b), int(t), int(e), int(c), 0, float(p))
        for b, t, e, c, p in rng.integers(1, 5000, (n, 5))
    ]


def test_the_linear_fit_recovers_its_coefficients(tmp_path: Path) -> None:
    truth = LinearCost((2e-3, 1e-5, 4e-6, 3e-9, 5e-5, 2e-7))
    shapes = _random_shapes(40, 0)
    fitted = LinearCost.fit(shapes, [truth.step_seconds(s) for s in shapes], {"machine": "x"})
    assert fitted.coefficients == pytest.approx(truth.coefficients, rel=1e-6)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(fitted.to_json()))
    assert load_cost_model(path).coefficients == fitted.coefficients
    with pytest.raises(ValueError, match="6 coefficients"):
        LinearCost((2e-3, 1e-5, 4e-6, 3e-9, 5e-5))


def test_the_linear_fit_shrugs_off_a_few_slow_steps() -> None:
    # A VM's calibration: every step as the truth prices it within 1%, but one in five
    # taking twice as long (another process had the cores).
    truth = LinearCost((2e-3, 1e-5, 4e-6, 3e-9, 5e-5, 2e-7))
    shapes = _random_shapes(200, 1)
    rng = np.random.default_rng(2)
    seconds = [truth.step_seconds(s) * (1 + rng.uniform(-0.01, 0.01)) for s in shapes]
    for i in range(0, len(seconds), 5):
        seconds[i] *= 2
    fitted = LinearCost.fit(shapes, seconds)
    clean = [s for i, s in enumerate(shapes) if i % 5]
    errors = [abs(fitted.step_seconds(s) / truth.step_seconds(s) - 1) for s in clean]
    assert max(errors) < 0.015
    # Least squares (the fit's first round) prices them 6% high.
    x = np.array([s.features() for s in shapes])
    y = np.array(seconds)
    squares, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    first = LinearCost(tuple(float(max(c, 0.0)) for c in squares))
    assert np.median([first.step_seconds(s) / truth.step_seconds(s) - 1 for s in clean]) > 0.04


def test_a_linear_cost_model_saved_before_context_tokens_still_loads(tmp_path: Path) -> None:
    old = {
        "kind": "linear",
        "features": ["step", "batch_size", "new_tokens", "attention_pairs", "num_extends"],
        "coefficients": [2e-3, 1e-5, 4e-6, 3e-9, 5e-5],
        "floor_s": 1e-5,
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = load_cost_model(path)
    assert isinstance(loaded, LinearCost)
    assert loaded.coefficients == (2e-3, 1e-5, 4e-6, 3e-9, 5e-5, 0.0)
    shape = StepShape(3, 300, 2, 900, 100, 4e4)
    assert loaded.step_seconds(shape) == pytest.approx(
        2e-3 + 3 * 1e-5 + 300 * 4e-6 + 4e4 * 3e-9 + 2 * 5e-5
    )
    path.write_text(json.dumps({**old, "features": ["step", "num_extends"]}))
    with pytest.raises(ValueError, match="not a calibrated cost model"):
        load_cost_model(path)


def test_a_step_after_idle_costs_the_fitted_extra_on_top(tmp_path: Path) -> None:
    config = _config()
    prefill, decode, extra = 0.020, 0.005, 0.012
    after_idle = AfterIdle((0.1, 1.0), (0.004, extra))
    table = TableCost((1,), (16.0,), ((decode,),), LinearCost((prefill, 0, 0, 0, 0, 0)),
                      after_idle=after_idle)  # fmt: skip
    assert table.after_idle_seconds(0.0, 1.0) == 0.0
    assert table.after_idle_seconds(0.05, 1.0) == pytest.approx(0.002)  # from 0 at no idle
    assert table.after_idle_seconds(0.55, 1.0) == pytest.approx(0.008)
    assert table.after_idle_seconds(30.0, 1.0) == pytest.approx(extra)  # flat past the last
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(table.to_json()))
    loaded = load_cost_model(path)
    assert isinstance(loaded, TableCost) and loaded.after_idle == after_idle
    # A machine at another speed: every price, the extra after idle too, scaled.
    slower = table.scaled(1.5)
    shapes = [StepShape(1, 1, 0, 40, 0, 40.0), StepShape(1, 20, 1, 20, 0, 210.0)]
    for shape in shapes:
        assert slower.step_seconds(shape) == pytest.approx(1.5 * table.step_seconds(shape))
    assert slower.after_idle_seconds(0.55, 1.0) == pytest.approx(1.5 * 0.008)
    # A request alone after long idle, one after 0.1 s of idle, one while the first runs:
    # only a step planned with the device idle pays, and only its first step.
    requests = [(np.arange(10, 30), 4), (np.arange(40, 60), 3), (np.arange(70, 90), 3)]
    first_done = prefill + extra + 3 * decode
    arrivals = np.array([0.0, first_done + 0.1, first_done + 0.1 + 0.001])
    sim = Simulation(
        lambda: build_core(ARGS, 1400, 8192, config),
        table,
        Workload(arrivals, WorkloadSpec(), recorded=requests),
    )
    sim.run()
    assert sim.first_token[0] == pytest.approx(prefill + extra)
    assert sim.finish[0] == pytest.approx(first_done)
    assert sim.first_token[1] - sim.sent[1] == pytest.approx(prefill + 0.004)
    # The third came while the second's prefill ran: after its first decode, busy, no extra.
    start = sim.first_token[1] + decode
    assert sim.first_token[2] == pytest.approx(start + prefill)
    # Every later step is priced busy: a decode step, or one and the third's prefill.
    itl = np.round(np.concatenate(sim._itl), 9)
    assert set(itl.tolist()) == {decode, decode + prefill}


def test_the_extra_after_idle_is_fitted_against_requests_sent_back_to_back() -> None:
    # Prefills of 32 and 256 tokens: 30 and 90 ms right after the request before (a few ms
    # of idle), 2, 6 and 10 ms more after 0.03, 0.3 and 3 s; one at 3 s took 50 ms more (a
    # slow moment of a VM).
    idles, sizes, seconds = [], [], []
    for gap, extra in ((0.004, 0.0), (0.03, 0.002), (0.3, 0.006), (3.0, 0.010)):
        for size, busy in ((32, 0.030), (256, 0.090)):
            idles += [gap] * 3
            sizes += [size] * 3
            seconds += [busy + extra] * 3
    seconds[-1] += 0.05
    fitted = AfterIdle.fit(idles, sizes, seconds)
    assert fitted is not None
    assert fitted.gaps_s == pytest.approx((0.03, 0.3, 3.0))
    assert fitted.extra_s == pytest.approx((0.002, 0.006, 0.010))
    # Too few steps after about the same idle make no point, nor steps of a size never
    # sent back to back; a longer idle never costs less, and none costs less than nothing.
    assert AfterIdle.fit([0.004, 0.5, 0.5], [32] * 3, [0.03] * 3) is None
    assert AfterIdle.fit([0.004] * 3 + [0.5] * 3, [32] * 3 + [64] * 3, [0.03] * 6) is None
    falling = AfterIdle.fit(
        [0.004] * 3 + [0.1] * 3 + [1.0] * 3, [32] * 9, [0.03] * 3 + [0.038] * 3 + [0.033] * 3
    )
    assert falling is not None and falling.extra_s == pytest.approx((0.008, 0.008))
    below = AfterIdle.fit([0.004] * 3 + [0.1] * 3, [32] * 6, [0.03] * 3 + [0.028] * 3)
    assert below == AfterIdle((0.1,), (0.0,))


def _after_extend_table(extras: tuple[float, ...]) -> TableCost:
    """Prefills of 20 ms plus 0.1 ms a token; decode steps of 5 ms at batch 1 and 9 ms at 8
    (12 ms at 64), with a longer context a little dearer; `extras` after an extend."""
    grid = ((0.005, 0.006), (0.009, 0.010), (0.012, 0.014))
    line = LinearCost((0.020, 0, 1e-4, 0, 0, 0))
    return TableCost((1, 8, 64), (64.0, 1024.0), grid, line, after_extend=AfterExtend(extras))


def test_the_first_decode_steps_after_an_extend_cost_the_fitted_extra(tmp_path: Path) -> None:
    config = _config()
    table = _after_extend_table((0.004, 0.002, 0.001))
    decode = float(table.decode_seconds(np.array([1]), np.array([30]))[0])
    numbers = np.array([1, 3, 4, NO_EXTEND_YET])
    assert table.after_extend_seconds(numbers).tolist() == pytest.approx([0.004, 0.001, 0, 0])
    assert LinearCost((1, 0, 0, 0, 0, 0)).after_extend_seconds(numbers).tolist() == [0] * 4
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(table.to_json()))
    loaded = load_cost_model(path)
    assert isinstance(loaded, TableCost) and loaded.after_extend == table.after_extend
    # A machine at another speed: decode steps (and what they pay after an extend) by one
    # factor, prefills by another.
    slower = table.scaled(2.0, 3.0)
    prefill = StepShape(1, 20, 1, 20, 0, 210.0)
    assert slower.step_seconds(prefill) == pytest.approx(3 * table.step_seconds(prefill))
    assert slower.step_seconds(StepShape(1, 1, 0, 30, 0, 30.0)) == pytest.approx(2 * decode)
    assert slower.after_extend_seconds(numbers).tolist() == pytest.approx([0.008, 0.002, 0, 0])
    # A request alone: its first decode steps pay 4, 2 and 1 ms more, the rest none, step by
    # step and in a run of decode steps played in one core call (from the third) alike.
    for fast in (False, True):
        sim = Simulation(
            lambda: build_core(ARGS, 1400, 8192, config),
            table,
            Workload(np.zeros(1), WorkloadSpec(), recorded=[(np.arange(10, 30), 8)]),
            fast_forward=fast,
        )
        sim.run()
        itl = np.concatenate(sim._itl)
        grow = table.decode_seconds(np.ones(7), 20 + np.arange(1, 8))  # context: a token a step
        assert itl == pytest.approx(grow + np.array([0.004, 0.002, 0.001, 0, 0, 0, 0]))


@pytest.mark.parametrize("span", [0.5, 3.0])
def test_a_prefill_makes_the_decode_steps_after_it_pay_again_in_runs_and_alone(span: float) -> None:
    # Requests arriving over `span` seconds: every prefill (a new request's, or a chunk of
    # one) restarts the count of the steps after it, the same whether the decode steps are
    # played one by one or in runs.
    config = _config()
    requests = _mixed_requests(40, seed=7)
    arrivals = np.sort(np.random.default_rng(3).uniform(0, span, 40))
    extras = (0.004, 0.003, 0.002, 0.001, 0.0005)
    results = []
    for table, fast in ((extras, False), (extras, True), ((), False)):
        sim = Simulation(
            lambda: build_core(ARGS, 1400, 8192, config),
            _after_extend_table(table),
            Workload(arrivals, WorkloadSpec(), recorded=requests),
            fast_forward=fast,
        )
        report = sim.run()
        results.append((report, sim.finish.copy(), np.sort(np.concatenate(sim._itl))))
    (slow, end0, itl0), (fast_, end1, itl1), (_, end_none, _) = results
    np.testing.assert_allclose(end1, end0, rtol=1e-12)
    np.testing.assert_allclose(itl1, itl0, rtol=1e-9, atol=1e-12)
    assert fast_["steps"] == slow["steps"]
    # And the extras made the traffic take longer than without.
    assert end0.max() > end_none.max()


def test_the_table_leaves_the_first_decode_steps_after_an_extend_to_after_extend() -> None:
    # Each grid point: a prefill, then ten decode steps, the first three 6, 2 and 1 ms over
    # the steady steps. The table holds the steady steps; after_extend what the first take
    # on top (the context grows a token a step: within 0.1 ms). The points of batches 8 to
    # 64 have four decode steps each, none steady: the table takes their median, and their
    # excess over it (about none: they are in it) stays out of the fit.
    batches, contexts = [1, 2, 4, 8, 16, 32, 64], [64, 256]
    shapes, seconds = [], []
    for c in contexts:
        for b in batches:
            shapes.append(StepShape(b, b * c, b, b * c, 0, b * c * (c + 1) / 2))
            seconds.append(0.02 + 1e-5 * b * c)
            for k in range(1, 11 if b <= 4 else 5):
                shapes.append(StepShape(b, b, 0, b * (c + k), 0, float(b * (c + k))))
                seconds.append(_decode_truth(b, c + k) + (0.006, 0.002, 0.001, 0, 0)[min(k, 5) - 1])
    table = TableCost.fit(shapes, seconds, batches, contexts)
    assert table.after_extend is not None
    assert table.after_extend.extra_s == pytest.approx((0.006, 0.002, 0.001, 0, 0), abs=1e-4)
    assert table.meta is not None and table.meta["grid_points_without_steady_decodes"] == 8
    numbers = decodes_since_extend(shapes)
    steady = [s for s, n in zip(shapes, numbers, strict=True) if n > 5 and s.batch_size <= 4]
    for shape in steady:
        per_row = shape.context_tokens / shape.batch_size
        truth = _decode_truth(shape.batch_size, per_row)
        assert table.step_seconds(shape) == pytest.approx(truth, rel=0.02)
    assert table.meta["decode_fit_mean_rel_error"] < 0.02
    # Too few steps of a number give no price from there on; a later step never pays more
    # than an earlier one, and none less than nothing.
    assert AfterExtend.fit([1] * 4, [0.003] * 4) is None
    fitted = AfterExtend.fit([1] * 5 + [2] * 5 + [3] * 4, [0.003] * 5 + [0.005] * 5 + [0] * 4)
    assert fitted == AfterExtend((0.003, 0.003))
    assert AfterExtend.fit([1] * 5, [-0.001] * 5) == AfterExtend((0.0,))


def test_at_speed_a_table_scales_decode_steps_and_prefills_by_each_ones_own_speed() -> None:
    # Two runs of a cell: decode steps 10% and 20% slower than priced, prefills 10% faster
    # and 14% slower: each the median of the runs' own ratios (not a difference of medians).
    runs = [
        {"step_seconds": 2.0, "model_step_seconds": 2.0, "decode_step_seconds": 1.1,
         "model_decode_step_seconds": 1.0},
        {"step_seconds": 2.6, "model_step_seconds": 2.2, "decode_step_seconds": 1.8,
         "model_decode_step_seconds": 1.5},
    ]  # fmt: skip
    decode, extend = validate._speeds(runs)
    assert decode == pytest.approx((1.1 + 1.2) / 2)
    assert extend == pytest.approx((0.9 / 1.0 + 0.8 / 0.7) / 2)
    # A run that logged no prefills (or no decode steps) gives no split.
    only_decodes = dict(runs[0], step_seconds=1.1, model_step_seconds=1.0)
    assert validate._speeds([runs[0], only_decodes]) == (None, None)


def test_the_validation_prices_each_replicas_decode_steps_after_its_own_extends() -> None:
    # Two DP ranks' steps interleaved in one log: rank 1 decodes before any extend of its
    # own (priced steady) while rank 0's extend makes rank 0's next decodes pay.
    table = _after_extend_table((0.004, 0.001))
    prefill, decode = StepShape(1, 20, 1, 20, 0, 210.0), StepShape(1, 1, 0, 30, 0, 30.0)
    log = [(0, prefill), (1, decode), (0, decode), (1, prefill), (0, decode), (1, decode)]
    lines = [json.dumps(dataclasses.asdict(s) | {"seconds": 0.01, "dp_rank": r}) for r, s in log]
    priced = validate.price_steps(lines, table)
    d, p = table.step_seconds(decode), table.step_seconds(prefill)
    assert priced["model_decode_step_seconds"] == pytest.approx(4 * d + 0.004 + 0.001 + 0.004)
    assert priced["model_step_seconds"] == pytest.approx(2 * p + 4 * d + 0.009)


def test_the_table_corrects_its_extend_line_by_the_steps_tokens(tmp_path: Path) -> None:
    # Prefills of 64 to 2,048 tokens on a line, but those of 256 tokens 15% above it (a CPU's
    # kernels are not linear in the tokens); 4 decode steps make the table's one point.
    line = LinearCost((0.02, 0, 3e-4, 0, 0, 0))
    shapes, seconds = [], []
    for n in (64, 256, 1024, 2048):
        shape = StepShape(1, n, 1, n, 0, n * (n + 1) / 2)
        shapes += [shape] * 6
        seconds += [line.step_seconds(shape) * (1.15 if n == 256 else 1.0)] * 6
    decode = StepShape(1, 1, 0, 64, 0, 64.0)
    table = TableCost.fit([*shapes, *[decode] * 4], [*seconds, *[0.005] * 4], [1], [64])
    # The line through the other sizes (lone prompts: its features are collinear, so its
    # prices, not its coefficients), and the factor where the steps leave it.
    for n in (64, 1024, 2048):
        shape = StepShape(1, n, 1, n, 0, n * (n + 1) / 2)
        assert table.extend.step_seconds(shape) == pytest.approx(line.step_seconds(shape), rel=1e-3)
    assert table.extend_tokens == (64, 256, 1024, 2048)
    assert table.extend_factors == pytest.approx((1.0, 1.15, 1.0, 1.0), rel=1e-3)
    for shape, took in zip(shapes, seconds, strict=True):
        assert table.step_seconds(shape) == pytest.approx(took, rel=1e-3)
    # Between two points, interpolated in log2 of the tokens; flat past the ends.
    at_512 = StepShape(1, 512, 1, 512, 0, 512 * 513 / 2)
    assert table.step_seconds(at_512) == pytest.approx(1.075 * line.step_seconds(at_512), rel=1e-3)
    few = StepShape(1, 8, 1, 8, 0, 36.0)
    assert table.step_seconds(few) == pytest.approx(line.step_seconds(few), rel=1e-3)
    assert table.meta is not None and table.meta["extend_fit_max_rel_error"] < 1e-3
    # Saved and loaded with it, and scaled with the rest.
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(table.to_json()))
    assert load_cost_model(path) == table
    assert table.scaled(2.0).step_seconds(shapes[6]) == pytest.approx(2 * seconds[6], rel=1e-3)


def _decode_truth(batch: float, per_row: float) -> float:
    """A decode step's seconds that no line fits: cheap low-bit rows up to 4, a dense
    GEMM's fixed cost above, attention growing with the KV read."""
    rows = 2e-3 * batch if batch <= 4 else 2e-2 + 5e-4 * batch
    return 4e-3 + rows + 1e-6 * batch * per_row


def _calibration_steps(
    batches: list[int], contexts: list[int], prefill: LinearCost
) -> tuple[list[StepShape], list[float]]:
    """What `--calibrate` times at each grid point: a prefill of the batch's prompts, then
    four decode steps whose context grows by a token per row each."""
    shapes, seconds = [], []
    for c in contexts:
        for b in batches:
            extend = StepShape(b, b * c, b, b * c, 0, b * c * (c + 1) / 2)
            shapes.append(extend)
            seconds.append(prefill.step_seconds(extend))
            for k in range(1, 5):
                shapes.append(StepShape(b, b, 0, b * (c + k), 0, float(b * (c + k))))
                seconds.append(_decode_truth(b, c + k))
    return shapes, seconds


def test_the_calibrated_table_reads_decode_steps_off_its_grid(tmp_path: Path) -> None:
    batches, contexts = [1, 2, 4, 8, 16], [64, 256, 1024]
    prefill = LinearCost((3e-3, 1e-4, 5e-5, 2e-9, 1e-3, 0.0))
    shapes, seconds = _calibration_steps(batches, contexts, prefill)
    # Noise: the first batch-8 step at 256 timed far too fast, and every batch-16 step at
    # 64 during a lull, as fast as batch 2's.
    dip = next(i for i, s in enumerate(shapes) if s.batch_size == 8 and s.context_tokens == 8 * 257)
    seconds[dip] = 1e-4
    lull = [i for i, s in enumerate(shapes) if s.batch_size == 16 and s.context_tokens < 16 * 100]
    for i in lull:
        if not shapes[i].num_extends:
            seconds[i] = _decode_truth(2, shapes[i].context_tokens / 16)
    # A decode step between grid batches (a server decodes the first requests while the
    # others still prefill): left out.
    shapes.append(StepShape(3, 3, 0, 3 * 66, 0, 3 * 66.0))
    seconds.append(10.0)
    table = TableCost.fit(shapes, seconds, batches, contexts, {"dtype": "bfloat16"})
    assert table.batches == tuple(batches)
    assert table.contexts == pytest.approx([c + 2.5 for c in contexts])

    def decode(b: int, per_row: float) -> float:
        return float(table.decode_seconds(np.array([b]), np.array([b * per_row]))[0])

    # On the grid, the median of its steps (the one dip outvoted); the lull is lifted to
    # the smaller batch's cost.
    for b in batches:
        for c in contexts:
            truth = _decode_truth(8 if (b, c) == (16, 64) else b, c + 2.5)
            assert decode(b, c + 2.5) == pytest.approx(truth, rel=1e-9)
    # Between grid points linearly; a line through all of them is 25% off at batch 4.
    assert decode(3, 66.5) == pytest.approx(
        (_decode_truth(2, 66.5) + _decode_truth(4, 66.5)) / 2, rel=1e-9
    )
    assert decode(6, 66.5) == pytest.approx(
        (_decode_truth(4, 66.5) + _decode_truth(8, 66.5)) / 2, rel=1e-9
    )
    line = LinearCost.fit(shapes, seconds)
    assert abs(line.step_seconds(StepShape(4, 4, 0, 266, 0, 266.0)) / decode(4, 66.5) - 1) > 0.25
    # Past the grid along its last segment; below it flat.
    slope = (_decode_truth(16, 1026.5) - _decode_truth(8, 1026.5)) / 8
    assert decode(32, 1026.5) == pytest.approx(_decode_truth(16, 1026.5) + 16 * slope)
    assert decode(1, 10) == pytest.approx(_decode_truth(1, 66.5))
    # Prefills by their own linear fit.
    long_prefill = StepShape(2, 3000, 2, 3000, 500, 2.5e6)
    assert table.step_seconds(long_prefill) == pytest.approx(prefill.step_seconds(long_prefill))
    # Many decode steps at once, as one by one.
    b = np.array([1, 3, 8, 40])
    ctx = np.array([0, 3 * 700, 8 * 300, 40 * 2000])
    at_once = table.decode_seconds(b, ctx)
    one_by_one = [
        table.step_seconds(StepShape(int(x), int(x), 0, int(y), 0, float(y)))
        for x, y in zip(b, ctx, strict=True)
    ]
    assert at_once == pytest.approx(one_by_one)
    # More rows or more context never costs less, whatever the grid's noise.
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 64, 500)
    per_row = rng.uniform(0, 3000, 500)
    base = table.decode_seconds(rows, rows * per_row)
    assert (table.decode_seconds(rows + 1, (rows + 1) * per_row) >= base).all()
    assert (table.decode_seconds(rows, rows * (per_row + 50)) >= base).all()
    assert min_step_seconds(table) <= base.min()
    assert min_step_seconds(table) <= table.step_seconds(StepShape(1, 1, 1, 1, 0, 1.0))
    # Saved and loaded as the calibration wrote it; the engine's dtype sizes the pool.
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(table.to_json()))
    loaded = load_cost_model(path)
    assert loaded == table
    assert Deployment(EngineArgs(), _config(), calibrated=loaded).dtype == "bfloat16"


@pytest.mark.parametrize("server", [False, True], ids=["in-process", "through-server"])
def test_a_calibration_times_every_grid_point_and_prefills_over_a_cached_prefix(
    server: bool,
) -> None:
    # Steps of 20 ms: with instant ones, a point's first request could finish its decode
    # before a busy machine's client sent the second, leaving the point no step of both.
    engine = EngineArgs(load_format="null", chunked_prefill_size=64, null_step_ms=20.0)
    timer = calibrate.time_server_steps if server else calibrate.time_steps
    shapes, seconds, idle_steps, meta = timer(engine, [1, 2], [16, 48], idle_gaps=(0.1,))
    assert len(shapes) == len(seconds) and all(t > 0 for t in seconds)
    decodes = [s for s in shapes if not s.num_extends]
    assert {s.batch_size for s in decodes} == {1, 2}
    extends = [s for s in shapes if s.num_extends]
    # The second round of each point hits its first round's prompts in the radix cache.
    assert any(s.prefix_tokens >= s.num_extends * 10 for s in extends)
    assert any(s.prefix_tokens == 0 for s in extends)
    # Then prompts prefilled alone, up to a chunk and a half: a whole chunk, and a chunk
    # continuing a prompt over its cached first one (twice each).
    assert meta["prefill_lengths"] == [16, 32, 64, 96]
    alone = [(s.new_tokens, s.prefix_tokens) for s in extends if s.batch_size == 1]
    for length in (16, 32, 64):
        assert alone.count((length, 0)) >= 2
    assert alone.count((32, 64)) >= 2
    assert meta.get("through") == ("rsgl serve" if server else None)
    # Through a server, what a request spends outside its steps (HTTP, tokenizing, hops),
    # and prefills of requests sent alone: after the idle gap, and right after the request
    # before (the step log's idle before each).
    assert (meta.get("request_latency_s", 0) > 0) == server
    table = TableCost.fit(shapes, seconds, [1, 2], [16, 48], meta)
    assert table.batches == (1, 2) and len(table.contexts) == 2
    if not server:
        assert idle_steps == []  # in process the steps run back to back
        return
    lengths = calibrate.IDLE_PROMPT_LENS
    assert len(idle_steps) == 2 * len(lengths) * calibrate.IDLE_REPEATS
    after_gap = [step for step in idle_steps if step.idle_s >= 0.1]
    assert len(after_gap) == len(idle_steps) // 2
    assert all(step.idle_s < 0.1 for step in idle_steps if step not in after_gap)
    assert len({step.new_tokens for step in idle_steps}) == len(lengths)
    # The null executor's steps take as long after idle: next to nothing on top.
    after_idle = AfterIdle.fit(*zip(*idle_steps, strict=True))
    assert after_idle is not None and after_idle.seconds(1.0) < 0.01


def test_a_saved_calibration_keeps_its_timed_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cost.json"
    argv = ["--calibrate", "--load-format", "null", "--calibrate-grid", "1,2:16,48"]
    assert main([*argv, "--calibrate-output", str(out)]) == 0
    capsys.readouterr()
    saved = json.loads(out.read_text())
    fields = saved["sample_fields"]
    steps = [dict(zip(fields, row, strict=True)) for row in saved["samples"]]
    assert len(steps) == saved["meta"]["samples"]
    seconds = [step.pop("seconds") for step in steps]
    shapes = [StepShape(**step) for step in steps]
    # The same model refits from them, and the file still loads as that model.
    refit = TableCost.fit(shapes, seconds, [1, 2], [16, 48], saved["meta"])
    assert refit.decode_s == load_cost_model(out).decode_s
    assert refit.to_json()["extend"] == saved["extend"]
    assert saved["idle_steps"] == [] and saved["after_idle"] is None  # none in process


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--calibrate-grid", "1,x:64"),
        ("--calibrate-grid", "0,2:64"),
        ("--calibrate-idle-gaps", "0.1,soon"),
        ("--calibrate-idle-gaps", "0.1,-1"),
        ("--dp-size", "2"),  # a table prices one replica's steps
    ],
)
def test_a_bad_calibration_option_is_refused_by_name(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--calibrate", "--load-format", "null", flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_the_calibration_grid_gains_the_low_bit_switch() -> None:
    grid = [1, 2, 4, 8, 16, 32, 64]
    # On an AVX2 CPU in float32 four rows read the blocks and five the dense copy.
    assert calibrate.with_low_bit_switch(grid, 4) == [1, 2, 4, 5, 8, 16, 32, 64]
    assert calibrate.with_low_bit_switch(grid, 24) == [1, 2, 4, 8, 16, 24, 25, 32, 64]
    assert calibrate.with_low_bit_switch(grid, 32) == [1, 2, 4, 8, 16, 32, 33, 64]
    # Nothing outside the grid's range, nothing without low-bit weights.
    assert calibrate.with_low_bit_switch(grid, 64) == grid
    assert calibrate.with_low_bit_switch(grid, None) == grid


def test_a_calibration_grid_with_holes_is_refused() -> None:
    prefill = LinearCost((3e-3, 1e-4, 5e-5, 2e-9, 1e-3, 0.0))
    shapes, seconds = _calibration_steps([1, 8], [64, 256], prefill)
    keep = [
        i
        for i, s in enumerate(shapes)
        if s.num_extends or s.batch_size == 1 or s.context_tokens < 8 * 200
    ]
    with pytest.raises(ValueError, match=r"no steps at \(batch, context\) \[\(8, 256\)\]"):
        TableCost.fit([shapes[i] for i in keep], [seconds[i] for i in keep], [1, 8], [64, 256])


def test_a_calibration_skips_the_grid_points_past_its_tokens_and_times_the_rest_twice() -> None:
    passes = calibrate.grid_points([1, 8, 64], [64, 256, 1024, 2048], 8192, 2)
    first = [(1, 64), (8, 64), (64, 64), (1, 256), (8, 256), (64, 256), (1, 1024), (8, 1024)]
    first += [(1, 2048)]
    # 64 x 256 is past the tokens, but every batch keeps its two shortest contexts.
    assert passes == [first, first[::-1]]
    assert calibrate.grid_points([1], [64], 16, 3) == [[(1, 64)]] * 3


def test_the_table_prices_the_skipped_grid_points_from_their_batch() -> None:
    prefill = LinearCost((3e-3, 1e-4, 5e-5, 2e-9, 1e-3, 0.0))
    batches, contexts = [1, 8, 64], [64, 256, 1024, 2048]
    shapes, seconds = _calibration_steps(batches, contexts, prefill)
    timed = {p for grid in calibrate.grid_points(batches, contexts, 16384, 1) for p in grid}
    keep = [
        i
        for i, s in enumerate(shapes)
        if s.num_extends or (s.batch_size, _grid_context(s, contexts)) in timed
    ]
    shapes, seconds = [shapes[i] for i in keep], [seconds[i] for i in keep]
    # Without the cap the points are holes; with it, priced along their batch's last segment.
    with pytest.raises(ValueError, match=r"\(64, 1024\), \(64, 2048\)\]"):
        TableCost.fit(shapes, seconds, batches, contexts)
    table = TableCost.fit(shapes, seconds, batches, contexts, max_tokens=16384)
    assert table.contexts == pytest.approx([c + 2.5 for c in contexts])
    grid = np.array(table.decode_s)
    # Timed points: their steps' median (here, the truth at the middle step's context).
    for i, b in enumerate(batches):
        for j, c in enumerate(contexts):
            if (b, c) in timed:
                assert grid[i, j] == pytest.approx(_decode_truth(b, c + 2.5))
    # Skipped: the truth is linear in the context, so its extension is exact.
    assert grid[2, 2] == pytest.approx(_decode_truth(64, 1026.5))
    assert grid[2, 3] == pytest.approx(_decode_truth(64, 2050.5))
    # A hole that the cap does not explain is still refused.
    no_short = [i for i, s in enumerate(shapes) if s.num_extends or s.context_tokens > 64 * 100]
    with pytest.raises(ValueError, match=r"no steps at \(batch, context\) \[\(1, 64\)"):
        TableCost.fit(
            [shapes[i] for i in no_short],
            [seconds[i] for i in no_short],
            batches,
            contexts,
            None,
            16384,
        )


def _grid_context(shape: StepShape, contexts: list[int]) -> int:
    """The grid context a decode step's context per row is nearest."""
    return min(contexts, key=lambda c: abs(c - shape.context_tokens / shape.batch_size))


def test_the_roofline_prices_memory_compute_and_tensor_parallelism() -> None:
    config = _config()
    h100 = Deployment(EngineArgs(), config, spec=HardwareSpec.load("h100"))
    h200 = Deployment(EngineArgs(), config, spec=HardwareSpec.load("h200"))
    tp2 = h100.with_layout(Layout(1, 2))
    decode = StepShape(8, 8, 0, 8 * 1024, 0, 8 * 1024.0)
    prefill = StepShape(8, 8 * 2048, 8, 8 * 2048, 0, 8 * 2048 * 1024.5)
    c100, c200, ctp2 = h100.cost_model(), h200.cost_model(), tp2.cost_model()
    # Decode reads every weight: H200's bandwidth makes it faster, its FLOPs do not
    # change a compute-bound prefill.
    assert c200.step_seconds(decode) < c100.step_seconds(decode)
    assert c200.step_seconds(prefill) == pytest.approx(c100.step_seconds(prefill), rel=0.01)
    assert c100.step_seconds(prefill) > 10 * c100.step_seconds(decode)
    # Two ranks halve the weights each reads, and pay for all-reduces.
    assert ctp2.step_seconds(decode) < c100.step_seconds(decode)
    assert ctp2.step_seconds(decode) > c100.step_seconds(decode) / 2
    # The pool: 85% of the memory minus this rank's weights (16 GB of bf16 for 8B), over
    # 128 KiB per token (32 layers x 8 KV heads x 128 x K and V x 2 bytes).
    per_token = 2 * 32 * 8 * 128 * 2
    assert h100.max_total_tokens() == pytest.approx(
        (80 * 2**30 * 0.85 - 16.06e9) / per_token, rel=0.01
    )
    assert h200.max_total_tokens() == pytest.approx((141e9 * 0.85 - 16.06e9) / per_token, rel=0.01)
    # Each of two ranks holds half the KV heads and half the weights.
    assert tp2.max_total_tokens() > 2 * h100.max_total_tokens()


def test_the_capacity_search_finds_where_the_slo_breaks() -> None:
    slo = parse_slo("ttft_p99<200ms,itl_p99<0.05s")
    assert slo == [("p99_ttft_ms", 200.0), ("p99_itl_ms", 50.0)]
    with pytest.raises(ValueError, match="ttft_p42"):
        parse_slo("ttft_p42<1s")
    config = _config()
    dep = Deployment(EngineArgs(max_total_tokens=20000), config, fixed_step_s=0.02)
    spec = WorkloadSpec(num_prompts=150, random_input_len=64, random_output_len=16)
    result = find_capacity(dep, spec, slo, Layout(1, 1), duration_s=None, tolerance=0.1)
    best = result.best_rate
    assert best is not None and best > 0
    held = [p for p in result.points if slo_holds(p, slo)]
    broken = [p for p in result.points if not slo_holds(p, slo)]
    assert held and broken
    assert max(p["request_rate"] for p in held) == best
    assert min(p["request_rate"] for p in broken) > best
    # Two replicas hold more.
    two = find_capacity(dep, spec, slo, Layout(2, 1), duration_s=None, tolerance=0.1)
    assert two.best_rate is not None and two.best_rate > best


def test_under_a_concurrency_cap_the_capacity_is_where_the_client_stops_keeping_up() -> None:
    # Every step costs 20 ms whatever its batch, so without a cap TTFT stays near two steps
    # until a prefill waits behind others; with four in flight a request takes at least 16
    # steps (prefill and 15 decodes: 0.32 s), the four finish at most 12.5 req/s, and past
    # that the arrivals queue client-side while TTFT (counted from sending) stays low.
    slo = parse_slo("ttft_p99<100ms")
    config = _config()
    dep = Deployment(EngineArgs(max_total_tokens=20000), config, fixed_step_s=0.02)
    spec = WorkloadSpec(num_prompts=150, random_input_len=64, random_output_len=16)
    free = find_capacity(dep, spec, slo, Layout(1, 1), duration_s=None, tolerance=0.1)
    capped = find_capacity(
        dep, spec, slo, Layout(1, 1), duration_s=None, tolerance=0.1, max_concurrency=4
    )
    assert free.best_rate is not None and capped.best_rate is not None
    # The 5% of slack lets a rate a little above 12.5 req/s hold over 150 requests (four
    # sent at once, then one per finish: 0.95 x 150 <= 4 + 12.5 x 150 / rate).
    assert 5 < capped.best_rate < 12.5 * 150 / (MIN_KEEP_UP_RATIO * 150 - 4)
    assert free.best_rate > 100 * capped.best_rate
    assert all(p["max_concurrency"] is None and keeps_up(p) for p in free.points)
    broken = [p for p in capped.points if not slo_holds(p, slo)]
    assert broken
    for p in broken:
        # Refused for throughput alone: every request served, TTFT p99 well in the SLO.
        assert p["failures"] == 0 and p["p99_ttft_ms"] < 100
        assert p["keep_up_ratio"] < MIN_KEEP_UP_RATIO
        assert p["p99_client_wait_ms"] > 1000
    held = [p for p in capped.points if slo_holds(p, slo)]
    assert max(p["request_rate"] for p in held) == capped.best_rate
    assert all(p["max_concurrency"] == 4 for p in capped.points)


def test_a_trace_workload_replays_the_shared_trace() -> None:
    if not GSP_TRACE.is_file():
        pytest.skip(f"no trace at {GSP_TRACE} (the shared folder sits beside the repository)")
    requests, stamps = read_trace(GSP_TRACE)
    assert len(requests) == 768 and stamps is None
    spec = WorkloadSpec(dataset="trace", trace=str(GSP_TRACE))
    assert len(make_workload(spec, 5.0)) == 768


def test_generated_workloads() -> None:
    gsp = WorkloadSpec(dataset="gsp", gsp_num_groups=3, gsp_prompts_per_group=4)
    prompts = [p for p, _ in make_workload(gsp, math.inf).requests()]
    assert len(prompts) == 12
    prefixes = {tuple(p[:1024]) for p in prompts}
    assert len(prefixes) == 3
    rated = make_workload(WorkloadSpec(), 50.0, duration_s=20.0)
    assert len(rated) == 1000 and rated.arrivals[-1] == pytest.approx(20.0, rel=0.1)


def test_the_cli_prints_the_serving_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.jsonl"
    argv = ["--model-path", str(LLAMA3_8B), "--hardware", "h100", "--tp-size", "2"]
    argv += ["--dp-size", "2", "--num-prompts", "40", "--request-rate", "20"]
    assert main([*argv, "--output-file", str(out)]) == 0
    record = json.loads(out.read_text())
    for key in ("request_throughput", "p99_ttft_ms", "median_itl_ms", "p99_e2e_ms"):
        assert record[key] > 0
    assert record["cache_hit_rate"] == 0.0 and record["retractions"] == 0
    assert record["successes"] == 40 and record["events_per_s"] > 0
    assert record["max_concurrency"] is None
    assert "Serving Benchmark Result" in capsys.readouterr().err
    assert main([*argv, "--max-concurrency", "3", "--output-file", str(out)]) == 0
    capped = json.loads(out.read_text().splitlines()[-1])
    assert capped["max_concurrency"] == 3 and capped["successes"] == 40
    assert capped["concurrency"] <= 3 and capped["duration_s"] > record["duration_s"]
    assert main([*argv, "--max-concurrency", "0"]) == 2


def test_the_capacity_report_has_plots_and_tables(tmp_path: Path) -> None:
    out = tmp_path / "report"
    argv = ["--model-path", str(LLAMA3_8B), "--fixed-step-ms", "20", "--num-prompts", "60"]
    argv += ["--random-output-len", "16", "--max-total-tokens", "20000"]
    argv += ["--slo", "ttft_p99<200ms", "--layouts", "1x1,2x1", "--report-dir", str(out)]
    assert main(argv) == 0
    assert (out / "capacity.png").read_bytes().startswith(b"\x89PNG")
    page = (out / "capacity.html").read_text()
    assert "data:image/png;base64," in page and "<td>2x1</td>" in page
    record = json.loads((out / "capacity.json").read_text())
    best = {x["layout"]: x["best_rate"] for x in record["layouts"]}
    assert best["2x1"] > best["1x1"] > 0


def test_the_capacity_report_states_the_cap_and_the_keep_up_threshold(tmp_path: Path) -> None:
    out = tmp_path / "report"
    argv = ["--model-path", str(LLAMA3_8B), "--fixed-step-ms", "20", "--num-prompts", "60"]
    argv += ["--random-output-len", "16", "--max-total-tokens", "20000", "--max-concurrency"]
    argv += ["4", "--slo", "ttft_p99<100ms", "--report-dir", str(out)]
    assert main(argv) == 0
    record = json.loads((out / "capacity.json").read_text())
    assert record["max_concurrency"] == 4
    assert record["min_keep_up_ratio"] == MIN_KEEP_UP_RATIO
    [layout] = record["layouts"]
    assert all(p["max_concurrency"] == 4 for p in layout["points"])
    assert 0 < layout["best_rate"] < 20
    page = (out / "capacity.html").read_text()
    assert "at most 4 requests in flight" in page
    assert "<th>keep_up_ratio</th>" in page and "<th>p99_client_wait_ms</th>" in page
    assert (out / "capacity.png").read_bytes().startswith(b"\x89PNG")
    assert main([*argv, "--max-concurrency", "0"]) == 2


# A decode step of 4 rows over 512 tokens of KV.
DECODE = StepShape(4, 4, 0, 512, 0, 512.0)


class _ExitedServer:
    def terminate(self) -> None:
        pass

    def wait(self, timeout: float) -> int:
        return 0


def test_the_validation_runs_both_sides_under_the_same_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The real path with the server and the network taken out: the client's runs are
    # recorded instead of sent, each answered with one plausible result per request, and
    # the server's step log gets a prefill and a decode step per run.
    sent: list[serving.BenchConfig] = []
    step_log: list[Path] = []

    async def run_benchmark(
        config: serving.BenchConfig, requests: list[serving.BenchRequest]
    ) -> serving.BenchRun:
        sent.append(config)
        results = [
            serving.RequestResult(True, r.prompt_len, r.output_len, 0.05, 0.5, [0.03])
            for r in requests
        ]
        with step_log[-1].open("a") as f:
            for shape, seconds in ((StepShape(2, 40, 2, 40, 0, 420.0), 0.3), (DECODE, 0.02)):
                f.write(json.dumps(dataclasses.asdict(shape) | {"seconds": seconds}) + "\n")
        return serving.BenchRun(results, 2.0)

    def start_server(log: Path, *flags: str) -> tuple[_ExitedServer, str]:
        step_log.append(Path(flags[flags.index("--step-log") + 1]))
        return _ExitedServer(), "http://x"

    monkeypatch.setattr(serving, "run_benchmark", run_benchmark)
    monkeypatch.setattr(serving, "load_tokenizer", lambda path: WordTokenizer())
    monkeypatch.setattr(validate, "start_server", start_server)
    posts: list[str] = []
    ok = httpx.Response(200, request=httpx.Request("POST", "http://x"))
    monkeypatch.setattr("httpx.post", lambda url, **k: posts.append(url) or ok)
    cost = tmp_path / "cost.json"
    linear = LinearCost((2e-3, 1e-5, 4e-6, 3e-9, 5e-5, 0.0))
    cost.write_text(json.dumps(linear.to_json()))
    argv = ["--model-path", str(LLAMA3_8B), "--cost-model", str(cost), "--validate"]
    argv += ["--validate-scale", "0.05", "--max-total-tokens", "20000"]
    for cap, rounds in ((None, 1), (2, 2)):
        sent.clear()
        posts.clear()
        out = tmp_path / f"rows-{cap}.jsonl"
        flags = [] if cap is None else ["--max-concurrency", str(cap)]
        flags += ["--validate-rounds", str(rounds), "--output-file", str(out)]
        assert main([*argv, *flags]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(rows) == 6  # three workloads at two loads
        assert len(sent) == 6 * rounds
        assert [c.max_concurrency for c in sent] == [cap] * 6 * rounds
        # No run warms the server with its own first prompt (the simulation's cache starts
        # empty); the server is warmed once, before the first.
        assert [c.warmup_requests for c in sent] == [0] * 6 * rounds
        assert posts == ["http://x/generate"] + ["http://x/flush_cache"] * 6 * rounds
        # Round by round, every cell in turn, the order reversed every other round.
        rates = [row["rate"] for row in rows]
        assert [c.request_rate for c in sent] == (rates + rates[::-1])[: 6 * rounds]
        for row in rows:
            assert row["max_concurrency"] == row["predicted"]["max_concurrency"] == cap
            # Each load is its share of the workload's capacity, as the simulation has it
            # with every request at once; the prediction is at that rate.
            assert row["rate"] == pytest.approx(row["load"] * row["capacity"], abs=1e-3)
            assert row["predicted"]["request_rate"] == row["rate"]
            assert len(row["measured_runs"]) == row["measured"]["runs"] == rounds
            assert row["measured"]["median_ttft_ms"] == pytest.approx(50.0)
            assert row["measured"]["median_ttft_ms_spread"] == 0.0
            # Each run's logged steps, as timed and as the cost model prices them.
            measured = row["measured"]
            assert measured["step_seconds"] == pytest.approx(0.32)
            assert measured["mean_decode_batch"] == DECODE.batch_size
            assert row["predicted"]["mean_decode_batch"] >= 1
            assert measured["decode_step_seconds"] == pytest.approx(0.02)
            assert measured["model_decode_step_seconds"] == pytest.approx(
                linear.step_seconds(DECODE)
            )
            assert measured["model_step_seconds"] == pytest.approx(
                linear.step_seconds(DECODE) + linear.step_seconds(StepShape(2, 40, 2, 40, 0, 420))
            )
            # The machine's speed in the run against the calibration's, and the cell
            # simulated again at that speed.
            assert row["run_speed"] == pytest.approx(0.32 / measured["model_step_seconds"])
            assert row["predicted_at_run_speed"]["request_rate"] == row["rate"]
            if cap is not None:
                assert row["predicted"]["concurrency"] <= cap
                assert "keep_up_ratio" in row["predicted"]
        assert [row["load"] for row in rows] == [*LOADS] * 3
        assert rows[0]["capacity"] > rows[0]["rate"] > 0
        table = capsys.readouterr().out
        cap_text = "none" if cap is None else f"{cap} requests in flight"
        assert f"median of {rounds} runs" in table
        assert f"max concurrency: {cap_text}" in table
        decode_priced = linear.step_seconds(DECODE)
        assert f"decode s    {0.02:>11.3f}{'':>8}{decode_priced:>11.3f}" in table
        assert "at speed" in table
    assert main([*argv, "--validate-rounds", "0"]) == 2


def test_the_measured_medians_and_their_spread() -> None:
    runs = [
        {"output_throughput": v, "median_ttft_ms": 100.0, "median_itl_ms": 10.0 * v}
        for v in (1.0, 3.0, 2.0)
    ]
    got = median_of([dict(r, failures=0, ok=True) for r in runs])
    assert got["output_throughput"] == 2.0 and got["median_itl_ms"] == 20.0
    assert got["output_throughput_spread"] == pytest.approx(1.0)
    assert got["median_ttft_ms_spread"] == 0.0
    assert got["runs"] == 3 and "ok" not in got


def test_the_linear_fit_never_makes_a_cost_negative() -> None:
    # Noisy timings of decode steps only (batch = new tokens), where an unconstrained fit
    # trades the two collinear features against each other.
    rng = np.random.default_rng(1)
    shapes = [StepShape(b, b, 0, b * c, 0, float(b * c)) for b in (1, 8) for c in (32, 128)]
    shapes += [StepShape(1, n, 1, n, 0, n * (n + 1) / 2) for n in (32, 128)]
    seconds = [0.02 * (1 + rng.normal(0, 0.3)) for _ in shapes]
    fitted = LinearCost.fit(shapes, seconds)
    assert min(fitted.coefficients) >= 0
    long_prefill = StepShape(1, 4096, 1, 4096, 0, 4096 * 4097 / 2)
    assert fitted.step_seconds(long_prefill) >= fitted.step_seconds(shapes[0]) > 0


@pytest.mark.parametrize("method", ["round_robin", "total_tokens"])
@pytest.mark.parametrize(("pool", "span"), [(1000, 0.5), (1400, 3.0)])
def test_decode_runs_in_one_core_call_change_nothing(method: str, pool: int, span: float) -> None:
    # The same traffic step by step and with runs of decode steps played by the core in
    # one call: every request's times, every gap and every counter agree. The small pool
    # under a burst retracts; the larger one over 3 s mostly decodes.
    config = _config()
    requests = _mixed_requests(60, seed=5)
    arrivals = np.sort(np.random.default_rng(2).uniform(0, span, 60))
    dep = Deployment(EngineArgs(), config, spec=HardwareSpec.load("h100"))
    results = []
    for fast in (False, True):
        sim = Simulation(
            lambda: build_core(ARGS, pool, 8192, config),
            dep.cost_model(),
            Workload(arrivals, WorkloadSpec(), recorded=requests),
            dp_size=2,
            load_balance_method=method,
            fast_forward=fast,
        )
        report = sim.run()
        itl = np.sort(np.concatenate(sim._itl))
        results.append((report, sim.first_token.copy(), sim.finish.copy(), itl, sim.events))
    (slow, ttft0, end0, itl0, events0), (fast_, ttft1, end1, itl1, events1) = results
    assert (slow["retractions"] > 0) == (pool == 1000)
    np.testing.assert_allclose(ttft1, ttft0, rtol=1e-12)
    np.testing.assert_allclose(end1, end0, rtol=1e-12)
    np.testing.assert_allclose(itl1, itl0, rtol=1e-9, atol=1e-12)
    keys = ("steps", "retractions", "total_output_tokens", "cache_hit_rate", "p99_itl_ms")
    for key in (*keys, "mean_decode_batch"):
        assert fast_[key] == slow[key], key
    assert events1 < events0
    if pool == 1400:
        assert events1 < events0 / 2  # most decode steps were played in runs
