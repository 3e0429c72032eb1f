"""The Rust core's batched `Detokenizer` against a naive Python reference and the tokenizer's
own decode: many requests step together, with random ids (special tokens and invalid UTF-8
included), several tokens per step, stop strings that span tokens, skip_special_tokens and
no_stop_trim; and the decoded-window path, which keeps only a bounded tail too."""

from __future__ import annotations

import codecs
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from rsgl._core import Detokenizer
from rsgl.models.loader import resolve_model_dir
from rsgl.tokenizer.detokenizer import ByteTable, IncrementalDetokenizer

# A request's outcome: its whole text, and (position of the token that completed the stop
# string, the stop string) if one ended it.
Outcome = tuple[str, tuple[int, str] | None]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def table(tokenizer: Any) -> ByteTable:
    t = ByteTable.of(tokenizer)
    assert t is not None
    return t


def reference(
    table: ByteTable, ids: list[int], stop: list[str], skip: bool, no_stop_trim: bool
) -> Outcome:
    """Python's incremental UTF-8 decoder over the tokens' bytes; after every token, the
    whole text so far is searched for the stop strings (the earliest start wins, the first
    listed among equal starts)."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = ""
    stop = [s for s in stop if s]
    for k, token in enumerate(ids):
        if token >= len(table.token_bytes) or (skip and token in table.special):
            continue
        text += utf8.decode(table.token_bytes[token])
        found = [(text.find(s), n, s) for n, s in enumerate(stop) if s in text]
        if found:
            at, _, s = min(found)
            return text[: at + len(s) if no_stop_trim else at], (k, s)
    return text + utf8.decode(b"", final=True).rstrip("\ufffd"), None


def run_batched(
    detok: Detokenizer,
    requests: list[tuple[list[list[int]], list[str], bool, bool]],
) -> list[Outcome]:
    """Every request's steps (lists of tokens) through one `step` call per step, all
    requests together; each one's text and stop as `reference` gives them."""
    handles = [detok.add(stop, skip, trim) for _, stop, skip, trim in requests]
    texts = [""] * len(requests)
    stops: list[tuple[int, str] | None] = [None] * len(requests)
    fed = [0] * len(requests)
    for s in range(max(len(steps) for steps, *_ in requests)):
        batch = [r for r, (steps, *_) in enumerate(requests) if s < len(steps)]
        deltas, stopped = detok.step(
            [handles[r] for r in batch], [requests[r][0][s] for r in batch]
        )
        for r, text in zip(batch, deltas, strict=True):
            texts[r] += text
        for i, tokens, matched in stopped:
            r = batch[i]
            assert stops[r] is None, "a request matched twice"
            stops[r] = (fed[r] + tokens - 1, matched)
            assert detok.matched_stop(handles[r]) == matched
        for r in batch:
            fed[r] += len(requests[r][0][s])
    for r, h in enumerate(handles):
        texts[r] += detok.finish(h)
        detok.remove(h)
    assert len(detok) == 0
    return list(zip(texts, stops, strict=True))


def random_requests(
    rng: np.random.Generator, vocab: int, count: int, texts: list[str]
) -> list[tuple[list[list[int]], list[str], bool, bool]]:
    """`count` requests of random ids in steps of 1-3 tokens, with stop strings cut from
    `texts` (so that some match), skip_special_tokens and no_stop_trim at random."""
    requests = []
    for _ in range(count):
        ids = rng.integers(0, vocab, size=int(rng.integers(0, 60))).tolist()
        steps = []
        while ids:
            n = int(rng.integers(1, 4))
            steps.append(ids[:n])
            ids = ids[n:]
        stop = []
        for _ in range(int(rng.integers(0, 3))):
            source = texts[int(rng.integers(len(texts)))]
            start = int(rng.integers(0, max(1, len(source) - 1)))
            stop.append(source[start : start + int(rng.integers(1, 6))])
        requests.append((steps or [[]], stop, bool(rng.integers(2)), bool(rng.integers(2))))
    return requests


def check(
    table: ByteTable,
    requests: list[tuple[list[list[int]], list[str], bool, bool]],
    got: list[Outcome],
) -> None:
    for (steps, stop, skip, trim), outcome in zip(requests, got, strict=True):
        ids = [t for step in steps for t in step]
        assert outcome == reference(table, ids, stop, skip, trim), (ids, stop, skip, trim)


def test_random_ids_in_batched_steps_match_the_reference_and_the_decode(
    tokenizer: Any, table: ByteTable
):
    rng = np.random.default_rng(1)
    detok = table.detokenizer()
    vocab = len(table.token_bytes)
    # Stop strings from real text and from decoded random ids (U+FFFD and specials too).
    samples = ["The capital of France is Paris.", "東京は日本の首都です 🎉 émigré"]
    samples += [tokenizer.decode(rng.integers(0, vocab, size=8).tolist()) for _ in range(20)]
    for _ in range(20):
        requests = random_requests(rng, vocab, 16, samples)
        got = run_batched(detok, requests)
        check(table, requests, got)
        # Without a stop string: the tokenizer's own decode (an incomplete last character
        # dropped instead of shown as U+FFFD).
        for (steps, _, skip, _), (text, stopped) in zip(requests, got, strict=True):
            if stopped is None:
                want = tokenizer.decode([t for s in steps for t in s], skip_special_tokens=skip)
                assert text in (want, want.rstrip("\ufffd"))


