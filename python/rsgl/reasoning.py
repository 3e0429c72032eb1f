"""Reasoning separation (SGLang's `--reasoning-parser`): a thinking model writes its
reasoning between markers (`<think>` ... `</think>`) before its answer; the chat API returns
the reasoning as `reasoning_content` and the answer as `content`, in whole messages and in
stream deltas.

Whether a request reasons is the format's call: `deepseek-r1` always does (its template
opens `<think>` itself, so the output starts inside the reasoning); `qwen3` does unless the
request turns it off with `chat_template_kwargs: {"enable_thinking": false}`, which its
template reads. A template that ends the prompt with the start marker has opened the
reasoning too. A request that reasons has its grammar (response_format, a forced tool call)
applied only after the end marker (`rsgl.grammar.reasoning_gate`), as SGLang's
ReasonerGrammarBackend does.

Torch-free: the server's frontend runs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How one model family marks its reasoning.

    `always`: the output starts inside the reasoning whatever the request says; otherwise
    it does when the request leaves `enable_thinking` on, or when the model writes `start`.
    `interrupted_by`: a marker that ends the reasoning without `end` (Qwen3 may open a tool
    call straight from its thinking); it stays in the content.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always: bool = False
    interrupted_by: str | None = None

    def reasons(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request's output starts inside its reasoning (SGLang's
        `require_reasoning`), as the chat template is told by `chat_template_kwargs`."""
        if self.always:
            return True
        return (chat_template_kwargs or {}).get("enable_thinking") is not False

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` has opened the reasoning (its template
        writes the start marker at the end of the generation prompt)."""
        return prompt_tail.rstrip().endswith(self.start)

    def split(self, text: str, reasons: bool) -> tuple[str, str]:
        """A whole answer as (reasoning, content)."""
        splitter = ReasoningSplitter(self, reasons)
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        return reasoning + more_reasoning, content + more_content


# `--reasoning-parser` names (SGLang's).
FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("deepseek-r1", always=True),
    "qwen3": ReasoningFormat("qwen3", interrupted_by="<tool_call>"),
}


class ReasoningSplitter:
    """One choice's answer as it streams: `feed` each piece, `finish` at the end; each
    returns the (reasoning, content) text that piece adds.

    A piece that ends with the beginning of a marker holds that tail back until the next
    piece shows whether the marker completes. With `stream_reasoning` off (SGLang's
    option) the reasoning comes in one piece, when it ends. Content before a start marker
    the model writes itself stays content.
    """

    __slots__ = ("_held_reasoning", "_opened", "_pending", "_phase", "fmt", "stream_reasoning")

    def __init__(self, fmt: ReasoningFormat, reasons: bool, stream_reasoning: bool = True) -> None:
        self.fmt = fmt
        self.stream_reasoning = stream_reasoning
        # "before": content that may still open a reasoning; "reasoning"; "content": the rest.
        self._phase = "reasoning" if reasons else "before"
        # Inside a reasoning the start marker may still come once (a model that writes
        # `<think>` although the template opened it); it is dropped.
        self._opened = False
        self._pending = ""
        self._held_reasoning = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self._pending += piece
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._phase == "content":
                content.append(self._pending)
                self._pending = ""
            elif self._phase == "before":
                if not self._before(content):
                    break
            elif not self._reasoning(reasoning):
                break
        ended = self._phase != "reasoning"
        return self._reasoning_out("".join(reasoning), ended), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the answer is complete."""
        rest, self._pending = self._pending, ""
        if self._phase == "reasoning":
            self._phase = "content"
            return self._reasoning_out(rest, ended=True), ""
        return self._reasoning_out("", ended=True), rest

    def _before(self, content: list[str]) -> bool:
        """Consumes content up to a start marker; False when it must wait for more text."""
        text, start = self._pending, self.fmt.start
        at = text.find(start)
        if at >= 0:
            content.append(text[:at])
            self._pending = text[at + len(start) :]
            self._phase, self._opened = "reasoning", True
            return True
        keep = _partial_marker(text, (start,))
        content.append(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return False

    def _reasoning(self, reasoning: list[str]) -> bool:
        """Consumes reasoning up to its end; False when it must wait for more text."""
        fmt, text = self.fmt, self._pending
        if not self._opened:
            stripped = text.lstrip()
            if len(stripped) < len(fmt.start) and fmt.start.startswith(stripped):
                return False  # maybe the start marker, still arriving
            self._opened = True
            if stripped.startswith(fmt.start):
                text = self._pending = stripped[len(fmt.start) :]
        ends = [(text.find(fmt.end), len(fmt.end))]
        if fmt.interrupted_by is not None:
            ends.append((text.find(fmt.interrupted_by), 0))  # the marker stays content
        found = [(at, skip) for at, skip in ends if at >= 0]
        if found:
            at, skip = min(found)
            reasoning.append(text[:at])
            self._pending = text[at + skip :]
            self._phase = "content"
            return True
        markers = (fmt.end,) if fmt.interrupted_by is None else (fmt.end, fmt.interrupted_by)
        keep = _partial_marker(text, markers)
        reasoning.append(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return False

    def _reasoning_out(self, text: str, ended: bool) -> str:
        """`text` now, or (stream_reasoning off) all of the reasoning once it has ended."""
        if self.stream_reasoning:
            return text
        self._held_reasoning += text
        if not ended:
            return ""
        out, self._held_reasoning = self._held_reasoning, ""
        return out


def marker_ids(tokenizer: Any, marker: str) -> tuple[int, ...]:
    """The token ids the tokenizer writes `marker` with; ValueError if none."""
    ids = tuple(int(t) for t in tokenizer.encode(marker, add_special_tokens=False))
    if not ids:
        raise ValueError(f"the tokenizer writes the marker {marker!r} with no tokens")
    return ids


def reasoning_end_ids(tokenizer: Any, parser: str | None) -> tuple[int, ...] | None:
    """The tokens that end a reasoning under `--reasoning-parser` `parser` (None: none)."""
    return None if parser is None else marker_ids(tokenizer, FORMATS[parser].end)


class MarkerWatch:
    """Watches a stream of token ids for a marker written as `ids` (on ids, as SGLang
    matches the end of a reasoning: a model writes its marker one way, a special token in
    the models that think). `feed` each token; `done` once the stream has ended with it."""

    __slots__ = ("done", "ids", "matched")

    def __init__(self, ids: Sequence[int]) -> None:
        assert ids, "a marker is at least one token"
        self.ids = tuple(ids)
        self.matched = 0  # how many of ids the stream ends with so far
        self.done = False

    def feed(self, token: int) -> bool:
        """Whether the stream ends with the marker after `token`."""
        if not self.done:
            self.matched = self._advance(token)
            self.done = self.matched == len(self.ids)
        return self.done

    def _advance(self, token: int) -> int:
        """The longest start of `ids` the stream ends with after `token` (after a mismatch
        a shorter start may still be under way: `</</think>`)."""
        seen = (*self.ids[: self.matched], token)
        for n in range(len(seen), 0, -1):
            if seen[-n:] == self.ids[:n]:
                return n
        return 0

    def one_short(self) -> bool:
        """Whether the next token may complete the marker."""
        return self.matched == len(self.ids) - 1


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `markers` (and is not
    all of it): that much may yet become a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


__all__ = [
    "FORMATS",
    "MarkerWatch",
    "ReasoningFormat",
    "ReasoningSplitter",
    "marker_ids",
    "reasoning_end_ids",
]
