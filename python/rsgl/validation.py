"""Request validation at the door, shared by `rsgl.Engine` and the server's frontend.

Everything a request carries is checked here, before anything is queued: token ids are ints
in `[0, vocab_size)`, numbers are finite and in range, `prompt + max_new_tokens` fits the
context, and the sizes an operator bounds (`n`, logprobs, stop strings) stay under their
limits. A bad request raises `InvalidRequest` naming the offending parameter, which the
server turns into a 400 and the Engine raises as the ValueError it is. Nothing that passes
here may fail a step of the scheduling loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rsgl.errors import InvalidRequest
from rsgl.grammar.constraint import CONSTRAINT_FIELDS
from rsgl.sampling_params import FLOAT_FIELDS, INT64_MAX, SamplingParams

# OpenAI bounds logit_bias values to [-100, 100], and to 300 tokens.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300
# Per-request id lists widen per-slot tables in the sampler and are scanned per token.
MAX_STOP_TOKEN_IDS = 64
# SGLang's max_new_tokens when a native request names none.
DEFAULT_MAX_NEW_TOKENS = 128
# Chat roles a chat template may meet.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask: the model's sizes and the operator's bounds."""

    vocab_size: int
    context_length: int
    # Longest prompt the KV pool can ever hold (smaller than the context on a small pool).
    max_prompt_len: int
    # Clamp max_new_tokens to what the context leaves instead of refusing (SGLang's
    # --allow-auto-truncate).
    allow_auto_truncate: bool = False
    max_n: int = 128
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_string_len: int = 1024


# ------------------------------------------------------------------------------- prompts


def check_token_ids(ids: Any, limits: RequestLimits, param: str) -> list[int]:
    """`ids` as a list of ints in [0, vocab_size); InvalidRequest names `param` otherwise."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidRequest(f"{param} must be a list of token ids", param)
    out = list(ids)
    vocab = limits.vocab_size
    for i, t in enumerate(out):
        if type(t) is not int:
            raise InvalidRequest(f"{param}[{i}] must be an integer token id, got {t!r}", param)
        if not 0 <= t < vocab:
            raise InvalidRequest(
                f"{param}[{i}] = {t} is not a token id of this model (valid: 0 to {vocab - 1})",
                param,
            )
    return out


def check_prompt(ids: Any, limits: RequestLimits, param: str = "prompt") -> list[int]:
    """A tokenized prompt: non-empty, valid ids, shorter than the context and the pool."""
    prompt = check_token_ids(ids, limits, param)
    if not prompt:
        raise InvalidRequest("the prompt is empty", param)
    if len(prompt) >= limits.context_length:
        raise InvalidRequest(
            f"This model's maximum context length is {limits.context_length} tokens. However, "
            f"your prompt has {len(prompt)} tokens. Please reduce the length of the prompt.",
            param,
        )
    if len(prompt) > limits.max_prompt_len:
        raise InvalidRequest(
            f"the prompt has {len(prompt)} tokens, but the KV cache holds prompts of at most "
            f"{limits.max_prompt_len} tokens",
            param,
        )
    return prompt


def tokenize_prompt(
    tokenizer: Any,
    limits: RequestLimits,
    *,
    text: Any = None,
    input_ids: Any = None,
    messages: Any = None,
    param: str | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The checked token ids of a prompt given as text, token ids or chat messages (exactly
    one; messages go through the model's chat template). `param` names it in errors
    (default: the form's own name). With `continue_final_message` the prompt ends inside
    the last (assistant) message instead of opening a new one; `chat_template_kwargs` are
    the template's own variables (SGLang's and HF's names for both); `tools` (OpenAI's
    function tools) reach the template as its `tools`."""
    if sum(x is not None for x in (text, input_ids, messages)) != 1:
        raise InvalidRequest("give exactly one of text, input_ids or messages", param or "text")
    if messages is not None:
        name = param or "messages"
        options: dict[str, Any] = dict(_template_variables(tokenizer, chat_template_kwargs))
        if continue_final_message:
            options.update(add_generation_prompt=False, continue_final_message=True)
        else:
            options["add_generation_prompt"] = True
        if tools:
            options["tools"] = tools
        try:
            ids = tokenizer.apply_chat_template(
                check_messages(messages), tokenize=True, return_dict=False, **options
            )
        except InvalidRequest:
            raise
        except Exception as exc:  # a template that refuses these messages
            raise InvalidRequest(f"invalid messages: {exc}", name) from exc
        return check_prompt([int(t) for t in ids], limits, name)
    if text is not None:
        name = param or "text"
        if not isinstance(text, str):
            raise InvalidRequest(f"{name} must be a string", name)
        return check_prompt(
            [int(t) for t in tokenizer.encode(check_text(text, name))], limits, name
        )
    return check_prompt(input_ids, limits, param or "input_ids")


