"""A request that reasons first samples freely until its reasoning's end marker (as the
embedded tokenizer writes `</think>`), then under its grammar: both backends, driven through
the masks the loop would apply."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
from grammar_walk import allowed_ids, walk

from rsgl.grammar.backend import GrammarBackend
from rsgl.grammar.constraint import Constraint
from rsgl.grammar.reasoning_gate import ReasoningGate
from rsgl.reasoning import FORMATS, marker_ids

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


def gated(backend: GrammarBackend, tokenizer: Any) -> ReasoningGate:
    compiled = backend.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    end = marker_ids(tokenizer, FORMATS["deepseek-r1"].end)
    return ReasoningGate(backend.matcher(compiled), end)


def test_the_end_marker_is_the_tokens_the_tokenizer_writes(tokenizer: Any) -> None:
    end = marker_ids(tokenizer, "</think>")
    assert len(end) > 1  # SmolLM2 has no think tokens: several ordinary ones
    assert tokenizer.decode(list(end)) == "</think>"


def test_reasoning_is_free_and_the_grammar_applies_after_its_end(
    backend: GrammarBackend, tokenizer: Any
) -> None:
    gate = gated(backend, tokenizer)
    fresh = gated(backend, tokenizer).inner
    thought = tokenizer.encode("Prose, not JSON: <b>ok</b> </ think", add_special_tokens=False)
    for token in thought:
        assert gate.masking() is None  # any token may come
        assert gate.accept(token)  # even ones the JSON grammar forbids
    assert not gate.is_terminated()
    for token in gate.end.ids:
        assert gate.masking() is None
        assert gate.accept(token)
    inner = gate.masking()
    assert inner is gate.inner  # the grammar starts now, at its beginning
    assert np.array_equal(allowed_ids(backend, inner), allowed_ids(backend, fresh))
    assert tokenizer.encode("Prose", add_special_tokens=False)[0] not in set(
        allowed_ids(backend, inner).tolist()
    )
    out = walk(backend, gate, tokenizer, seed=0)  # walk reads the gate's masks from here
    assert gate.is_terminated()
    jsonschema.validate(json.loads(tokenizer.decode(out[:-1])), SCHEMA)


def test_a_marker_that_breaks_off_and_starts_again_still_ends_the_reasoning(
    backend: GrammarBackend, tokenizer: Any
) -> None:
    gate = gated(backend, tokenizer)
    first, *rest = gate.end.ids
    for token in [first, first, *rest[:-1], first, *rest]:  # "</</thin</think>"
        assert gate.masking() is None
        gate.accept(token)
    assert gate.masking() is gate.inner


def test_a_step_waits_for_a_mask_only_when_the_reasoning_may_end_by_then(
    backend: GrammarBackend, tokenizer: Any
) -> None:
    gate = gated(backend, tokenizer)
    *before_last, last = gate.end.ids
    thought = tokenizer.encode("Some thought", add_special_tokens=False)
    for token in [*thought, *before_last]:
        # The token in flight cannot complete the marker: the next one samples freely.
        assert not gate.may_mask_after_one()
        gate.accept(token)
    assert gate.may_mask_after_one()  # the token in flight may be the marker's last
    gate.accept(thought[0])  # it was not: the reasoning goes on
    assert not gate.may_mask_after_one()
    for token in gate.end.ids:
        gate.accept(token)
    assert gate.may_mask_after_one() and gate.masking() is gate.inner
    assert gate.inner.may_mask_after_one()  # a grammar of its own always may
