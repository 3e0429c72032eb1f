"""The tools and a tool round in the history reach the chat template, in the shape HF
templates take (the embedded model's tokenizer with a template that prints them)."""

from __future__ import annotations

import pytest

from rsgl.errors import InvalidRequest
from rsgl.models.loader import resolve_model_dir
from rsgl.tokenizer.loader import load_tokenizer
from rsgl.validation import RequestLimits, check_messages, tokenize_prompt

LIMITS = RequestLimits(vocab_size=49152, context_length=8192, max_prompt_len=8192)
# Prints what a tools-aware template (Qwen 2.5's, Llama 3.1's) reads.
TEMPLATE = (
    "{% for t in tools %}[tool {{ t.function.name }} {{ t.function.parameters | tojson }}]"
    "{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} city="
    "{{ c.function.arguments.city }}]{% endfor %}{% endfor %}"
)


def test_tools_and_tool_turns_reach_the_template() -> None:
    tokenizer = load_tokenizer(resolve_model_dir(None))
    tokenizer.chat_template = TEMPLATE
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object"}},
        }
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
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
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]
    ids = tokenize_prompt(tokenizer, LIMITS, messages=messages, tools=tools)
    assert tokenizer.decode(ids) == (
        '[tool get_weather {"type": "object"}]<user>Weather?<assistant>'
        "[call get_weather city=Paris]<tool>Sunny"
    )


def test_tool_calls_are_checked_and_only_assistants_carry_them() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cases = [
        ([{"role": "user", "content": "x", "tool_calls": [call]}], "only assistant"),
        ([{"role": "assistant", "content": None, "tool_calls": call}], "must be a list"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}], "must be"),
    ]
    for messages, says in cases:
        with pytest.raises(InvalidRequest) as raised:
            check_messages(messages)
        assert says in raised.value.message and raised.value.param.startswith("messages.0")
    kept = check_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert kept[0]["tool_calls"][0]["function"]["arguments"] == {}
