"""The frontend's side of the engine: tokenized requests out, token ids in, text to clients.

It runs in the HTTP process's event loop. Requests go to the scheduler process over ZeroMQ;
each step's token ids come back in one message, are detokenized here (stop strings found
here are reported back so the scheduler stops the request), and reach each request's
asyncio queue. Latency metrics are measured here, where the client sees them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from rsgl.sampling_params import SamplingParams
from rsgl.server import ipc
from rsgl.server.metrics import ServerMetrics
from rsgl.tokenizer.detokenizer import Decoder, IncrementalDetokenizer

logger = logging.getLogger("rsgl.server")

STATS_LOG_INTERVAL_S = 10.0
FLUSH_TIMEOUT_S = 30.0
# How often deadlines and stalled streams are looked at.
TIMER_INTERVAL_S = 0.25
# Updates a streaming request may have waiting for its client before the stall clock starts.
STREAM_BACKLOG_LIMIT = 64


@dataclass(slots=True)
class Update:
    """New text and token ids of one request; `meta` (SGLang's meta_info) when it is over."""

    text: str
    token_ids: list[int]
    meta: dict[str, Any] | None = None


@dataclass(slots=True)
class ReqState:
    """A request the frontend is waiting on."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    # The client's request id (several choices of one request share it).
    group: str
    queue: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    completion_tokens: int = 0
    # When the server gives up on it (--request-timeout-s).
    deadline: float | None = None
    # The HTTP response streaming it, and since when its client has not kept up.
    stream_task: asyncio.Task[Any] | None = None
    stalled_since: float | None = None


class EngineUnavailable(RuntimeError):
    """The scheduler process is gone or the queue is full (HTTP 503)."""


class Frontend:
    """Submits requests to the scheduler process and routes its outputs back."""

    def __init__(
        self,
        tokenizer: Decoder,
        info: dict[str, Any],
        metrics: ServerMetrics,
        commands: zmq.asyncio.Socket,
        events: zmq.asyncio.Socket,
        *,
        max_queued_requests: int | None = None,
        log_requests: bool = False,
        request_timeout_s: float | None = None,
        stream_stall_timeout_s: float = 30.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics
        self.commands = commands
        self.events = events
        self.max_queued_requests = max_queued_requests
        self.log_requests = log_requests
        self.request_timeout_s = request_timeout_s
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.pending: dict[str, ReqState] = {}
        self._groups: dict[str, set[str]] = {}  # client request id -> pending choice ids
        self.stats: dict[str, Any] = {}
        self.healthy = True
        # Set by a graceful shutdown: new requests are refused, running ones finish.
        self.draining = False
        self._flushes: dict[int, asyncio.Future[bool]] = {}
        self._tokens = itertools.count()
        self._last_log = time.perf_counter()
        self._last_generated = 0

    # ------------------------------------------------------------------ requests

    async def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        group: str | None = None,
    ) -> ReqState:
        """Sends a request; raises EngineUnavailable when unhealthy or the queue is full.
        `group` is the client's request id when `rid` is one choice of several."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not healthy")
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if self.max_queued_requests is not None:
            waiting = sum(1 for s in self.pending.values() if s.last_token is None)
            if waiting >= self.max_queued_requests:
                raise EngineUnavailable(
                    f"too many queued requests ({waiting}); the limit is {self.max_queued_requests}"
                )
        if rid in self.pending:
            raise ValueError(f"request id {rid!r} is already in use")
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens
        )
        wire = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
        # Encoded before the request is registered: if that fails, nothing is left behind.
        message = ipc.encoder.encode(ipc.AddRequest(rid, prompt_ids, wire, priority))
        state = ReqState(rid, prompt_ids, params, detok, group or rid)
        if self.request_timeout_s is not None:
            state.deadline = state.created + self.request_timeout_s
        self.pending[rid] = state
        self._groups.setdefault(state.group, set()).add(rid)
        self.commands.send(message)
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s", rid, len(prompt_ids), wire)
        return state

    async def updates(self, state: ReqState) -> AsyncIterator[Update]:
        """A request's updates until it finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            while True:
                update = await state.queue.get()
                yield update
                if update.meta is not None:
                    finished = True
                    return
        finally:
            # Synchronous on purpose: this also runs while the consumer is being cancelled.
            if not finished:
                self.abort(state.rid, "the client disconnected")

    def watch_stream(self, states: list[ReqState]) -> None:
        """The current task streams these requests to a client: if that client stops
        reading, the requests are aborted and the task cancelled (which closes the
        connection) after the stall timeout."""
        task = asyncio.current_task()
        for state in states:
            state.stream_task = task

    def abort(
        self,
        rid: str,
        message: str = "aborted by the client",
        status_code: int | None = None,
        err_type: str | None = None,
    ) -> bool:
        """Aborts a pending request; it finishes with finish_reason abort. A `status_code`
        marks an abort the server decided (a timeout): the client gets it as an error."""
        state = self.pending.pop(rid, None)
        if state is None:
            return False
        self._send(ipc.AbortRequest(rid, message))
        reason: dict[str, Any] = {"type": "abort", "message": message}
        if status_code is not None:
            reason.update(status_code=status_code, err_type=err_type)
        meta = self._meta(state, reason)
        self._finish(state, Update(self._rest_of_text(state), [], meta))
        return True

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown: refuse new requests, wait up to `timeout_s` for the pending
        ones to finish, then abort what is left."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        logger.info("draining %d requests (at most %.0f s)", len(self.pending), timeout_s)
        while self.pending and loop.time() < deadline:
            await asyncio.sleep(TIMER_INTERVAL_S)
        if self.pending:
            logger.info("aborting %d requests still running", len(self.pending))
        self.abort_all("the server is shutting down")

    async def run_timers(self) -> None:
        """Aborts requests past their deadline and streams whose client stopped reading."""
        while True:
            await asyncio.sleep(TIMER_INTERVAL_S)
            self.expire(time.perf_counter())

    def expire(self, now: float) -> None:
        """One pass of `run_timers` at time `now`."""
        for rid, state in list(self.pending.items()):
            if state.deadline is not None and now > state.deadline:
                message = (
                    f"the request ran longer than the server's limit of {self.request_timeout_s} s"
                )
                self.abort(rid, message, 504, "TimeoutError")
            elif (
                state.stalled_since is not None
                and now - state.stalled_since > self.stream_stall_timeout_s
            ):
                logger.warning("request %s: its client stopped reading; aborting it", rid)
                self.abort(rid, "the client stopped reading the stream", 408, "TimeoutError")
                if state.stream_task is not None:
                    state.stream_task.cancel()

    async def flush_cache(self) -> bool:
        """Empties the scheduler's prefix cache; False while requests run. Raises
        EngineUnavailable if the scheduler does not answer within FLUSH_TIMEOUT_S."""
        token = next(self._tokens)
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._flushes[token] = done
        self._send(ipc.FlushCache(token))
        try:
            return await asyncio.wait_for(done, timeout=FLUSH_TIMEOUT_S)
        except TimeoutError:
            raise EngineUnavailable(
                f"the scheduler did not answer the cache flush within {FLUSH_TIMEOUT_S:.0f} s"
            ) from None
        finally:
            self._flushes.pop(token, None)

    def abort_all(self, message: str) -> None:
        """Ends every pending request (shutdown or a dead scheduler): clients get a 503."""
        for rid in list(self.pending):
            self.abort(rid, message, 503, "ServiceUnavailableError")

    def _rest_of_text(self, state: ReqState) -> str:
        """The held-back tail of a request's text; "" if the detokenizer itself fails (an
        error path must not fail the same way again)."""
        try:
            return state.detok.finish()
        except Exception:
            logger.exception("request %s: the end of its text could not be decoded", state.rid)
            return ""

    def _send(self, command: ipc.Command) -> None:
        # PUSH to a connected peer below its high-water mark sends at once; not awaiting the
        # returned future keeps aborts possible from code that is being cancelled.
        self.commands.send(ipc.encoder.encode(command))

    # ------------------------------------------------------------------ events

    async def run_events(self) -> None:
        """Reads the scheduler's events forever."""
        while True:
            event = ipc.event_decoder.decode(await self.events.recv())
            if isinstance(event, ipc.StepOutputs):
                now = time.perf_counter()
                for out in event.outputs:
                    try:
                        self._on_output(out, now)
                    except Exception:  # one request's failure stays its own
                        logger.exception("request %s: its output could not be processed", out.rid)
                        self.abort(
                            out.rid,
                            "internal error processing the output",
                            500,
                            "InternalServerError",
                        )
            elif isinstance(event, ipc.Stats):
                self.stats = event.stats
                self.metrics.observe_stats(event.stats)
                self._maybe_log()
            elif isinstance(event, ipc.FlushResult):
                future = self._flushes.pop(event.token, None)
                if future is not None and not future.done():
                    future.set_result(event.ok)

    def _on_output(self, out: ipc.RequestOutput, now: float) -> None:
        state = self.pending.get(out.rid)
        if state is None:
            return  # finished or aborted here already
        ids = out.token_ids
        meta = out.meta
        m = self.metrics.model
        if ids:
            if state.last_token is None:
                self.metrics.ttft.labels(m).observe(now - state.created)
            else:
                self.metrics.itl.labels(m).observe(now - state.last_token)
            state.last_token = now
            state.completion_tokens += len(ids)
            self.metrics.generation_tokens.labels(m).inc(len(ids))
        # As SGLang: a request stopped by a token leaves that token's text out.
        text_ids = ids
        if meta is not None and isinstance(meta["finish_reason"].get("matched"), int) and ids:
            text_ids = ids[:-1]
        text = []
        for i, token in enumerate(text_ids):
            text.append(state.detok.add(token))
            if state.detok.matched_stop is not None:
                matched = state.detok.matched_stop
                self._send(ipc.FinishRequest(out.rid, matched))
                state.completion_tokens -= len(ids) - (i + 1)
                del self.pending[out.rid]
                meta = self._meta(state, {"type": "stop", "matched": matched})
                self._finish(state, Update("".join(text), ids[: i + 1], meta))
                return
        if meta is not None:
            del self.pending[out.rid]
            text.append(self._rest_of_text(state))
            self._finish(state, Update("".join(text), ids, meta))
        else:
            state.queue.put_nowait(Update("".join(text), ids))
            if state.stream_task is not None and state.queue.qsize() > STREAM_BACKLOG_LIMIT:
                if state.stalled_since is None:
                    state.stalled_since = now
            else:
                state.stalled_since = None

    def _meta(self, state: ReqState, reason: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": state.rid,
            "finish_reason": reason,
            "prompt_tokens": len(state.prompt_ids),
            "completion_tokens": state.completion_tokens,
            "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - state.created,
        }

    def abort_group(self, group: str) -> bool:
        """Aborts every pending choice of the client's request `group`."""
        rids = list(self._groups.get(group, ()))
        return sum(self.abort(rid) for rid in rids) > 0

    def _finish(self, state: ReqState, update: Update) -> None:
        meta = update.meta
        assert meta is not None
        members = self._groups.get(state.group)
        if members is not None:
            members.discard(state.rid)
            if not members:
                del self._groups[state.group]
        aborted = meta["finish_reason"]["type"] == "abort"
        self.metrics.observe_finish(meta, aborted)
        if self.log_requests:
            logger.info("finish %s: %s", state.rid, meta)
        state.queue.put_nowait(update)

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log < STATS_LOG_INTERVAL_S:
            return
        s = self.stats
        generated = int(s.get("generated_tokens", 0))
        rate = (generated - self._last_generated) / (now - self._last_log)
        self._last_log, self._last_generated = now, generated
        capacity = max(1, int(s.get("capacity", 1)))
        used = 1 - (s.get("available", 0) + s.get("evictable", 0)) / capacity
        prompt = s.get("prompt_tokens", 0)
        hit = s.get("cached_tokens", 0) / prompt if prompt else 0.0
        logger.info(
            "gen throughput %.1f tok/s, running %d, queued %d, KV usage %.1f%%, cache hit %.1f%%",
            rate,
            s.get("running", 0),
            s.get("waiting", 0),
            100 * used,
            100 * hit,
        )
