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

import dataclasses
import json
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

from rsgl._core import Finished, FinishReason, Plan, Scheduler
from rsgl.errors import FatalStepError, InvalidRequest
from rsgl.grammar.backend import GrammarError, Matcher
from rsgl.grammar.compiler import GrammarCompiler
from rsgl.grammar.constraint import Constraint
from rsgl.grammar.reasoning_gate import ReasoningGate
from rsgl.grammar.step_mask import StepMask
from rsgl.model_executor.executor import LaunchedStep, StepExecutor
from rsgl.model_executor.model_runner import StepOutput
from rsgl.outputs import SpecCounts, TokenUpdate
from rsgl.sampling_params import SamplingParams
from rsgl.scheduler.fault_injection import FaultInjector, InjectedFault
from rsgl.scheduler.step_shape import StepShape
from rsgl.speculative.policy import DraftPolicy

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

    def execute(self, prepared: Any, *, vocab_mask: StepMask | None = None) -> StepOutput: ...


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
    # Its grammar's state, fed every committed token (None: free text).
    matcher: Matcher | None = None
    # Speculation: the verify steps that carried its drafts, those drafts, and how many of
    # them were accepted (None: the engine does not speculate).
    spec: SpecCounts | None = None


@dataclass(slots=True)
class _Compiling:
    """A constrained request waiting for its grammar, outside the core (it holds no slot)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    constraint: Constraint
    future: Future[Any]
    deadline: float
    arrival: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class _Launched:
    plan: Plan
    result: LaunchedStep
    mask: StepMask | None = None
    # The draft limit it was planned under (speculation: > 0 is the drafting way).
    draft_limit: int = 0
    # When the loop began planning it (the cost the draft policy measures runs from here,
    # or from the previous step's end when that came later: steps overlap).
    planned_at: float = 0.0


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
        grammar: GrammarCompiler | None = None,
        grammar_refusal: str = "constrained decoding is off (--grammar-backend none)",
        grammar_compile_timeout: float = 30.0,
        reasoning_end_ids: Sequence[int] | None = None,
        adaptive_drafts: bool = True,
        low_bit_rows: int | None = None,
        step_log: str | None = None,
        dp_rank: int = 0,
    ) -> None:
        self.core = core
        # --step-log: each step's shape and seconds, a JSON line each (line-buffered, so a
        # reader sees every finished step).
        self._step_log = None if step_log is None else open(step_log, "a", buffering=1)  # noqa: SIM115 - closed by shutdown
        self._dp_rank = dp_rank
        # Structured output: the compiler (None: constraints are refused with
        # `grammar_refusal`), and the requests waiting for their grammar.
        self.grammar = grammar
        self.grammar_refusal = grammar_refusal
        self.grammar_compile_timeout = grammar_compile_timeout
        # The tokens that end a reasoning (--reasoning-parser): a request that reasons first
        # (`require_reasoning`) is constrained only after them. None: no parser.
        self.reasoning_end_ids = None if reasoning_end_ids is None else tuple(reasoning_end_ids)
        self._compiling: dict[str, _Compiling] = {}
        self._constrained = 0  # requests in the core with a matcher
        self.mask_fills = 0  # steps that filled grammar masks
        self.mask_fill_seconds = 0.0  # summed over those steps
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
        self.overlapped_steps = 0  # steps launched while the one before was in flight
        # Speculation: steps that verified drafts; the request rows with drafts in them, their
        # drafts, and the tokens those rows committed (accepted drafts + one each).
        self.verify_steps = 0
        self.spec_rows = 0
        self.spec_drafts = 0
        self.spec_tokens = 0
        # Whether each step drafts, chosen from measured costs (None: not speculating).
        self.draft_policy = None
        if core.draft_limit > 0:
            self.draft_policy = DraftPolicy(
                core.draft_limit, adaptive=adaptive_drafts, low_bit_rows=low_bit_rows
            )
        self.step_failures = 0
        self._failures_in_a_row = 0
        # When the last processed step's result was ready (at first: when the loop was built).
        self._last_step_done = time.perf_counter()
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
        if self.grammar is not None:
            self.grammar.shutdown()
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None

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

    def spec_stats(self) -> dict[str, float]:
        """Speculative decoding's running totals (for /metrics and get_server_info): verify
        steps, the request rows in them that had drafts, their drafts, the tokens those
        rows committed, and the average accept length (tokens per drafted row: accepted
        drafts + 1, SGLang's `spec_accept_length`). Empty when the engine does not
        speculate."""
        if self.draft_policy is None:
            return {}
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_drafted_rows": self.spec_rows,
            "spec_draft_tokens": self.spec_drafts,
            "spec_committed_tokens": self.spec_tokens,
            "spec_accept_length": self.spec_tokens / self.spec_rows if self.spec_rows else 0.0,
            "spec_draft_limit": self.core.draft_limit,
        }

    def grammar_stats(self) -> dict[str, float]:
        """Constrained decoding's running totals (for /metrics and get_server_info): the
        requests waiting for a grammar, compiles, cache hits, failures, the seconds spent
        compiling, and the steps that filled masks and the seconds they took."""
        stats: dict[str, float] = {
            "grammar_waiting": len(self._compiling),
            "grammar_mask_fills": self.mask_fills,
            "grammar_mask_seconds": self.mask_fill_seconds,
        }
        if self.grammar is not None:
            c = self.grammar.stats
            stats["grammar_compiles"] = c.misses
            stats["grammar_cache_hits"] = c.hits
            stats["grammar_compile_failures"] = c.failures
            stats["grammar_compile_seconds"] = c.compile_seconds
        return stats

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
                if self._compiling.pop(rid, None) is not None:
                    continue
                core_id = self._by_rid[rid]
                self._forget(self._requests[core_id])
                self.core.abort(core_id, "another request of the batch was refused")
            raise

    def _add(self, rid: str, prompt_ids: list[int], params: SamplingParams, priority: int) -> None:
        """On the loop thread: registers a request with the core and here; a constrained
        one first waits for its grammar (`_grammar_ready` adds it)."""
        if rid in self._by_rid or rid in self._compiling:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.max_new_tokens == 0:
            # Nothing to generate: over before it starts (the core only takes requests
            # that generate).
            reason = FinishReason.max_length(0)
            self.emit([TokenUpdate(rid, [], finish=reason, cached_tokens=0, queue_time=0.0)])
            return
        constraint = params.constraint()
        if constraint is None:
            self._add_to_core(rid, prompt_ids, params, priority)
            return
        if self.grammar is None:
            raise InvalidRequest(f"{constraint.kind}: {self.grammar_refusal}", constraint.kind)
        if params.require_reasoning and self.reasoning_end_ids is None:
            raise InvalidRequest(
                "require_reasoning needs a --reasoning-parser (it says where the reasoning "
                f"ends and the {constraint.kind} begins)",
                "require_reasoning",
            )
        future = self.grammar.submit(constraint)
        deadline = time.monotonic() + self.grammar_compile_timeout
        self._compiling[rid] = _Compiling(
            rid, prompt_ids, params, priority, constraint, future, deadline
        )
        # Wakes the loop (it may be idle) on the compiler's thread, or at once on a hit.
        future.add_done_callback(lambda _: self._inbox.put(lambda: self._grammar_ready(rid)))

    def _add_to_core(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        matcher: Matcher | None = None,
    ) -> Request:
        core_id = self._next_core_id
        self.core.add_request(
            core_id,
            np.asarray(prompt_ids, dtype=np.int64),
            params.max_new_tokens,
            min_new_tokens=params.min_new_tokens,
            stop_token_ids=params.stop_token_ids,
            # A grammar ends with the model's EOS, which then ends the request (SGLang's
            # FINISH_MATCHED_TOKEN), ignore_eos or not; before its end the mask forbids it.
            ignore_eos=params.ignore_eos and matcher is None,
            priority=priority,
        )
        if matcher is not None:
            # Its mask of each position depends on the tokens before it: no drafts.
            self.core.disable_speculation(core_id)
        self._next_core_id += 1
        req = Request(rid, core_id, prompt_ids, params, matcher=matcher)
        if self.draft_policy is not None:
            req.spec = SpecCounts()
        self._constrained += matcher is not None
        self._requests[core_id] = req
        self._by_rid[rid] = core_id
        return req

    def _grammar_ready(self, rid: str) -> None:
        """On the loop thread: `rid`'s grammar compiled (it enters the core with a matcher
        of its own) or failed (it ends with a 400 naming the compiler's error)."""
        waiting = self._compiling.pop(rid, None)
        if waiting is None:
            return  # aborted or timed out meanwhile
        assert self.grammar is not None
        kind = waiting.constraint.kind
        try:
            matcher = self.grammar.backend.matcher(waiting.future.result())
            if waiting.params.require_reasoning:
                assert self.reasoning_end_ids is not None  # checked by `_add`
                matcher = ReasoningGate(matcher, self.reasoning_end_ids)
            req = self._add_to_core(
                rid, waiting.prompt_ids, waiting.params, waiting.priority, matcher
            )
        except GrammarError as exc:
            self._refuse(waiting, f"invalid request: {kind} does not compile: {exc}")
            return
        except ValueError as exc:  # the core refused it (as `submit` reports)
            self._refuse(waiting, f"invalid request: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
            logger.exception("the grammar backend failed for request %s", rid)
            self._refuse(waiting, f"the grammar backend failed: {exc!r}", 500)
            return
        req.arrival = waiting.arrival

    def _refuse(self, waiting: _Compiling, message: str, status_code: int | None = 400) -> None:
        reason = FinishReason.abort(message, status_code)
        queue_time = time.perf_counter() - waiting.arrival
        update = TokenUpdate(waiting.rid, [], finish=reason, cached_tokens=0, queue_time=queue_time)
        self.emit([update])

    def _expire_compiles(self) -> float | None:
        """Ends the requests whose grammar took longer than `grammar_compile_timeout` to
        compile; returns the seconds until the next deadline (None: nobody waits)."""
        if not self._compiling:
            return None
        now = time.monotonic()
        for rid, waiting in list(self._compiling.items()):
            if waiting.deadline <= now:
                del self._compiling[rid]
                timeout = self.grammar_compile_timeout
                self._refuse(
                    waiting,
                    f"invalid request: compiling its {waiting.constraint.kind} took longer "
                    f"than --grammar-compile-timeout ({timeout:g} s)",
                )
        return min((w.deadline for w in self._compiling.values()), default=now + 1) - now

    def post(self, fn: Callable[[], object]) -> None:
        """Runs `fn` on the loop thread soon, without waiting."""
        self._inbox.put(fn)

    def finish(self, rid: str, matched: str) -> None:
        """Whoever detokenizes found stop string `matched`: the request ends now, silently
        (its output was completed there)."""

        def finish() -> None:
            core_id = self._by_rid.get(rid)
            if core_id is not None:
                self.core.finish(core_id, matched)
                self._forget(self._requests[core_id])

        self._inbox.put(finish)

    def abort(self, rid: str, message: str = "aborted by the client", wait: bool = True) -> bool:
        """Aborts a request; False if it is unknown or already finished (always True without
        `wait`, which returns at once)."""

        def abort() -> bool:
            waiting = self._compiling.pop(rid, None)
            if waiting is not None:
                self._refuse(waiting, message, status_code=None)
                return True
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

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> None:
        try:
            command = self._inbox.get(block=block, timeout=timeout if block else None)
            command()
            while True:
                self._inbox.get_nowait()()
        except queue.Empty:
            pass

    def _run(self) -> None:
        launched: _Launched | None = None
        nxt: _Launched | None = None
        try:
            while not self._stopping:
                idle = launched is None and not self.core.has_work
                if idle:
                    # Idle: verify the bookkeeping, then block until something arrives
                    # (or a grammar's compile deadline passes).
                    self.core.check()
                self._drain_inbox(block=idle, timeout=self._expire_compiles())
                if self._stopping:
                    break
                planned_at, limit = time.perf_counter(), 0
                if self.draft_policy is not None:
                    limit = self.draft_policy.draft_limit()
                    self.core.set_draft_limit(limit)
                    if launched is not None and (limit > 0 or launched.plan.draft_lens.any()):
                        # Drafting reads each request's newest token, and a verify step's
                        # accepted counts decide where the next tokens go: the step in
                        # flight ends first. Steps without drafts overlap as usual.
                        self._process(launched)
                        launched = None
                if launched is not None and self.core.commit_moves_rows:
                    # Its commit swaps a request's duplicate prompt KV for the tree's copy
                    # (Scheduler::commit_moves_rows): the next step must read the copy, as
                    # it does without overlap.
                    self._process(launched)
                    launched = None
                    continue
                plan = self.core.schedule()
                nxt = None
                if plan.forward_mode != "idle":
                    admissions = self._admissions(plan)
                    fault = self._planted_fault(plan)
                    mask = self._step_mask(plan)
                    result = self._stream.launch(
                        lambda p=plan: self.runner.prepare(p),  # type: ignore[misc]
                        lambda prepared, a=admissions, f=fault, m=mask: self._execute(  # type: ignore[misc]
                            prepared, a, f, m
                        ),
                    )
                    nxt = _Launched(plan, result, mask, limit, planned_at)
                    self.steps += 1
                    self.overlapped_steps += launched is not None
                if launched is not None:
                    self._process(launched)
                if nxt is not None and nxt.mask is not None:
                    # Every token the new step's grammar rows depend on is accepted now
                    # (the step before it was just processed); its forward runs meanwhile.
                    self._fill_mask(nxt)
                launched, nxt = nxt, None
                if launched is not None and not self.overlap:
                    self._process(launched)
                    launched = None
            if launched is not None:
                self._process(launched)
            self._abort_all("the engine is shutting down", 503)
        except BaseException as exc:  # the engine reports it; requests must not hang
            logger.exception("rsgl scheduler loop failed")
            self.error = exc
            for step in (launched, nxt):
                if step is not None and step.mask is not None:
                    step.mask.release()  # its sampler must not wait for a mask forever
            self._abort_all(f"engine error: {exc!r}", 500)

    def _step_mask(self, plan: Plan) -> StepMask | None:
        """A mask for the plan's rows whose requests have a grammar that may apply by then
        (None when none has). At most one step, the one before, is still in flight."""
        if not self._constrained:
            return None
        requests = self._requests
        rows = [
            i
            for i, core_id in enumerate(plan.rids.tolist())
            if (req := requests.get(core_id)) is not None
            and req.matcher is not None
            and req.matcher.may_mask_after_one()
        ]
        if not rows:
            return None
        assert self.grammar is not None
        return StepMask(np.asarray(rows, dtype=np.int64), self.grammar.backend.words)

    def _fill_mask(self, step: _Launched) -> None:
        assert step.mask is not None and self.grammar is not None
        rids = step.plan.rids
        matchers = []
        for row in step.mask.rows.tolist():
            req = self._requests.get(int(rids[row]))
            matcher = None if req is None else req.matcher
            matchers.append(None if matcher is None else matcher.masking())
        step.mask.fill(self.grammar.backend, matchers)
        self.mask_fills += 1
        self.mask_fill_seconds += step.mask.fill_seconds

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
        mask: StepMask | None = None,
    ) -> StepOutput:
        """On the stream: admit new slots, then run the step (in launch order)."""
        for slot, params, prompt_ids, output_ids in admissions:
            self.runner.admit(slot, params, prompt_ids, output_ids)
        if fault is not None:
            raise InjectedFault(fault)
        if mask is None:
            return self.runner.execute(prepared)
        return self.runner.execute(prepared, vocab_mask=mask)

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
            self._last_step_done = time.perf_counter()
            self._fail_step(launched.plan, exc)
            return
        done_at, previous_done = time.perf_counter(), self._last_step_done
        self._last_step_done = done_at
        self._failures_in_a_row = 0
        accept_lens = None
        if out.accept_lens is None:
            outcome = self.core.commit(launched.plan.id, tokens)
        else:  # a verify step: each request's accepted drafts and its next token
            accept_lens = out.accept_lens.numpy()
            outcome = self.core.commit_spec(launched.plan.id, tokens, accept_lens)
            self._count_drafts(launched.plan, accept_lens)
        plan = launched.plan
        # The step's own time: from when it was planned, or from when the step before it
        # finished if that was later (overlapped, it ran after that one).
        seconds = done_at - max(launched.planned_at, previous_done)
        if self.draft_policy is not None and plan.forward_mode == "decode":
            self.draft_policy.observe(
                len(plan.rids),
                limit=launched.draft_limit,
                seconds=seconds,
                accepted=None if accept_lens is None else (accept_lens - 1).tolist(),
                shadow=self.core.take_shadow_accepts(),
            )
        if self._step_log is not None:
            record = dataclasses.asdict(StepShape.of(plan))
            # How long the device sat idle before this step (0 when it was planned while
            # the step before it ran): a CPU runs a step after idle slower.
            idle = max(0.0, launched.planned_at - previous_done)
            record |= {"dp_rank": self._dp_rank, "seconds": seconds, "idle_s": idle}
            if self.draft_policy is not None:  # what the step's verify planned and accepted
                record["draft_limit"] = launched.draft_limit
                record["accepted_drafts"] = (
                    0 if accept_lens is None else int(accept_lens.sum()) - len(accept_lens)
                )
            self._step_log.write(json.dumps(record) + "\n")
        # Output row of each request's next token (one row per token of a verify step).
        index = None
        if out.sample.token_logprobs is not None:
            firsts = np.arange(len(tokens)) if out.accept_lens is None else None
            if firsts is None:
                lens = out.accept_lens.numpy()  # type: ignore[union-attr]
                firsts = np.cumsum(lens) - lens
            index = dict(zip(launched.plan.rids.tolist(), firsts.tolist(), strict=True))
        finished = {f.rid: f for f in outcome.finished}
        updates: list[TokenUpdate] = []
        rejected: list[Request] = []
        # A request's tokens are adjacent (several after a verify step): one update each.
        update: TokenUpdate | None = None
        req: Request | None = None
        for core_id, token in zip(outcome.rids.tolist(), outcome.tokens.tolist(), strict=True):
            if req is None or req.core_id != core_id:
                self._end_update(req, update, finished, updates)
                req = self._requests[core_id]
                update = TokenUpdate(req.rid, [])
                if not req.output_ids:
                    update.cached_tokens = self._cached_tokens_of(req)
                    update.queue_time = (req.scheduled or req.arrival) - req.arrival
            assert update is not None
            if req.matcher is not None and not req.matcher.accept(token):
                rejected.append(req)
                req.matcher = None  # unusable now; its later rows go unmasked, then dropped
                self._constrained -= 1
            update.token_ids.append(token)
            req.output_ids.append(token)
            if index is not None and req.params.return_logprob:
                entry = _logprob_entry(out, index[core_id], req.params, token)
                update.logprobs = [*(update.logprobs or []), entry]
            if index is not None:
                index[core_id] += 1
        self._end_update(req, update, finished, updates)
        for f in finished.values():  # finished without a token this step
            done = self._requests.get(f.rid)
            if done is not None:
                updates.append(self._complete(done, f.finish_reason, cached_tokens=f.cached_tokens))
        for req in rejected:
            # The mask allows only what the grammar accepts, so this is a backend fault:
            # the request ends (its KV is released by the core), nobody else's does.
            if req.core_id not in self._requests:
                continue
            message = f"the grammar rejected token {req.output_ids[-1]}"
            logger.error("request %s: %s", req.rid, message)
            if self.core.abort(req.core_id, message) == "removed":
                updates.append(self._complete(req, FinishReason.abort(message, 500), None))
        self.emit(updates)

    def _count_drafts(self, plan: Plan, accept_lens: np.ndarray) -> None:
        """A verify step's totals, and each drafting request's own (for its meta_info)."""
        draft_lens = plan.draft_lens
        drafted = draft_lens > 0
        self.verify_steps += 1
        self.spec_rows += int(drafted.sum())
        self.spec_drafts += int(draft_lens.sum())
        self.spec_tokens += int(accept_lens[drafted].sum())
        for row in np.flatnonzero(drafted).tolist():
            req = self._requests.get(int(plan.rids[row]))
            if req is not None and req.spec is not None:
                req.spec.add(int(draft_lens[row]), int(accept_lens[row]) - 1)

    def _end_update(
        self,
        req: Request | None,
        update: TokenUpdate | None,
        finished: dict[int, Finished],
        updates: list[TokenUpdate],
    ) -> None:
        """Closes `req`'s update of this step: with its finish if the commit ended it."""
        if req is None or update is None:
            return
        if req.spec is not None:
            update.spec = req.spec.to_tuple()
        f = finished.pop(req.core_id, None)
        if f is not None:
            self._forget(req)
            update.finish = f.finish_reason
            update.cached_tokens = f.cached_tokens
        updates.append(update)

    def _forget(self, req: Request) -> None:
        self._constrained -= req.matcher is not None
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
        spec = None if req.spec is None else req.spec.to_tuple()
        return TokenUpdate(
            req.rid,
            [],
            finish=reason,
            cached_tokens=cached_tokens,
            queue_time=queue_time,
            spec=spec,
        )

    def _cached_tokens_of(self, req: Request) -> int:
        info = self.core.request_info(req.core_id)
        return 0 if info is None else int(info.get("cached_tokens", 0))

    def _abort_all(self, message: str, status_code: int) -> None:
        reason = FinishReason.abort(message, status_code)
        updates = [self._complete(r, reason, 0) for r in list(self._requests.values())]
        if updates:
            self.emit(updates)
        for waiting in list(self._compiling.values()):
            self._refuse(waiting, message, status_code)
        self._compiling.clear()


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