def test_real_text_with_stop_strings_spanning_tokens(tokenizer: Any, table: ByteTable):
    text = "The capital of France is Paris. It is known for the Eiffel Tower. 東京🎉 and more."
    ids = tokenizer.encode(text)
    detok = table.detokenizer()
    stops = [["Paris. It"], [" Eiffel", "known"], ["京🎉"], ["zzz"], ["Tower", "T"], ["."]]
    requests = [([ids[i : i + 2] for i in range(0, len(ids), 2)], s, True, trim)
                for s in stops for trim in (False, True)]  # fmt: skip
    got = run_batched(detok, requests)
    check(table, requests, got)
    assert got[0][0] == "The capital of France is "
    assert got[1][0] == "The capital of France is Paris. It"
    assert got[2][0] == "The capital of France is Paris. It is "  # "known" starts first
    assert got[4][0] == "The capital of France is Paris. It is known for the Eiffel Tower. 東"


def test_invalid_utf8_is_replaced_exactly_as_pythons_decoder_does():
    """A table of random byte strings, mostly pieces of multi-byte characters, stray
    continuation bytes and bytes UTF-8 never uses."""
    rng = np.random.default_rng(2)
    alphabet = [*b"ab", *"é東🎉".encode(), 0x80, 0xBF, 0xC0, 0xC1, 0xED, 0xA0, 0xF4, 0x90, 0xFF]
    tokens = [bytes(rng.choice(alphabet, size=int(rng.integers(0, 4))).tolist()) for _ in range(40)]
    table = ByteTable(tokens, frozenset({0}))
    detok = table.detokenizer()
    samples = ["\ufffd", "é東", "ab\ufffd", "🎉a"]
    for _ in range(30):
        requests = random_requests(rng, len(tokens) + 2, 16, samples)  # ids beyond: no text
        check(table, requests, run_batched(detok, requests))


def test_the_window_path_agrees_with_the_batched_one(tokenizer: Any, table: ByteTable):
    text = "One 東京 two émigré three 🎉 four five. " * 3
    ids = tokenizer.encode(text)
    detok = table.detokenizer()
    for stop in ([], [" four"], ["🎉 f", "two"], ["five. One"]):
        for trim in (False, True):
            window = IncrementalDetokenizer(tokenizer, [], stop, True, trim)
            handle = detok.add(stop, True, trim)
            got_w, got_b = "", ""
            for i in range(0, len(ids), 3):
                text_w, stop_w = window.push(ids[i : i + 3])
                texts, stopped = detok.step([handle], [ids[i : i + 3]])
                got_w, got_b = got_w + text_w, got_b + texts[0]
                assert stop_w == (stopped[0][1:] if stopped else None)
                if stop_w is not None:
                    break
            assert got_w + window.finish() == got_b + detok.finish(handle)
            detok.remove(handle)


def test_the_window_path_keeps_only_a_bounded_tail(tokenizer: Any):
    """What a long output leaves behind stays the size of the longest stop string and a
    window of tokens: a token costs the same at the end of a long output as at the start."""
    ids = tokenizer.encode("A fairly ordinary sentence, with 東京 and 🎉 in it. ") * 100
    detok = IncrementalDetokenizer(tokenizer, [], ["never appears here"], True, False)
    released = ""
    for t in ids:
        released += detok.add(t)
        assert len(detok.held) <= detok.holdback
        assert len(detok.ids) <= 12
    assert released + detok.finish() == tokenizer.decode(ids)


def test_an_unknown_handle_takes_nothing_and_raises(table: ByteTable):
    detok = table.detokenizer()
    a = detok.add()
    b = detok.add()
    detok.remove(b)
    with pytest.raises(KeyError):
        detok.step([a, b], [[100], [101]])
    with pytest.raises(ValueError, match="2 handles but 1 token lists"):
        detok.step([a, a], [[100]])
    assert detok.step([a], [[]]) == ([""], [])  # a's token was not taken
    with pytest.raises(KeyError):
        detok.finish(b)
    assert len(detok) == 1 and detok.vocab_size == len(table.token_bytes)


def test_a_stop_string_no_text_can_contain_still_holds_back_its_length():
    detok = ByteTable([bytes([b]) for b in range(128)], frozenset()).detokenizer()
    handle = detok.add(["\ud800xyz"])  # a lone surrogate: never decoded, never matched
    texts, stops = detok.step([handle], [list(b"abcdefxyz")])
    assert (texts, stops) == (["abcdef"], [])  # three characters held back
    assert detok.finish(handle) == "xyz"
