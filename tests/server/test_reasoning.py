"""Reasoning separation through a real server (`--reasoning-parser`) and the `openai`
client: `reasoning_content` apart from the content in answers and stream deltas,
`separate_reasoning` and `stream_reasoning`, qwen3's `enable_thinking`, and a constraint that
applies only once the reasoning has ended.

The embedded model does not think. Under deepseek-r1 every answer starts inside a reasoning,
so whatever it writes is reasoning until it writes `</think>`; one prompt, nudged by a
logit_bias toward the marker's tokens, makes it write the marker first."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from launcher import launch, stop

MODEL = "SmolLM2-135M-Instruct"
# The embedded tokenizer writes `</think>` as `</`, `think`, `>`; favouring the first two
# makes the model open its answer with the marker for this prompt.
MARKER_PROMPT = "Print the HTML-like tag </think> followed by the number 7."
MARKER_BIAS = {"9617": 3, "17400": 3}
QUESTION = "How many legs has a cat?"


def serve(tmp_path_factory: pytest.TempPathFactory, parser: str) -> Iterator[openai.OpenAI]:
    log_path = tmp_path_factory.mktemp(f"reasoning-{parser}") / "server.log"
    proc, url = launch(
        log_path, "--max-total-tokens", "20000", "--dtype", "float32", "--reasoning-parser", parser
    )
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    stop(proc, log_path)


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from serve(tmp_path_factory, "deepseek-r1")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from serve(tmp_path_factory, "qwen3")


def ask(client: openai.OpenAI, prompt: str, **kw: Any) -> Any:
    extra = kw.pop("extra_body", None)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=kw.pop("max_tokens", 24),
        extra_body=extra,
        **kw,
    ).choices[0]


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_an_answer_that_never_ends_its_reasoning_is_all_reasoning(r1: openai.OpenAI) -> None:
    whole = ask(r1, QUESTION, extra_body={"separate_reasoning": False}).message.content
    assert whole and "</think>" not in whole
    split = ask(r1, QUESTION).message
    assert reasoning_of(split) == whole
    assert split.content == ""


def test_a_stream_carries_reasoning_deltas_apart_from_content(r1: openai.OpenAI) -> None:
    whole = ask(r1, QUESTION).message
    for stream_reasoning in (True, False):
        chunks = r1.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=24,
            stream=True,
            extra_body={"stream_reasoning": stream_reasoning},
        )
        pieces = [
            (c.choices[0].delta.model_extra or {}).get("reasoning_content")
            for c in chunks
            if c.choices
        ]
        said = [p for p in pieces if p]
        assert "".join(said) == reasoning_of(whole)
        # Streamed as it comes, or (stream_reasoning false) in one piece at the end.
        assert len(said) > 1 if stream_reasoning else len(said) == 1


def test_a_constraint_waits_for_the_reasoning_to_end(r1: openai.OpenAI) -> None:
    # The regex forbids what the reasoning writes, so only the gate lets it through ...
    held = ask(r1, QUESTION, extra_body={"regex": "(yes|no)"})
    assert not re.fullmatch("(yes|no)", reasoning_of(held.message) or "")
    assert held.message.content == ""
    # ... and from the end marker on the output is the regex's.
    kw: dict[str, Any] = {"logit_bias": MARKER_BIAS}
    raw = ask(
        r1, MARKER_PROMPT, extra_body={"regex": "(yes|no)", "separate_reasoning": False}, **kw
    )
    text = raw.message.content or ""
    assert "</think>" in text, f"the prompt no longer makes the model end its reasoning: {text!r}"
    before, after = text.split("</think>", 1)
    assert re.fullmatch("(yes|no)", after), text
    assert raw.finish_reason == "stop"
    split = ask(r1, MARKER_PROMPT, extra_body={"regex": "(yes|no)"}, **kw).message
    assert (reasoning_of(split) or "", split.content) == (before, after)


def test_require_reasoning_on_generate_gates_its_constraint(r1: openai.OpenAI) -> None:
    url = str(r1.base_url).removesuffix("/v1/")
    body = {
        "text": QUESTION,
        "require_reasoning": True,
        "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 12, "temperature": 0},
    }
    out = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    assert not re.fullmatch("(yes|no)", out["text"])
    meta = out["meta_info"]
    assert meta["reasoning_tokens"] == meta["completion_tokens"] > 0  # it never ended
    body["require_reasoning"] = False
    out = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    assert re.fullmatch("(yes|no)", out["text"]), out
    assert "reasoning_tokens" not in out["meta_info"]


def test_qwen3_reasons_unless_enable_thinking_is_false(qwen3: openai.OpenAI) -> None:
    thinking = ask(qwen3, QUESTION, extra_body={"regex": "(yes|no)"})
    # All reasoning (the model never writes `</think>`), so the regex never applies.
    assert reasoning_of(thinking.message) and thinking.message.content == ""
    assert not re.fullmatch("(yes|no)", reasoning_of(thinking.message) or "")
    off = {"chat_template_kwargs": {"enable_thinking": False}, "regex": "(yes|no)"}
    plain = ask(qwen3, QUESTION, extra_body=off)
    assert reasoning_of(plain.message) is None
    assert re.fullmatch("(yes|no)", plain.message.content or "")
    assert plain.finish_reason == "stop"
    # A prompt that has opened the reasoning reasons, enable_thinking or not.
    opened = qwen3.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "<think>"},
        ],
        temperature=0,
        max_tokens=24,
        extra_body=dict(off, continue_final_message=True),
    ).choices[0]
    assert reasoning_of(opened.message) and opened.message.content == ""
    assert not re.fullmatch("(yes|no)", reasoning_of(opened.message) or "")


def test_usage_counts_the_reasoning_tokens(r1: openai.OpenAI, qwen3: openai.OpenAI) -> None:
    def usage(client: openai.OpenAI, prompt: str, **kw: Any) -> tuple[Any, Any]:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=24,
            **kw,
        )
        assert out.usage is not None and out.usage.completion_tokens_details is not None
        return out, out.usage

    # A reasoning that never ends is every token of the answer, in each of two choices.
    out, used = usage(r1, QUESTION, n=2)
    assert len(out.choices) == 2 and used.completion_tokens > 2
    assert used.completion_tokens_details.reasoning_tokens == used.completion_tokens
    # One that ends: its tokens up to the end marker's three (`</`, `think`, `>`), and none
    # of the answer after it; the stream's usage says the same.
    answer = {"regex": "(yes|no)"}  # after the reasoning, a short answer
    out, used = usage(r1, MARKER_PROMPT, logit_bias=MARKER_BIAS, extra_body=answer)
    message = out.choices[0].message
    assert message.content, "the prompt no longer makes the model end its reasoning"
    reasoning = used.completion_tokens_details.reasoning_tokens
    assert 3 <= reasoning < used.completion_tokens
    if not reasoning_of(message):
        assert reasoning == 3
    chunks = list(
        r1.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": MARKER_PROMPT}],
            temperature=0,
            max_tokens=24,
            logit_bias=MARKER_BIAS,
            extra_body=answer,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = chunks[-1].usage
    assert streamed is not None and streamed.completion_tokens_details is not None
    assert streamed.completion_tokens_details.reasoning_tokens == reasoning
    # A request that does not reason has none.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    _, used = usage(qwen3, QUESTION, extra_body=off)
    assert used.completion_tokens_details.reasoning_tokens == 0 < used.completion_tokens
