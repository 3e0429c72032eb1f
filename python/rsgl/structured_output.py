"""Structured output (constrained decoding: JSON schemas, regexes, grammars, tool calls).

rsgl does not constrain decoding yet. Until it does, every request field that asks for it is
refused here, in this one place, with a 400 naming the field: ignoring it would hand back
unconstrained text that the client takes for valid JSON or a tool call. Each field is
accepted at a value that asks for nothing (null, an empty string or list, OpenAI's
`{"type": "text"}` response format, a `tool_choice` that calls no tool). The work that
implements structured output replaces `check_unset` and these tables.
"""

from __future__ import annotations

import json
from typing import Any

from rsgl.errors import InvalidRequest

# SGLang's SamplingParams fields (in /generate's `sampling_params` and the Engine's, and at
# the top level of SGLang's OpenAI requests): name -> the values that ask for nothing.
SAMPLING_FIELDS: dict[str, tuple[Any, ...]] = {
    "json_schema": (None, ""),
    "regex": (None, ""),
    "ebnf": (None, ""),
    "structural_tag": (None, ""),
}

# OpenAI's request fields (`functions` and `function_call` are the deprecated spellings of
# `tools` and `tool_choice`). `tool_choice: "auto"` without tools calls none.
OPENAI_FIELDS: dict[str, tuple[Any, ...]] = {
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}

FIELDS: dict[str, tuple[Any, ...]] = {**SAMPLING_FIELDS, **OPENAI_FIELDS}


def is_unset(name: str, value: Any) -> bool:
    """Whether structured-output field `name` at `value` asks for nothing."""
    return any(_json_equal(value, nothing) for nothing in FIELDS[name])


def check_unset(name: str, value: Any) -> None:
    """Nothing if `value` leaves structured-output field `name` unset; InvalidRequest naming
    the field otherwise."""
    if not is_unset(name, value):
        shown = " or ".join(json.dumps(u) for u in FIELDS[name])
        raise InvalidRequest(
            f"{name} is not supported yet: this server cannot constrain its output (JSON "
            f"schemas, regexes, grammars, tool calls); leave it unset ({shown})",
            name,
        )


def _json_equal(a: Any, b: Any) -> bool:
    """`a == b` as JSON values: true and 1 differ, 1 and 1.0 do not."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b
