"""The frontend's side of the engine: tokenized requests out, token ids in, text to clients.

It runs in the HTTP process's event loop. Requests go to the scheduler process over ZeroMQ;
each step's `TokenUpdate`s come back in one message and go through the same
`OutputProcessor` the in-process Engine uses (stop strings found there are reported back so
the scheduler stops the request), to each request's `OutputQueue`. Latency metrics are
measured here, where the client sees them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from rsgl._core import FinishReason
from rsgl.outputs import Output
from rsgl.sampling_params import SamplingParams
from rsgl.server import ipc
from rsgl.server.metrics import ServerMetrics
from rsgl.tokenizer.detokenizer import Decoder
from rsgl.tokenizer.output_processor import OutputProcessor, OutputQueue, RequestRecord

logger = logging.getLogger("rsgl.server")

STATS_LOG_INTERVAL_S = 10.0
FLUSH_TIMEOUT_S = 30.0
# How often deadlines and stalled streams are looked at.
TIMER_INTERVAL_S = 0.25
# Updates a streaming request may have waiting for its client before the stall clock starts.
# Below OutputQueue's hard cap (MAX_WAITING_OUTPUTS): a stalled queue stays at the cap, later
# updates merged into one, until the stall timeout aborts the request.
STREAM_BACKLOG_LIMIT = 64


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
        stream_interval: int = 1,
    ) -> None:
        self.processor = OutputProcessor(tokenizer, on_stop=self._on_stop, observer=self)
        self.info = info
        self.metrics = metrics
        self.commands = commands
        self.events = events
        self.max_queued_requests = max_queued_requests
        self.log_requests = log_requests
        self.request_timeout_s = request_timeout_s
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.stream_interval = stream_interval
        self._groups: dict[str, set[str]] = {}  # client request id -> pending choice ids
        self.stats: dict[str, Any] = {}
        self.healthy = True
        # Set by a graceful shutdown: new requests are refused, running ones finish.
        self.draining = False
        self._flushes: dict[int, asyncio.Future[bool]] = {}
        self._tokens = itertools.count()
        self._last_log = time.perf_counter()
        self._last_generated = 0

    @property
    def pending(self) -> dict[str, RequestRecord]:
        """The requests not finished yet, by request id."""
        return self.processor.records

    # ------------------------------------------------------------------ requests

    async def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        group: str | None = None,
        stream: bool = True,
    ) -> RequestRecord:
        """Sends a request; raises EngineUnavailable when unhealthy or the queue is full.
        `group` is the client's request id when `rid` is one choice of several. A request
        that does not `stream` gets one output, at its end; one that does gets one per
        `stream_interval` tokens."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not healthy")
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if self.max_queued_requests is not None:
            waiting = sum(1 for r in self.pending.values() if r.last_token_at is None)
            if waiting >= self.max_queued_requests:
                raise EngineUnavailable(
                    f"too many queued requests ({waiting}); the limit is {self.max_queued_requests}"
                )
        wire = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
        # Encoded before the request is registered: if that fails, nothing is left behind.
        message = ipc.encoder.encode(ipc.AddRequest(rid, prompt_ids, wire, priority))
        queue = OutputQueue(
            asyncio.get_running_loop(),
            threadsafe=False,
            stream=stream,
            interval=self.stream_interval,
        )
        record = RequestRecord(rid, prompt_ids, params, queue, group or rid, stream=stream)
        if self.request_timeout_s is not None:
            record.deadline = record.created + self.request_timeout_s
        self.processor.add(record)  # ValueError if the id is in use
        self._groups.setdefault(record.group, set()).add(rid)
        self.commands.send(message)
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s", rid, len(prompt_ids), wire)
        return record

    async def outputs(self, record: RequestRecord) -> AsyncIterator[Output]:
        """A request's outputs until it finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            async for output in record.queue:
                yield output
                finished = output.meta is not None
        finally:
            # Synchronous on purpose: this also runs while the consumer is being cancelled.
            if not finished:
                self.abort(record.rid, "the client disconnected")

    def watch_stream(self, records: list[RequestRecord]) -> None:
        """The current task streams these requests to a client: if that client stops
        reading, the requests are aborted and the task cancelled (which closes the
        connection) after the stall timeout."""
        task = asyncio.current_task()
        for record in records:
            record.stream_task = task

    def abort(
        self, rid: str, message: str = "aborted by the client", status_code: int | None = None
    ) -> bool:
        """Aborts a pending request; it finishes with finish_reason abort. A `status_code`
        marks an abort the server decided (a timeout): the client gets it as an error."""
        if rid not in self.pending:
            return False
        self._send(ipc.AbortRequest(rid, message))
        return self.processor.end(rid, FinishReason.abort(message, status_code))

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
        for rid, record in list(self.pending.items()):
            if record.deadline is not None and now > record.deadline:
                message = (
                    f"the request ran longer than the server's limit of {self.request_timeout_s} s"
                )
                self.abort(rid, message, 504)
            elif (
                record.stalled_since is not None
                and now - record.stalled_since > self.stream_stall_timeout_s
            ):
                logger.warning("request %s: its client stopped reading; aborting it", rid)
                self.abort(rid, "the client stopped reading the stream", 408)
                if record.stream_task is not None:
                    record.stream_task.cancel()

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
            self.abort(rid, message, 503)

    def abort_group(self, group: str) -> bool:
        """Aborts every pending choice of the client's request `group`."""
        rids = list(self._groups.get(group, ()))
        return sum(self.abort(rid) for rid in rids) > 0

    def _on_stop(self, rid: str, matched: str) -> None:
        self._send(ipc.FinishRequest(rid, matched))

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
                self.processor.process(event.updates)
                # A recv whose message is already there does not yield: without this, a
                # scheduler that steps faster than this loop processes would starve the
                # responses that stream the outputs to clients.
                await asyncio.sleep(0)
            elif isinstance(event, ipc.Stats):
                self.stats = event.stats
                self.metrics.observe_stats(event.stats)
                self._maybe_log()
            elif isinstance(event, ipc.FlushResult):
                future = self._flushes.pop(event.token, None)
                if future is not None and not future.done():
                    future.set_result(event.ok)

    # ------------------------------------------------------------------ observer

    def on_tokens(self, record: RequestRecord, count: int, now: float) -> None:
        """Latency metrics, and the stall clock of a stream whose client falls behind."""
        last = record.last_token_at
        self.metrics.observe_tokens(
            now - record.created if last is None else None,
            None if last is None else now - last,
            count,
            streaming=record.stream,
        )
        if record.stream_task is not None and record.queue.qsize() >= STREAM_BACKLOG_LIMIT:
            if record.stalled_since is None:
                record.stalled_since = now
        else:
            record.stalled_since = None

    def on_finish(self, record: RequestRecord, meta: dict[str, Any]) -> None:
        members = self._groups.get(record.group)
        if members is not None:
            members.discard(record.rid)
            if not members:
                del self._groups[record.group]
        aborted = meta["finish_reason"]["type"] == "abort"
        self.metrics.observe_finish(meta, aborted, streaming=record.stream)
        if self.log_requests:
            logger.info("finish %s: %s", record.rid, meta)

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