def _template_variables(tokenizer: Any, variables: Any) -> dict[str, Any]:
    """`chat_template_kwargs`, checked: an object whose keys are none of the arguments that
    `apply_chat_template` takes itself (`tools`, `add_generation_prompt`, ...) nor the
    template's `messages`, which the request's own fields set."""
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise InvalidRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    reserved = {"messages"} | {
        p.name for p in parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    taken = sorted(set(variables) & reserved)
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields "
            "set those",
            "chat_template_kwargs",
        )
    return dict(variables)


def resolve_max_new_tokens(
    prompt_len: int, requested: int | None, limits: RequestLimits, param: str = "max_tokens"
) -> int:
    """The output budget of a prompt: what the context leaves when `requested` is None, else
    `requested` if it fits (clamped instead with `allow_auto_truncate`)."""
    room = limits.context_length - prompt_len
    if requested is None:
        return room
    if requested < 0:
        raise InvalidRequest(f"{param} must be >= 0, got {requested}", param)
    if requested > room and not limits.allow_auto_truncate:
        total = prompt_len + requested
        raise InvalidRequest(
            "Requested token count exceeds the model's maximum context length of "
            f"{limits.context_length} tokens. You requested a total of {total} tokens: "
            f"{prompt_len} tokens from the input messages and {requested} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit.",
            param,
        )
    return min(requested, room)


def check_text(text: str, param: str) -> str:
    """Text that is valid Unicode (JSON can carry lone surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{param} is not valid Unicode: {exc.reason} at character {exc.start}", param
        ) from None
    return text


def check_int64(value: Any, param: str) -> int:
    """An integer that fits int64 (the core's request fields)."""
    if type(value) is not int or not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise InvalidRequest(f"{param} must be an integer that fits 64 bits, got {value!r}", param)
    return value


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages with known roles and text content, in the shape chat templates take:
    content parts (`[{"type": "text", "text": ...}]`) are joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, Mapping):
            raise InvalidRequest(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            known = ", ".join(sorted(CHAT_ROLES))
            raise InvalidRequest(f"{where}.role must be one of {known}; got {role!r}", where)
        content = m.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, f"{where}.content")
        elif content is None and role == "assistant":
            content = ""  # an assistant turn that only called tools
        elif not isinstance(content, str):
            raise InvalidRequest(
                f"{where}.content must be a string or a list of text parts", f"{where}.content"
            )
        message = dict(m, content=check_text(content, f"{where}.content"))
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise InvalidRequest(f"{where}: only assistant messages carry tool_calls", where)
            message["tool_calls"] = _template_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(message)
    return out


