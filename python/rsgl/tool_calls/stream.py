"""A streamed answer's content and tool calls as OpenAI's chunk deltas.

Every piece of text re-parses the answer so far with its format (`ToolCallFormat.parse`)
and sends what grew since the last piece: new content, a new call's header (`index`, `id`,
`type`, `function.name` with empty `arguments`), then its arguments' new characters. One
parse for whole and streamed answers keeps them equal; tool-call answers are short, so
parsing the text so far again costs little. A stream cannot take back what it sent: if the
text turns out otherwise (a call that is not well-formed after all), what it sent stands and
the rest comes as content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from rsgl.tool_calls.parsers import Parsed, ParsedCall, ToolCallFormat


def call_id() -> str:
    """A tool call's id, OpenAI-style."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call: ParsedCall) -> dict[str, Any]:
    """A whole answer's `message.tool_calls` entry."""
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass(slots=True)
class _SentCall:
    name: str
    arguments: str = ""


@dataclass(slots=True)
class Delta:
    """What one piece of text adds: content, and tool-call deltas in OpenAI's shape."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream:
    """One choice's answer as it streams: `feed` each piece, `finish` at the end."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.content = ""
        self.calls: list[_SentCall] = []

    def feed(self, piece: str) -> Delta:
        self.text += piece
        return self._grown(self.fmt.parse(self.text, final=False))

    def finish(self) -> Delta:
        """What the whole answer adds to what was sent."""
        return self._grown(self.fmt.parse(self.text, final=True))

    def _grown(self, parsed: Parsed) -> Delta:
        delta = Delta()
        if parsed.content.startswith(self.content):
            delta.content = parsed.content[len(self.content) :]
            self.content = parsed.content
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self.calls):
                self.calls.append(_SentCall(call.name))
                header = {"name": call.name, "arguments": ""}
                delta.tool_calls.append(
                    {"index": index, "id": call_id(), "type": "function", "function": header}
                )
            sent = self.calls[index]
            if sent.name != call.name:
                break
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(
                sent.arguments
            ):
                more = call.arguments[len(sent.arguments) :]
                sent.arguments = call.arguments
                delta.tool_calls.append({"index": index, "function": {"arguments": more}})
        return delta
