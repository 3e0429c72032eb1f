"""Each `--tool-call-parser` format on crafted model outputs: the whole answer's content and
calls, and the same answer streamed in random pieces, whose deltas add up to the whole
answer's (content as content until a call begins, each call's id and name before its
arguments)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from rsgl.tool_calls import FORMATS, ToolCallFormat, ToolCallStream
from rsgl.tool_calls.parsers import JsonArray

WEATHER = {"city": "Paris", "days": [1, 2], "note": 'a "}" {brace}'}
# (format, model output, content, [(name, arguments)]).
CASES: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (
        "qwen25",
        "Let me check.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + "\n</tool_call>\n<tool_call>\n"
        + '{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',
        "",
        [("f", {"x": 1})],
    ),
    (
        "qwen25",
        # Cut off after the arguments: still a call.
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}',
        "",
        [("f", {"x": 1})],
    ),
    (
        "mistral",
        "Sure. [TOOL_CALLS] ["
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + ', {"name": "g", "arguments": {"n": null}}]',
        "Sure.",
        [("get_weather", WEATHER), ("g", {"n": None})],
    ),
    (
        "mistral",
        ' [{"name": "f", "arguments": "{\\"x\\": 2}"}]',  # no marker; arguments encoded twice
        "",
        [("f", {"x": 2})],
    ),
    (
        "llama3",
        "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": WEATHER}),
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3",
        'I will look it up.<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; '
        '{"name": "b", "parameters": {}}',
        "I will look it up.",
        [("a", {"q": "x;y"}), ("b", {})],
    ),
    (
        "llama3",
        '  {"name": "f", "parameters": {"deep": {"a": [1, {"b": "]"}]}}}',
        "",
        [("f", {"deep": {"a": [1, {"b": "]"}]}})],
    ),
    (
        "pythonic",
        'See [1] first. [get_weather(city="Paris", days=[1, 2], on=True, x=null), '
        "get_time(tz='UTC')]",
        "See [1] first.",
        [("get_weather", {"city": "Paris", "days": [1, 2], "on": True, "x": None})]
        + [("get_time", {"tz": "UTC"})],
    ),
    (
        "pythonic",
        "[f()]",
        "",
        [("f", {})],
    ),
]

# Outputs with no call in them, or none that is well-formed: all content.
NO_CALLS = [
    ("qwen25", "Paris is sunny today.\n"),
    ("qwen25", "I would use <tool_call> here, but no."),
    ("qwen25", "<tool_call>\nnot json\n</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("mistral", "Use [TOOL_CALLS] wisely."),
    ("mistral", "[1, 2] are numbers"),
    ("llama3", "The answer is {x}."),
    ("llama3", '{"answer": 42}'),
    ("pythonic", "Lists look like [1, 2] and [a, b]."),
    ("pythonic", "[print('hi') + 1]"),
]


def whole(fmt: ToolCallFormat, text: str) -> tuple[str, list[tuple[str | None, Any]]]:
    parsed = fmt.parse(text, final=True)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def streamed(
    fmt: ToolCallFormat, text: str, rng: random.Random
) -> tuple[str, list[tuple[str | None, Any]]]:
    """The stream's deltas for `text` cut at random places, put back together; checks the
    order OpenAI's clients rely on."""
    stream = ToolCallStream(fmt)
    content = ""
    calls: list[dict[str, Any]] = []
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    for d in deltas:
        content += d.content
        for entry in d.tool_calls:
            index = entry["index"]
            if index == len(calls):  # a new call: its header comes first, arguments empty
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                assert entry["function"]["name"] and entry["function"]["arguments"] == ""
                calls.append({"name": entry["function"]["name"], "arguments": ""})
            else:
                assert set(entry) == {"index", "function"}
                assert set(entry["function"]) == {"arguments"}
                calls[index]["arguments"] += entry["function"]["arguments"]
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_answer_gives_its_content_and_calls(
    parser: str, text: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    assert whole(FORMATS[parser](), text) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_streamed_answer_adds_up_to_the_whole_answer(
    parser: str, text: str, content: str, calls: list[tuple[str, Any]]
) -> None:
    rng = random.Random(f"{parser}:{text}")
    for _ in range(40):
        assert streamed(FORMATS[parser](), text, rng) == (content, calls)


@pytest.mark.parametrize(("parser", "text"), NO_CALLS)
def test_text_without_a_well_formed_call_is_content(parser: str, text: str) -> None:
    assert whole(FORMATS[parser](), text) == (text, [])
    rng = random.Random(text)
    for _ in range(20):
        assert streamed(FORMATS[parser](), text, rng) == (text, [])


def test_content_streams_before_the_call_begins() -> None:
    stream = ToolCallStream(FORMATS["qwen25"]())
    assert stream.feed("It is ").content == "It is"
    assert stream.feed("sunny. <tool").content == " sunny."  # `<tool` may open a call
    d = stream.feed('_call>\n{"name": "f", "arguments": {"x"')
    assert d.content == ""
    header, arguments = d.tool_calls
    assert header["function"] == {"name": "f", "arguments": ""}
    assert arguments == {"index": 0, "function": {"arguments": '{"x"'}}
    assert stream.feed(": 1}}\n</tool_call>").tool_calls == [
        {"index": 0, "function": {"arguments": ": 1}"}}
    ]
    assert stream.finish().tool_calls == []


def test_an_answer_cut_off_keeps_its_last_call_with_the_arguments_so_far() -> None:
    parsed = JsonArray().parse('[{"name": "f", "parameters": {"city": "Par', final=True)
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == [
        ("f", '{"city": "Par', False)
    ]


def test_the_forced_array_streams_no_content() -> None:
    text = ' [{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    rng = random.Random(0)
    for _ in range(40):
        assert streamed(JsonArray(), text, rng) == ("", [("f", {"a": 1}), ("g", {})])


def test_an_answer_cut_off_before_a_calls_name_keeps_the_calls_before_it() -> None:
    text = '[{"name": "f", "parameters": {}}, {"name":'
    parsed = JsonArray().parse(text, final=True)
    assert parsed.content == "" and [c.name for c in parsed.calls] == ["f"]
