"""Incremental detokenization against the embedded model's real tokenizer: streamed deltas
concatenate to the full decode, never show half a character, and stop strings are found
across token boundaries without leaking any of their characters first."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

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


@pytest.fixture(params=["window", "bytes"])
def path(request: pytest.FixtureRequest, table: ByteTable) -> ByteTable | None:
    """Both ways of detokenizing: decoded windows, and the byte-level table."""
    return table if request.param == "bytes" else None


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feeds `ids` one by one; the deltas, then the rest at the end."""
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_full_decode(
    tokenizer: Any, path: ByteTable | None, text: str, skip: bool
):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say something:")
    detok = IncrementalDetokenizer(tokenizer, prompt, [], skip_special_tokens=skip, table=path)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas), deltas


def test_a_character_split_across_tokens_is_released_only_when_complete(
    tokenizer: Any, path: ByteTable | None
):
    ids = tokenizer.encode("東京🎉")
    assert len(ids) > 3, "byte-level BPE splits these characters over several tokens"
    detok = IncrementalDetokenizer(tokenizer, [], [], table=path)
    deltas = [detok.add(t) for t in ids]
    assert "" in deltas  # some token completed no character
    assert "".join(deltas) + detok.finish() == "東京🎉"


def test_the_fast_decode_path_matches_the_tokenizers_decode(tokenizer: Any):
    decode = fast_decode(tokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for skip in (True, False):
            assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_stop_string_across_tokens_ends_the_text_before_it(
    tokenizer: Any, path: ByteTable | None
):
    text = "The capital of France is Paris. It is known for the Eiffel Tower."
    ids = tokenizer.encode(text)
    stop = "Paris. It"
    detok = IncrementalDetokenizer(tokenizer, [], [stop, "never appears"], table=path)
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


def test_text_that_could_start_a_stop_string_is_held_back(tokenizer: Any, path: ByteTable | None):
    detok = IncrementalDetokenizer(tokenizer, [], ["Paris. It"], table=path)
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


def test_no_stop_trim_keeps_the_stop_string(tokenizer: Any, path: ByteTable | None):
    ids = tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(tokenizer, [], [" three"], no_stop_trim=True, table=path)
    text = ""
    for t in ids:
        text += detok.add(t)
        if detok.matched_stop is not None:
            break
    text += detok.finish()
    assert detok.matched_stop == " three"
    assert text == "one two three"


def test_the_earliest_of_several_stop_strings_wins(tokenizer: Any, path: ByteTable | None):
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, [], [" delta", " beta gamma", " gamma"], table=path)
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
    for _ in range(300):
        ids = rng.integers(0, len(table.token_bytes), size=int(rng.integers(1, 40))).tolist()
        for skip in (True, False):
            detok = IncrementalDetokenizer(tokenizer, [], [], skip, table=table)
            got = "".join(detok.add(t) for t in ids) + detok.finish()
            want = tokenizer.decode(ids, skip_special_tokens=skip)
            assert got in (want, want.rstrip("\ufffd")), (ids, skip)


def test_only_byte_level_tokenizers_get_a_table(tokenizer: Any):
    from tokenizers import Tokenizer, decoders, models

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert ByteTable.of(wordpiece) is None
    assert ByteTable.of(tokenizer.backend_tokenizer) is not None
