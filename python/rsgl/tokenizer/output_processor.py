"""Token ids to text for every request of a step: the one output path of Engine and server.

The loop reports token ids and typed finishes (`rsgl.outputs.TokenUpdate`); an
`OutputProcessor` keeps one `RequestRecord` per request, turns each step's updates into
text deltas (incremental detokenization with stop strings and their hold-back), ends a
request whose text reached a stop string (and tells the loop through `on_stop`), and builds
SGLang's `meta_info` when a request is over. `rsgl.Engine` runs it on the loop thread, the
server's frontend on its event loop; both hand their consumers `Output`s through an
`OutputQueue`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rsgl._core import FinishReason
from rsgl.outputs import Output, TokenUpdate, merge, spec_meta
from rsgl.reasoning import MarkerWatch
from rsgl.sampling_params import SamplingParams
from rsgl.tokenizer.detokenizer import ByteTable, Decoder, IncrementalDetokenizer, fast_decode

logger = logging.getLogger(__name__)


# Outputs a queue holds for a consumer that has fallen behind. What comes beyond them is
# merged into one held output (its text joined, its ids and logprobs appended), which goes
# in with the next output that finds room, or with the last one: a stalled stream costs a
# bounded number of objects, and no more text than its request may generate. The server's
# frontend starts its stall clock below this (`rsgl.server.frontend.STREAM_BACKLOG_LIMIT`).
MAX_WAITING_OUTPUTS = 128

# The abort message of a request whose output could not be processed (status 500).
PROCESSING_FAILED = "internal error processing the output"


class OutputQueue:
    """One request's outputs on their way to its consumer.

    Without an event loop it is a thread-safe queue read by `__iter__`. With one, it is an
    asyncio queue read by `__aiter__`, fed from that loop's own thread (`threadsafe=False`,
    the server's frontend) or from another thread (the Engine's loop thread feeding an
    `async_generate` caller).

    A consumer that wants only the whole result says `stream=False`: the pieces are then
    gathered here and the consumer wakes once, for one merged output, instead of once per
    token (with hundreds of requests per step that saves most of the delivery cost, and
    keeps millions of short-lived outputs away from the garbage collector). A streaming
    consumer may likewise ask to wake once per `interval` tokens (SGLang's
    `--stream-interval`); the last output always comes at once.

    At most MAX_WAITING_OUTPUTS outputs wait in the queue, plus the last one (the asyncio
    queue is bounded to that): a consumer that stops reading gets the rest merged.
    """

    def __init__(
        self,
        aio_loop: asyncio.AbstractEventLoop | None = None,
        *,
        threadsafe: bool = True,
        stream: bool = True,
        interval: int = 1,
    ) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.aio_loop = aio_loop
        self.threadsafe = threadsafe
        # Tokens to gather before the consumer wakes; None: only at the end.
        self.interval: int | None = interval if stream else None
        # The pieces gathered for the next wake-up, when outputs are gathered at all.
        self._gathered: _Gathered | None = None if self.interval == 1 else _Gathered()
        # What the consumer has not had room for (see MAX_WAITING_OUTPUTS); touched only
        # where outputs enter the queue (the loop's thread for an asyncio queue).
        self._held: _Gathered | None = None
        self._sync: queue.SimpleQueue[Output] | None = None
        self._aio: asyncio.Queue[Output] | None = None
        if aio_loop is None:
            self._sync = queue.SimpleQueue()
        else:
            self._aio = asyncio.Queue(maxsize=MAX_WAITING_OUTPUTS + 1)

    def use_interval(self, interval: int) -> None:
        """From now on a streaming queue wakes its consumer once per `interval` tokens (a
        request's own stream_interval); a whole-result queue still wakes it once. Called
        before the first output."""
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if self.interval is not None:
            self.interval = interval
            self._gathered = None if interval == 1 else _Gathered()

    def put(self, output: Output) -> None:
        gathered = self._gathered
        if gathered is not None:
            gathered.add(output)
            if output.meta is None and (self.interval is None or len(gathered.ids) < self.interval):
                return
            output = gathered.take(output.meta)
        if self._aio is None or not self.threadsafe:
            self._enqueue(output)
            return
        assert self.aio_loop is not None
        if not self.aio_loop.is_closed():  # else the consumer is gone with its loop
            # RuntimeError: closed between the check and the call.
            with contextlib.suppress(RuntimeError):
                self.aio_loop.call_soon_threadsafe(self._enqueue, output)

    def _enqueue(self, output: Output) -> None:
        """Into the queue, or held while MAX_WAITING_OUTPUTS wait there. Runs where the queue
        is fed (so nothing else adds to it meanwhile); the last output always goes in."""
        full = output.meta is None and self.qsize() >= MAX_WAITING_OUTPUTS
        if full or self._held is not None:
            if self._held is None:
                self._held = _Gathered()
            self._held.add(output)
            if full:
                return
            output = self._held.take(output.meta)
            self._held = None
        if self._sync is not None:
            self._sync.put(output)
        else:
            assert self._aio is not None
            self._aio.put_nowait(output)

    def qsize(self) -> int:
        """Outputs waiting for the consumer."""
        return self._sync.qsize() if self._sync is not None else self._aio.qsize()  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[Output]:
        """Outputs until the last one (the one with `meta`). Whatever waits when the
        consumer comes back is merged into one output: a consumer that falls behind gets
        fewer, larger pieces instead of a growing backlog."""
        assert self._sync is not None, "an asyncio OutputQueue is read with `async for`"
        while True:
            output = _merge_waiting(self._sync.get(), self._sync)
            yield output
            if output.meta is not None:
                return

    async def __aiter__(self) -> AsyncIterator[Output]:
        assert self._aio is not None, "a synchronous OutputQueue is read with `for`"
        while True:
            output = _merge_waiting(await self._aio.get(), self._aio)
            yield output
            if output.meta is not None:
                return


class _Gathered:
    """Outputs merged as they come: texts kept to be joined once, ids and logprobs appended
    (strings and ints, which the garbage collector does not track)."""

    __slots__ = ("ids", "logprobs", "texts")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[dict[str, Any]] | None = None

    def add(self, output: Output) -> None:
        self.texts.append(output.text)
        self.ids.extend(output.token_ids)
        if output.logprobs is not None:
            self.logprobs = [] if self.logprobs is None else self.logprobs
            self.logprobs.extend(output.logprobs)

    def take(self, meta: dict[str, Any] | None) -> Output:
        """The gathered outputs as one (ending with `meta`); empty again afterwards."""
        out = Output("".join(self.texts), self.ids, meta, self.logprobs)
        self.texts, self.ids, self.logprobs = [], [], None
        return out


def _merge_waiting(
    first: Output, waiting: queue.SimpleQueue[Output] | asyncio.Queue[Output]
) -> Output:
    """`first` and every output already waiting behind it, as one."""
    if first.meta is not None or waiting.empty():
        return first
    parts = [first]
    while parts[-1].meta is None and not waiting.empty():
        parts.append(waiting.get_nowait())
    return merge(parts)


@dataclass(slots=True, eq=False)
class RequestRecord:
    """A request from the moment it is accepted until its last output is delivered."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    queue: OutputQueue
    # The caller's request id: the choices of one request (n > 1, a batch) share it.
    group: str = ""
    # Whether its consumer streams the outputs (the metrics tell the two kinds apart).
    stream: bool = True
    created: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float | None = None
    spec: tuple[int, int, int] | None = None  # TokenUpdate.spec, the latest
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # A request that reasons first (require_reasoning): the watch for its reasoning's end
    # marker, and how many of its tokens the reasoning took (the marker's included).
    reasoning: MarkerWatch | None = None
    reasoning_tokens: int = 0
    # Its text: a handle in the processor's batched `Detokenizer` (byte-level BPE), or its
    # own decoded-window detokenizer (any other tokenizer).
    text_handle: int = -1
    detok: IncrementalDetokenizer | None = None
    # The server's watch over it: when it times out (--request-timeout-s), the response
    # task streaming it, since when that client has not kept up.
    deadline: float | None = None
    stream_task: asyncio.Task[Any] | None = None
    stalled_since: float | None = None

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.rid


class Observer(Protocol):
    """Hooks for whoever watches requests go by (the server's metrics and request groups)."""

    def on_tokens(self, record: RequestRecord, count: int, now: float) -> None: ...

    def on_finish(self, record: RequestRecord, meta: dict[str, Any]) -> None: ...


class OutputProcessor:
    """Detokenizes, applies stop strings and delivers; see the module docstring.

    All methods run on one thread (the Engine's loop thread, or the frontend's event loop).
    A request whose output cannot be processed ends alone with an error (status 500).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        on_stop: Callable[[str, str], None],
        observer: Observer | None = None,
        reasoning_end_ids: Sequence[int] | None = None,
    ) -> None:
        self.decode = fast_decode(tokenizer)
        # The tokens of the end of a reasoning (--reasoning-parser): the reasoning tokens of
        # a request that reasons are counted up to them (usage's `reasoning_tokens`).
        self.reasoning_end_ids = reasoning_end_ids
        # Byte-level BPE: every request's text of a step in one call to the Rust core; any
        # other tokenizer: one decoded-window detokenizer per request.
        table = ByteTable.of(tokenizer)
        self.detokenizer = table.detokenizer() if table is not None else None
        self.on_stop = on_stop
        self.observer = observer
        self.records: dict[str, RequestRecord] = {}

    def add(self, record: RequestRecord) -> None:
        """Starts following `record` (its rid must be new here)."""
        if record.rid in self.records:
            raise ValueError(f"request id {record.rid!r} is already in use")
        p = record.params
        if p.stream_interval:
            record.queue.use_interval(p.stream_interval)
        if p.require_reasoning and self.reasoning_end_ids:
            record.reasoning = MarkerWatch(self.reasoning_end_ids)
        if self.detokenizer is not None:
            record.text_handle = self.detokenizer.add(p.stop, p.skip_special_tokens, p.no_stop_trim)
        else:
            record.detok = IncrementalDetokenizer(
                self.decode, record.prompt_ids, p.stop, p.skip_special_tokens, p.no_stop_trim
            )
        self.records[record.rid] = record

    def process(self, updates: Sequence[TokenUpdate]) -> None:
        """One step's updates: text deltas out, finished requests completed."""
        now = time.perf_counter()
        batch: list[tuple[RequestRecord, TokenUpdate]] = []
        handles: list[int] = []
        text_ids: list[list[int]] = []
        for update in updates:
            record = self.records.get(update.rid)
            if record is None:
                continue  # ended here already (a stop string, an abort)
            ids = update.token_ids
            finish = update.finish
            # As SGLang: the text of a request stopped by a token leaves that token out.
            if finish is not None and finish.matched_token is not None and ids:
                ids = ids if record.params.no_stop_trim else ids[:-1]
            batch.append((record, update))
            handles.append(record.text_handle)
            text_ids.append(ids)
        if not batch:
            return
        texts: list[str] | None = None
        stops: dict[int, tuple[int, str]] | None = None
        if self.detokenizer is not None:
            try:
                texts, stopped = self.detokenizer.step(handles, text_ids)
            except Exception:  # a bug: end the step's requests rather than leave them hanging
                logger.exception("a step's output could not be detokenized")
                for record, _ in batch:
                    self.end(record.rid, FinishReason.abort(PROCESSING_FAILED, 500), text="")
                return
            if stopped:
                stops = {i: (tokens, matched) for i, tokens, matched in stopped}
        for i, (record, update) in enumerate(batch):
            try:
                if texts is None:  # not byte-level: the request decodes its own windows
                    assert record.detok is not None
                    text, stop = record.detok.push(text_ids[i])
                else:
                    text, stop = texts[i], stops.get(i) if stops else None
                self._apply(record, update, text, stop, now)
            except Exception:  # one request's failure stays its own
                logger.exception("request %s: its output could not be processed", record.rid)
                self.end(record.rid, FinishReason.abort(PROCESSING_FAILED, 500), text="")

    def _apply(
        self,
        record: RequestRecord,
        update: TokenUpdate,
        text: str,
        stop: tuple[int, str] | None,
        now: float,
    ) -> None:
        """One request's update and its new text to its consumer; `stop` is (tokens, stop
        string) when a stop string ended the text with the update's `tokens`-th token."""
        ids = update.token_ids
        if update.cached_tokens is not None:
            record.cached_tokens = update.cached_tokens
        if update.queue_time is not None and record.queue_time is None:
            record.queue_time = update.queue_time
        if update.spec is not None:
            record.spec = update.spec
        if ids:
            if self.observer is not None:  # before `last_token_at` moves: it times from there
                self.observer.on_tokens(record, len(ids), now)
            record.last_token_at = now
        if stop is not None:
            kept, matched = stop
            output = Output(text, ids[:kept], logprobs=self._account(record, update, kept))
            self.on_stop(record.rid, matched)
            self._complete(record, output, FinishReason.stop_str(matched))
            return
        output = Output(text, ids, logprobs=self._account(record, update, len(ids)))
        if update.finish is None:
            record.queue.put(output)
            return
        output.text += self._rest_of_text(record)
        self._complete(record, output, update.finish)

    @staticmethod
    def _account(
        record: RequestRecord, update: TokenUpdate, kept: int
    ) -> list[dict[str, Any]] | None:
        """Counts the first `kept` tokens of `update` as generated, and returns their
        log-probability entries (also kept for meta_info) when the request asked for them."""
        record.completion_tokens += kept
        watch = record.reasoning
        if watch is not None and not watch.done:
            for token in update.token_ids[:kept]:
                record.reasoning_tokens += 1
                if watch.feed(token):
                    break
        if not record.params.return_logprob:
            return None
        entries = (update.logprobs or [])[:kept]
        record.logprobs.extend(entries)
        return entries

    def end(self, rid: str, reason: FinishReason, *, text: str | None = None) -> bool:
        """Ends a request here (an abort, a timeout, a failure): its consumer gets the text
        held back so far (or `text`) and the finish. False if it is not followed."""
        record = self.records.get(rid)
        if record is None:
            return False
        rest = self._rest_of_text(record) if text is None else text
        self._complete(record, Output(rest, []), reason)
        return True

    def _rest_of_text(self, record: RequestRecord) -> str:
        """The held-back tail of a request's text; "" if decoding it fails (an error path
        must not fail the same way again)."""
        try:
            if record.detok is not None:
                return record.detok.finish()
            assert self.detokenizer is not None
            return self.detokenizer.finish(record.text_handle)
        except Exception:
            logger.exception("request %s: the end of its text could not be decoded", record.rid)
            return ""

    def _complete(self, record: RequestRecord, output: Output, reason: FinishReason) -> None:
        del self.records[record.rid]
        if self.detokenizer is not None:
            # Already gone only where a failed step ends its requests.
            with contextlib.suppress(KeyError):
                self.detokenizer.remove(record.text_handle)
        meta = make_meta(record, reason)
        output.meta = meta
        if self.observer is not None:
            self.observer.on_finish(record, meta)
        record.queue.put(output)


def make_meta(record: RequestRecord, reason: FinishReason) -> dict[str, Any]:
    """SGLang's meta_info for a finished request."""
    now = time.perf_counter()
    meta: dict[str, Any] = {
        "id": record.rid,
        "finish_reason": reason.to_dict(),
        "prompt_tokens": len(record.prompt_ids),
        "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens,
        "e2e_latency": now - record.created,
        # Never scheduled (aborted while queued): it waited all its life.
        "queue_time": record.queue_time if record.queue_time is not None else now - record.created,
    }
    if record.reasoning is not None:
        meta["reasoning_tokens"] = record.reasoning_tokens
    if record.spec is not None:
        meta.update(spec_meta(record.spec))
    if record.params.return_logprob:
        meta["output_token_logprobs"] = record.logprobs
    return meta
