"""Structured output at the API's edge: what OpenAI's `response_format` and SGLang's
constraint extras (`json_schema`, `regex`, `ebnf`, `structural_tag`, at the top level of its
OpenAI requests) ask the sampler for, as sampling params (`rsgl.grammar` compiles them).

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
    response_format: dict[str, Any] | None, extras: dict[str, Any]
) -> dict[str, Any]:
    """The sampling params (`json_schema`, `regex`, ...) that an OpenAI request's
    `response_format` and SGLang extras ask for; InvalidRequest naming the field for a
    malformed format, and naming both when more than one constraint is given."""
    params = {k: v for k, v in extras.items() if v not in (None, "")}
    fmt = _response_format(response_format)
    if fmt:
        if params:
            other = next(iter(params))
            raise InvalidRequest(
                f"response_format and {other} are both set: a request takes one constraint",
                other,
            )
        return fmt
    return params


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


__all__ = ["CONSTRAINT_FIELDS", "constraint_params"]
