"""Schemathesis against a real `rsgl serve` on loopback, from the server's own OpenAPI schema
(FastAPI's `/openapi.json`): every operation gets schema-valid and schema-violating requests,
and no answer may be a 5xx, while every error body is an OpenAI error object.

Of schemathesis's own checks only `not_a_server_error` fits this server. FastAPI documents a
422 `HTTPValidationError` for every body, but the server answers malformed input with a 400
OpenAI error, so `status_code_conformance` and `response_schema_conformance` would fail on
every refused request (and the success responses declare no schema to conform to).
`negative_data_rejection` and `positive_data_acceptance` would fail on requests the schema
allows but the server rightly refuses (a prompt plus max_tokens past the context, min_tokens
above max_tokens). This file's own checks take their place: `openai_error_body` for every
error status, and `no_server_error_in_stream` for the failures a stream reports after its 200.

Two things steer the generated requests, both in this file and both stated where they are:
`RUNTIME_LIMITS` narrows the published schema to the limits this server was launched with,
so that schema-valid examples get past validation into the engine, and `bound_generation`
caps how many tokens a request may make, so that the run stays short on a CPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from launcher import launch, stop
from schemathesis.checks import not_a_server_error

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152
CONTEXT_LENGTH = 8192
MAX_N = 2  # --max-n, so that a fuzzed `n` cannot multiply the work
MAX_LOGPROBS = 20  # the server's default --max-logprobs
MAX_EXAMPLES = 50
SEED = 20240611
REQUEST_TIMEOUT_S = 60.0
# Most tokens one sequence of a request may cost. The server decodes for real (about 60 ms a
# step on two cores), and a length the schema allows, up to the whole context, takes minutes.
GENERATION_CAP = 4
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# Limits this server was launched with, which a static schema cannot state (it gives them in
# words): the served model's name, its vocabulary and context, and --max-n. The published
# schema already carries every static range (rsgl.server.protocol.BOUNDS); these narrow it
# further, merged into the server's own property schemas, so that schema-valid examples get
# past validation into the engine rather than stopping at a 404 or 400. Schema-violating
# examples come from the narrowed schema too, so each limit is also fuzzed from outside; and
# since no check asks a schema-valid request to succeed, a limit that drifts from the
# server's can only make the fuzzing shallower, never fail it.
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}
TOKEN_IDS = {"items": TOKEN_ID}
ID_LIST = {"type": "array", "items": TOKEN_ID, "minItems": 1}


def once_or_per_prompt(schema: dict[str, Any]) -> dict[str, Any]:
    """A /generate field given once or as a list with one entry per prompt of a batch."""
    return {"anyOf": [schema, {"type": "array", "items": schema, "minItems": 1}, {"type": "null"}]}


LENGTH = {"maximum": CONTEXT_LENGTH}
RUNTIME_LIMITS: dict[str, dict[str, Any]] = {
    "model": {"anyOf": [{"const": MODEL}, {"type": "null"}]},
    "n": {"maximum": MAX_N},
    "best_of": {"maximum": MAX_N},
    "max_tokens": LENGTH,
    "max_completion_tokens": LENGTH,
    "max_new_tokens": LENGTH,
    "min_tokens": LENGTH,
    "min_new_tokens": LENGTH,
    "stop_token_ids": TOKEN_IDS,
    # Flat lists: /generate's top-level field may also hold one list per prompt, a form
    # this narrowing leaves out (the name is shared with sampling_params' flat field).
    "token_ids_logprob": TOKEN_IDS,
    "input_ids": once_or_per_prompt(ID_LIST),
    "text": once_or_per_prompt({"type": "string", "minLength": 1}),
    # Four digits stay inside the vocabulary.
    "logit_bias": {"propertyNames": {"pattern": "^(0|[1-9][0-9]{0,3})$"}},
    "logprobs": {"maximum": MAX_LOGPROBS},
    "top_logprobs": {"maximum": MAX_LOGPROBS},
    "top_logprobs_num": {"maximum": MAX_LOGPROBS},
    "prompt": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            {"type": "array", "items": TOKEN_ID, "minItems": 1},
            {
                "type": "array",
                "items": {"type": "array", "items": TOKEN_ID, "minItems": 1},
                "minItems": 1,
            },
        ]
    },
}


def narrow(properties: dict[str, Any]) -> None:
    """Merges RUNTIME_LIMITS into the property schemas of an object, nested ones (objects
    among a field's options, or the items of a list of them) included."""
    for name, schema in properties.items():
        if name in RUNTIME_LIMITS:
            schema.update(RUNTIME_LIMITS[name])
        for option in schema.get("anyOf", []):
            for sub in (option, option.get("items", {})):
                if "properties" in sub:
                    narrow(sub["properties"])


# Generation lengths per operation: the budgets (the first one filled in when all are open),
# then the minimum.
LENGTH_FIELDS = {
    "/v1/completions": (("max_tokens",), "min_tokens"),
    "/v1/chat/completions": (("max_tokens", "max_completion_tokens"), "min_tokens"),
    "/generate": (("max_new_tokens",), "min_new_tokens"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("fuzz") / "server.log"
    proc, url = launch(log_path, "--api-key", KEY, "--max-n", str(MAX_N))
    yield url
    stop(proc, log_path)


@pytest.fixture(scope="module")
def api_schema(server: str) -> schemathesis.BaseSchema:
    raw = httpx.get(f"{server}/openapi.json", headers=AUTH, timeout=30).json()
    for name in ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest"):
        narrow(raw["components"]["schemas"][name]["properties"])
    config = schemathesis.Config.from_dict(
        {
            "base-url": server,
            "seed": SEED,
            "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
            "request-timeout": REQUEST_TIMEOUT_S,
            # Whole streams (the cap keeps them short), so that an error event at the end is
            # seen; schemathesis stops reading after 20 events by default.
            "max-stream-events": 1000,
            # By default reports hide every field named like a secret, max_tokens included.
            "output": {"sanitization": {"enabled": False}},
        }
    )
    return schemathesis.openapi.from_dict(raw, config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """pytest 9.2 dropped `Node._nodeid`, which schemathesis 4.32.5's fixture-loaded schemas
    read (and rewrite, to name each operation); without it every test fails at once."""
    request.node._nodeid = request.node.nodeid


def capped(value: Any) -> Any:
    """A length the server would accept, lowered to GENERATION_CAP; anything else (negative,
    fractional, past the context) is left for the server to refuse. JSON Schema's integers
    include integral floats such as 1948.0, which pydantic takes as 1948, so they are capped
    too (keeping their type)."""
    kind = type(value)
    if kind in (int, float) and GENERATION_CAP < value <= CONTEXT_LENGTH and value == int(value):
        return kind(GENERATION_CAP)
    return value


def bound_generation(case: schemathesis.Case[Any]) -> None:
    """Caps the generation lengths of `case` in place, so that a request costs at most a few
    decode steps per sequence.

    This changes what is fuzzed, and only here: a length in (cap, context] is sent as the cap,
    and a length left open (absent or null: 16 tokens on completions, 128 on /generate, the
    rest of the context in chat) is sent as the cap, so the defaults are not fuzzed. Lengths
    the server must refuse go out unchanged."""
    lengths = LENGTH_FIELDS.get(case.operation.path)
    if lengths is None or not isinstance(case.body, dict):
        return
    targets: list[Any] = [case.body]
    if case.operation.path == "/generate":
        if case.body.get("sampling_params") is None:
            case.body["sampling_params"] = {}
        params = case.body["sampling_params"]
        # One object for the batch, or one per prompt.
        targets = params if isinstance(params, list) else [params]
    budgets, minimum = lengths
    for target in targets:
        if not isinstance(target, dict):
            continue
        for name in (*budgets, minimum):
            if name in target:
                target[name] = capped(target[name])
        if all(target.get(name) is None for name in budgets):
            target[budgets[0]] = GENERATION_CAP


def openai_error_problem(body: Any) -> str | None:
    """Why `body` is not `{"error": {"message", "type", "param", "code"}}`, or None."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return "the body is not an object with the single key `error`"
    err = body["error"]
    if not isinstance(err, dict) or set(err) != OPENAI_ERROR_KEYS:
        keys = sorted(err) if isinstance(err, dict) else type(err).__name__
        return f"`error` must have exactly the keys {sorted(OPENAI_ERROR_KEYS)}, got {keys}"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return "`error.message` and `error.type` must be strings"
    if err["param"] is not None and not isinstance(err["param"], str):
        return "`error.param` must be a string or null"
    return None


@schemathesis.check
def openai_error_body(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> None:
    """Every error answer is an OpenAI error object, the shape the openai client parses (a
    5xx is checked too, though `not_a_server_error` fails it anyway)."""
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"the {response.status_code} body is not JSON") from None
    problem = openai_error_problem(body)
    assert problem is None, f"{problem}: {body!r}"


@schemathesis.check
def no_server_error_in_stream(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> None:
    """A stream has sent its 200 before it generates, so a later failure arrives as an error
    event instead of a status; such an event must be OpenAI-shaped and not a server error."""
    content_types = [v for k, v in response.headers.items() if k.lower() == "content-type"]
    if not any("text/event-stream" in v for values in content_types for v in values):
        return
    for line in response.content.decode(errors="replace").splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[len("data: ") :])
        if "error" not in event:
            continue
        problem = openai_error_problem(event)
        assert problem is None, f"stream error event: {problem}: {event!r}"
        code = event["error"]["code"]
        assert not (type(code) is int and code >= 500), f"server error in the stream: {event!r}"


@pytest.mark.fuzz
@schema.parametrize()
def test_no_server_errors_and_every_error_is_openai_shaped(case: schemathesis.Case[Any]) -> None:
    bound_generation(case)
    case.call_and_validate(
        headers=AUTH,
        checks=[not_a_server_error, openai_error_body, no_server_error_in_stream],
        timeout=REQUEST_TIMEOUT_S,
    )
