"""The scheduling loop: rsgl._core plans, the model runner executes, Python streams results.

One thread runs the loop; launched steps execute in order on a `StepExecutor`: a worker
thread on CPU (torch releases the GIL in its ops), CUDA streams on a GPU. In overlap mode
(default) the loop plans and launches step N+1 before it reads step N's tokens, so
Python/Rust scheduling and detokenization overlap the forward. A decode input that is not
on the host yet is a placeholder the runner resolves from its FutureMap. The core defers
every free a still-running step could observe, so the loop never has to reason about it.

The loop knows token ids, not text: after each step it emits one list of `TokenUpdate`s
(new ids and typed finishes); `rsgl.tokenizer.output_processor` makes text of them, in this
process (the Engine) or in the server's frontend process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from rsgl._core import FinishReason, Plan, Scheduler
from rsgl.errors import FatalStepError
from rsgl.model_executor.executor import LaunchedStep, StepExecutor
from rsgl.model_executor.model_runner import StepOutput
from rsgl.outputs import TokenUpdate
from rsgl.sampling_params import SamplingParams
from rsgl.scheduler.fault_injection import FaultInjector, InjectedFault

logger = logging.getLogger(__name__)

# A step that raises aborts its requests and the loop goes on; this many failures in a row
# (no step succeeding in between) mean the model state is broken, and the loop stops.
MAX_CONSECUTIVE_STEP_FAILURES = 8

# Where the loop's updates go: called on the loop thread, once per step (with every
# request that advanced or ended) and once per finish outside a step (an abort).
Emit = Callable[[list[TokenUpdate]], None]


class Runner(Protocol):
    """What the loop asks of a model runner (`ModelRunner`, or `NullRunner` for no math):
    `prepare` a plan's inputs on the device, then `execute` them (see `StepExecutor`)."""

    device: torch.device

    def admit(
        self,
        req_slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None: ...

    def prepare(self, plan: Plan) -> Any: ...

    def execute(self, prepared: Any) -> StepOutput: ...


@dataclass(slots=True)
class Request:
    """What the loop needs to know of one request beyond what the core tracks."""

    rid: str
    core_id: int
    prompt_ids: list[int]
    params: SamplingParams
    # Generated so far: a retracted request is re-admitted with them.
    output_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None  # first time a plan included it (queue time ends)


@dataclass(slots=True)
class _Launched:
    plan: Plan
    result: LaunchedStep


class StepFailed(RuntimeError):
    """Too many steps failed in a row: the loop stops (see MAX_CONSECUTIVE_STEP_FAILURES)."""


class SchedulerLoop:
    """Drives `core` and `runner`; requests and commands arrive through a queue.

    Every public method is thread-safe: it enqueues a command for the loop thread, which
    alone touches the core, the runner and request state. Results go to `emit` (see
    `Emit`); whoever detokenizes reports the stop strings it finds with `finish`.

    Faults are isolated: a step whose execution raises aborts exactly the requests in it
    (finish_reason abort with status_code 500 and the error; their KV is released and never
    cached) and the loop serves everyone else; `step_failures` counts such steps. Only a run
    of failures with no success between them stops the loop.
    """

    def __init__(
        self,
        core: Scheduler,
        runner: Runner,
        emit: Emit,
        *,
        overlap: bool = True,
        executor: StepExecutor | None = None,
    ) -> None:
        self.core = core
        self.runner = runner
        self.emit = emit
        self.overlap = overlap
        self._inbox: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._requests: dict[int, Request] = {}
        self._by_rid: dict[str, int] = {}
        self._next_core_id = 0
        self._stream = executor or StepExecutor.for_device(runner.device)
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
        self._stream.shutdown()

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
        self, rid: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Queues a request and returns at once; if the core refuses it, it ends with an
        abort (status 400, message "invalid request: ...")."""

        def add_or_report() -> None:
            try:
                self._add(rid, prompt_ids, params, priority)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                reason = FinishReason.abort(f"invalid request: {exc}", 400)
                self.emit([TokenUpdate(rid, [], finish=reason, cached_tokens=0)])

        self._inbox.put(add_or_report)

    def add_many(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> None:
        """On the loop thread (inside `call`): adds requests so the next plan sees them all.
        If one is refused (ValueError from the core), none is added and the error raises."""
        added: list[str] = []
        try:
            for rid, prompt_ids, params in requests:
                self._add(rid, prompt_ids, params, 0)
                added.append(rid)
        except BaseException:
            for rid in added:
                core_id = self._by_rid.pop(rid)
                del self._requests[core_id]
                self.core.abort(core_id, "another request of the batch was refused")
            raise

    def _add(self, rid: str, prompt_ids: list[int], params: SamplingParams, priority: int) -> None:
        """On the loop thread: registers a request with the core and here."""
        if rid in self._by_rid:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.max_new_tokens == 0:
            # Nothing to generate: over before it starts (the core only takes requests
            # that generate).
            reason = FinishReason.max_length(0)
            self.emit([TokenUpdate(rid, [], finish=reason, cached_tokens=0, queue_time=0.0)])
            return
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
        self._requests[core_id] = Request(rid, core_id, prompt_ids, params)
        self._by_rid[rid] = core_id

    def post(self, fn: Callable[[], object]) -> None:
        """Runs `fn` on the loop thread soon, without waiting."""
        self._inbox.put(fn)

    def finish(self, rid: str, matched: str) -> None:
        """Whoever detokenizes found stop string `matched`: the request ends now, silently
        (its output was completed there)."""

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
                self.emit([self._complete(req, FinishReason.abort(message), cached_tokens=0)])
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
                    result = self._stream.launch(
                        lambda p=plan: self.runner.prepare(p),  # type: ignore[misc]
                        lambda prepared, a=admissions, f=fault: self._execute(prepared, a, f),  # type: ignore[misc]
                    )
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
            self._abort_all("the engine is shutting down", 503)
        except BaseException as exc:  # the engine reports it; requests must not hang
            logger.exception("rsgl scheduler loop failed")
            self.error = exc
            self._abort_all(f"engine error: {exc!r}", 500)

    def _admissions(self, plan: Plan) -> list[tuple[int, SamplingParams, list[int], list[int]]]:
        """Per-slot sampling state for requests that got a request slot in this plan."""
        if len(plan.admitted) == 0:
            return []
        slot_of = dict(zip(plan.rids.tolist(), plan.req_slots.tolist(), strict=True))
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
        prepared: Any,
        admissions: list[tuple[int, SamplingParams, list[int], list[int]]],
        fault: str | None = None,
    ) -> StepOutput:
        """On the stream: admit new slots, then run the step (in launch order)."""
        for slot, params, prompt_ids, output_ids in admissions:
            self.runner.admit(slot, params, prompt_ids, output_ids)
        if fault is not None:
            raise InjectedFault(fault)
        return self.runner.execute(prepared)

    def _fail_step(self, plan: Plan, exc: Exception) -> None:
        """A step raised: its requests end with the error; nothing it wrote is kept. An
        error that leaves the device unusable (`is_fatal_step_error`) stops the loop at once."""
        self.step_failures += 1
        self._failures_in_a_row += 1
        if self.is_fatal_step_error(exc):
            raise StepFailed(f"step {plan.id} left the device unusable: {exc!r}") from exc
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
        updates = []
        for f in outcome.finished:
            req = self._requests.get(f.rid)
            if req is None:
                continue
            reason = FinishReason.abort(message, 500) if f.rid in failed else f.finish_reason
            updates.append(self._complete(req, reason, cached_tokens=f.cached_tokens))
        self.emit(updates)

    @staticmethod
    def is_fatal_step_error(exc: BaseException) -> bool:
        """Whether a step's error (or one it was raised from) leaves the process unusable: a
        CUDA error is sticky (a device-side assert poisons the context, and every later
        kernel fails), so serving on would only fail every step after it; a
        `FatalStepError` (a broken tensor-parallel group) says so itself."""
        seen: set[int] = set()
        cause: BaseException | None = exc
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if isinstance(cause, torch.AcceleratorError | FatalStepError):
                return True
            if isinstance(cause, RuntimeError) and any(
                mark in str(cause) for mark in ("CUDA error", "device-side assert")
            ):
                return True
            cause = cause.__cause__ or cause.__context__
        return False

    def _process(self, launched: _Launched) -> None:
        """Reads a step's tokens, commits them and emits what each request got."""
        try:
            # Inside the try: on a GPU, an error of the step's kernels surfaces here.
            out = launched.result.result()
            tokens = out.next_token_ids.numpy()
        except Exception as exc:  # noqa: BLE001 - isolated: only this step's requests fail
            self._fail_step(launched.plan, exc)
            return
        self._failures_in_a_row = 0
        outcome = self.core.commit(launched.plan.id, tokens)
        index = None
        if out.sample.token_logprobs is not None:
            index = {rid: i for i, rid in enumerate(launched.plan.rids.tolist())}
        finished = {f.rid: f for f in outcome.finished}
        updates = []
        for core_id, token in zip(outcome.rids.tolist(), outcome.tokens.tolist(), strict=True):
            req = self._requests[core_id]
            update = TokenUpdate(req.rid, [token])
            if not req.output_ids:
                update.cached_tokens = self._cached_tokens_of(req)
                update.queue_time = (req.scheduled or req.arrival) - req.arrival
            req.output_ids.append(token)
            if index is not None and req.params.return_logprob:
                update.logprobs = [_logprob_entry(out, index[core_id], req.params, token)]
            f = finished.pop(core_id, None)
            if f is not None:
                self._forget(req)
                update.finish = f.finish_reason
                update.cached_tokens = f.cached_tokens
            updates.append(update)
        for f in finished.values():  # finished without a token this step
            done = self._requests.get(f.rid)
            if done is not None:
                updates.append(self._complete(done, f.finish_reason, cached_tokens=f.cached_tokens))
        self.emit(updates)

    def _forget(self, req: Request) -> None:
        del self._requests[req.core_id]
        self._by_rid.pop(req.rid, None)

    def _complete(
        self, req: Request, reason: FinishReason, cached_tokens: int | None
    ) -> TokenUpdate:
        """Ends `req` here; returns the update that tells its caller."""
        self._forget(req)
        if cached_tokens is None:
            cached_tokens = self._cached_tokens_of(req)
        queue_time = (req.scheduled or time.perf_counter()) - req.arrival
        return TokenUpdate(
            req.rid, [], finish=reason, cached_tokens=cached_tokens, queue_time=queue_time
        )

    def _cached_tokens_of(self, req: Request) -> int:
        info = self.core.request_info(req.core_id)
        return 0 if info is None else int(info.get("cached_tokens", 0))

    def _abort_all(self, message: str, status_code: int) -> None:
        reason = FinishReason.abort(message, status_code)
        updates = [self._complete(r, reason, 0) for r in list(self._requests.values())]
        if updates:
            self.emit(updates)


def _logprob_entry(out: StepOutput, i: int, params: SamplingParams, token: int) -> dict[str, Any]:
    s = out.sample
    assert s.token_logprobs is not None
    entry: dict[str, Any] = {"token_id": token, "logprob": float(s.token_logprobs[i])}
    if params.top_logprobs_num and s.top_logprob_ids is not None and s.top_logprobs is not None:
        n = params.top_logprobs_num
        entry["top_logprobs"] = [
            {"token_id": int(t), "logprob": float(lp)}
            for t, lp in zip(
                s.top_logprob_ids[i, :n].tolist(), s.top_logprobs[i, :n].tolist(), strict=True
            )
        ]
    if params.token_ids_logprob and s.token_ids_logprobs is not None:
        values = s.token_ids_logprobs[i, : len(params.token_ids_logprob)].tolist()
        entry["token_ids_logprob"] = [
            {"token_id": t, "logprob": float(lp)}
            for t, lp in zip(params.token_ids_logprob, values, strict=True)
        ]
    return entry
