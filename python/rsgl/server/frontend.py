"""The frontend's side of the engine: tokenized requests out, token ids in, text to clients.

It runs in the HTTP process's event loop (or, for `rsgl.Engine(dp_size > 1)`, in a thread of
its own: `rsgl.server.threaded_frontend`). Requests go to the scheduler processes over
ZeroMQ, one per data-parallel rank, the rank picked by the `Dispatcher`; each step's
`TokenUpdate`s come back in one message and go through the same `OutputProcessor` the
in-process Engine uses (stop strings found there are reported back so the scheduler stops
the request), to each request's `OutputQueue`. Latency metrics are measured here, where the
client sees them.

A rank that dies takes only its own requests with it: they end with a 503 naming the rank,
the dispatcher stops choosing it, and the other ranks keep serving (`rank_died`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from rsgl._core import FinishReason
from rsgl.outputs import Output
from rsgl.sampling_params import SamplingParams
from rsgl.server import ipc
from rsgl.server.dispatcher import Dispatcher, NoLiveRank
from rsgl.server.metrics import ServerMetrics
from rsgl.tokenizer.detokenizer import Decoder
from rsgl.tokenizer.output_processor import OutputProcessor, OutputQueue, RequestRecord

logger = logging.getLogger("rsgl.server")

STATS_LOG_INTERVAL_S = 10.0
# How long the ranks have to answer a question (a cache flush, an integrity check, stats).
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
    """Submits requests to the scheduler processes and routes their outputs back.

    `infos` are the ranks' `Ready` infos and `commands` their command sockets, one per
    data-parallel rank; `events` is the one socket every rank sends to.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        infos: Sequence[dict[str, Any]],
        metrics: ServerMetrics,
        commands: Sequence[zmq.asyncio.Socket],
        events: zmq.asyncio.Socket,
        *,
        load_balance_method: str = "round_robin",
        max_queued_requests: int | None = None,
        log_requests: bool = False,
        request_timeout_s: float | None = None,
        stream_stall_timeout_s: float = 30.0,
        stream_interval: int = 1,
        reasoning_end_ids: Sequence[int] | None = None,
    ) -> None:
        if len(infos) != len(commands):
            raise ValueError(f"{len(infos)} rank infos for {len(commands)} command sockets")
        self.processor = OutputProcessor(
            tokenizer, on_stop=self._on_stop, observer=self, reasoning_end_ids=reasoning_end_ids
        )
        # The ranks are replicas of one model: rank 0 speaks for the model and its sizes.
        self.rank_infos = list(infos)
        self.info = self.rank_infos[0]
        self.dp_size = len(commands)
        self.metrics = metrics
        self.commands = list(commands)
        self.events = events
        self.dispatcher = Dispatcher(
            self.dp_size,
            load_balance_method,
            [int(i["max_total_tokens"]) for i in infos],
            context_length=int(self.info["context_length"]),
        )
        self.max_queued_requests = max_queued_requests
        self.log_requests = log_requests
        self.request_timeout_s = request_timeout_s
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.stream_interval = stream_interval
        self._groups: dict[str, set[str]] = {}  # client request id -> pending choice ids
        # Each rank's latest statistics ({} until its first arrive, and once it died).
        self.rank_stats: list[dict[str, Any]] = [{} for _ in range(self.dp_size)]
        # Ranks whose process died, with its exit code.
        self.dead_ranks: dict[int, int | None] = {}
        # Set by a graceful shutdown: new requests are refused, running ones finish.
        self.draining = False
        # Answers awaited from the ranks, by (question token, rank).
        self._replies: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._tokens = itertools.count()
        now = time.perf_counter()
        self._last_log = [now] * self.dp_size
        self._last_generated = [0] * self.dp_size
        # Speculating ranks' (drafted rows, committed tokens) at their last log line.
        self._last_spec: dict[int, tuple[int, int]] = {}

    @property
    def healthy(self) -> bool:
        """At least one rank serves."""
        return len(self.dead_ranks) < self.dp_size

    @property
    def degraded(self) -> bool:
        """Some ranks died; the others serve."""
        return 0 < len(self.dead_ranks) < self.dp_size

    @property
    def stats(self) -> dict[str, Any]:
        """The live ranks' latest statistics, summed (one rank: its own, as it sent them);
        `new_token_ratio`, a ratio, is their mean."""
        live = [s for r, s in enumerate(self.rank_stats) if r not in self.dead_ranks and s]
        return sum_stats(live)

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
        *,
        dp_rank: int | None = None,
        queue: OutputQueue | None = None,
    ) -> RequestRecord:
        """Sends a request; raises EngineUnavailable when no rank serves, the named
        `dp_rank` does not, or the queue is full. `group` is the client's request id when
        `rid` is one choice of several. A request that does not `stream` gets one output,
        at its end; one that does gets one per `stream_interval` tokens. `queue` replaces
        the asyncio queue of this loop (a caller on another thread brings its own)."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not healthy")
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if dp_rank is not None and not (0 <= dp_rank < self.dp_size):
            raise ValueError(f"data_parallel_rank must be in [0, {self.dp_size}), got {dp_rank}")
        if dp_rank is not None and dp_rank in self.dead_ranks:
            raise EngineUnavailable(f"data-parallel rank {dp_rank} is not serving (it died)")
        if self.max_queued_requests is not None:
            waiting = sum(1 for r in self.pending.values() if r.last_token_at is None)
            if waiting >= self.max_queued_requests:
                raise EngineUnavailable(
                    f"too many queued requests ({waiting}); the limit is {self.max_queued_requests}"
                )
        wire = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
        # Encoded before the request is registered: if that fails, nothing is left behind.
        message = ipc.encoder.encode(ipc.AddRequest(rid, prompt_ids, wire, priority))
        if queue is None:
            queue = OutputQueue(
                asyncio.get_running_loop(),
                threadsafe=False,
                stream=stream,
                interval=self.stream_interval,
            )
        record = RequestRecord(rid, prompt_ids, params, queue, group or rid, stream=stream)
        if self.request_timeout_s is not None:
            record.deadline = record.created + self.request_timeout_s
        if dp_rank is None:
            dp_rank = self._sibling_rank(record)
        self.processor.add(record)  # ValueError if the id is in use
        try:
            cost = self.dispatcher.cost(len(prompt_ids), params.max_new_tokens)
            rank = self.dispatcher.assign(rid, prompt_ids, cost, dp_rank)
        except NoLiveRank as exc:
            del self.processor.records[rid]
            raise EngineUnavailable(str(exc)) from None
        self._groups.setdefault(record.group, set()).add(rid)
        self.commands[rank].send(message)
        if self.log_requests:
            logger.info(
                "request %s: %d prompt tokens, rank %d, %s", rid, len(prompt_ids), rank, wire
            )
        return record

    def _sibling_rank(self, record: RequestRecord) -> int | None:
        """The rank of a pending choice of the same request with the same prompt (n > 1):
        copies of a prompt share its prefix, so they go where it is cached. The copies
        `expand_requests` makes share one prompt list, so identity finds them cheaply."""
        if self.dp_size == 1:
            return None
        for rid in self._groups.get(record.group, ()):
            other = self.pending.get(rid)
            if other is not None and other.prompt_ids is record.prompt_ids:
                rank = self.dispatcher.rank_of(rid)
                if rank is not None and rank not in self.dead_ranks:
                    return rank
        return None

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
        self._send_for(rid, ipc.AbortRequest(rid, message))
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
        """Empties every live rank's prefix cache; False if any refuses (requests run
        there). Raises EngineUnavailable if a rank does not answer within FLUSH_TIMEOUT_S."""
        results = await self._ask_all(ipc.FlushCache, "the cache flush")
        for rank, ok in results.items():
            if ok:
                self.dispatcher.forget_prefixes(rank)
        return all(results.values())

    async def check_integrity(self) -> None:
        """Runs every live rank's core integrity check (between its steps); RuntimeError
        naming the rank and what is broken."""
        results = await self._ask_all(ipc.CheckIntegrity, "the integrity check")
        broken = [f"data-parallel rank {r}: {e}" for r, e in results.items() if e is not None]
        if broken:
            raise RuntimeError("; ".join(broken))

    async def fetch_stats(self) -> dict[int, dict[str, Any]]:
        """Every live rank's statistics as of now (not the last periodic ones)."""
        results: dict[int, dict[str, Any]] = await self._ask_all(ipc.GetStats, "the statistics")
        for rank, stats in results.items():
            self.rank_stats[rank] = stats
        return results

    async def _ask_all(self, question: Callable[[int], ipc.Command], what: str) -> dict[int, Any]:
        """Sends `question(token)` to every live rank and gathers their answers by rank."""
        token = next(self._tokens)
        loop = asyncio.get_running_loop()
        ranks = [r for r in range(self.dp_size) if r not in self.dead_ranks]
        if not ranks:
            raise EngineUnavailable("the engine is not healthy")
        waits = []
        for rank in ranks:
            future: asyncio.Future[Any] = loop.create_future()
            self._replies[(token, rank)] = future
            waits.append(future)
            self._send(rank, question(token))
        try:
            answers = await asyncio.wait_for(asyncio.gather(*waits), timeout=FLUSH_TIMEOUT_S)
        except TimeoutError:
            late = [r for r, f in zip(ranks, waits, strict=True) if not f.done()]
            who = "the scheduler" if self.dp_size == 1 else f"data-parallel rank(s) {late}"
            raise EngineUnavailable(
                f"{who} did not answer {what} within {FLUSH_TIMEOUT_S:.0f} s"
            ) from None
        finally:
            for rank in ranks:
                self._replies.pop((token, rank), None)
        return dict(zip(ranks, answers, strict=True))

    def _reply(self, token: int, rank: int, value: Any) -> None:
        future = self._replies.pop((token, rank), None)
        if future is not None and not future.done():
            future.set_result(value)

    def abort_all(self, message: str) -> None:
        """Ends every pending request (shutdown or a dead scheduler): clients get a 503."""
        for rid in list(self.pending):
            self.abort(rid, message, 503)

    def abort_group(self, group: str) -> bool:
        """Aborts every pending choice of the client's request `group`."""
        rids = list(self._groups.get(group, ()))
        return sum(self.abort(rid) for rid in rids) > 0

    def rank_died(self, rank: int, exit_code: int | None) -> int:
        """A rank's process is gone: the requests it had end with a 503 naming it, questions
        waiting for it fail, and it gets no more work. Returns how many requests failed."""
        if rank in self.dead_ranks:
            return 0
        self.dead_ranks[rank] = exit_code
        self.rank_stats[rank] = {}
        message = f"data-parallel rank {rank} died (exit code {exit_code})"
        if self.dp_size == 1:
            message = f"the scheduler process died (exit code {exit_code})"
        failed = 0
        for rid in self.dispatcher.remove_rank(rank):
            failed += self.processor.end(rid, FinishReason.abort(message, 503))
        for (_, r), future in list(self._replies.items()):
            if r == rank and not future.done():
                future.set_exception(EngineUnavailable(message))
        self.metrics.rank_died(rank, self.dp_size - len(self.dead_ranks))
        return failed

    def _on_stop(self, rid: str, matched: str) -> None:
        self._send_for(rid, ipc.FinishRequest(rid, matched))

    def _send_for(self, rid: str, command: ipc.Command) -> None:
        """Sends a command about request `rid` to the rank serving it (if that rank lives)."""
        rank = self.dispatcher.rank_of(rid)
        if rank is not None and rank not in self.dead_ranks:
            self._send(rank, command)

    def _send(self, rank: int, command: ipc.Command) -> None:
        # PUSH to a connected peer below its high-water mark sends at once; not awaiting the
        # returned future keeps aborts possible from code that is being cancelled.
        self.commands[rank].send(ipc.encoder.encode(command))

    # ------------------------------------------------------------------ events

    async def run_events(self) -> None:
        """Reads the schedulers' events forever."""
        while True:
            event = ipc.event_decoder.decode(await self.events.recv())
            if isinstance(event, ipc.StepOutputs):
                self.processor.process(event.updates)
                # A recv whose message is already there does not yield: without this, a
                # scheduler that steps faster than this loop processes would starve the
                # responses that stream the outputs to clients.
                await asyncio.sleep(0)
            elif isinstance(event, ipc.Stats):
                rank = event.dp_rank
                if rank in self.dead_ranks:
                    continue  # sent just before it died
                self.rank_stats[rank] = event.stats
                if event.token is not None:
                    self._reply(event.token, rank, event.stats)
                    continue
                self.metrics.observe_stats(event.stats, rank)
                self._maybe_log(rank)
            elif isinstance(event, ipc.FlushResult):
                self._reply(event.token, event.dp_rank, event.ok)
            elif isinstance(event, ipc.IntegrityResult):
                self._reply(event.token, event.dp_rank, event.error)

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
        self.dispatcher.release(record.rid)
        aborted = meta["finish_reason"]["type"] == "abort"
        self.metrics.observe_finish(meta, aborted, streaming=record.stream)
        if self.log_requests:
            logger.info("finish %s: %s", record.rid, meta)

    def _maybe_log(self, rank: int) -> None:
        now = time.perf_counter()
        if now - self._last_log[rank] < STATS_LOG_INTERVAL_S:
            return
        s = self.rank_stats[rank]
        generated = int(s.get("generated_tokens", 0))
        rate = (generated - self._last_generated[rank]) / (now - self._last_log[rank])
        self._last_log[rank], self._last_generated[rank] = now, generated
        capacity = max(1, int(s.get("capacity", 1)))
        used = 1 - (s.get("available", 0) + s.get("evictable", 0)) / capacity
        prompt = s.get("prompt_tokens", 0)
        hit = s.get("cached_tokens", 0) / prompt if prompt else 0.0
        logger.info(
            "%sgen throughput %.1f tok/s, running %d, queued %d, KV usage %.1f%%, "
            "cache hit %.1f%%%s",
            f"[DP{rank}] " if self.dp_size > 1 else "",
            rate,
            s.get("running", 0),
            s.get("waiting", 0),
            100 * used,
            100 * hit,
            self._accept_length_since_last_log(rank, s),
        )

    def _accept_length_since_last_log(self, rank: int, s: dict[str, Any]) -> str:
        """The log line's ", accept len X" when the rank speculates: tokens committed per
        drafted request row since the previous line (as SGLang's log shows)."""
        if "spec_drafted_rows" not in s:
            return ""
        rows, tokens = int(s["spec_drafted_rows"]), int(s["spec_committed_tokens"])
        last_rows, last_tokens = self._last_spec.get(rank, (0, 0))
        self._last_spec[rank] = rows, tokens
        if rows == last_rows:
            return ", accept len -"
        return f", accept len {(tokens - last_tokens) / (rows - last_rows):.2f}"


def sum_stats(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several ranks' statistics as one: counts summed, `new_token_ratio` averaged, the
    speculation's accept length recomputed from the summed counts and its draft limit the
    largest rank's."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    total: dict[str, Any] = {}
    for stats in per_rank:
        for key, value in stats.items():
            total[key] = total.get(key, 0) + value
    if per_rank and "new_token_ratio" in total:
        total["new_token_ratio"] /= len(per_rank)
    if "spec_drafted_rows" in total:
        rows = total["spec_drafted_rows"]
        total["spec_accept_length"] = total["spec_committed_tokens"] / rows if rows else 0.0
        total["spec_draft_limit"] = max(s.get("spec_draft_limit", 0) for s in per_rank)
    return total
