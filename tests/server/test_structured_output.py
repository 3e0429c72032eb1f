"""Structured outputs through a real server and real clients: the `openai` client's
`chat.completions.parse` with a pydantic model, `response_format` json_object and
json_schema on chat and completions, SGLang's extras and /generate's sampling params; bad
constraints answer 400 in the OpenAI shape with the compiler's message, and the server keeps
serving; a client that leaves while its grammar still compiles is aborted cleanly, nothing
held, while the server serves everyone else."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from launcher import launch, stop
from pydantic import BaseModel, Field

from rsgl.bench.grammar import pathological_regex

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("structured") / "server.log"
    proc, url = launch(log_path, "--max-total-tokens", "20000", "--dtype", "float32")
    yield url
    stop(proc, log_path)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=100_000_000)


def test_openai_parse_returns_a_validated_pydantic_object(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_response_format_gives_a_json_object(
    client: openai.OpenAI, stream: bool
) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "List three colors."}],
        "response_format": {"type": "json_object"},
        "max_tokens": 120,
        "temperature": 0,
    }
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(stream=True, **kw)
        )
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content or ""
    assert isinstance(json.loads(text), dict), text


def test_completions_take_a_json_schema_and_sglang_extras(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    out = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer in JSON:",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    phone = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=20,
        temperature=0,
        extra_body={"regex": r" \(\d{3}\) \d{3}-\d{4}"},
    )
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", phone.choices[0].text)
    assert phone.choices[0].finish_reason == "stop"


def test_generate_takes_sampling_param_constraints(server: str) -> None:
    body = {
        "text": "Answer yes or no: is water wet?",
        "sampling_params": {"ebnf": 'root ::= " yes" | " no"', "max_new_tokens": 8},
    }
    out = httpx.post(f"{server}/generate", json=body, timeout=60).json()
    assert out["text"] in (" yes", " no"), out
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"regex": "a("}, None, "regex does not compile"),
        ({"json_schema": '{"type": "objekt"}'}, None, "json_schema does not compile"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "regex and ebnf are both set"),
        (
            {"response_format": {"type": "json_object"}, "regex": "a"},
            "regex",
            "response_format and regex are both set",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "not one of text"),
        ({"json_schema": "{nope"}, "json_schema", "not valid JSON"),
    ],
)
def test_a_bad_constraint_is_a_400_and_the_server_serves_on(
    client: openai.OpenAI, extra: dict[str, Any], param: str | None, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5, extra_body=extra)
    error = raised.value.body
    assert isinstance(error, dict) and says in error["message"], error
    if param is not None:
        assert error["param"] == param
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert ok.choices[0].text is not None


def test_require_reasoning_without_a_reasoning_parser_is_a_400(server: str) -> None:
    body = {
        "text": "Is water wet?",
        "require_reasoning": True,
        "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 4},
    }
    out = httpx.post(f"{server}/generate", json=body, timeout=60)
    assert out.status_code == 400, out.text
    assert "--reasoning-parser" in out.json()["error"]["message"]


def test_vllm_guided_fields_constrain_the_output(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    chat = {"model": MODEL, "max_tokens": 30, "temperature": 0}
    ask = [{"role": "user", "content": "Is the sky blue?"}]
    out = client.chat.completions.create(messages=ask, extra_body={"guided_json": schema}, **chat)
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)
    choices = ["blue sky", "green (grass)", "red?"]
    out = client.chat.completions.create(
        messages=ask, extra_body={"guided_choice": choices}, **chat
    )
    assert out.choices[0].message.content in choices
    assert out.choices[0].finish_reason == "stop"
    phone = client.completions.create(
        prompt="Call me at", extra_body={"guided_regex": r" \d{3}-\d{4}"}, **chat
    )
    assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text)
    said = client.completions.create(
        prompt="Answer:", extra_body={"guided_grammar": 'root ::= " yes" | " no"'}, **chat
    )
    assert said.choices[0].text in (" yes", " no")


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"regex": "a", "guided_json": {}}, "guided_json", "regex and guided_json are both"),
        (
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "guided_choice",
            "response_format and guided_choice are both set",
        ),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "--grammar-backend"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    ],
)
def test_a_guided_field_rsgl_cannot_honour_is_a_400_naming_it(
    client: openai.OpenAI, extra: dict[str, Any], param: str, says: str
) -> None:
    for create in (client.completions.create, client.chat.completions.create):
        kw: dict[str, Any] = {"prompt": "hi"}
        if create == client.chat.completions.create:
            kw = {"messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(openai.BadRequestError) as raised:
            create(model=MODEL, max_tokens=5, extra_body=extra, **kw)  # type: ignore[call-overload]
        error = raised.value.body
        assert isinstance(error, dict) and says in error["message"], error
        assert error["param"] == param


# xgrammar compiles each bounded run of "any character" in this regex for most of a second
# (8 runs: 6 s on the Sapphire Rapids development machine, longer on slower ones): a real
# compile that is still under way when its client leaves.
SLOW_REGEX = pathological_regex(8, "slow")


@pytest.fixture(scope="module")
def xgrammar_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("structured-xgrammar") / "server.log"
    flags = ("--max-total-tokens", "20000", "--grammar-backend", "xgrammar")
    proc, url = launch(log_path, *flags, "--grammar-compile-timeout", "300")
    yield url
    stop(proc, log_path)


def server_stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/get_server_info", timeout=10).json()["stats"])


async def until(url: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The server's stats once `check` holds (polled; fails after a generous deadline)."""
    deadline = time.monotonic() + 300
    while True:
        stats = await asyncio.to_thread(server_stats, url)
        # Empty until the scheduler's first snapshot has arrived.
        if stats and check(stats):
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"the server never got there: {stats}")
        await asyncio.sleep(0.1)


