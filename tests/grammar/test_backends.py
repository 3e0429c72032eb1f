"""Both grammar backends, driven through their masks alone, produce only text in the
language: JSON that validates against its schema, regex full matches, EBNF sentences."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from grammar_walk import SCHEMAS, allowed_ids, backend_for, walk

from rsgl.grammar.backend import GrammarBackend, GrammarError, GrammarOptions
from rsgl.grammar.constraint import Constraint


def text_of(tokens: list[int], tokenizer: Any) -> str:
    assert tokens[-1] == tokenizer.eos_token_id  # a grammar ends with the stop token
    return str(tokenizer.decode(tokens[:-1]))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_walk_through_a_schema_validates(
    backend: GrammarBackend, tokenizer: Any, name: str
) -> None:
    schema = SCHEMAS[name]
    compiled = backend.compile(Constraint.of({"json_schema": schema}))  # type: ignore[arg-type]
    for seed in range(4):
        text = text_of(walk(backend, backend.matcher(compiled), tokenizer, seed), tokenizer)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "regex", [r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no|maybe)", r"[a-z]{2,5}@[a-z]{3}\.com", r"\d+"]
)
def test_every_walk_through_a_regex_fully_matches(
    backend: GrammarBackend, tokenizer: Any, regex: str
) -> None:
    compiled = backend.compile(Constraint("regex", regex))
    for seed in range(4):
        text = text_of(walk(backend, backend.matcher(compiled), tokenizer, seed), tokenizer)
        # \d is any Unicode digit in both backends, as in Python's re.
        assert re.fullmatch(regex, text), text


def test_every_walk_through_an_ebnf_grammar_is_a_sentence(
    backend: GrammarBackend, tokenizer: Any
) -> None:
    ebnf = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z]+'
    compiled = backend.compile(Constraint("ebnf", ebnf))
    for seed in range(4):
        text = text_of(walk(backend, backend.matcher(compiled), tokenizer, seed), tokenizer)
        assert re.fullmatch(r"(hello|hi) [a-z]+!", text), text


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 8},  # 6 or 7
        {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        {"type": "number", "minimum": -1, "exclusiveMaximum": 0},
    ],
)
def test_exclusive_bounds_hold(backend: GrammarBackend, tokenizer: Any, schema: Any) -> None:
    # Walks pick among the allowed tokens at random: a backend that dropped an exclusive
    # bound (or took it as inclusive) would write 5, 8, 0 or a number outside the range.
    compiled = backend.compile(Constraint.of({"json_schema": schema}))  # type: ignore[arg-type]
    for seed in range(8):
        text = text_of(walk(backend, backend.matcher(compiled), tokenizer, seed), tokenizer)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("kind", "source", "says"),
    [
        ("json_schema", '{"type": "objekt"}', "objekt"),
        ("regex", "a(", ""),
        ("ebnf", 'root ::= "unclosed', ""),
    ],
)
def test_a_constraint_that_does_not_compile_says_why(
    backend: GrammarBackend, kind: str, source: str, says: str
) -> None:
    with pytest.raises(GrammarError) as raised:
        backend.compile(Constraint(kind, source))  # type: ignore[arg-type]
    message = str(raised.value)
    assert message and says in message
    assert ".cc:" not in message  # the compiler's own source locations are cleaned away


def test_json_whitespace_is_bounded_or_off(tokenizer: Any) -> None:
    schema = Constraint("json_schema", '{"type":"object"}')
    space = tokenizer.convert_tokens_to_ids("Ġ")  # one space
    for name in ("xgrammar", "llguidance"):
        bounded = backend_for(name, tokenizer, GrammarOptions(max_whitespace=4))
        m = bounded.matcher(bounded.compile(schema))
        assert m.accept(tokenizer.convert_tokens_to_ids("{"))
        accepted = 0
        while space in allowed_ids(bounded, m) and accepted < 50:
            assert m.accept(space)
            accepted += 1
        assert accepted == 4, name
        compact = backend_for(name, tokenizer, GrammarOptions(disable_any_whitespace=True))
        m = compact.matcher(compact.compile(schema))
        assert m.accept(tokenizer.convert_tokens_to_ids("{"))
        assert space not in allowed_ids(compact, m), name
