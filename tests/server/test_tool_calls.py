"""Tool calling through a real `rsgl serve --tool-call-parser qwen25` and the `openai`
client: `required` and a named function give calls that parse and match their tool's
schema, whole and streamed (id and name before the arguments); `auto` reads the model's own
calls (a regex makes the tiny model write one) and leaves prose as content; tool turns in
the history reach the template; malformed tool fields are 400s naming them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from launcher import launch, stop

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]
# Makes the model write a call in Qwen 2.5's format, which `auto` must then find.
QWEN_CALL = (
    r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,8}", "days": [1-7]\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log_path = tmp_path_factory.mktemp("tool_calls") / "server.log"
    proc, url = launch(
        log_path,
        "--max-total-tokens",
        "20000",
        "--dtype",
        "float32",
        "--tool-call-parser",
        "qwen25",
    )
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    stop(proc, log_path)


def check_calls(calls: list[tuple[str, str]], names: set[str], reason: str | None) -> None:
    """Each (name, arguments) names a tool and its arguments are JSON matching its schema;
    an answer cut off by max_tokens (the tiny model may call tools until it is) has all but
    its last call whole."""
    assert calls and reason in ("tool_calls", "length")
    whole = calls if reason == "tool_calls" else calls[:-1]
    assert whole or reason == "tool_calls"
    assert {name for name, _ in calls} <= names
    for name, arguments in whole:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed answer's content, calls and finish reason, put together from its deltas,
    checking that each call's first delta carries its id and name and no arguments."""
    content, calls, reason = "", [], None
    ids: list[str] = []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            assert d.function is not None
            if d.index == len(calls):
                assert d.id and d.id.startswith("call_") and d.type == "function"
                assert d.function.name and d.function.arguments == ""
                ids.append(d.id)
                calls.append([d.function.name, ""])
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    assert len(set(ids)) == len(ids)
    return content, [(n, a) for n, a in calls], reason


@pytest.mark.parametrize(("parallel", "max_tokens"), [(False, 300), (True, 120)])
def test_required_gives_calls_that_match_their_tools(
    client: openai.OpenAI, parallel: bool, max_tokens: int
) -> None:
    done = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=max_tokens,
        temperature=0,
    )
    choice = done.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.message.content is None
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    pairs = [(c.function.name, c.function.arguments) for c in calls]
    check_calls(pairs, set(SCHEMAS), choice.finish_reason)
    if not parallel:
        assert len(calls) == 1 and choice.finish_reason == "tool_calls"


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=120,
        temperature=0.8,
        seed=3,
    )
    choice = done.choices[0]
    assert choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    check_calls(calls, {"get_time"}, choice.finish_reason)


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "get_weather"}}, False),
    ],
)
def test_forced_calls_stream_as_tool_call_deltas(
    client: openai.OpenAI, tool_choice: Any, parallel: bool
) -> None:
    content, calls, reason = streamed(
        client,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        max_tokens=120,
        temperature=0,
    )
    assert content == ""
    names = set(SCHEMAS) if tool_choice == "required" else {"get_weather"}
    check_calls(calls, names, reason)
    if not parallel:
        assert len(calls) == 1 and reason == "tool_calls"


def test_auto_reads_the_models_own_call(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 100,
        "temperature": 0,
        "extra_body": {"regex": QWEN_CALL},
    }
    done = client.chat.completions.create(model=MODEL, **kw)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    check_calls(calls, {"get_weather"}, choice.finish_reason)
    assert streamed(client, **kw) == ("Sure.", calls, "tool_calls")


def test_auto_without_a_call_is_content(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"messages": ASK, "tools": TOOLS, "max_tokens": 20, "temperature": 0}
    done = client.chat.completions.create(model=MODEL, **kw)
    choice = done.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert streamed(client, **kw) == (choice.message.content, [], choice.finish_reason)


def test_a_tool_round_in_the_history_is_taken(client: openai.OpenAI) -> None:
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."},
    ]
    done = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=10
    )
    assert done.choices[0].message.tool_calls is None
    assert done.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("kw", "param", "says"),
    [
        ({"functions": [TOOLS[0]["function"]]}, "functions", "give `tools`"),
        ({"tools": TOOLS, "function_call": {"name": "get_time"}}, "function_call", "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format constrains it too",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)
def test_malformed_tool_fields_are_400s_naming_them(
    client: openai.OpenAI, kw: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **kw)
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == param and says in error["message"]