def test_a_client_gone_while_its_grammar_compiles_is_aborted_and_nothing_leaks(
    xgrammar_server: str,
) -> None:
    url = xgrammar_server
    slow_body = {"model": MODEL, "prompt": "Text:", "max_tokens": 2000, "regex": SLOW_REGEX}
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    quick = {"type": "json_schema", "json_schema": {"name": "quick", "schema": answer}}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            before = await until(url, lambda s: s["live"] == 0 and "grammar_waiting" in s)
            slow = asyncio.ensure_future(client.post("/v1/completions", json=slow_body))
            await until(url, lambda s: s["grammar_waiting"] == 1)
            # Served while it compiles: a free request and a constrained one (another
            # compile: the pool has two threads).
            free = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
            r = await client.post("/v1/completions", json=free)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            constrained = dict(free, prompt="OK? JSON:", max_tokens=40, response_format=quick)
            r = await client.post("/v1/completions", json=constrained)
            assert r.status_code == 200, r.text
            assert isinstance(json.loads(r.json()["choices"][0]["text"])["ok"], bool)
            assert server_stats(url)["grammar_waiting"] == 1  # the slow one still compiles
            slow.cancel()  # the client hangs up
            with pytest.raises(asyncio.CancelledError):
                await slow
            await until(url, lambda s: s["grammar_waiting"] == 0)
            # The same schema again waits for the compile still under way (or hits the
            # cache): once it answers, the abandoned request can no longer start.
            again = dict(slow_body, max_tokens=1)
            r = await client.post("/v1/completions", json=again)
            assert r.status_code == 200, r.text
            # Stats arrive from the scheduler between steps: wait for a snapshot that has
            # counted the last request (an older one is idle too).
            idle = await until(
                url,
                lambda s: (
                    s["live"] == 0 and s["running"] == 0 and s["requests"] - before["requests"] >= 3
                ),
            )
            # It never reached the scheduler (three requests did: free, quick, again),
            # and nothing is held once idle.
            assert idle["requests"] - before["requests"] == 3, (before, idle)
            assert idle["aborts"] == before["aborts"]
            assert idle["held"] == 0 and idle["protected"] == 0, idle
            assert idle["grammar_compiles"] - before["grammar_compiles"] == 2

    asyncio.run(scenario())
