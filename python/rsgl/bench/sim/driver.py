"""The simulation: real scheduling cores on a virtual clock.

Each replica is a real `rsgl._core.Scheduler`, built as the server builds it
(`rsgl.stack.build_core`), and requests reach the replicas through the server's own
`Dispatcher`. Each replica follows `SchedulerLoop._run`'s order of calls exactly: drain the
arrivals, `schedule()`, launch; in overlap mode (the default) the next plan is made while
the previous step runs and that step is committed afterwards. Nothing is computed and
nothing sleeps: a launched step ends `cost.step_seconds(StepShape.of(plan))` after the
device is free (plus `cost.after_idle_seconds` when the device sat idle before it was
planned, as a CPU's steps after idle run slower, and `cost.after_extend_seconds` for the
first decode steps after an extend, which a CPU runs slower too), and its tokens (a
constant id: every request ignores EOS, as `rsgl bench serving` sends them) are committed
at that virtual time.
TTFT, ITL and E2E are virtual times, summarized by `rsgl bench serving`'s own report code.

Replicas only meet at the dispatcher, so each replica's own calls run in its own order and
a replica is brought forward only as far as an arrival needs: the rank the dispatcher picks
for arrival k depends on what it has released (requests finished or refused) before `t_k`,
so every replica whose next unknown release may fall before `t_k` is played up to `t_k`
first (`_settle`); the others keep playing long runs of decode steps. A replica's bound on
its next release counts commits: a request needs one commit per output token, and every
step costs at least the smallest step. With `max_concurrency` (as `rsgl bench serving
--max-concurrency`), an arrival waits client-side until fewer than that many requests are
in flight; it is sent when a release makes room, and its latencies count from then. The
report then says how long arrivals waited client-side and what share of them the client
had sent by the last arrival (`keep_up_ratio`: well below 1, the traffic outran the cap).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rsgl._core import Finished, Plan, Scheduler
from rsgl.bench.serving import summarize_arrays
from rsgl.bench.sim.cost import NO_EXTEND_YET, CostModel, min_step_seconds
from rsgl.bench.sim.workload import Workload
from rsgl.scheduler.step_shape import StepShape
from rsgl.server.dispatcher import Dispatcher

# The token every step samples; requests ignore EOS, so its value never ends one.
SAMPLED_TOKEN = 100

# Most decode steps one `decode_run` call may play (a bound on the prediction's arrays).
RUN_STEPS = 1024

# Called with (replica, plan) for every launched step (tests compare step sequences).
OnLaunch = Callable[[int, Plan], None]


@dataclass(slots=True)
class _Launched:
    """A planned step in flight: what committing and pricing it needs, and when it ends."""

    id: int
    batch_size: int
    num_extends: int
    context_tokens: int
    end: float


@dataclass(slots=True)
class _Replica:
    core: Scheduler
    pending: list[tuple[int, np.ndarray, int]] = field(default_factory=list)
    wake_at: float = math.inf  # its one scheduled wake-up (inf: none)
    commits: int = 0
    # (commits by which the request may have finished, rid): each commit gives a request at
    # most one token, so none finishes before the smallest of these (stale entries linger).
    finish_keys: list[tuple[int, int]] = field(default_factory=list)
    launched: _Launched | None = None
    nxt: _Launched | None = None
    committing: bool = False  # a wake-up at `launched.end` commits it
    asleep: bool = True
    # When its last launched step ends (-inf: none yet, so the first step follows a long idle).
    free_at: float = -math.inf
    # Its decode steps launched since its last extend step (cost.after_extend_seconds).
    decodes_since_extend: int = NO_EXTEND_YET
    steps: int = 0
    busy_s: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0


class Simulation:
    """Replicas behind a dispatcher, driven through `workload` on a virtual clock.

    `make_core()` builds one replica's core; `cost` prices each step. `run()` returns the
    report (the fields of `rsgl bench serving`'s, plus the simulation's own).
    """

    def __init__(
        self,
        make_core: Callable[[], Scheduler],
        cost: CostModel,
        workload: Workload,
        *,
        dp_size: int = 1,
        load_balance_method: str = "round_robin",
        context_length: int | None = None,
        overlap: bool = True,
        on_launch: OnLaunch | None = None,
        fast_forward: bool = True,
        max_concurrency: int | None = None,
        request_latency_s: float = 0.0,
    ) -> None:
        self.cost = cost
        if not (math.isfinite(request_latency_s) and request_latency_s >= 0):
            raise ValueError(f"request_latency_s must be >= 0, got {request_latency_s}")
        # Seconds from a request's sending to its replica's core (the server's time outside
        # its steps, `calibrate.request_latency`): its TTFT and E2E include them.
        self.request_latency_s = request_latency_s
        # Runs of decode steps in one core call (`_fast_forward`); off, every step is a
        # wake-up of its own (and `on_launch` sees every plan).
        self.fast_forward = fast_forward
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.workload = workload
        self.overlap = overlap
        self.on_launch = on_launch
        self.replicas = [_Replica(make_core()) for _ in range(dp_size)]
        capacities = [int(r.core.config["max_total_tokens"]) for r in self.replicas]
        self.dispatcher = Dispatcher(
            dp_size, load_balance_method, capacities, context_length=context_length
        )
        n = len(workload)
        # When each request was sent: its arrival, or later under max_concurrency.
        self.sent = np.asarray(workload.arrivals, dtype=np.float64).copy()
        self.rank = np.zeros(n, dtype=np.int64)
        self.prompt_lens = np.zeros(n, dtype=np.int64)
        self.first_token = np.full(n, -1.0)
        self.last_token = np.full(n, -1.0)
        self.finish = np.full(n, -1.0)
        self.output_tokens = np.zeros(n, dtype=np.int64)
        self.cached_tokens = np.zeros(n, dtype=np.int64)
        self._itl: list[np.ndarray] = []
        self._tokens = np.full(1 << 12, SAMPLED_TOKEN, dtype=np.int64)
        self._done = np.zeros(n, dtype=bool)  # finished or refused
        # Releases not yet shown to the dispatcher and the client: (virtual time, rid).
        self._releases: list[tuple[float, int]] = []
        self._in_flight = 0  # sent and not yet released (the client's count)
        # Per replica, a lower bound on the time of its next release not yet played.
        self._bound = np.full(dp_size, math.inf)
        self._min_step_s = min_step_seconds(cost)
        # Whether the send times or the ranks depend on releases (round robin's do not).
        self._coupled = max_concurrency is not None or (
            dp_size > 1 and load_balance_method != "round_robin"
        )
        self._until = math.inf  # a run stops before this: no arrival can reach it earlier
        self.events = 0
        self.refused: list[str] = []

    # ------------------------------------------------------------------ the event loop

    def run(self) -> dict[str, Any]:
        arrivals = self.workload.arrivals
        requests = self.workload.requests()
        limit = self.max_concurrency
        sent = -math.inf
        for k in range(len(arrivals)):
            prompt, output_len = next(requests)
            # The client sends in arrival order (bench_serving's semaphore is FIFO).
            t = max(float(arrivals[k]), sent)
            if self._coupled:
                self._settle(t)
            self._apply_releases(t)
            if limit is not None:
                while self._in_flight >= limit:
                    t = self._next_release(t)
            sent = t
            self._arrive(k, t, prompt, output_len)
            self.events += 1
        for r, rep in enumerate(self.replicas):
            while rep.wake_at < math.inf:
                self._process(r, math.inf)
        self._apply_releases(math.inf)
        return self.report()

    def _settle(self, t: float) -> None:
        """Plays every replica whose next release may come before `t` up to `t`: then every
        release before `t` is known."""
        bound = self._bound
        while True:
            r = int(bound.argmin())
            if bound[r] >= t:
                return
            self._process(r, t)

    def _apply_releases(self, t: float) -> None:
        """Shows the dispatcher and the client the releases before `t`."""
        releases = self._releases
        while releases and releases[0][0] < t:
            self._release(heapq.heappop(releases)[1])

    def _release(self, i: int) -> None:
        self._in_flight -= 1
        if self.dispatcher.dp_size > 1:
            self.dispatcher.release(str(i))

    def _next_release(self, t: float) -> float:
        """With every release before `t` applied: plays replicas until the earliest release
        is known, applies it and returns its time (at least `t`)."""
        bound, releases = self._bound, self._releases
        while True:
            r = int(bound.argmin())
            top = releases[0][0] if releases else math.inf
            if top <= bound[r]:
                if top == math.inf:
                    raise RuntimeError("requests in flight but no replica will release one")
                self._release(heapq.heappop(releases)[1])
                return max(top, t)
            # No request can be sent before the next release, which is no earlier than
            # this replica's bound (the smallest) nor than t.
            self._process(r, max(float(bound[r]), t))

    def _process(self, r: int, until: float) -> None:
        """Replica `r`'s next wake-up, its runs stopping before `until`."""
        rep = self.replicas[r]
        now, rep.wake_at = rep.wake_at, math.inf
        self._until = until
        self._resume(r, now)
        self.events += 1
        self._update_bound(r, rep)

    def _update_bound(self, r: int, rep: _Replica) -> None:
        """A lower bound on replica `r`'s next release: none comes before its next wake-up
        (arrivals waiting there may be refused then); after it, the request nearest its
        finish needs `n` more commits, each a step of at least the smallest step's cost."""
        wake = rep.wake_at
        keys = rep.finish_keys
        if rep.pending or wake == math.inf:
            self._bound[r] = wake
            return
        done = self._done
        while keys and done[keys[0][1]]:
            heapq.heappop(keys)
        n = keys[0][0] - rep.commits if keys else 1
        if n >= 2 and rep.nxt is not None:
            at = rep.nxt.end + (n - 2) * self._min_step_s
        else:
            at = wake + (n - 1) * self._min_step_s
        self._bound[r] = max(wake, at)

    def _wake(self, r: int, t: float) -> None:
        self.replicas[r].wake_at = t

    def _arrive(self, i: int, now: float, prompt: np.ndarray, output_len: int) -> None:
        self.prompt_lens[i] = len(prompt)
        self.sent[i] = now
        d = self.dispatcher
        r = 0 if d.dp_size == 1 else d.assign(str(i), prompt, d.cost(len(prompt), output_len))
        self.rank[i] = r
        self._in_flight += 1
        replica = self.replicas[r]
        # The replica sees it a latency later; later arrivals reach it later still.
        at = now + self.request_latency_s
        while replica.wake_at < at:
            self._process(r, at)
        room = replica.core.max_new_tokens_room(len(prompt))
        heapq.heappush(replica.finish_keys, (replica.commits + min(output_len, room), i))
        replica.pending.append((i, prompt, output_len))
        if replica.asleep:
            replica.asleep = False
            self._wake(r, at)
        self._update_bound(r, replica)

    def _resume(self, r: int, now: float) -> None:
        """Replica `r`'s loop at `now`: commit the step that ends now (if that is why it
        woke), then plan and launch until it must wait for a step to end (or sleeps)."""
        rep = self.replicas[r]
        if rep.committing:
            assert rep.launched is not None
            if self._can_fast_forward(rep):
                self._fast_forward(r, rep, now)
                return
            self._commit(rep, rep.launched, now)
            rep.launched, rep.nxt, rep.committing = rep.nxt, None, False
        self._plan(r, rep, now)

    def _plan(self, r: int, rep: _Replica, now: float) -> None:
        """The loop's planning half: drain arrivals, schedule, launch, until it waits."""
        while True:
            if rep.pending:
                self._admit(rep, now)
            if rep.launched is not None and rep.core.commit_moves_rows:
                # The real loop commits such a step before planning: wait for its end.
                rep.committing = True
                self._wake(r, rep.launched.end)
                return
            if self._launch(r, rep, rep.core.schedule(), now):
                return

    def _launch(self, r: int, rep: _Replica, plan: Plan, now: float) -> bool:
        """Launches a plan made at `now`; True when the replica now waits (for a step to
        end, or asleep), False when the loop plans again at once (overlap)."""
        nxt = None
        if plan.forward_mode != "idle":
            start = now if rep.launched is None else max(now, rep.launched.end)
            shape = StepShape.of(plan)
            seconds = self.cost.step_seconds(shape)
            if plan.num_extends:
                rep.decodes_since_extend = 0
            else:
                seconds += float(self._after_extend(rep, 1)[0])
                rep.decodes_since_extend += 1
            # Idle before it as the loop logs it: from the last step's end to this plan.
            idle = now - rep.free_at
            if idle > 0:
                seconds += self.cost.after_idle_seconds(idle, seconds)
            rep.free_at = start + seconds
            nxt = _Launched(
                plan.id, plan.batch_size, plan.num_extends, shape.context_tokens, start + seconds
            )
            rep.steps += 1
            rep.busy_s += seconds
            if plan.num_extends == 0:
                rep.decode_steps += 1
                rep.decode_rows += plan.batch_size
            if self.on_launch is not None:
                self.on_launch(r, plan)
        if rep.launched is not None:
            # Overlap: the plan just made waits while the running step ends.
            rep.nxt, rep.committing = nxt, True
            self._wake(r, rep.launched.end)
            return True
        rep.launched = nxt
        if nxt is None:
            if rep.core.has_work:
                raise RuntimeError(f"replica {r}: work left but nothing to schedule")
            rep.asleep = True
            return True
        if not self.overlap:
            rep.committing = True
            self._wake(r, nxt.end)
            return True
        return False

    # ------------------------------------------------------------------ decode runs

    def _can_fast_forward(self, rep: _Replica) -> bool:
        """Two decode steps in flight and no arrival waiting: what follows is a run of
        decode steps until something changes, which the core can play in one call."""
        nxt = rep.nxt
        return (
            self.fast_forward
            and nxt is not None
            and nxt.num_extends == 0
            and rep.launched is not None
            and rep.launched.num_extends == 0
            and not rep.pending
            and self.on_launch is None
        )

    def _fast_forward(self, r: int, rep: _Replica, now: float) -> None:
        """The wake-ups of a run of decode steps in one `decode_run` call: as many commits
        as end before the horizon (priced as if the batch never shrank, which only
        overestimates: a step never gets cheaper with more rows), then the same state the
        step-by-step path would leave."""
        a, b = rep.launched, rep.nxt
        assert a is not None and b is not None
        horizon = self._until
        if b.end >= horizon:
            max_steps = 1
        else:
            # Steps only get dearer as the context grows: the first bounds how many fit.
            batch, context = b.batch_size, b.context_tokens
            cheapest = self.cost.decode_seconds(np.array([batch]), np.array([context + batch]))
            n = RUN_STEPS
            if horizon < math.inf:
                n = min(n, int((horizon - b.end) / max(float(cheapest[0]), 1e-9)) + 1)
            grow = batch * np.arange(1, n + 1)
            costs = self.cost.decode_seconds(np.full(n, batch), context + grow)
            costs = costs + self._after_extend(rep, n)
            max_steps = 2 + int(np.searchsorted(b.end + np.cumsum(costs), horizon))
        run = rep.core.decode_run(max_steps, SAMPLED_TOKEN)
        committed, per_step, rids, finished, plan_ids, batches, contexts, other = run
        costs = self.cost.decode_seconds(batches, contexts) + self._after_extend(rep, len(batches))
        rep.decodes_since_extend += len(batches)
        ends = np.concatenate([[a.end, b.end], b.end + np.cumsum(costs)])
        rep.free_at = max(rep.free_at, float(ends[-1]))
        times = ends[:committed]
        rep.steps += len(plan_ids)
        rep.decode_steps += len(plan_ids)
        rep.decode_rows += int(batches.sum())
        rep.commits += committed
        rep.busy_s += float(costs.sum())
        if len(rids):
            last = self.last_token
            first = int(per_step[0])
            self._itl.append(times[0] - last[rids[:first]])
            self._itl.append(np.repeat(np.diff(times), per_step[1:]))
            np.maximum.at(last, rids, np.repeat(times, per_step))
        for step, f in finished:
            self._finished(f, float(times[step]))
        now = float(times[-1])
        # In flight now: what is left of [a, b, the run's plans] after `committed` commits
        # (one or two of them; only those become objects).
        flying = [
            (a, b)[j]
            if j < 2
            else _Launched(
                int(plan_ids[j - 2]), int(batches[j - 2]), 0, int(contexts[j - 2]), float(ends[j])
            )
            for j in range(committed, 2 + len(plan_ids))
        ]
        rep.launched = flying[0] if flying else None
        rep.nxt = flying[1] if len(flying) > 1 else None
        rep.committing = False
        if other is not None:
            if not self._launch(r, rep, other, now):
                self._plan(r, rep, now)
        elif rep.nxt is not None:
            rep.committing = True
            assert rep.launched is not None
            self._wake(r, rep.launched.end)
        else:
            self._plan(r, rep, now)

    def _after_extend(self, rep: _Replica, n: int) -> np.ndarray:
        """What the replica's next `n` decode steps cost on top for the extend before them."""
        return self.cost.after_extend_seconds(rep.decodes_since_extend + np.arange(1, n + 1))

    def _admit(self, rep: _Replica, now: float) -> None:
        for i, prompt, output_len in rep.pending:
            try:
                rep.core.add_request(i, prompt, output_len, ignore_eos=True)
            except ValueError as exc:
                self.refused.append(f"request {i}: {exc}")
                self._done[i] = True
                heapq.heappush(self._releases, (now, i))
        rep.pending.clear()

    def _commit(self, rep: _Replica, plan: _Launched, now: float) -> None:
        outcome = rep.core.commit(plan.id, self._tokens[: plan.batch_size])
        rep.commits += 1
        rids = outcome.rids
        if len(rids):
            last = self.last_token
            prev = last[rids]
            last[rids] = now
            if plan.num_extends == 0:  # decode rows: every request has had its first token
                self._itl.append(now - prev)
            else:
                started = prev >= 0
                self.first_token[rids[~started]] = now
                self._itl.append(now - prev[started])
        for f in outcome.finished:
            self._finished(f, now)

    def _finished(self, f: Finished, now: float) -> None:
        i = f.rid
        self.finish[i] = now
        self.output_tokens[i] = f.completion_tokens
        self.cached_tokens[i] = f.cached_tokens
        self._done[i] = True
        heapq.heappush(self._releases, (now, i))

    # ------------------------------------------------------------------ the report

    def report(self) -> dict[str, Any]:
        """`rsgl bench serving`'s summary of the virtual run, plus retractions, steps and
        each replica's pool size and busy share."""
        arrivals = self.workload.arrivals
        done = self.finish >= 0
        end = float(self.finish[done].max()) if done.any() else 0.0
        duration = end - float(arrivals[0]) if len(arrivals) else 0.0
        ok = done & (self.first_token >= 0)
        summary = summarize_arrays(
            duration,
            prompt_lens=self.prompt_lens[ok],
            output_tokens=self.output_tokens[ok],
            ttft=self.first_token[ok] - self.sent[ok],
            e2e=self.finish[ok] - self.sent[ok],
            itl=np.concatenate(self._itl) if self._itl else np.zeros(0),
            cached_tokens=self.cached_tokens[ok],
            cache_reported=np.ones(int(ok.sum()), dtype=bool),
            errors=self.refused,
        )
        stats = [r.core.stats() for r in self.replicas]
        summary["retractions"] = int(sum(s["retractions"] for s in stats))
        summary["steps"] = int(sum(r.steps for r in self.replicas))
        decode_steps = sum(r.decode_steps for r in self.replicas)
        decode_rows = sum(r.decode_rows for r in self.replicas)
        summary["mean_decode_batch"] = decode_rows / decode_steps if decode_steps else 0.0
        summary["events"] = self.events
        summary["max_total_tokens"] = int(stats[0]["capacity"]) if stats else 0
        busy = [r.busy_s / duration if duration else 0.0 for r in self.replicas]
        summary["replica_busy_mean"] = round(float(np.mean(busy)), 4) if busy else 0.0
        if self.max_concurrency is not None and len(arrivals):
            summary |= self._client_queue(np.asarray(arrivals, dtype=np.float64))
        return summary

    def _client_queue(self, arrivals: np.ndarray) -> dict[str, Any]:
        """Under `max_concurrency`: the client-side wait (arrival to sending, ms) and
        `keep_up_ratio`, the share of the requests sent by the time the last one arrived.
        The ratio is the sending throughput over the arrival window against the offered
        rate over the same window; once the cap binds, a request is sent only when one
        finishes, so it is the completion throughput too. Counting over the arrival window
        keeps the drain after the last arrival out of it."""
        wait_ms = (self.sent - arrivals) * 1000.0
        sent_in_time = int((self.sent <= arrivals[-1]).sum())
        return {
            "mean_client_wait_ms": round(float(wait_ms.mean()), 3),
            "median_client_wait_ms": round(float(np.median(wait_ms)), 3),
            "p99_client_wait_ms": round(float(np.percentile(wait_ms, 99)), 3),
            "keep_up_ratio": sent_in_time / len(arrivals),
        }
