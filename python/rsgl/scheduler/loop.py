"""The scheduling loop: rsgl._core plans, the model runner executes, Python streams results.

One thread runs the loop; a second, the CPU "stream", executes launched steps in order (a
single-worker executor). In overlap mode (default) the loop plans and launches step N+1
before it reads step N's tokens, so Python/Rust scheduling and detokenization overlap the
torch forward (torch releases the GIL in its ops). A decode input that is not on the host
yet is a placeholder the runner resolves from its FutureMap. The core defers every free a
still-running step could observe, so the loop never has to reason about that itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rsgl._core import Plan, Scheduler
from rsgl.model_executor.model_runner import StepOutput
from rsgl.sampling_params import SamplingParams
from rsgl.scheduler.fault_injection import FaultInjector, InjectedFault
from rsgl.tokenizer.detokenizer import Decoder, IncrementalDetokenizer

logger = logging.getLogger(__name__)

# A step that raises aborts its requests and the loop goes on; this many failures in a row
# (no step succeeding in between) mean the model state is broken, and the loop stops.
MAX_CONSECUTIVE_STEP_FAILURES = 8

# An update for one request: (text delta, new token ids, finished meta_info or None).
Deliver = Callable[[str, list[int], dict[str, Any] | None], None]


class Runner(Protocol):
    """What the loop asks of a model runner (`ModelRunner`, or `NullRunner` for no math)."""

    def admit(
        self,
        req_slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None: ...

    def step(self, plan: Plan) -> StepOutput: ...


@dataclass(slots=True)
class Request:
    """What the loop needs to know of one request beyond what the core tracks."""

    rid: str
    core_id: int
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Deliver
    # None in raw-token mode: the caller detokenizes (and reports stop strings via `finish`).
    detok: IncrementalDetokenizer | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None  # first time a plan included it (queue time ends)


@dataclass(slots=True)
class _Launched:
    plan: Plan
    result: Future[StepOutput]


class StepFailed(RuntimeError):
    """Too many steps failed in a row: the loop stops (see MAX_CONSECUTIVE_STEP_FAILURES)."""


class SchedulerLoop:
    """Drives `core` and `runner`; requests and commands arrive through a queue.

    Every public method is thread-safe: it enqueues a command for the loop thread, which
    alone touches the core, the runner and request state. With a `tokenizer` the loop
    detokenizes and applies stop strings itself (the in-process Engine); without one it
    delivers token ids only and the caller reports stop strings with `finish` (the server,
    whose frontend process detokenizes). `on_step_end` runs after each step's results have
    been delivered (the server flushes one message per step there).

    Faults are isolated: a step whose execution raises aborts exactly the requests in it
    (finish_reason abort with status_code 500 and the error; their KV is released and never
    cached) and the loop serves everyone else; `step_failures` counts such steps. Only a run
    of failures with no success between them stops the loop.
    """

    def __init__(
        self,
        core: Scheduler,
        runner: Runner,
        tokenizer: Decoder | None,
        *,
        overlap: bool = True,
        on_step_end: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self.runner = runner
        self.tokenizer = tokenizer
        self.overlap = overlap
        self.on_step_end = on_step_end
        self._inbox: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._requests: dict[int, Request] = {}
        self._by_rid: dict[str, int] = {}
        self._next_core_id = 0
        self._stream = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rsgl-stream")
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.steps = 0
        self.step_failures = 0
        self._failures_in_a_row = 0
        self._faults = FaultInjector.from_env()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Starts the loop thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rsgl-loop", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Aborts what is left, stops the loop and the stream."""
        if self._thread is not None:
            self._inbox.put(self._stop)
            self._thread.join()
            self._thread = None
        self._stream.shutdown(wait=True)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs `fn` on the loop thread and returns its result."""
        if self._thread is None or self.error is not None:
            raise RuntimeError(f"the engine loop is not running: {self.error!r}")
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                done.set_exception(exc)

        self._inbox.put(run)
        return done.result(timeout)

    # ---------------------------------------------------------------- commands

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        deliver: Deliver,
        wait: bool = True,
        priority: int = 0,
    ) -> None:
        """Queues a request. With `wait`, raises ValueError (from the core) if it can never
        run; without, returns at once and reports such an error as an abort through
        `deliver` (its message starts with "invalid request:")."""

        def add() -> None:
            self._add(rid, prompt_ids, params, deliver, priority)

        if wait:
            self.call(add)
            return

        def add_or_report() -> None:
            try:
                add()
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                reason = {
                    "type": "abort",
                    "message": f"invalid request: {exc}",
                    "status_code": 400,
                    "err_type": "BadRequestError",
                }
                meta = _meta(rid, reason)
                meta["prompt_tokens"] = len(prompt_ids)
                deliver("", [], meta)

        self._inbox.put(add_or_report)

    def _add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        deliver: Deliver,
        priority: int,
    ) -> bool:
        """On the loop thread: registers a request with the core and here; False when it
        is over at once (nothing to generate)."""
        if rid in self._by_rid:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.max_new_tokens == 0:
            # Nothing to generate: the request is over before it starts (the core only
            # takes requests that generate).
            meta = _meta(rid, {"type": "length", "length": 0})
            meta["prompt_tokens"] = len(prompt_ids)
            deliver("", [], meta)
            return False
        core_id = self._next_core_id
        self.core.add_request(
            core_id,
            np.asarray(prompt_ids, dtype=np.int64),
            params.max_new_tokens,
            min_new_tokens=params.min_new_tokens,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            priority=priority,
        )
        self._next_core_id += 1
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens
            )
        self._requests[core_id] = Request(rid, core_id, prompt_ids, params, deliver, detok)
        self._by_rid[rid] = core_id
        return True

    def submit_many(
        self, requests: Sequence[tuple[str, list[int], SamplingParams, Deliver]]
    ) -> None:
        """Queues several requests in one loop command, so the next plan sees them all.
        If one is rejected, the ones already added are aborted and the error is raised."""
        added: list[str] = []

        def add_all() -> None:
            try:
                for rid, prompt_ids, params, deliver in requests:
                    if self._add(rid, prompt_ids, params, deliver, 0):
                        added.append(rid)
            except BaseException:
                for rid in added:
                    core_id = self._by_rid.pop(rid)
                    self.core.abort(core_id, "another request of the batch was rejected")
                    del self._requests[core_id]
                raise

        if requests:
            self.call(add_all)

    def post(self, fn: Callable[[], object]) -> None:
        """Runs `fn` on the loop thread soon, without waiting."""
        self._inbox.put(fn)

    def finish(self, rid: str, matched: str) -> None:
        """The caller found stop string `matched`: the request ends now, silently (the caller
        already completed it)."""

        def finish() -> None:
            core_id = self._by_rid.pop(rid, None)
            if core_id is not None:
                self.core.finish(core_id, matched)
                del self._requests[core_id]

        self._inbox.put(finish)

    def abort(self, rid: str, message: str = "aborted by the client", wait: bool = True) -> bool:
        """Aborts a request; False if it is unknown or already finished (always True without
        `wait`, which returns at once)."""

        def abort() -> bool:
            core_id = self._by_rid.get(rid)
            if core_id is None:
                return False
            status = self.core.abort(core_id, message)
            if status == "removed":
                req = self._requests[core_id]
                self._complete(req, {"type": "abort", "message": message}, cached_tokens=0)
            return status != "unknown"

        if not wait:
            self._inbox.put(abort)
            return True
        return bool(self.call(abort))

    # ---------------------------------------------------------------- the loop

    def _stop(self) -> None:
        self._stopping = True

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(block=block)
            command()
            while True:
                self._inbox.get_nowait()()
        except queue.Empty:
            pass

    def _run(self) -> None:
        launched: _Launched | None = None
        try:
            while not self._stopping:
                idle = launched is None and not self.core.has_work
                if idle:
                    # Idle: verify the bookkeeping, then block until something arrives.
                    self.core.check()
                self._drain_inbox(block=idle)
                if self._stopping:
                    break
                plan = self.core.schedule()
                nxt = None
                if plan.forward_mode != "idle":
                    admissions = self._admissions(plan)
                    fault = self._planted_fault(plan)
                    result = self._stream.submit(self._execute, plan, admissions, fault)
                    nxt = _Launched(plan, result)
                    self.steps += 1
                if launched is not None:
                    self._process(launched)
                launched = nxt
                if launched is not None and not self.overlap:
                    self._process(launched)
                    launched = None
            if launched is not None:
                self._process(launched)
            self._abort_all("the engine is shutting down", 503, "ServiceUnavailableError")
        except BaseException as exc:  # the engine reports it; requests must not hang
            logger.exception("rsgl scheduler loop failed")
            self.error = exc
            self._abort_all(f"engine error: {exc!r}", 500, "InternalServerError")

    def _admissions(self, plan: Plan) -> list[tuple[int, SamplingParams, list[int], list[int]]]:
        """Per-slot sampling state for requests that got a request slot in this plan."""
        if len(plan.admitted) == 0:
            return []
        slot_of = dict(zip(plan.rids.tolist(), plan.req_slots.tolist()))
        out = []
        for core_id in plan.admitted.tolist():
            req = self._requests[core_id]
            if req.scheduled is None:
                req.scheduled = time.perf_counter()
            out.append((slot_of[core_id], req.params, req.prompt_ids, list(req.output_ids)))
        return out

    def _planted_fault(self, plan: Plan) -> str | None:
        if self._faults is None:
            return None
        return self._faults.fault_for(self._requests[i].rid for i in plan.rids.tolist())

    def _execute(
        self,
        plan: Plan,
        admissions: list[tuple[int, SamplingParams, list[int], list[int]]],
        fault: str | None = None,
    ) -> StepOutput:
        """On the stream: admit new slots, then run the step (in launch order)."""
        for slot, params, prompt_ids, output_ids in admissions:
            self.runner.admit(slot, params, prompt_ids, output_ids)
        if fault is not None:
            raise InjectedFault(fault)
        return self.runner.step(plan)

    def _fail_step(self, plan: Plan, exc: Exception) -> None:
        """A step raised: its requests end with the error; nothing it wrote is kept."""
        self.step_failures += 1
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise StepFailed(f"{self._failures_in_a_row} steps failed in a row") from exc
        core_ids = plan.rids.tolist()
        logger.error(
            "step %d (%s, %d requests) failed; aborting its requests",
            plan.id,
            plan.forward_mode,
            len(core_ids),
            exc_info=exc,
        )
        message = f"the step running this request failed: {exc!r}"
        for core_id in core_ids:
            self.core.fail(core_id, message)
        # Every request of the plan is finished now, so the commit drops these tokens; it
        # releases (uncached) those no later in-flight step still reads.
        outcome = self.core.commit(plan.id, np.zeros(len(core_ids), dtype=np.int64))
        failed = set(core_ids)
        for f in outcome.finished:
            req = self._requests.get(f.rid)
            if req is None:
                continue
            reason = dict(f.finish_reason)
            if f.rid in failed:
                reason.update(status_code=500, err_type="InternalServerError")
            self._complete(req, reason, cached_tokens=f.cached_tokens)
        if self.on_step_end is not None:
            self.on_step_end()

    def _process(self, launched: _Launched) -> None:
        """Reads a step's tokens, commits them, streams text and finishes requests."""
        try:
            out = launched.result.result()
            # Inside the try: on a GPU, an error of the step's kernels surfaces here.
            tokens = out.next_token_ids.cpu().numpy()
        except Exception as exc:  # noqa: BLE001 - isolated: only this step's requests fail
            self._fail_step(launched.plan, exc)
            return
        self._failures_in_a_row = 0
        outcome = self.core.commit(launched.plan.id, tokens)
        index = None
        if out.sample.token_logprobs is not None:
            index = {rid: i for i, rid in enumerate(launched.plan.rids.tolist())}
        # As SGLang: the text of a request stopped by a token leaves that token out.
        stopped_by_token = {
            f.rid for f in outcome.finished if isinstance(f.finish_reason.get("matched"), int)
        }
        for core_id, token in zip(outcome.rids.tolist(), outcome.tokens.tolist()):
            req = self._requests[core_id]
            req.output_ids.append(token)
            if index is not None and req.params.return_logprob:
                req.logprobs.append(_logprob_entry(out, index[core_id], req.params, token))
            if req.detok is None:
                req.deliver("", [token], None)
                continue
            if core_id in stopped_by_token:
                continue
            delta = req.detok.add(token)
            if req.detok.matched_stop is not None:
                cached = self._cached_tokens_of(req)
                self.core.finish(core_id, req.detok.matched_stop)
                reason = {"type": "stop", "matched": req.detok.matched_stop}
                self._complete(req, reason, cached_tokens=cached, last_delta=delta, token=token)
            elif delta:
                req.deliver(delta, [token], None)
            else:
                req.deliver("", [token], None)
        for f in outcome.finished:
            done = self._requests.get(f.rid)
            if done is not None:
                self._complete(done, f.finish_reason, cached_tokens=f.cached_tokens)
        if self.on_step_end is not None:
            self.on_step_end()

    def _complete(
        self,
        req: Request,
        reason: dict[str, Any],
        cached_tokens: int | None,
        last_delta: str = "",
        token: int | None = None,
    ) -> None:
        del self._requests[req.core_id]
        self._by_rid.pop(req.rid, None)
        if cached_tokens is None:
            cached_tokens = int(self._cached_tokens_of(req))
        meta = _meta(req.rid, reason)
        meta.update(
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=cached_tokens,
            e2e_latency=time.perf_counter() - req.arrival,
            queue_time=(req.scheduled or time.perf_counter()) - req.arrival,
        )
        if req.params.return_logprob:
            meta["output_token_logprobs"] = req.logprobs
        text = last_delta + (req.detok.finish() if req.detok is not None else "")
        req.deliver(text, [] if token is None else [token], meta)

    def _cached_tokens_of(self, req: Request) -> int:
        info = self.core.request_info(req.core_id)
        return 0 if info is None else int(info.get("cached_tokens", 0))

    def _abort_all(self, message: str, status_code: int, err_type: str) -> None:
        reason: dict[str, Any] = {
            "type": "abort",
            "message": message,
            "status_code": status_code,
            "err_type": err_type,
        }
        for req in list(self._requests.values()):
            self._complete(req, dict(reason), cached_tokens=0)


def _meta(rid: str, reason: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "finish_reason": reason,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "e2e_latency": 0.0,
        "queue_time": 0.0,
    }


def _logprob_entry(out: StepOutput, i: int, params: SamplingParams, token: int) -> dict[str, Any]:
    s = out.sample
    assert s.token_logprobs is not None
    entry: dict[str, Any] = {"token_id": token, "logprob": float(s.token_logprobs[i])}
    if params.top_logprobs_num and s.top_logprob_ids is not None and s.top_logprobs is not None:
        n = params.top_logprobs_num
        entry["top_logprobs"] = [
            {"token_id": int(t), "logprob": float(lp)}
            for t, lp in zip(s.top_logprob_ids[i, :n].tolist(), s.top_logprobs[i, :n].tolist())
        ]
    if params.token_ids_logprob and s.token_ids_logprobs is not None:
        values = s.token_ids_logprobs[i, : len(params.token_ids_logprob)].tolist()
        entry["token_ids_logprob"] = [
            {"token_id": t, "logprob": float(lp)} for t, lp in zip(params.token_ids_logprob, values)
        ]
    return entry
