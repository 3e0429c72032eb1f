"""Reasoning separation (`--reasoning-parser`): whole answers and streams split into
reasoning and content the same way, however the text is cut into pieces (one character
at a time, or the embedded tokenizer's tokens), markers cut in half included."""

from __future__ import annotations

from typing import Any

import pytest
from grammar_walk import embedded_tokenizer

from rsgl.reasoning import FORMATS, ReasoningSplitter

R1, QWEN3 = FORMATS["deepseek-r1"], FORMATS["qwen3"]

# (format, reasons, answer, reasoning, content)
CASES = [
    (
        R1,
        True,
        "Paris is in France.</think>The capital is Paris.",
        "Paris is in France.",
        "The capital is Paris.",
    ),
    (R1, True, "<think>\nStep 1: add.\n</think>\n\n42", "\nStep 1: add.\n", "\n\n42"),
    (
        R1,
        True,
        "still thinking when max_tokens cut it",
        "still thinking when max_tokens cut it",
        "",
    ),
    (R1, True, "</think>", "", ""),
    (QWEN3, True, "<think>a < b and c </ d</think>So a < b.", "a < b and c </ d", "So a < b."),
    (QWEN3, False, "No thinking here: 1 < 2.", "", "No thinking here: 1 < 2."),
    (QWEN3, False, "Hi. <think>hmm</think>Bye.", "hmm", "Hi. Bye."),
    (
        QWEN3,
        True,
        "I should call it.<tool_call>\n{}\n</tool_call>",
        "I should call it.",
        "<tool_call>\n{}\n</tool_call>",
    ),
    (QWEN3, True, "<think></think>", "", ""),
    (QWEN3, False, "ends with half a marker <thi", "", "ends with half a marker <thi"),
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return embedded_tokenizer()


@pytest.mark.parametrize(("fmt", "reasons", "text", "reasoning", "content"), CASES)
def test_a_whole_answer_splits_into_reasoning_and_content(
    fmt: Any, reasons: bool, text: str, reasoning: str, content: str
) -> None:
    assert fmt.split(text, reasons) == (reasoning, content)


def stream(splitter: ReasoningSplitter, pieces: list[str]) -> list[tuple[str, str]]:
    out = [splitter.feed(p) for p in pieces]
    out.append(splitter.finish())
    return out


def token_pieces(tokenizer: Any, text: str) -> list[str]:
    """`text` as a model streams it: each token's new characters."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, before = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i])
        pieces.append(now[len(before) :])
        before = now
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize(("fmt", "reasons", "text", "reasoning", "content"), CASES)
def test_a_stream_splits_as_the_whole_answer_does(
    tokenizer: Any, fmt: Any, reasons: bool, text: str, reasoning: str, content: str
) -> None:
    for pieces in (list(text), token_pieces(tokenizer, text), [text]):
        out = stream(ReasoningSplitter(fmt, reasons), pieces)
        assert "".join(r for r, _ in out) == reasoning, pieces
        assert "".join(c for _, c in out) == content, pieces


def test_reasoning_streams_as_it_comes_and_a_half_marker_waits() -> None:
    splitter = ReasoningSplitter(R1, reasons=True)
    assert splitter.feed("First, ") == ("First, ", "")
    assert splitter.feed("look.</th") == ("look.", "")  # "</th" may be the end marker
    assert splitter.feed("ink>Done") == ("", "Done")
    assert splitter.feed(" now.") == ("", " now.")
    assert splitter.finish() == ("", "")


def test_without_stream_reasoning_the_reasoning_comes_in_one_piece_when_it_ends() -> None:
    splitter = ReasoningSplitter(R1, reasons=True, stream_reasoning=False)
    assert splitter.feed("First, ") == ("", "")
    assert splitter.feed("look.") == ("", "")
    assert splitter.feed("</think>Done") == ("First, look.", "Done")
    cut = ReasoningSplitter(R1, reasons=True, stream_reasoning=False)
    assert stream(cut, ["never ", "ends"]) == [("", ""), ("", ""), ("never ends", "")]


def test_which_requests_reason() -> None:
    assert R1.reasons(None) and R1.reasons({"enable_thinking": False})
    assert QWEN3.reasons(None) and QWEN3.reasons({"enable_thinking": True})
    assert not QWEN3.reasons({"enable_thinking": False})
    assert QWEN3.opened_by("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
