"""The tool-call formats models write, by SGLang's `--tool-call-parser` names, and the JSON
array that `tool_choice` "required" or a named function constrains the output to.

Each format has one parse, for whole answers and for streams alike: `parse(text, final)`.
With `final` the text is the whole answer. Without it the text is what has arrived so far
and may end anywhere: the content is then only what can no longer turn out to be part of a
call (a possible marker's first characters and trailing whitespace are held back), and the
last call may be partial -- its name None until the name is complete, its arguments a prefix
of their final text. A stream (`rsgl.tool_calls.stream`) re-parses the text so far on every
piece and sends what grew; that one parse per format makes a streamed answer the same as the
whole one.

A call's arguments are the JSON text of its arguments object as the model wrote it (what
OpenAI's `function.arguments` carries), so that a stream can send them as they grow; a
call's arguments given as a JSON string (some models encode them twice) are unwrapped.
Text that is not a well-formed call (a marker followed by something else) stays content.
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

# The keys models use for a call's arguments: llama3 writes "parameters", the others
# "arguments"; the constrained array uses SGLang's "parameters".
_ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\n\r"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(slots=True)
class ParsedCall:
    """A tool call found in the text: `name` (None while it is still being written) and
    its `arguments`' JSON text (a prefix of it while `complete` is false)."""

    name: str | None
    arguments: str
    complete: bool


@dataclass(slots=True)
class Parsed:
    """What a text holds: `content` for the user, and the calls after it."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallFormat(ABC):
    """A model's way of writing tool calls (a `--tool-call-parser`)."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """The content and the calls of `text` (the whole answer when `final`, else the
        answer so far: see the module's docstring)."""


# ------------------------------------------------------------------- JSON scanning


class _Malformed(Exception):
    """The text cannot be the format's call."""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _scan_string(text: str, i: int, quote: str = '"') -> int | None:
    """The index past the string literal opening at text[i] (None: the text ends first)."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == quote:
            return i + 1
        i += 1
    return None


def _scan_json_value(text: str, i: int) -> int | None:
    """The index past the JSON value starting at text[i] (None: the text ends inside it).
    Only the extent is found here; `json.loads` judges the value once it is whole."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _scan_string(text, i)
    if c in "{[":
        return _scan_nested(text, i, '"', "{[", "}]")
    start = i
    while i < len(text) and (text[i].isalnum() or text[i] in "+-."):
        i += 1
    if i == start:
        raise _Malformed(f"no JSON value at {text[start : start + 10]!r}")
    # A number or a literal may go on while the text does.
    return None if i == len(text) else i


def _scan_call_object(text: str, i: int, final: bool) -> tuple[ParsedCall | None, int]:
    """The call written as a JSON object `{"name": ..., "arguments": {...}}` at text[i],
    and the index past it (len(text) when the text ends inside it: the call is then partial,
    or None before its name is known, and stays so in a final text that max_tokens cut).
    _Malformed when it is not such an object."""
    if i >= len(text):
        return None, i
    if text[i] != "{":
        raise _Malformed("a call is a JSON object")
    start = i
    name: str | None = None
    arguments = ""
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            break
        if text[i] == "}":
            return _whole_call(text[start : i + 1]), i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
        key_end = _scan_string(text, i) if i < len(text) and text[i] == '"' else None
        if i < len(text) and text[i] != '"':
            raise _Malformed("an object key is a string")
        if key_end is None:
            break
        key = _loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            raise _Malformed("a key is followed by ':'")
        value_start = _skip_ws(text, i + 1)
        value_end = _scan_json_value(text, value_start)
        if key == "name" and value_end is not None:
            value = _loads(text[value_start:value_end])
            if not isinstance(value, str):
                raise _Malformed("a call's name is a string")
            name = value
        elif key in _ARGUMENT_KEYS and text.startswith("{", value_start):
            # An object's text so far is a prefix of its whole text; other values (a
            # string holding the JSON) are sent once whole.
            arguments = text[value_start : len(text) if value_end is None else value_end]
        if value_end is None:
            break
        i = value_end
    return (None if name is None else ParsedCall(name, arguments, False)), len(text)


