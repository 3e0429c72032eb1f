"""The request validator both entry points share: each bad input names its parameter."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from sglang_fields import SAMPLING_PARAMS_DEFAULTS, TOP_K_ALL

from rsgl.errors import InvalidRequest
from rsgl.sampling_params import SamplingParams
from rsgl.validation import (
    RequestLimits,
    check_messages,
    check_prompt,
    expand_requests,
    make_sampling_params,
    resolve_max_new_tokens,
    tokenize_prompt,
)

LIMITS = RequestLimits(vocab_size=100, context_length=64, max_prompt_len=60, max_n=4)


def param_of(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        fn(*args, **kwargs)
    return info.value.param


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        ([], "empty"),
        ([1, 100], "not a token id"),
        ([-1], "not a token id"),
        ([1, True], "integer token id"),
        ([1, 2.0], "integer token id"),
        ("abc", "list of token ids"),
        ([1] * 64, "maximum context length is 64"),
        ([1] * 61, "at most 60 tokens"),
    ],
)
def test_bad_prompts_are_refused_with_the_reason(ids: Any, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why) as info:
        check_prompt(ids, LIMITS, "input_ids")
    assert info.value.param == "input_ids"


def test_good_prompt_passes_through() -> None:
    assert check_prompt([0, 5, 99], LIMITS) == [0, 5, 99]


def test_max_new_tokens_must_fit_the_context_unless_auto_truncate() -> None:
    assert resolve_max_new_tokens(10, None, LIMITS) == 54  # no limit: what the context leaves
    assert resolve_max_new_tokens(10, 54, LIMITS) == 54
    with pytest.raises(InvalidRequest, match="You requested a total of 65 tokens") as info:
        resolve_max_new_tokens(10, 55, LIMITS, "max_tokens")
    assert info.value.message.startswith(
        "Requested token count exceeds the model's maximum context length of 64 tokens."
    )
    assert info.value.param == "max_tokens"
    assert param_of(resolve_max_new_tokens, 10, -1, LIMITS, "max_tokens") == "max_tokens"
    truncating = RequestLimits(100, 64, 60, allow_auto_truncate=True)
    assert resolve_max_new_tokens(10, 10**8, truncating) == 54


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": 1 << 70}, "top_k"),
        ({"seed": 1 << 64}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"n": 5}, "n"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": "x" * 1025}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logit_bias": {"100": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"token_ids_logprob": [1, 100]}, "token_ids_logprob"),
        ({"max_new_tokens": 1000}, "max_new_tokens"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": 3.5e38}, "temperature"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"token_ids_logprob": list(range(21))}, "token_ids_logprob"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
        ({"stop": ["\ud800"]}, "stop"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_sampling_params_name_their_field(raw: dict[str, Any], param: str) -> None:
    assert param_of(make_sampling_params, raw, LIMITS, 10) == param


def test_sampling_params_defaults_and_conversions() -> None:
    params, n = make_sampling_params(
        {"n": 2, "stop": "end", "logit_bias": {"7": -100, 8: 5}, "top_logprobs": 3}, LIMITS, 10
    )
    assert n == 2
    assert params.stop == ["end"]
    assert params.logit_bias == {7: -100.0, 8: 5.0}
    assert params.return_logprob and params.top_logprobs_num == 3
    assert params.max_new_tokens == 54  # the default (128) shrinks to what the context leaves
    absent, _ = make_sampling_params({}, LIMITS, 10, default_max_new_tokens=16)
    assert absent.max_new_tokens == 16
    unlimited, _ = make_sampling_params({"max_new_tokens": None}, LIMITS, 10)
    assert unlimited.max_new_tokens == 54
    with_ids, _ = make_sampling_params({"token_ids_logprob": [1, 2]}, LIMITS, 10)
    assert with_ids.return_logprob


def test_chat_messages_need_known_roles_and_text_content() -> None:
    ok = check_messages(
        [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert [m["content"] for m in ok] == ["be brief", "ab", ""]
    assert param_of(check_messages, []) == "messages"
    assert param_of(check_messages, [{"role": "robot", "content": "x"}]) == "messages.0"
    assert param_of(check_messages, [{"role": "user", "content": 5}]) == "messages.0.content"
    assert param_of(check_messages, [{"role": "user"}]) == "messages.0.content"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert param_of(check_messages, image) == "messages.0.content"
    assert param_of(check_messages, ["hi"]) == "messages.0"
    assert param_of(check_messages, [{"role": {}, "content": "x"}]) == "messages.0"


def test_repeated_ids_count_once() -> None:
    params, _ = make_sampling_params({"stop_token_ids": [5, 5, 6] * 40}, LIMITS, 10)
    assert params.stop_token_ids == [5, 6]


def test_every_sglang_sampling_field_is_accepted_at_its_default() -> None:
    raw = dict(SAMPLING_PARAMS_DEFAULTS, max_new_tokens=8)
    params, n = make_sampling_params(raw, LIMITS, 10)
    assert n == 1
    # SGLang's defaults are rsgl's: its top_k default means the whole vocabulary.
    ours = dataclasses.replace(SamplingParams(max_new_tokens=8), top_k=TOP_K_ALL)
    assert params == ours


def test_sampling_seed_is_an_alias_of_seed() -> None:
    assert make_sampling_params({"sampling_seed": 7}, LIMITS, 10)[0].seed == 7
    assert make_sampling_params({"sampling_seed": None}, LIMITS, 10)[0].seed is None
    assert make_sampling_params({"seed": 7, "sampling_seed": 7}, LIMITS, 10)[0].seed == 7
    assert make_sampling_params({"seed": 7, "sampling_seed": None}, LIMITS, 10)[0].seed == 7
    assert param_of(make_sampling_params, {"sampling_seed": 1 << 64}, LIMITS, 10) == (
        "sampling_seed"
    )
    assert param_of(make_sampling_params, {"sampling_seed": "7"}, LIMITS, 10) == "sampling_seed"
    with pytest.raises(InvalidRequest, match="seed and sampling_seed name the same") as info:
        make_sampling_params({"seed": 7, "sampling_seed": 8}, LIMITS, 10)
    assert info.value.param == "sampling_seed"


@pytest.mark.parametrize(
    ("name", "unset", "value"),
    [
        ("stop_regex", [], ["\\d+"]),
        ("stop_regex", "", "\\d+"),
        ("custom_params", {}, {"k": 1}),
        ("beam_width", 1, 4),
        ("beam_width", 1, True),  # a bool is not the integer 1
        ("watermark", {}, {"enabled": True}),
        ("stop_strs", [], ["x"]),
        ("stop_regex_strs", [], ["x"]),
        ("stop_str_max_len", 0, 3),
        ("stop_regex_max_len", 0, 3),
        ("is_normalized", False, True),
        ("ebnf_full_assistant", False, True),
    ],
)
def test_sglang_fields_for_what_rsgl_cannot_do_are_refused_only_when_set(
    name: str, unset: Any, value: Any
) -> None:
    for nothing in (None, unset):
        make_sampling_params({name: nothing}, LIMITS, 10)
    with pytest.raises(InvalidRequest, match=f"{name} is not supported") as info:
        make_sampling_params({name: value}, LIMITS, 10)
    assert info.value.param == name


def test_constraints_are_sampling_params_json_as_text_or_object() -> None:
    as_text = make_sampling_params({"json_schema": '{"type": "object"}'}, LIMITS, 10)[0]
    as_object = make_sampling_params({"json_schema": {"type": "object"}}, LIMITS, 10)[0]
    assert as_text.constraint() == as_object.constraint() is not None
    assert make_sampling_params({"regex": "[a-z]+"}, LIMITS, 10)[0].regex == "[a-z]+"
    assert make_sampling_params({"regex": ""}, LIMITS, 10)[0].constraint() is None
    for bad, says in (
        ({"regex": 3}, "regex must be a string"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
        ({"ebnf": 'root ::= "a"', "regex": "a"}, "regex and ebnf are both set"),
    ):
        with pytest.raises(InvalidRequest, match=says):
            make_sampling_params(bad, LIMITS, 10)


def test_a_request_may_set_its_own_stream_interval() -> None:
    assert make_sampling_params({"stream_interval": 4}, LIMITS, 10)[0].stream_interval == 4
    for server_default in (None, 0):
        params, _ = make_sampling_params({"stream_interval": server_default}, LIMITS, 10)
        assert not params.stream_interval
    for bad in (-1, 2.5, "2", True):
        assert param_of(make_sampling_params, {"stream_interval": bad}, LIMITS, 10) == (
            "stream_interval"
        )


# ------------------------------------------------------------------ expansion and prompts


def _params(*ns: int) -> list[tuple[Any, int]]:
    return [(make_sampling_params({}, LIMITS, 1)[0], n) for n in ns]


def test_one_rid_names_a_single_job_or_numbers_each_of_many():
    (job,) = expand_requests([[1]], _params(1), "abc")
    assert (job.rid, job.group, job.index, job.prompt_index) == ("abc", "abc", 0, 0)
    jobs = expand_requests([[1], [2]], _params(2, 2), "r")
    assert [j.rid for j in jobs] == ["r-0", "r-1", "r-2", "r-3"]
    assert [j.prompt_index for j in jobs] == [0, 0, 1, 1]
    assert {j.group for j in jobs} == {"r"}
    assert [j.prompt_ids for j in jobs] == [[1], [1], [2], [2]]


def test_a_rid_list_names_each_prompt():
    jobs = expand_requests([[1], [2]], _params(1, 2), ["a", "b"])
    assert [(j.rid, j.group) for j in jobs] == [("a", "a"), ("b-0", "b"), ("b-1", "b")]


def test_no_rid_gets_a_fresh_one_per_call():
    a = expand_requests([[1]], _params(1))[0].rid
    b = expand_requests([[1]], _params(1))[0].rid
    assert a != b and len(a) == 32


@pytest.mark.parametrize(
    ("rid", "prompts"),
    [("", 1), ("x" * 257, 1), ("tab\there", 1), (["a"], 2), (["a", 3], 2), (["a", "a"], 2)],
)
def test_malformed_or_clashing_rids_are_refused(rid: Any, prompts: int):
    assert param_of(expand_requests, [[1]] * prompts, _params(*[1] * prompts), rid) == "rid"


class WordTokenizer:
    """A tokenizer of the right shape: one id per word (ids are word lengths)."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages: Any, **_: Any) -> list[int]:
        return [len(m["content"]) for m in messages]


def test_tokenize_prompt_takes_exactly_one_form_and_checks_it():
    tok = WordTokenizer()
    assert tokenize_prompt(tok, LIMITS, text="a bb ccc") == [1, 2, 3]
    assert tokenize_prompt(tok, LIMITS, input_ids=[5, 6]) == [5, 6]
    messages = [{"role": "user", "content": "hello"}]
    assert tokenize_prompt(tok, LIMITS, messages=messages) == [5]
    assert param_of(tokenize_prompt, tok, LIMITS) == "text"
    assert param_of(tokenize_prompt, tok, LIMITS, text="a", input_ids=[1]) == "text"
    assert param_of(tokenize_prompt, tok, LIMITS, text="", param="prompt") == "prompt"
    assert param_of(tokenize_prompt, tok, LIMITS, text=3) == "text"
    assert param_of(tokenize_prompt, tok, LIMITS, input_ids=[100]) == "input_ids"
    assert param_of(tokenize_prompt, tok, LIMITS, messages=[{"role": "x"}]) == "messages.0"
    assert param_of(tokenize_prompt, tok, LIMITS, text="\ud800") == "text"
