"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for.

- `none` (the default without tools): no call. The tools do not reach the chat template
  (SGLang's choice; vLLM passes them unless told otherwise), and the answer is content.
- `auto` (the default with tools): the tools reach the template and the model decides;
  its calls are read from its own format by the server's `--tool-call-parser`. Without a
  parser the answer is content, as SGLang's.
- `required`, or a named function (`{"type": "function", "function": {"name": ...}}`):
  the output is constrained to a JSON array of calls, `[{"name": ..., "parameters": {...}}]`,
  each call's parameters matching its tool's schema (SGLang's and vLLM's constraint), so
  that it cannot fail to parse; `parallel_tool_calls: false` allows one call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rsgl.errors import InvalidRequest
from rsgl.tool_calls.parsers import FORMATS, JsonArray, ToolCallFormat

# OpenAI's rule for a function's name.
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A function given no parameters takes none.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a chat request is served: the tools its chat template sees (None: no tools),
    the JSON schema its output must match (calls forced), and the format its calls are
    read in (None: the answer is content)."""

    template_tools: list[dict[str, Any]] | None = None
    json_schema: str | None = None
    fmt: ToolCallFormat | None = None


def plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any, parser: str | None) -> ToolPlan:
    """The ToolPlan of a request's tool fields, checked (InvalidRequest naming the field);
    `parser` is the server's `--tool-call-parser`."""
    functions = check_tools(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false", "parallel_tool_calls")
    choice, named = _check_tool_choice(tool_choice, functions)
    if choice == "none":
        return ToolPlan()
    template_tools = [{"type": "function", "function": f} for f in functions.values()]
    if choice == "auto":
        fmt = FORMATS[parser]() if parser is not None else None
        return ToolPlan(template_tools, None, fmt)
    chosen = [functions[named]] if named is not None else list(functions.values())
    schema = forced_calls_schema(chosen, parallel=parallel_tool_calls is not False)
    return ToolPlan(template_tools, json.dumps(schema), JsonArray())


def forced_calls_schema(functions: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    """The JSON schema of an answer that calls some of `functions`: an array of
    `{"name", "parameters"}` objects, at least one (only one unless `parallel`)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": f.get("parameters", _NO_PARAMETERS),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """The request's functions by name: `tools` is null or a list of
    `{"type": "function", "function": {name, description?, parameters?, strict?}}`."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of function tools", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidRequest(
                f'{where} must be {{"type": "function", "function": {{...}}}} (the only kind '
                "of tool this server calls)",
                "tools",
            )
        f = tool.get("function")
        if not isinstance(f, Mapping):
            raise InvalidRequest(f"{where}.function must be an object", "tools")
        name = f.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise InvalidRequest(
                f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools"
            )
        if name in functions:
            raise InvalidRequest(f"{where}: two tools are named {name!r}", "tools")
        if not isinstance(f.get("description", ""), str | None):
            raise InvalidRequest(f"{where}.function.description must be a string", "tools")
        parameters = f.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidRequest(
                f"{where}.function.parameters must be a JSON schema object", "tools"
            )
        if not isinstance(f.get("strict"), bool | None):
            raise InvalidRequest(f"{where}.function.strict must be true or false", "tools")
        functions[name] = {k: v for k, v in f.items() if v is not None}
    return functions


def _check_tool_choice(choice: Any, functions: Mapping[str, Any]) -> tuple[str, str | None]:
    """ "none", "auto" or "required", and the name of the function to call if one is
    named (then "required")."""
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidRequest(
                f"tool_choice must be one of none, auto, required or "
                f'{{"type": "function", "function": {{"name": ...}}}}; got {choice!r}',
                "tool_choice",
            )
        if choice == "required" and not functions:
            raise InvalidRequest('tool_choice "required" needs tools', "tool_choice")
        return (choice if functions else "none"), None
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or name is None:
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in functions:
        known = ", ".join(sorted(functions)) or "none"
        raise InvalidRequest(
            f"tool_choice names function {name!r}, which is not in tools (given: {known})",
            "tool_choice",
        )
    return "required", str(name)