def _template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls`, checked, in the shape chat templates
    take: each call's `function.arguments` (a JSON string on the wire) as the object it
    encodes (vLLM and SGLang decode them too; templates print them with `tojson`)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list of tool calls", where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            function = {}
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(arguments, str | Mapping):
            raise InvalidRequest(
                f"{where}.{j} must be {{'id': ..., 'type': 'function', 'function': "
                "{'name': ..., 'arguments': '<JSON>'}}",
                where,
            )
        if isinstance(arguments, str):
            # Not JSON: the template gets the text the model wrote.
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        out.append(dict(call, function=dict(function, arguments=arguments)))
    return out


def _join_text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise InvalidRequest(
                f"{where}.{j} must be a text part ({{'type': 'text', 'text': ...}}); this "
                "model reads text only",
                where,
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}.{j}.text must be a string", where)
        texts.append(text)
    return "".join(texts)


# ------------------------------------------------------------------------------- sampling

# Accepted JSON types of each SamplingParams field (bool is never an int here).
_INT_FIELDS = frozenset(
    {"max_new_tokens", "top_k", "min_new_tokens", "top_logprobs_num", "stream_interval"}
)
_BOOL_FIELDS = frozenset(
    {
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "return_logprob",
        "no_stop_trim",
        "require_reasoning",
    }
)
_PARAM_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# Other names of SamplingParams fields in sampling_params dicts: OpenAI's logprob names, and
# SGLang 0.5's name for the seed.
SAMPLING_ALIASES = {
    "logprobs": "return_logprob",
    "top_logprobs": "top_logprobs_num",
    "sampling_seed": "seed",
}
# The rest of SGLang 0.5's SamplingParams (sglang/srt/sampling/sampling_params.py): fields
# for what rsgl cannot do, and SGLang's internal fields (which its own normalize() fills in).
# Each is accepted at a value that asks for nothing -- null, or what SGLang itself treats
# as unset -- and refused naming the field otherwise, so that a request never silently gets
# less than it asked for. Name -> (the values meaning unset, why it is refused when set).
UNSET_ONLY_SAMPLING_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "stop_regex": ((None, "", []), "no stop regexes"),
    "custom_params": ((None, {}), "no custom logit processors"),
    "beam_width": ((None, 1), "no beam search"),
    "watermark": ((None, {}), "no watermarking"),
    "stop_strs": ((None, "", []), "SGLang-internal; give stop"),
    "stop_regex_strs": ((None, "", []), "SGLang-internal; no stop regexes"),
    "stop_str_max_len": ((None, 0), "SGLang-internal; give stop"),
    "stop_regex_max_len": ((None, 0), "SGLang-internal; no stop regexes"),
    "is_normalized": ((None, False), "SGLang-internal"),
    "ebnf_full_assistant": ((None, False), "SGLang-internal; no constrained decoding"),
}


def make_sampling_params(
    raw: Mapping[str, Any] | None,
    limits: RequestLimits,
    prompt_len: int,
    *,
    default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
    max_tokens_param: str = "max_new_tokens",
) -> tuple[SamplingParams, int]:
    """SamplingParams for a prompt of `prompt_len` tokens from an SGLang-style dict, plus `n`.

    Types, finiteness and ranges are checked here, and `max_new_tokens` is resolved against
    the context: absent means `default_max_new_tokens` (or less, to fit), None means
    whatever the context leaves. `max_tokens_param` is how the caller's API spells it (for
    error messages)."""
    if raw is not None and not isinstance(raw, Mapping):
        raise InvalidRequest("sampling_params must be an object", "sampling_params")
    values = dict(raw or {})
    n = values.pop("n", 1)
    if type(n) is not int or not 1 <= n <= limits.max_n:
        raise InvalidRequest(f"n must be an integer in [1, {limits.max_n}], got {n!r}", "n")
    fields: dict[str, Any] = {}
    for key, value in values.items():
        if key in UNSET_ONLY_SAMPLING_FIELDS:
            _check_unset(key, value)
            continue
        name = SAMPLING_ALIASES.get(key, key)
        if name not in _PARAM_KEYS:
            raise InvalidRequest(f"unknown sampling parameter {key!r}", key)
        if value is None and name != "max_new_tokens":
            continue  # an explicit null means the default
        value = _typed(name, key, value, limits)
        if name in fields and not _json_equal(fields[name], value):
            other = next(k for k in values if k != key and SAMPLING_ALIASES.get(k, k) == name)
            raise InvalidRequest(f"{other} and {key} name the same parameter; give one", key)
        fields[name] = value
    stop = fields.get("stop")
    if stop is not None:
        fields["stop"] = _check_stop(stop, limits)
    if "stop_token_ids" in fields:
        ids = check_token_ids(fields["stop_token_ids"], limits, _key_of("stop_token_ids", values))
        fields["stop_token_ids"] = _bounded_unique(ids, MAX_STOP_TOKEN_IDS, "stop_token_ids")
    if "logit_bias" in fields:
        fields["logit_bias"] = check_logit_bias(fields["logit_bias"], limits)
    if "token_ids_logprob" in fields:
        ids = check_token_ids(fields["token_ids_logprob"], limits, "token_ids_logprob")
        fields["token_ids_logprob"] = _bounded_unique(ids, limits.max_logprobs, "token_ids_logprob")
    top = fields.get("top_logprobs_num", 0)
    if not 0 <= top <= limits.max_logprobs:
        raise InvalidRequest(
            f"top_logprobs must be in [0, {limits.max_logprobs}], got {top}",
            _key_of("top_logprobs_num", values),
        )
    if top or fields.get("token_ids_logprob"):
        fields["return_logprob"] = True
    if "max_new_tokens" in fields:
        requested = fields["max_new_tokens"]
    elif default_max_new_tokens is not None:
        # A default nobody asked for never makes a request fail: it shrinks to fit.
        requested = min(default_max_new_tokens, limits.context_length - prompt_len)
    else:
        requested = None
    fields["max_new_tokens"] = resolve_max_new_tokens(
        prompt_len, requested, limits, max_tokens_param
    )
    try:
        return SamplingParams(**fields), n
    except InvalidRequest as exc:
        param = _key_of(exc.param, values) if exc.param else None
        raise InvalidRequest(exc.message, param) from exc


def _check_unset(key: str, value: Any) -> None:
    """Nothing if `value` leaves SGLang field `key` unset; InvalidRequest naming it else."""
    unset, why = UNSET_ONLY_SAMPLING_FIELDS[key]
    if not any(_json_equal(value, u) for u in unset):
        shown = " or ".join(json.dumps(u) for u in unset)
        raise InvalidRequest(
            f"{key} is not supported by this server ({why}); leave it unset ({shown})", key
        )


def _json_equal(a: Any, b: Any) -> bool:
    """`a == b` as JSON values: true and 1 differ, 1 and 1.0 do not."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _bounded_unique(ids: list[int], limit: int, param: str) -> list[int]:
    """`ids` without repeats (first occurrences kept), at most `limit` of them."""
    unique = list(dict.fromkeys(ids))
    if len(unique) > limit:
        raise InvalidRequest(
            f"{param} may hold at most {limit} token ids, got {len(unique)}", param
        )
    return unique


def _key_of(name: str, raw: Mapping[str, Any]) -> str:
    """The caller's spelling of field `name` (an alias if they used one)."""
    for alias, target in SAMPLING_ALIASES.items():
        if target == name and alias in raw:
            return alias
    return name


def _typed(name: str, key: str, value: Any, limits: RequestLimits) -> Any:
    """`value` if it has the JSON type field `name` takes (its range is SamplingParams'
    business); InvalidRequest names `key`."""
    if name in FLOAT_FIELDS:
        if type(value) not in (int, float):
            raise InvalidRequest(f"{key} must be a number, got {value!r}", key)
    elif name in _INT_FIELDS or name == "seed":
        if value is not None and type(value) is not int:
            raise InvalidRequest(f"{key} must be an integer, got {value!r}", key)
    elif name in _BOOL_FIELDS and type(value) is not bool:
        raise InvalidRequest(f"{key} must be true or false, got {value!r}", key)
    elif name in CONSTRAINT_FIELDS:
        if name in ("json_schema", "structural_tag") and isinstance(value, dict | bool):
            return json.dumps(value)  # SGLang takes JSON text; an object is as good
        if not isinstance(value, str):
            raise InvalidRequest(f"{key} must be a string, got {value!r:.60}", key)
    return value


def _check_stop(stop: Any, limits: RequestLimits) -> list[str]:
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if len(strings) > limits.max_stop_strings:
        raise InvalidRequest(
            f"at most {limits.max_stop_strings} stop strings are allowed, got {len(strings)}",
            "stop",
        )
    for s in strings:
        check_text(s, "stop")
    longest = max((len(s) for s in strings), default=0)
    if longest > limits.max_stop_string_len:
        raise InvalidRequest(
            f"stop strings may have at most {limits.max_stop_string_len} characters, "
            f"got one of {longest}",
            "stop",
        )
    return list(strings)


def check_logit_bias(bias: Any, limits: RequestLimits) -> dict[int, float]:
    """OpenAI's `logit_bias` (token id, as int or decimal string -> bias in [-100, 100])."""
    if not isinstance(bias, Mapping):
        raise InvalidRequest("logit_bias must map token ids to numbers", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}",
            "logit_bias",
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str):
            # ASCII digits only: str.isdigit() also takes superscripts, which int() refuses.
            token = int(key) if re.fullmatch(r"[0-9]{1,10}", key) else None
        if type(token) is not int or not 0 <= token < limits.vocab_size:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id of this model "
                f"(valid: 0 to {limits.vocab_size - 1})",
                "logit_bias",
            )
        if type(value) not in (int, float) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}",
                "logit_bias",
            )
        out[token] = float(value)
    return out


# --------------------------------------------------------------------------- expansion


@dataclass(frozen=True, slots=True)
class Job:
    """One generation to run: prompt `prompt_index` of a call, one of its `n` copies."""

    rid: str
    # The caller's request id: every job of one prompt (or of the whole call) shares it.
    group: str
    index: int  # across the call: prompt_index * n + copy
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


def expand_requests(
    prompts: Sequence[list[int]],
    params: Sequence[tuple[SamplingParams, int]],
    rid: str | Sequence[str] | None = None,
) -> list[Job]:
    """The jobs of a call: `n` copies of every (prompt, params), with request ids.

    One `rid` names the call: it is the id of its only job, or `<rid>-<index>` of each.
    A list names each prompt (SGLang's batch form): `<rid[i]>` or `<rid[i]>-<copy>`.
    No `rid`: a random one. InvalidRequest (param "rid") for a malformed rid.
    """
    if isinstance(rid, str) or rid is None:
        base = _check_rid(rid) if rid is not None else uuid.uuid4().hex
        total = sum(n for _, n in params)
        jobs: list[Job] = []
        for i, (ids, (p, n)) in enumerate(zip(prompts, params, strict=True)):
            for _ in range(n):
                index = len(jobs)
                name = base if total == 1 else f"{base}-{index}"
                jobs.append(Job(name, base, index, i, ids, p))
        return jobs
    if not isinstance(rid, Sequence) or len(rid) != len(prompts):
        raise InvalidRequest(f"rid must be a string or a list of {len(prompts)} strings", "rid")
    jobs = []
    for i, (ids, (p, n), r) in enumerate(zip(prompts, params, rid, strict=True)):
        base = _check_rid(r)
        for k in range(n):
            jobs.append(Job(base if n == 1 else f"{base}-{k}", base, len(jobs), i, ids, p))
    if len({j.rid for j in jobs}) != len(jobs):
        raise InvalidRequest("request ids must be distinct", "rid")
    return jobs


# Request ids travel in logs, metrics and the wire: bounded, printable.
MAX_RID_LEN = 256


def _check_rid(rid: Any) -> str:
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_LEN or not rid.isprintable():
        raise InvalidRequest(
            f"rid must be a non-empty printable string of at most {MAX_RID_LEN} characters",
            "rid",
        )
    return rid
