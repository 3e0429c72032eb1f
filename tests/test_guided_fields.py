"""The constraints OpenAI requests ask for at the API's edge: vLLM's `guided_*` fields read
as rsgl's constraints (`guided_choice` as a regex that both backends compile to exactly
the choices, whatever characters they hold), and one constraint per request."""

from __future__ import annotations

from typing import Any

import pytest
from grammar_walk import BACKENDS, backend_for, embedded_tokenizer

from rsgl.errors import InvalidRequest
from rsgl.grammar.backend import GrammarBackend
from rsgl.grammar.constraint import Constraint
from rsgl.structured_output import constraint_params

CHOICES = ["a.b", "x|y", "(1+2)*3", "C:\\dir", "[ok]", "{n}", "^$?", "two words - & ~ #/"]


def accepts(backend: GrammarBackend, compiled: Any, tokenizer: Any, text: str) -> bool:
    """Whether a matcher takes `text` (as the tokenizer writes it) and then ends."""
    m = backend.matcher(compiled)
    tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    return all(m.accept(t) for t in tokens) and m.is_terminated()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return embedded_tokenizer()


@pytest.mark.parametrize("name", BACKENDS)
def test_guided_choice_is_exactly_one_of_the_choices(name: str, tokenizer: Any) -> None:
    backend = backend_for(name, tokenizer)
    params = constraint_params(None, {}, {"guided_choice": CHOICES})
    compiled = backend.compile(Constraint.of(params))  # type: ignore[arg-type]
    for choice in CHOICES:
        assert accepts(backend, compiled, tokenizer, choice), choice
    for other in ("axb", "x", "1+2*3", "ok", "a.b.", "two words"):
        assert not accepts(backend, compiled, tokenizer, other), other


def test_guided_fields_are_the_constraints_they_name() -> None:
    schema = {"type": "object"}
    assert constraint_params(None, {}, {"guided_json": schema}) == {
        "json_schema": '{"type": "object"}'
    }
    assert constraint_params(None, {}, {"guided_regex": "a+"}) == {"regex": "a+"}
    assert constraint_params(None, {}, {"guided_grammar": 'root ::= "a"'}) == {
        "ebnf": 'root ::= "a"'
    }


@pytest.mark.parametrize(
    ("response_format", "extras", "guided", "param", "says"),
    [
        (None, {"regex": "a"}, {"guided_json": {}}, "guided_json", "regex and guided_json"),
        ({"type": "json_object"}, {}, {"guided_choice": ["a"]}, "guided_choice", "response_fo"),
        (None, {}, {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "both set"),
        (None, {}, {"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        (None, {}, {"guided_json": "{nope"}, "guided_json", "not valid JSON"),
        (None, {}, {"guided_json": "[1]"}, "guided_json", "must be a JSON schema"),
    ],
)
def test_a_second_constraint_or_a_bad_choice_list_is_refused_by_name(
    response_format: Any, extras: dict[str, Any], guided: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        constraint_params(response_format, extras, guided)
    assert raised.value.param == param
    assert says in str(raised.value)
