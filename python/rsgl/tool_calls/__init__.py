"""Tool calling on /v1/chat/completions: what a request's tool fields ask for
(`request`), the formats models write calls in (`parsers`), and a streamed answer's
content and calls as OpenAI's deltas (`stream`). Torch-free: the server's frontend runs it."""

from rsgl.tool_calls.parsers import FORMATS, Parsed, ParsedCall, ToolCallFormat
from rsgl.tool_calls.request import ToolPlan, plan
from rsgl.tool_calls.stream import Delta, ToolCallStream, tool_call

__all__ = [
    "FORMATS",
    "Delta",
    "Parsed",
    "ParsedCall",
    "ToolCallFormat",
    "ToolCallStream",
    "ToolPlan",
    "plan",
    "tool_call",
]