def _loads(source: str) -> Any:
    try:
        return json.loads(source)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _Malformed(str(exc)) from None


def _whole_call(source: str) -> ParsedCall:
    obj = _loads(source)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise _Malformed("a call is an object with a string name")
    key = next((k for k in _ARGUMENT_KEYS if k in obj), None)
    value = obj.get(key) if key else {}
    if isinstance(value, str):  # arguments encoded twice
        value = _loads(value)
        if not isinstance(value, dict):
            raise _Malformed("a call's arguments are an object")
        return ParsedCall(obj["name"], json.dumps(value, ensure_ascii=False), True)
    if not isinstance(value, dict):
        raise _Malformed("a call's arguments are an object")
    if key is None:
        return ParsedCall(obj["name"], "{}", True)
    # The model's own text of the arguments: what a stream sent, piece by piece.
    begin = _skip_ws(source, source.index(":", _key_position(source, key)) + 1)
    end = _scan_json_value(source, begin)
    assert end is not None
    return ParsedCall(obj["name"], source[begin:end], True)


def _key_position(source: str, key: str) -> int:
    """Where `"key"` stands as a key of the object `source` (top level)."""
    i = 1
    while True:
        i = _skip_ws(source, i)
        if source[i] == ",":
            i = _skip_ws(source, i + 1)
        key_end = _scan_string(source, i)
        assert key_end is not None
        if json.loads(source[i:key_end]) == key:
            return key_end
        value_start = _skip_ws(source, source.index(":", key_end) + 1)
        end = _scan_json_value(source, value_start)
        assert end is not None
        i = end


# ------------------------------------------------------------------ shared shapes


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How much of `text` is safe to show as content while markers may still arrive: all
    but a tail that some marker starts with."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                longest = max(longest, k)
                break
    return len(text) - longest


def _content(before: str, after: str = "") -> str:
    """Content around calls: the text before them without its trailing whitespace (which
    a stream holds back, not knowing yet whether a call follows), and text after them
    unless it is only whitespace."""
    return before.rstrip() + (after if after.strip() else "")


def _no_call(text: str, final: bool, markers: tuple[str, ...]) -> Parsed:
    if final:
        return Parsed(text)
    return Parsed(text[: _held_back(text, markers)].rstrip())


def _call_list(
    text: str,
    i: int,
    final: bool,
    *,
    open_: str = "",
    separator: str = ",",
    close: str = "",
) -> tuple[list[ParsedCall], int, bool]:
    """JSON call objects from text[i]: `open_`, objects divided by `separator`, `close`.
    Returns the calls, where they end, and whether the text ended inside them."""
    calls: list[ParsedCall] = []
    i = _skip_ws(text, i)
    if open_:
        if i >= len(text):
            return calls, i, True
        if text[i] != open_:
            raise _Malformed(f"expected {open_!r}")
        i = _skip_ws(text, i + 1)
    while True:
        call, i = _scan_call_object(text, i, final)
        if i >= len(text) and (call is None or not call.complete):
            if call is not None:
                calls.append(call)
            return calls, i, True
        assert call is not None
        calls.append(call)
        i = _skip_ws(text, i)
        if i >= len(text):
            return calls, i, not final or bool(close)
        if text[i] == separator:
            i = _skip_ws(text, i + 1)
            continue
        if close:
            if text[i] != close:
                raise _Malformed(f"calls are divided by {separator!r} and end with {close!r}")
            return calls, i + 1, False
        return calls, i, False


# Finds calls from an index: returns them, where they end, and whether the text ended
# inside them.
CallsParser = Callable[[str, int, bool], tuple[list[ParsedCall], int, bool]]


