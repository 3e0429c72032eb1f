"""What a chat request's tool fields ask for: the tools the template sees, the schema that
forces calls under `required` or a named function, the parser `auto` reads calls with, and
400s naming the field for malformed tools or choices."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from rsgl.errors import InvalidRequest
from rsgl.tool_calls import plan
from rsgl.tool_calls.parsers import JsonArray, Qwen25

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def valid(schema: str, value: Any) -> bool:
    try:
        jsonschema.validate(value, json.loads(schema))
    except jsonschema.ValidationError:
        return False
    return True


def test_required_forces_an_array_of_calls_to_any_tool() -> None:
    p = plan([WEATHER, TIME], "required", None, None)
    assert p.template_tools == [WEATHER, TIME]
    assert isinstance(p.fmt, JsonArray) and p.json_schema is not None
    two = [
        {"name": "get_time", "parameters": {}},
        {"name": "get_weather", "parameters": {"city": "x"}},
    ]
    assert valid(p.json_schema, two)
    assert not valid(p.json_schema, [])
    assert not valid(p.json_schema, [{"name": "get_weather", "parameters": {}}])
    assert not valid(p.json_schema, [{"name": "other", "parameters": {}}])


def test_a_named_function_and_no_parallel_calls_allow_one_call_of_it() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    p = plan([WEATHER, TIME], named, False, "qwen25")
    assert p.json_schema is not None
    assert valid(p.json_schema, [{"name": "get_weather", "parameters": {"city": "x"}}])
    assert not valid(p.json_schema, [{"name": "get_time", "parameters": {}}])
    call = {"name": "get_weather", "parameters": {"city": "x"}}
    assert not valid(p.json_schema, [call, call])


def test_auto_reads_calls_with_the_servers_parser_and_none_sends_no_tools() -> None:
    auto = plan([WEATHER], None, None, "qwen25")
    assert auto.template_tools == [WEATHER] and auto.json_schema is None
    assert isinstance(auto.fmt, Qwen25)
    assert plan([WEATHER], "auto", None, None).fmt is None  # no parser: content
    none = plan([WEATHER], "none", None, "qwen25")
    assert (none.template_tools, none.json_schema, none.fmt) == (None, None, None)
    assert plan(None, "auto", None, "qwen25").template_tools is None


@pytest.mark.parametrize(
    ("tools", "choice", "param", "says"),
    [
        ({"type": "function"}, None, "tools", "must be a list"),
        ([{"type": "code_interpreter"}], None, "tools", "tools[0] must be"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools", "letters"),
        ([WEATHER, WEATHER], None, "tools", "two tools are named"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            None,
            "tools",
            "JSON schema object",
        ),
        ([WEATHER], "always", "tool_choice", "must be one of"),
        (None, "required", "tool_choice", "needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "f"}}, "tool_choice", "not in"),
        ([WEATHER], {"type": "custom", "name": "f"}, "tool_choice", "tool_choice must be"),
    ],
)
def test_malformed_tools_and_choices_are_400s_naming_the_field(
    tools: Any, choice: Any, param: str, says: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        plan(tools, choice, None, None)
    assert raised.value.param == param and says in raised.value.message
