"""The one output path: token updates in, text deltas, stop strings and meta_info out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from transformers import AutoTokenizer

from rsgl._core import FinishReason
from rsgl.models.loader import resolve_model_dir
from rsgl.outputs import Output, TokenUpdate, merge
from rsgl.sampling_params import SamplingParams
from rsgl.server.frontend import STREAM_BACKLOG_LIMIT
from rsgl.tokenizer.output_processor import (
    MAX_WAITING_OUTPUTS,
    OutputProcessor,
    OutputQueue,
    RequestRecord,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


class Harness:
    def __init__(self, tokenizer: Any) -> None:
        self.stops: list[tuple[str, str]] = []
        self.processor = OutputProcessor(tokenizer, on_stop=lambda r, m: self.stops.append((r, m)))
        self.queues: dict[str, OutputQueue] = {}

    def add(self, rid: str, prompt: list[int], **params: Any) -> None:
        q = OutputQueue()
        self.queues[rid] = q
        self.processor.add(RequestRecord(rid, prompt, SamplingParams(**params), q))

    def feed(self, rid: str, ids: list[int], finish: FinishReason | None = None) -> None:
        """One token per step, the finish with the last."""
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            self.processor.process([TokenUpdate(rid, [t], finish=finish if last else None)])

    def result(self, rid: str) -> Output:
        return merge(self.queues[rid])


def test_a_stop_token_is_in_output_ids_but_not_in_the_text(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", tokenizer.encode("Hi"))
    ids = tokenizer.encode(" there friend") + [2]  # 2: <|im_end|>
    h.feed("a", ids, FinishReason.stop_token(2))
    out = h.result("a")
    assert out.token_ids == ids
    assert out.text == " there friend"
    assert out.meta is not None
    assert out.meta["completion_tokens"] == len(ids) == len(out.token_ids)
    assert out.meta["finish_reason"] == {"type": "stop", "matched": 2}


def test_no_stop_trim_keeps_the_stop_tokens_text(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [], no_stop_trim=True, skip_special_tokens=False)
    ids = tokenizer.encode(" ok") + [2]
    h.feed("a", ids, FinishReason.stop_token(2))
    assert h.result("a").text == " ok<|im_end|>"


def test_a_stop_string_ends_the_request_and_tells_the_loop(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [], stop=[" four"])
    h.add("b", [])
    ids = tokenizer.encode("one two three four five six")
    for t in ids:
        h.processor.process([TokenUpdate("a", [t]), TokenUpdate("b", [t])])
    h.processor.process([TokenUpdate("b", [], finish=FinishReason.max_length(len(ids)))])
    a, b = h.result("a"), h.result("b")
    assert h.stops == [("a", " four")]
    assert a.text == "one two three"
    k = a.token_ids
    assert k == ids[: len(k)] and tokenizer.decode(k).endswith(" four")
    assert a.meta is not None and a.meta["finish_reason"] == {"type": "stop", "matched": " four"}
    assert a.meta["completion_tokens"] == len(k)
    # The other request of the same steps goes on to its own end.
    assert b.text == "one two three four five six" and b.token_ids == ids
    assert "a" not in h.processor.records and "b" not in h.processor.records


def test_streamed_outputs_concatenate_to_the_merged_text(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", tokenizer.encode("Q:"), stop=["zzz"])
    ids = tokenizer.encode(" 東京 is big, émigré café.")
    h.feed("a", ids, FinishReason.max_length(len(ids)))
    chunks = list(h.queues["a"])
    assert [c.meta is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids)
    assert [t for c in chunks for t in c.token_ids] == ids


def test_an_abort_delivers_the_held_back_text_and_the_reason(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [], stop=["Paris. It"])
    h.feed("a", tokenizer.encode("We saw Paris"))
    assert h.processor.end("a", FinishReason.abort("timed out", 504))
    assert not h.processor.end("a", FinishReason.abort("again"))
    out = h.result("a")
    assert out.text == "We saw Paris"
    assert out.meta is not None
    assert out.meta["finish_reason"] == {
        "type": "abort",
        "message": "timed out",
        "status_code": 504,
    }
    # Updates that arrive after the end are ignored.
    h.processor.process([TokenUpdate("a", [5])])
    assert h.queues["a"].qsize() == 0


class FailingTokenizer:
    """The real tokenizer, except that decoding `BROKEN` raises (a planted fault)."""

    BROKEN = 12345

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.BROKEN in ids:
            raise RuntimeError("planted decode failure")
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


def test_one_request_failing_to_decode_ends_alone_with_a_500(tokenizer: Any):
    h = Harness(FailingTokenizer(tokenizer))
    h.add("bad", [])
    h.add("good", [])
    h.processor.process(
        [
            TokenUpdate("bad", [FailingTokenizer.BROKEN]),
            TokenUpdate("good", [tokenizer.encode("x")[0]]),
        ]
    )
    h.processor.process([TokenUpdate("good", [], finish=FinishReason.max_length(1))])
    bad, good = h.result("bad"), h.result("good")
    assert bad.meta is not None and bad.meta["finish_reason"]["status_code"] == 500
    assert good.text == "x" and good.meta is not None
    assert good.meta["finish_reason"] == {"type": "length", "length": 1}


def test_meta_info_carries_cached_tokens_queue_time_and_logprobs(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [1, 2, 3], return_logprob=True)
    entry = {"token_id": 7, "logprob": -0.5}
    h.processor.process([TokenUpdate("a", [7], logprobs=[entry], cached_tokens=2, queue_time=0.25)])
    h.processor.process(
        [
            TokenUpdate(
                "a", [8], logprobs=[entry], finish=FinishReason.max_length(2), cached_tokens=2
            )
        ]
    )
    meta = h.result("a").meta
    assert meta is not None
    assert meta["prompt_tokens"] == 3 and meta["cached_tokens"] == 2
    assert meta["queue_time"] == 0.25
    assert meta["output_token_logprobs"] == [entry, entry]
    assert meta["e2e_latency"] >= 0


def test_a_duplicate_request_id_is_refused(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [])
    with pytest.raises(ValueError, match="already in use"):
        h.add("a", [])


def test_a_consumer_that_falls_behind_gets_what_waits_merged():
    q = OutputQueue()
    for piece in ("a", "b", "c"):
        q.put(Output(piece, [ord(piece)]))
    it = iter(q)
    assert next(it) == Output("abc", [97, 98, 99])
    q.put(Output("d", [100]))
    q.put(Output("", [], {"id": "x"}))
    last = next(it)
    assert (last.text, last.token_ids, last.meta) == ("d", [100], {"id": "x"})


def test_a_whole_result_queue_wakes_its_consumer_once():
    q = OutputQueue(stream=False)
    q.put(Output("a", [1]))
    q.put(Output("b", [2]))
    assert q.qsize() == 0
    q.put(Output("", [3], {"id": "x"}))
    assert list(q) == [Output("ab", [1, 2, 3], {"id": "x"})]


def test_an_interval_queue_wakes_its_consumer_every_n_tokens():
    q = OutputQueue(interval=3)
    it = iter(q)
    entries = [{"token_id": t, "logprob": -t / 10} for t in range(1, 9)]
    chunks = []
    for t in range(1, 9):
        meta = {"id": "x"} if t == 8 else None
        q.put(Output(chr(96 + t), [t], meta, entries[t - 1 : t]))
        if q.qsize():  # the consumer keeps up: it takes each chunk as it comes
            chunks.append(next(it))
    assert [c.token_ids for c in chunks] == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert [c.text for c in chunks] == ["abc", "def", "gh"]
    assert [c.logprobs for c in chunks] == [entries[:3], entries[3:6], entries[6:]]
    assert [c.meta for c in chunks] == [None, None, {"id": "x"}]
    with pytest.raises(ValueError, match="interval"):
        OutputQueue(interval=0)


def test_a_requests_own_stream_interval_overrides_the_queues(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [], stream_interval=3)
    h.add("b", [], stream_interval=0)  # 0: the queue's own (1 here)
    ids = tokenizer.encode(" one two three four five six seven")[:7]
    for rid, sizes in (("a", [3, 3, 1]), ("b", [1] * 7)):
        chunks, it = [], iter(h.queues[rid])
        for i, t in enumerate(ids):
            finish = FinishReason.max_length(len(ids)) if i == len(ids) - 1 else None
            h.processor.process([TokenUpdate(rid, [t], finish=finish)])
            if h.queues[rid].qsize():  # the consumer keeps up
                chunks.append(next(it))
        assert [len(c.token_ids) for c in chunks] == sizes
    whole = OutputQueue(stream=False)
    whole.use_interval(3)  # a whole-result queue still wakes once
    for t in ids[:-1]:
        whole.put(Output("x", [t]))
    assert whole.qsize() == 0


def stalled_stream(q: OutputQueue, steps: int) -> None:
    """`steps` one-token outputs, then the last one, to a consumer that reads none of them."""
    entries = [{"token_id": t, "logprob": -1.0} for t in range(steps + 1)]
    for t in range(steps):
        q.put(Output(f"<{t}>", [t], logprobs=entries[t : t + 1]))
        assert q.qsize() <= MAX_WAITING_OUTPUTS
    q.put(Output("<end>", [steps], {"id": "x"}, entries[steps:]))


def check_delivery(chunks: list[Output], steps: int) -> None:
    """Nothing lost, nothing reordered, and the last output is last."""
    whole = merge(chunks)
    assert whole.token_ids == list(range(steps + 1))
    assert whole.text == "".join(f"<{t}>" for t in range(steps)) + "<end>"
    assert [e["token_id"] for e in whole.logprobs or []] == whole.token_ids
    assert whole.meta == {"id": "x"} and all(c.meta is None for c in chunks[:-1])


def test_a_stalled_consumers_queue_stops_growing_at_its_cap():
    steps = 10 * MAX_WAITING_OUTPUTS
    q = OutputQueue()
    stalled_stream(q, steps)
    assert q.qsize() == MAX_WAITING_OUTPUTS + 1
    chunks = list(q)
    assert len(chunks) == 1  # all waiting: merged into one when the consumer comes back
    check_delivery(chunks, steps)
    # The queue itself: at most the cap, then what came after it merged into one output.
    q = OutputQueue()
    stalled_stream(q, steps)
    waiting = [q._sync.get() for _ in range(q.qsize())]  # type: ignore[union-attr]
    assert len(waiting) == MAX_WAITING_OUTPUTS + 1
    assert [len(o.token_ids) for o in waiting[:-1]] == [1] * MAX_WAITING_OUTPUTS
    assert len(waiting[-1].token_ids) == steps + 1 - MAX_WAITING_OUTPUTS
    check_delivery(waiting, steps)


def test_a_held_output_goes_in_once_the_consumer_makes_room():
    q = OutputQueue()
    it = iter(q)
    for t in range(MAX_WAITING_OUTPUTS + 5):
        q.put(Output(f"<{t}>", [t]))
    assert next(it).token_ids == list(range(MAX_WAITING_OUTPUTS))
    q.put(Output(f"<{MAX_WAITING_OUTPUTS + 5}>", [MAX_WAITING_OUTPUTS + 5]))
    # The five held back and the new one, in order, as one output.
    assert next(it).token_ids == list(range(MAX_WAITING_OUTPUTS, MAX_WAITING_OUTPUTS + 6))


@pytest.mark.parametrize("threadsafe", [False, True])
def test_an_asyncio_queue_is_bounded_too(threadsafe: bool):
    steps = 4 * MAX_WAITING_OUTPUTS

    async def run() -> tuple[int, list[Output]]:
        loop = asyncio.get_running_loop()
        q = OutputQueue(loop, threadsafe=threadsafe)
        if threadsafe:  # fed from another thread, as the Engine feeds async_generate
            await loop.run_in_executor(None, stalled_stream, q, steps)
            for _ in range(100):  # the hand-overs run on this loop
                await asyncio.sleep(0.01)
        else:
            stalled_stream(q, steps)
        size = q.qsize()
        return size, [o async for o in q]

    size, chunks = asyncio.run(run())
    assert size == MAX_WAITING_OUTPUTS + 1
    check_delivery(chunks, steps)


def test_the_stall_clock_starts_below_the_queues_cap():
    # A stalled stream's queue stays at the cap; it must count as stalled there.
    assert STREAM_BACKLOG_LIMIT < MAX_WAITING_OUTPUTS


def test_each_output_carries_the_logprobs_of_its_own_tokens(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [], stop=[" four"], return_logprob=True)
    h.add("b", [])  # did not ask: no entries
    ids = tokenizer.encode("one two three four five")
    for t in ids:
        entry = [{"token_id": t, "logprob": -1.0}]
        h.processor.process(
            [TokenUpdate("a", [t], logprobs=entry), TokenUpdate("b", [t], logprobs=entry)]
        )
    chunks = list(h.queues["a"])
    # Every output's entries are those of its token ids, up to the stop string's last token.
    for c in chunks:
        assert [e["token_id"] for e in c.logprobs or []] == c.token_ids
    kept = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].meta is not None
    assert [e["token_id"] for e in chunks[-1].meta["output_token_logprobs"]] == kept
    assert len(kept) == chunks[-1].meta["completion_tokens"] < len(ids)
    h.processor.process([TokenUpdate("b", [], finish=FinishReason.max_length(len(ids)))])
    assert all(c.logprobs is None for c in h.queues["b"])


def test_a_stop_string_inside_a_multi_token_update_keeps_the_tokens_up_to_it(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [], stop=[" three"], return_logprob=True)
    ids = tokenizer.encode("one two three four five")
    entries = [{"token_id": t, "logprob": -1.0} for t in ids]
    h.processor.process([TokenUpdate("a", ids, logprobs=entries)])  # all in one step
    out = h.result("a")
    assert out.text == "one two"
    assert tokenizer.decode(out.token_ids) == "one two three"
    assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) < len(ids)
    assert out.meta is not None and out.meta["completion_tokens"] == len(out.token_ids)
    assert out.logprobs == entries[: len(out.token_ids)]
    assert h.stops == [("a", " three")]


def test_a_step_that_cannot_be_detokenized_ends_its_requests_with_a_500(tokenizer: Any):
    h = Harness(tokenizer)
    h.add("a", [])
    h.add("b", [])
    detokenizer = h.processor.detokenizer
    assert detokenizer is not None, "SmolLM2's tokenizer is byte-level BPE"
    detokenizer.remove(h.processor.records["b"].text_handle)  # a planted bookkeeping bug
    h.processor.process([TokenUpdate("a", [100]), TokenUpdate("b", [101])])
    for rid in ("a", "b"):
        meta = h.result(rid).meta
        assert meta is not None and meta["finish_reason"]["status_code"] == 500
    assert not h.processor.records and len(detokenizer) == 0


def test_the_observer_sees_each_token_before_it_becomes_the_last(tokenizer: Any):
    seen: list[float | None] = []

    class Watch:
        def on_tokens(self, record: RequestRecord, count: int, now: float) -> None:
            seen.append(record.last_token_at)  # None: the first token (time to first token)

        def on_finish(self, record: RequestRecord, meta: dict[str, Any]) -> None:
            pass

    processor = OutputProcessor(tokenizer, on_stop=lambda r, m: None, observer=Watch())
    processor.add(RequestRecord("a", [], SamplingParams(), OutputQueue()))
    for t in tokenizer.encode(" one two"):
        processor.process([TokenUpdate("a", [t])])
    assert seen[0] is None and all(s is not None for s in seen[1:]) and len(seen) > 1