def _parse_calls(text: str, final: bool, start: int, body: int, parse_calls: CallsParser) -> Parsed:
    """Content up to `start`, then the calls that `parse_calls(text, body, final)` finds
    (returning the calls, where they end, and whether the text ended inside them). An
    answer with a malformed call is all content."""
    before = text[:start]
    try:
        calls, end, open_ = parse_calls(text, body, final)
    except _Malformed:
        return Parsed(text if final else before.rstrip())
    if not final:
        return Parsed(before.rstrip(), calls)
    if open_ and not calls:
        return Parsed(text)
    return Parsed(_content(before, "" if open_ else text[end:]), calls)


def _parse_marked(
    text: str,
    final: bool,
    marker: str,
    parse_calls: CallsParser,
    markers: tuple[str, ...] = (),
) -> Parsed:
    """Content, then `marker` and the calls after it (`_parse_calls`)."""
    start = text.find(marker)
    if start < 0:
        return _no_call(text, final, markers or (marker,))
    return _parse_calls(text, final, start, start + len(marker), parse_calls)


# -------------------------------------------------------------------------- formats


class JsonArray(ToolCallFormat):
    """The output that `tool_choice` "required" or a named function constrains: a JSON
    array of `{"name": ..., "parameters": {...}}` (SGLang's and vLLM's shape)."""

    name = "json_array"

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = _parse_calls(text, final, 0, 0, self._array)
        return parsed if final else Parsed("", parsed.calls)

    @staticmethod
    def _array(text: str, i: int, final: bool) -> tuple[list[ParsedCall], int, bool]:
        return _call_list(text, i, final, open_="[", close="]")


class Qwen25(ToolCallFormat):
    """Qwen 2.5's and Hermes': `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one block per call."""

    name = "qwen25"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        return _parse_marked(text, final, self.OPEN, self._blocks)

    def _blocks(self, text: str, i: int, final: bool) -> tuple[list[ParsedCall], int, bool]:
        calls: list[ParsedCall] = []
        while True:
            found, i, open_ = _call_list(text, i, final)
            calls += found
            if open_ or i >= len(text):  # a last block the answer ended inside
                return calls, len(text), True
            if not text.startswith(self.CLOSE, i):
                if final or not self.CLOSE.startswith(text[i:]):
                    raise _Malformed(f"a call ends with {self.CLOSE}")
                return calls, len(text), True
            i = _skip_ws(text, i + len(self.CLOSE))
            if not text.startswith(self.OPEN, i):
                if not final and self.OPEN.startswith(text[i:]):
                    return calls, len(text), True
                return calls, i, False
            i += len(self.OPEN)


