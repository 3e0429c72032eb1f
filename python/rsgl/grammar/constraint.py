"""What a request constrains its output to, read from its sampling params (torch-free: the
server's frontend validates it at the door)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from rsgl.errors import InvalidRequest

ConstraintKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]

# SGLang's sampling-param names, one per kind; a request sets at most one.
CONSTRAINT_FIELDS: tuple[ConstraintKind, ...] = ("json_schema", "regex", "ebnf", "structural_tag")

# OpenAI's `response_format: {"type": "json_object"}`: a JSON object (OpenAI's meaning; SGLang
# allows any JSON value there).
JSON_OBJECT_SCHEMA = '{"type":"object"}'


@dataclass(frozen=True, slots=True)
class Constraint:
    """One request's grammar source: `kind` and its text, normalised so that equal
    constraints share one compiled grammar (JSON is re-serialised compactly, its key order
    kept: a schema's property order is the order it generates)."""

    kind: ConstraintKind
    source: str

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Constraint | None:
        """The constraint among `fields` (sampling-param name -> value; None and "" are
        unset), or None. InvalidRequest naming the field for more than one, a value that is
        not a string (a JSON schema or structural tag may also be an object), or JSON that
        does not parse."""
        given = [(k, fields.get(k)) for k in CONSTRAINT_FIELDS if fields.get(k) not in (None, "")]
        if not given:
            return None
        if len(given) > 1:
            names = " and ".join(k for k, _ in given)
            raise InvalidRequest(
                f"{names} are both set: a request takes one constraint", given[1][0]
            )
        kind, value = given[0]
        if kind in ("json_schema", "structural_tag"):
            return cls(kind, _normalised_json(kind, value))
        if not isinstance(value, str):
            raise InvalidRequest(f"{kind} must be a string, got {type(value).__name__}", kind)
        return cls(kind, value)

    def describe(self) -> str:
        """Short, for logs and errors."""
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"{self.kind} {text}"


def _normalised_json(kind: str, value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{kind} is not valid JSON: {exc}", kind) from None
    if kind == "json_schema" and not isinstance(value, dict | bool):
        raise InvalidRequest(f"{kind} must be a JSON object (a schema), got {value!r:.60}", kind)
    if kind == "structural_tag" and not isinstance(value, dict):
        raise InvalidRequest(f"{kind} must be a JSON object, got {value!r:.60}", kind)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


__all__ = ["CONSTRAINT_FIELDS", "JSON_OBJECT_SCHEMA", "Constraint", "ConstraintKind"]
