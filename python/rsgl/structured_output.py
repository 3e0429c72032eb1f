"""Structured output at the API's edge: what OpenAI's `response_format`, SGLang's
constraint extras (`json_schema`, `regex`, `ebnf`, `structural_tag`, at the top level of its
OpenAI requests) and vLLM's `guided_*` fields ask the sampler for, as sampling params
(`rsgl.grammar` compiles them).

Tool calls force their output with a JSON schema too; `rsgl.tool_calls` builds it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rsgl.errors import InvalidRequest
from rsgl.grammar.constraint import CONSTRAINT_FIELDS, JSON_OBJECT_SCHEMA

# OpenAI's rule for a json_schema response format's name.
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def constraint_params(
    response_format: dict[str, Any] | None,
    extras: dict[str, Any],
    guided: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sampling params (`json_schema`, `regex`, ...) that an OpenAI request's
    `response_format`, SGLang extras and vLLM `guided_*` fields ask for; InvalidRequest
    naming the field for a malformed one, and naming both when more than one is given."""
    asked = asked_constraints(response_format, extras, guided)
    if len(asked) > 1:
        (first, _), (second, _) = asked[:2]
        raise InvalidRequest(
            f"{first} and {second} are both set: a request takes one constraint", second
        )
    return asked[0][1] if asked else {}


def asked_constraints(
    response_format: dict[str, Any] | None,
    extras: dict[str, Any],
    guided: dict[str, Any] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """Each constraint a request gives: the field's name, and the sampling params it asks
    for."""
    asked = [(k, {k: v}) for k, v in extras.items() if v not in (None, "")]
    fmt = _response_format(response_format)
    if fmt:
        asked.insert(0, ("response_format", fmt))
    for name, value in (guided or {}).items():
        if value is not None:
            asked.append((name, _guided(name, value)))
    return asked


# vLLM's guided-decoding fields (its OpenAI extras until v0.12, which ignores them since):
# each is one of the constraints rsgl compiles.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")

# What a regex's syntax gives a meaning to outside a character class, in both backends.
_REGEX_SPECIAL = re.compile(r"[\\.^$|?*+()\[\]{}]")


def _guided(name: str, value: Any) -> dict[str, Any]:
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"guided_json is not valid JSON: {exc}", name) from None
        if not isinstance(value, dict | bool):
            raise InvalidRequest(f"guided_json must be a JSON schema, got {value!r:.60}", name)
        return {"json_schema": json.dumps(value)}
    if name == "guided_regex":
        return {"regex": value}
    if name == "guided_grammar":
        return {"ebnf": value}
    if not value or not all(isinstance(c, str) for c in value):
        raise InvalidRequest("guided_choice must be a non-empty list of strings", name)
    # vLLM's reading: exactly one of the choices.
    return {"regex": "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\g<0>", c) for c in value) + ")"}


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any]:
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise InvalidRequest("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(
                'response_format {"type": "json_schema"} needs a json_schema object '
                "(name, schema, strict)",
                "response_format",
            )
        name = spec.get("name")
        if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
            raise InvalidRequest(
                "response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                "response_format",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict | bool):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(fmt)}
    raise InvalidRequest(
        f"response_format type {kind!r} is not one of text, json_object, json_schema, "
        "structural_tag",
        "response_format",
    )


__all__ = ["CONSTRAINT_FIELDS", "GUIDED_FIELDS", "asked_constraints", "constraint_params"]
