"""Every request field is honoured, accepted with no effect, or refused naming it: the table
(`rsgl.server.request_fields.RULES`) against the request models, the README and a real
`rsgl serve` on loopback (the official openai client for the OpenAI endpoints); and
`best_of`, which returns the candidates with the highest cumulative logprob."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from launcher import launch, stop
from pydantic import BaseModel

from rsgl.outputs import Output
from rsgl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    StreamOptions,
    TokenizeRequest,
)
from rsgl.server.request_fields import ENDPOINTS, RULES, Handling, markdown_table, rules_for
from rsgl.server.routes.common import Choice
from rsgl.server.routes.openai import best_of, cumulative_logprob

MODEL = "SmolLM2-135M-Instruct"
README = Path(__file__).resolve().parents[2] / "README.md"
MODELS: dict[str, type[BaseModel]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
    "generate": GenerateRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
}
REFUSING = (Handling.REFUSED,)
# Any value but an unset one: refused fields are not declared, so their type is never checked.
SET = "set"


# --------------------------------------------------------------------- the table itself


def test_the_readme_table_is_the_rules() -> None:
    text = README.read_text()
    block = re.search(r"<!-- request-fields:begin -->\n(.*)<!-- request-fields:end -->", text, re.S)
    assert block is not None
    assert block.group(1) == markdown_table(), "run: python -m rsgl.server.request_fields"


@pytest.mark.parametrize("endpoint", sorted(MODELS))
def test_honoured_fields_are_declared_and_refused_ones_are_not(endpoint: str) -> None:
    """A declared field is read by the route (and typed by pydantic); an undeclared one
    reaches `refuse_unsupported`. Every declared field is in the table."""
    declared = set(MODELS[endpoint].model_fields)
    if endpoint in ("completions", "chat"):
        declared |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
    listed = {name for name, _ in rules_for(endpoint)}
    honoured = {name for name, _ in rules_for(endpoint, Handling.HONOURED)}
    refused = {name for name, _ in rules_for(endpoint, *REFUSING)}
    assert honoured <= declared, honoured - declared
    assert not refused & declared, refused & declared
    assert declared <= listed, declared - listed


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_no_field_is_in_two_rows_of_one_endpoint(endpoint: str) -> None:
    names = [name for name, _ in rules_for(endpoint)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_rule_names_known_endpoints() -> None:
    assert all(set(rule.endpoints) <= set(ENDPOINTS) and rule.names for rule in RULES)


def _result(prompt_index: int, index: int, logprobs: list[float]) -> tuple[Choice, Output]:
    entries = [{"token_id": 1, "logprob": x} for x in logprobs]
    return Choice(index, prompt_index, None), Output("", [1] * len(entries), None, entries)  # type: ignore[arg-type]


def test_best_of_keeps_each_prompts_most_likely_candidates_best_first() -> None:
    results = [
        _result(0, 0, [-1.0, -1.0]),
        _result(0, 1, [-0.5]),
        _result(0, 2, [-3.0]),
        _result(0, 3, [-0.2, -0.3]),
        _result(1, 4, [-2.0]),
        _result(1, 5, [-2.0]),
        _result(1, 6, []),
    ]
    chosen = best_of(results, 2)
    assert [c.index for c, _ in chosen] == [1, 3, 6, 4]  # a tie keeps the earlier candidate
    assert [cumulative_logprob(u) for _, u in chosen] == pytest.approx([-0.5, -0.5, 0.0, -2.0])


# --------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("request_fields") / "server.log"
    # float32: greedy answers are compared across requests.
    proc, url = launch(log_path, "--max-total-tokens", "40000", "--dtype", "float32")
    yield url
    stop(proc, log_path)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def nested(fields: dict[str, Any]) -> dict[str, Any]:
    """A body from fields named as the table names them (`stream_options.x` nested)."""
    body: dict[str, Any] = {}
    for name, value in fields.items():
        outer, _, inner = name.partition(".")
        if inner:
            body.setdefault(outer, {})[inner] = value
        else:
            body[name] = value
    return body


def openai_call(client: openai.OpenAI, endpoint: str, extra: dict[str, Any]) -> Any:
    stream = "stream_options" in extra
    if endpoint == "completions":
        return client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=1, stream=stream, extra_body=extra
        )
    messages: Any = [{"role": "user", "content": "Hi"}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, stream=stream, extra_body=extra
    )


def generate(server: str, body: dict[str, Any], status: int = 200) -> Any:
    resp = httpx.post(f"{server}/generate", json=body, timeout=120)
    assert resp.status_code == status, resp.text
    return resp.json()


def native_body(endpoint: str, fields: dict[str, Any]) -> dict[str, Any]:
    params = {"max_new_tokens": 1}
    if endpoint == "sampling_params":
        return {"text": "Hi", "sampling_params": dict(params, **fields)}
    return dict(fields, text="Hi", sampling_params=params)


REFUSED_CASES = [
    (endpoint, name)
    for endpoint in ("completions", "chat", "generate", "sampling_params")
    for name, _ in rules_for(endpoint, *REFUSING)
]


@pytest.mark.parametrize(("endpoint", "name"), REFUSED_CASES)
def test_each_refused_field_is_a_400_naming_it(
    server: str, client: openai.OpenAI, endpoint: str, name: str
) -> None:
    if endpoint in ("completions", "chat"):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_call(client, endpoint, nested({name: SET}))
        assert caught.value.param == name, caught.value
        message = str(caught.value)
    else:
        err = generate(server, native_body(endpoint, nested({name: SET})), 400)["error"]
        assert err["param"] == name, err
        message = err["message"]
    assert "not supported" in message


@pytest.mark.parametrize("endpoint", ["completions", "chat", "generate", "sampling_params"])
@pytest.mark.parametrize("which", [0, -1])
def test_refused_fields_left_unset_are_accepted(
    server: str, client: openai.OpenAI, endpoint: str, which: int
) -> None:
    """Every refused field of an endpoint at once, each at one of its unset values (null,
    or the last one listed: `{"type": "text"}`, `"auto"`, `0`, ...)."""
    fields = {name: rule.unset[which] for name, rule in rules_for(endpoint, *REFUSING)}
    if endpoint in ("completions", "chat"):
        out = openai_call(client, endpoint, nested(fields))
        if isinstance(out, openai.Stream):
            out = list(out)
        assert out
    else:
        assert generate(server, native_body(endpoint, nested(fields)))["meta_info"]


def test_fields_with_no_effect_change_nothing(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "The sky is", "max_tokens": 4}
    plain = client.completions.create(temperature=0, **kw).choices[0].text
    extra = {name: SET for name, _ in rules_for("completions", Handling.NO_EFFECT)}
    extra = {k: v for k, v in extra.items() if "." not in k}
    assert client.completions.create(temperature=0, extra_body=extra, **kw).choices[0].text == plain


# --------------------------------------------------------------------------- best_of

PROMPT = "The capital of France is"
# Two tokens nearly equally likely: each candidate draws either, so among 32 of them both
# occur (a miss has probability 2**-32). Logprobs are the model's raw ones, so the most
# likely candidate is the one that drew the greedy token.
COIN: dict[str, Any] = {"temperature": 100.0, "extra_body": {"top_k": 2, "ignore_eos": True}}


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(
    client: openai.OpenAI,
) -> None:
    greedy = client.completions.create(
        model=MODEL, prompt=[PROMPT, "One, two,"], max_tokens=1, temperature=0, logprobs=2
    )
    best = client.completions.create(
        model=MODEL, prompt=[PROMPT, "One, two,"], max_tokens=1, n=2, best_of=32, logprobs=2, **COIN
    )
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    for i, g in enumerate(greedy.choices):
        assert g.logprobs is not None and g.logprobs.top_logprobs is not None
        top = max(g.logprobs.top_logprobs[0].values())
        for c in best.choices[2 * i : 2 * i + 2]:
            assert c.text == g.text
            assert c.logprobs is not None and c.logprobs.token_logprobs is not None
            assert c.logprobs.token_logprobs[0] == pytest.approx(top, abs=1e-4)
    # Usage counts every candidate's tokens: 32 per prompt.
    assert best.usage is not None and best.usage.completion_tokens == 64
    assert best.usage.prompt_tokens == greedy.usage.prompt_tokens  # type: ignore[union-attr]


def test_best_of_ranks_longer_candidates_and_hides_logprobs_nobody_asked_for(
    client: openai.OpenAI,
) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, **COIN}
    ranked = client.completions.create(n=3, best_of=8, logprobs=0, **kw)
    sums = [sum(c.logprobs.token_logprobs or []) for c in ranked.choices if c.logprobs]
    assert len(sums) == 3 and sums == sorted(sums, reverse=True)
    quiet = client.completions.create(n=2, best_of=4, **kw)
    assert len(quiet.choices) == 2 and all(c.logprobs is None for c in quiet.choices)
    assert quiet.usage is not None and quiet.usage.completion_tokens == 12
    # best_of == n selects nothing, so it may stream.
    chunks = list(client.completions.create(n=2, best_of=2, stream=True, **kw))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_chat_takes_best_of_too(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    kw: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 1}
    greedy = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    extra = dict(COIN["extra_body"], best_of=32)
    best = client.chat.completions.create(temperature=100.0, extra_body=extra, **kw)
    assert [c.message.content for c in best.choices] == [greedy]
    assert best.usage is not None and best.usage.completion_tokens == 32


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"n": 3, "best_of": 2}, "greater than or equal to n"),
        ({"best_of": 2, "stream": True}, "cannot be streamed"),
        ({"best_of": 0}, "best_of must be"),
        ({"best_of": 129}, "best_of must be"),
    ],
)
def test_bad_best_of_is_a_400(client: openai.OpenAI, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, **kw)
    assert caught.value.param == "best_of" and message in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        messages: Any = [{"role": "user", "content": "Hi"}]
        stream = kw.pop("stream", False)
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, stream=stream, extra_body=kw
        )
    assert caught.value.param == "best_of"


# --------------------------------------------------- fields that were dropped, now honoured


def test_no_stop_trim_keeps_the_stop_string(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0}
    full = client.completions.create(max_tokens=12, **kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    trimmed = client.completions.create(max_tokens=12, stop=[stop], **kw).choices[0].text
    kept = client.completions.create(
        max_tokens=12, stop=[stop], extra_body={"no_stop_trim": True}, **kw
    ).choices[0]
    assert trimmed == full[: full.index(stop)]
    assert kept.text == trimmed + stop and kept.finish_reason == "stop"


def test_openai_requests_may_name_their_data_parallel_rank(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    for name in ("routed_dp_rank", "data_parallel_rank"):
        assert client.completions.create(extra_body={name: 0}, **kw).choices
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(extra_body={name: 1}, **kw)
        assert caught.value.param == name
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(extra_body={"routed_dp_rank": 0, "data_parallel_rank": 1}, **kw)
    assert caught.value.param == "routed_dp_rank"


def test_continue_final_message_and_input_ids_shape_the_chat_prompt(
    server: str, client: openai.OpenAI
) -> None:
    messages: Any = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "My favourite color is"},
    ]
    kw: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    cont = client.chat.completions.create(extra_body={"continue_final_message": True}, **kw)
    # The same prompt, rendered here: the template's text up to the assistant's words.
    fresh = httpx.post(f"{server}/tokenize", json={"messages": messages[:1]}).json()["tokens"]
    words = httpx.post(
        f"{server}/tokenize", json={"prompt": messages[1]["content"], "add_special_tokens": False}
    ).json()["tokens"]
    by_ids = client.chat.completions.create(extra_body={"input_ids": fresh + words}, **kw)
    assert cont.usage is not None and by_ids.usage is not None
    assert cont.usage.prompt_tokens == len(fresh) + len(words)
    assert cont.choices[0].message.content == by_ids.choices[0].message.content
    opened = client.chat.completions.create(**kw)
    assert opened.usage is not None and opened.usage.prompt_tokens > cont.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        extra = {"input_ids": fresh, "continue_final_message": True}
        client.chat.completions.create(extra_body=extra, **kw)
    assert caught.value.param == "continue_final_message"


def test_chat_template_kwargs_reach_the_template_but_not_its_own_arguments(
    client: openai.OpenAI,
) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    kw: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
    plain = client.chat.completions.create(**kw).choices[0].message.content
    # SmolLM2's template reads no variables of its own: an unused one changes nothing.
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    assert (
        client.chat.completions.create(extra_body=extra, **kw).choices[0].message.content == plain
    )
    for reserved in ("add_generation_prompt", "tools", "messages"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                extra_body={"chat_template_kwargs": {reserved: True}}, **kw
            )
        assert caught.value.param == "chat_template_kwargs" and reserved in str(caught.value)


def test_options_that_need_another_one_are_400s(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    chat: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 1}
    completion: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(top_logprobs=2, **chat)
    assert caught.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(stream_options={"include_usage": True}, **chat)
    assert caught.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(echo=True, logprobs=1, **completion)
    assert caught.value.param == "echo"
    echoed = client.completions.create(echo=True, **completion).choices[0].text
    assert echoed.startswith("Hi")
