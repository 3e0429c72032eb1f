"""OpenAI-compatible and SGLang-native request bodies, and OpenAI-shaped errors.

Pydantic checks only the JSON types here; ranges and the model's limits are checked once,
by `rsgl.validation`, for the Engine and the server alike. The published OpenAPI schema
still states those ranges (the `bounds` of each field), so that it describes what the server
accepts; limits an operator sets at launch (`--max-n`, the vocabulary, the context) are given
in words.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rsgl import structured_output
from rsgl.grammar.constraint import CONSTRAINT_FIELDS
from rsgl.sampling_params import FLOAT32_MAX, INT64_MAX, SEED_MAX, SEED_MIN, SamplingParams
from rsgl.validation import CHAT_ROLES, MAX_LOGIT_BIAS, UNSET_ONLY_SAMPLING_FIELDS

# JSON Schema bounds of each sampling field, as rsgl.validation enforces them.
FLOAT32 = {"minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX}
INT64 = {"minimum": -INT64_MAX - 1, "maximum": INT64_MAX}
TOKEN_IDS = {"items": {"type": "integer", "minimum": 0}}
BOUNDS: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0, "maximum": FLOAT32_MAX},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": INT64_MAX, "not": {"const": 0}},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": FLOAT32_MAX},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "seed": {"minimum": SEED_MIN, "maximum": SEED_MAX},
    "n": {"minimum": 1, "description": "at most the server's --max-n (default 128)"},
    "best_of": {"minimum": 1, "description": "at least n, at most the server's --max-n"},
    "max_new_tokens": {"minimum": 0, "description": "prompt + this must fit the context"},
    "min_new_tokens": {"minimum": 0, "maximum": INT64_MAX},
    "stop_token_ids": TOKEN_IDS,
    "token_ids_logprob": TOKEN_IDS,
    "input_ids": {**TOKEN_IDS, "minItems": 1},
    "top_logprobs_num": {"minimum": 0, "description": "at most the server's --max-logprobs"},
    "logit_bias": {
        "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {
            "type": "number",
            "minimum": -MAX_LOGIT_BIAS,
            "maximum": MAX_LOGIT_BIAS,
        },
    },
    "priority": INT64,
    "stream_interval": {
        "minimum": 0,
        "maximum": INT64_MAX,
        "description": "tokens per streamed chunk; null or 0: the server's --stream-interval",
    },
}


def bounded(default: Any, name: str, **kwargs: Any) -> Any:
    """A pydantic field whose schema carries BOUNDS[name]."""
    return Field(default, json_schema_extra=BOUNDS[name], **kwargs)


def batchable(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """`schema` (an array's or an object's) and a non-empty list of it: a /generate field
    given once or once per prompt of a batch."""
    kind = "object" if "properties" in schema else "array"
    one = {"type": kind, **schema}
    return [one, {"type": "array", "items": one, "minItems": 1}]


def _json_type(annotation: Any) -> dict[str, Any]:
    """The JSON Schema of a SamplingParams field type."""
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        return {"anyOf": [_json_type(a) for a in typing.get_args(annotation)]}
    if origin is list:
        return {"type": "array", "items": _json_type(typing.get_args(annotation)[0])}
    if origin is dict:
        return {
            "type": "object",
            "additionalProperties": _json_type(typing.get_args(annotation)[1]),
        }
    simple = {float: "number", int: "integer", bool: "boolean", str: "string", type(None): "null"}
    return {"type": simple[annotation]}


def native_sampling_schema() -> dict[str, Any]:
    """The schema of /generate's `sampling_params`: SamplingParams' fields and `n`."""
    hints = typing.get_type_hints(SamplingParams)
    properties = {"n": {"type": "integer", **BOUNDS["n"]}}
    for f in dataclasses.fields(SamplingParams):
        schema = _json_type(hints[f.name])
        if f.name == "max_new_tokens":
            schema = {"anyOf": [schema, {"type": "null"}]}
        properties[f.name] = {**schema, **BOUNDS.get(f.name, {})}
    properties["stop"] = {
        "anyOf": [{"type": "string"}, properties["stop"], {"type": "null"}],
        "description": "at most --max-stop-strings strings of --max-stop-string-len characters",
    }
    properties["logprobs"] = {"type": "boolean", "description": "alias of return_logprob"}
    properties["top_logprobs"] = {**properties["top_logprobs_num"], "description": "alias"}
    properties["sampling_seed"] = {**properties["seed"], "description": "alias of seed"}
    for name, (unset, why) in UNSET_ONLY_SAMPLING_FIELDS.items():
        properties[name] = {
            "anyOf": [{"const": value} for value in unset],
            "description": f"SGLang's; accepted only unset ({why})",
        }
    for name in ("json_schema", "structural_tag"):
        properties[name] = {
            "anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}],
            "description": "JSON text, or the object itself",
        }
    return {"type": "object", "properties": properties, "additionalProperties": False}


# A chat message as rsgl.validation.check_messages accepts it.
CHAT_MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "role": {"enum": sorted(CHAT_ROLES)},
        "content": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        "required": ["type", "text"],
                    },
                },
                {"type": "null", "description": "assistant messages only"},
            ]
        },
        "tool_calls": {
            "type": "array",
            "description": "assistant messages: the calls it made (OpenAI's shape)",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "arguments": {"type": "string", "description": "JSON text"},
                        },
                        "required": ["name", "arguments"],
                    },
                },
                "required": ["function"],
            },
        },
        "tool_call_id": {"type": "string", "description": "tool messages: the call answered"},
        "name": {"type": "string"},
    },
    "required": ["role"],
}


class StreamOptions(BaseModel):
    """OpenAI's stream options. Its other fields are kept for
    `rsgl.server.request_fields`, which refuses or accepts each one by name."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class OpenAIRequest(BaseModel):
    """Fields shared by completions and chat (OpenAI names plus SGLang's extras). The fields
    declared here are honoured; `rsgl.server.request_fields` says what happens to the rest."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = bounded(None, "temperature")
    top_p: float | None = bounded(None, "top_p")
    n: int = bounded(1, "n")
    best_of: int | None = bounded(None, "best_of")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = bounded(None, "seed")
    frequency_penalty: float = bounded(0.0, "frequency_penalty")
    presence_penalty: float = bounded(0.0, "presence_penalty")
    user: str | None = None
    top_k: int = bounded(-1, "top_k")
    min_p: float = bounded(0.0, "min_p")
    repetition_penalty: float = bounded(1.0, "repetition_penalty")
    min_tokens: int = bounded(0, "min_new_tokens")
    stop_token_ids: list[int] | None = bounded(None, "stop_token_ids")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = bounded(None, "logit_bias")
    priority: int = bounded(0, "priority")
    rid: str | None = None
    # SGLang's: serve the request on this data-parallel rank (its old and new names).
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None
    # Structured output: OpenAI's response_format, or one of SGLang's constraint extras.
    response_format: dict[str, Any] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    # vLLM's guided decoding (read as the constraints above).
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    def sampling_params(self) -> dict[str, Any]:
        """SGLang sampling_params for this request (the caller adds max_new_tokens, n and
        logprobs, which the two APIs spell differently)."""
        params: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "seed": self.seed,
            "logit_bias": self.logit_bias or {},
        }
        params.update(structured_output.constraint_params(*self._constraints()))
        return params

    def constraint_field(self) -> str | None:
        """The field that constrains the output (the first, if several do)."""
        asked = structured_output.asked_constraints(*self._constraints())
        return asked[0][0] if asked else None

    def _constraints(self) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any]]:
        extras: dict[str, Any] = {name: getattr(self, name) for name in CONSTRAINT_FIELDS}
        guided = {name: getattr(self, name) for name in structured_output.GUIDED_FIELDS}
        return self.response_format, extras, guided


class CompletionRequest(OpenAIRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra={"description": "text, token ids, or a batch of either; not empty"}
    )
    max_tokens: int | None = bounded(16, "max_new_tokens")
    echo: bool = False
    logprobs: int | None = bounded(None, "top_logprobs_num")


class ChatCompletionRequest(OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(
        min_length=1, json_schema_extra={"items": CHAT_MESSAGE_SCHEMA}
    )
    max_tokens: int | None = bounded(None, "max_new_tokens")
    max_completion_tokens: int | None = bounded(None, "max_new_tokens")
    logprobs: bool = False
    top_logprobs: int | None = bounded(None, "top_logprobs_num")
    # SGLang's chat-template options, and its prompt given as token ids (the messages are
    # still checked, but not rendered).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    input_ids: list[int] | None = Field(None, json_schema_extra=BOUNDS["input_ids"])
    # Tool calling (rsgl.tool_calls checks them).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning (--reasoning-parser, rsgl.reasoning): `reasoning_content` apart from the
    # content (SGLang's defaults), streamed as it comes or in one piece when it ends.
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class GenerateRequest(BaseModel):
    """POST /generate: SGLang's `GenerateReqInput`. The fields declared here are honoured or,
    for bookkeeping flags (`log_metrics`, `no_logs`), accepted; `rsgl.server.request_fields`
    refuses the ones naming a capability rsgl lacks when set. Fields rsgl does not know are
    ignored, as SGLang's own models do."""

    model_config = ConfigDict(extra="allow")

    # One prompt, or a batch: a list of texts or of token-id lists.
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = Field(
        None, json_schema_extra={"anyOf": [*batchable(BOUNDS["input_ids"]), {"type": "null"}]}
    )
    # One object for every prompt, or one per prompt.
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None,
        json_schema_extra={"anyOf": [*batchable(native_sampling_schema()), {"type": "null"}]},
    )
    stream: bool = False
    # One id (the choices of a batch or of n > 1 are `<rid>-<i>`) or one per prompt.
    rid: str | list[str] | None = None
    model: str | None = None
    # The logprob fields: once for the batch, or one entry per prompt.
    return_logprob: bool | list[bool] | None = None
    # SGLang's -1 (or None): no input-token logprobs; rsgl reports output tokens only.
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = Field(
        None,
        json_schema_extra={"anyOf": [*batchable(BOUNDS["token_ids_logprob"]), {"type": "null"}]},
    )
    return_text_in_logprobs: bool = False
    # The output starts with a reasoning; its constraint applies once the reasoning ends
    # (--reasoning-parser). Once, or one per prompt.
    require_reasoning: bool | list[bool] | None = None
    # Echo each choice's prompt token ids in its answer (`prompt_token_ids`).
    return_prompt_token_ids: bool = False
    priority: int | None = None
    # SGLang's: serve every prompt of the request on this data-parallel rank (a router that
    # balances the ranks itself, or a test, names it); None lets --load-balance-method pick.
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None
    log_metrics: bool = True
    no_logs: bool = False


class AbortBody(BaseModel):
    rid: str


class TokenizeRequest(BaseModel):
    """SGLang's /tokenize body: one of `prompt` (a string or several) and `messages`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """SGLang's /detokenize body: token ids, or several lists of them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class ApiError(Exception):
    """An error with an HTTP status, rendered OpenAI-style."""

    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, code: Any = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def sum_usage(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage of a request with several choices: the prompt counts once per prompt."""
    prompts: dict[int, tuple[int, int]] = {}
    completion = reasoning = 0
    for i, m in enumerate(metas):
        prompts.setdefault(m.get("prompt_index", i), (m["prompt_tokens"], m["cached_tokens"]))
        completion += m["completion_tokens"]
        reasoning += m.get("reasoning_tokens", 0)
    prompt = sum(p for p, _ in prompts.values())
    cached = sum(c for _, c in prompts.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }
