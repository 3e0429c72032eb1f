"""Incremental detokenization against the embedded model's real tokenizer: streamed deltas
concatenate to the full decode, never show half a character, and stop strings are found
across token boundaries without leaking any of their characters first. Every test runs both
ways: decoded windows (`IncrementalDetokenizer`) and the byte table (the Rust core's batched
`Detokenizer`, one request at a time here; tests/tokenizer/test_batched_detokenizer.py
steps many at once)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import pytest
from transformers import AutoTokenizer

from rsgl._core import Detokenizer
from rsgl.models.loader import resolve_model_dir
from rsgl.tokenizer.detokenizer import ByteTable, IncrementalDetokenizer, fast_decode

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "東京は日本の首都です。émigré naïve café — “quotes” and emoji 🎉🚀!",
    "def f(x):\n    return x ** 2  # squares\n\n\tindent",
    "   leading spaces, trailing spaces   ",
    "Mixed: <|im_start|>user\nhi<|im_end|> after special",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def table(tokenizer: Any) -> ByteTable:
    t = ByteTable.of(tokenizer)
    assert t is not None, "SmolLM2's tokenizer is byte-level BPE"
    return t


class Detok(Protocol):
    """One request's detokenizer, either way."""

    matched_stop: str | None

    def add(self, token: int) -> str: ...

    def finish(self) -> str: ...


class OneRequest:
    """A single request of the batched `Detokenizer`, fed one token per step."""

    def __init__(self, batched: Detokenizer, handle: int) -> None:
        self.batched, self.handle = batched, handle
        self.matched_stop: str | None = None

    def add(self, token: int) -> str:
        texts, stops = self.batched.step([self.handle], [[token]])
        if stops:
            self.matched_stop = stops[0][2]
            assert self.matched_stop == self.batched.matched_stop(self.handle)
        return texts[0]

    def finish(self) -> str:
        rest = self.batched.finish(self.handle)
        self.batched.remove(self.handle)
        return rest


# (prompt ids, stop strings, skip_special_tokens, no_stop_trim) -> one request's detokenizer.
MakeDetok = Callable[..., Detok]


@pytest.fixture(params=["window", "bytes"])
def make(request: pytest.FixtureRequest, tokenizer: Any, table: ByteTable) -> MakeDetok:
    """Both ways of detokenizing: decoded windows, and the byte-level table."""
    if request.param == "window":

        def window(
            prompt: list[int], stop: list[str], skip: bool = True, no_stop_trim: bool = False
        ) -> Detok:
            return IncrementalDetokenizer(tokenizer, prompt, stop, skip, no_stop_trim)

        return window
    batched = table.detokenizer()

    def bytes_(
        prompt: list[int], stop: list[str], skip: bool = True, no_stop_trim: bool = False
    ) -> Detok:
        return OneRequest(batched, batched.add(stop, skip, no_stop_trim))

    return bytes_


def stream(detok: Detok, ids: list[int]) -> list[str]:
    """Feeds `ids` one by one; the deltas, then the rest at the end."""
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(
    tokenizer: Any, make: MakeDetok, text: str, skip: bool
):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say something:")
    detok = make(prompt, [], skip)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas), deltas


def test_a_character_split_across_tokens_is_released_only_when_complete(
    tokenizer: Any, make: MakeDetok
):
    ids = tokenizer.encode("東京🎉")
    assert len(ids) > 3, "byte-level BPE splits these characters over several tokens"
    detok = make([], [])
    deltas = [detok.add(t) for t in ids]
    assert "" in deltas  # some token completed no character
    assert "".join(deltas) + detok.finish() == "東京🎉"


def test_the_fast_decode_path_matches_the_tokenizers_decode(tokenizer: Any):
    decode = fast_decode(tokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for skip in (True, False):
            assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_stop_string_across_tokens_ends_the_text_before_it(tokenizer: Any, make: MakeDetok):
    text = "The capital of France is Paris. It is known for the Eiffel Tower."
    ids = tokenizer.encode(text)
    stop = "Paris. It"
    detok = make([], [stop, "never appears"])
    deltas = []
    for t in ids:
        deltas.append(detok.add(t))
        if detok.matched_stop is not None:
            break
    deltas.append(detok.finish())
    assert detok.matched_stop == stop
    assert "".join(deltas) == "The capital of France is "
    # Nothing after the match is decoded, and no delta ever held part of the stop string.
    assert all("Paris" not in d for d in deltas)


def test_text_that_could_start_a_stop_string_is_held_back(tokenizer: Any, make: MakeDetok):
    detok = make([], ["Paris. It"])
    released = ""
    for t in tokenizer.encode("We went to Paris"):
        released += detok.add(t)
    # "Paris" (and the space before) might begin the stop string: not released yet ...
    assert not released.endswith("Paris")
    # ... and once the text moves on without completing it, it all comes out.
    for t in tokenizer.encode(" and Rome."):
        released += detok.add(t)
    released += detok.finish()
    assert detok.matched_stop is None
    assert released == "We went to Paris and Rome."


def test_no_stop_trim_keeps_the_stop_string(tokenizer: Any, make: MakeDetok):
    ids = tokenizer.encode("one two three four")
    detok = make([], [" three"], no_stop_trim=True)
    text = ""
    for t in ids:
        text += detok.add(t)
        if detok.matched_stop is not None:
            break
    text += detok.finish()
    assert detok.matched_stop == " three"
    assert text == "one two three"


def test_the_earliest_of_several_stop_strings_wins(tokenizer: Any, make: MakeDetok):
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = make([], [" delta", " beta gamma", " gamma"])
    text = "".join(stream(detok, ids))
    assert detok.matched_stop == " beta gamma"
    assert text == "alpha"


def test_the_byte_table_decodes_any_id_sequence_as_the_tokenizer_does(
    tokenizer: Any, table: ByteTable
):
    """Random ids over the whole vocabulary (special tokens, and byte pieces that form no
    valid UTF-8): streamed through the table they give the tokenizer's own decode, except
    that an incomplete character at the very end is dropped instead of shown as U+FFFD."""
    rng = np.random.default_rng(0)
    batched = table.detokenizer()
    for _ in range(300):
        ids = rng.integers(0, len(table.token_bytes), size=int(rng.integers(1, 40))).tolist()
        for skip in (True, False):
            handle = batched.add([], skip)
            got = "".join(batched.step([handle], [[t]])[0][0] for t in ids)
            got += batched.finish(handle)
            batched.remove(handle)
            want = tokenizer.decode(ids, skip_special_tokens=skip)
            assert got in (want, want.rstrip("\ufffd")), (ids, skip)


def test_only_byte_level_tokenizers_get_a_table(tokenizer: Any):
    from tokenizers import Tokenizer, decoders, models

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert ByteTable.of(wordpiece) is None
    assert ByteTable.of(tokenizer.backend_tokenizer) is not None