class Mistral(ToolCallFormat):
    """Mistral's: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`. `[TOOL_CALLS]` is
    a special token, in the text only with `skip_special_tokens: false`; without it, an
    answer that opens with the array is still read as calls."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool) -> Parsed:
        if self.MARKER not in text and text.lstrip().startswith("[{"):
            return _parse_calls(text, final, 0, 0, JsonArray._array)
        return _parse_marked(text, final, self.MARKER, JsonArray._array, (self.MARKER, "[{"))


class Llama3(ToolCallFormat):
    """Llama 3.1-3.3's JSON calls: `<|python_tag|>{"name": ..., "parameters": {...}}`,
    several divided by `;`, or such an object opening the answer without the tag (a special
    token, dropped from the text unless `skip_special_tokens: false`)."""

    name = "llama3"
    MARKER = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        if self.MARKER not in text and text.lstrip().startswith("{"):
            return _parse_calls(text, final, 0, 0, self._objects)
        return _parse_marked(text, final, self.MARKER, self._objects)

    @staticmethod
    def _objects(text: str, i: int, final: bool) -> tuple[list[ParsedCall], int, bool]:
        return _call_list(text, i, final, separator=";")


class Pythonic(ToolCallFormat):
    """Llama 3.2's and 4's pythonic calls: `[get_weather(city="Paris"), f(n=1)]`, keyword
    arguments of Python literals (`true`, `false`, `null` too). A call is known once its
    `)` closes it (before, `f(1)` or `[a(b)]` in prose may still turn out to be no call)."""

    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        i = 0
        while True:
            start = text.find("[", i)
            if start < 0:
                return _no_call(text, final, ("[",))
            opening = _PYTHONIC_OPENING.match(text, start)
            if opening is None:
                # Not a call list, unless the text ends where it could become one.
                if not final and _PYTHONIC_PREFIX.fullmatch(text, start):
                    return Parsed(text[:start].rstrip())
                i = start + 1
                continue
            try:
                calls, end, open_ = self._calls(text, start + 1, final)
            except _Malformed:
                i = start + 1
                continue
            if final and open_ and not calls:
                i = start + 1
                continue
            before = text[:start]
            if not final:
                return Parsed(before.rstrip(), calls)
            return Parsed(_content(before, "" if open_ else text[end:]), calls)

    @staticmethod
    def _calls(text: str, i: int, final: bool) -> tuple[list[ParsedCall], int, bool]:
        calls: list[ParsedCall] = []
        while True:
            i = _skip_ws(text, i)
            if i >= len(text):
                return calls, len(text), True
            m = _IDENTIFIER.match(text, i)
            if m is None:
                raise _Malformed("a pythonic call starts with a name")
            paren = _skip_ws(text, m.end())
            if paren >= len(text):
                return calls, len(text), True
            if text[paren] != "(":
                raise _Malformed("a pythonic call's name is followed by '('")
            end = _scan_python_call(text, paren)
            if end is None:
                return calls, len(text), True
            calls.append(ParsedCall(m.group(), _python_arguments(text[i:end]), True))
            i = _skip_ws(text, end)
            if i >= len(text):
                return calls, i, True
            if text[i] == ",":
                i += 1
                continue
            if text[i] == "]":
                return calls, i + 1, False
            raise _Malformed("pythonic calls are divided by ',' and end with ']'")


_PYTHONIC_OPENING = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.-]*\s*\(")
_PYTHONIC_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][A-Za-z0-9_.-]*\s*)?")
_LITERAL_NAMES = {"true": True, "false": False, "null": None}


def _scan_python_call(text: str, i: int) -> int | None:
    """The index past the `)` that closes the `(` at text[i] (None: the text ends first)."""
    return _scan_nested(text, i, "\"'", "([{", ")]}")


def _scan_nested(text: str, i: int, quotes: str, opening: str, closing: str) -> int | None:
    """The index past the bracket that closes the one at text[i], skipping quoted strings
    (None: the text ends first)."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c in quotes:
            end = _scan_string(text, i, c)
            if end is None:
                return None
            i = end
            continue
        if c in opening:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _python_arguments(source: str) -> str:
    """The JSON text of a pythonic call's keyword arguments."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as exc:
        raise _Malformed(str(exc)) from None
    if not isinstance(node, ast.Call) or node.args:
        raise _Malformed("a pythonic call takes keyword arguments only")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise _Malformed("no **arguments in a pythonic call")
        arguments[keyword.arg] = _literal(keyword.value)
    return json.dumps(arguments, ensure_ascii=False)


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:
        return _LITERAL_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        pairs = zip(node.keys, node.values, strict=True)
        return {_literal(k) if k else None: _literal(v) for k, v in pairs}
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        raise _Malformed("a pythonic call's arguments are literals") from None


# `--tool-call-parser` names (SGLang's; hermes is Qwen 2.5's format).
FORMATS: dict[str, type[ToolCallFormat]] = {
    "llama3": Llama3,
    "qwen25": Qwen25,
    "hermes": Qwen25,
    "mistral": Mistral,
    "pythonic": Pythonic,
}
