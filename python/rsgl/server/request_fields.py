"""What the server does with every field its clients may send: OpenAI's and SGLang's
/v1/completions and /v1/chat/completions, SGLang's /generate (and its `sampling_params`,
which `rsgl.Engine` takes too), /tokenize and /detokenize.

A known field is never silently dropped. It is honoured; or accepted with no effect, when
it is bookkeeping that changes no answer (each such row says why); or refused with a 400
naming it when set to anything but a value that asks for nothing (`unset`). Fields nobody
knows are ignored, as OpenAI's, vLLM's and SGLang's servers do.

`RULES` is the one statement of all this: the routes refuse what it refuses
(`refuse_unsupported`), the tests send every refused field to every endpoint it names, and
the README's table is `markdown_table()` (`python -m rsgl.server.request_fields` prints it).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rsgl.errors import InvalidRequest
from rsgl.grammar.constraint import CONSTRAINT_FIELDS
from rsgl.sampling_params import SamplingParams
from rsgl.structured_output import GUIDED_FIELDS
from rsgl.validation import SAMPLING_ALIASES, UNSET_ONLY_SAMPLING_FIELDS

# Where a field is read: the request bodies the server takes (`sampling_params` is
# /generate's sampling_params object, also `rsgl.Engine`'s).
ENDPOINTS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "generate": "/generate",
    "sampling_params": "`sampling_params` (/generate, `rsgl.Engine`)",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}


class Handling(enum.Enum):
    """What the server does with a field."""

    HONOURED = "honoured"
    NO_EFFECT = "accepted, no effect"
    REFUSED = "400 when set"


@dataclass(frozen=True, slots=True)
class FieldRule:
    """Fields handled alike on some endpoints. A REFUSED field passes at a value in `unset`
    or at a list of such values (SGLang's batches take some fields once per prompt)."""

    names: tuple[str, ...]
    endpoints: tuple[str, ...]
    handling: Handling
    note: str
    unset: tuple[Any, ...] = (None, False, {})


OPENAI = ("completions", "chat")
EVERYWHERE = ("completions", "chat", "generate")
H, N, R = Handling.HONOURED, Handling.NO_EFFECT, Handling.REFUSED


def _sampling_rules() -> list[FieldRule]:
    """/generate's sampling_params, from the code that reads them (`rsgl.validation`); the
    structured-output ones are `_structured_rules`'."""
    fields = (f.name for f in dataclasses.fields(SamplingParams))
    honoured = ("n", *fields)
    aliases = ", ".join(f"`{a}` is `{t}`" for a, t in SAMPLING_ALIASES.items())
    rules = [
        FieldRule(
            (*honoured, *SAMPLING_ALIASES),
            ("sampling_params",),
            H,
            f"SGLang's SamplingParams ({aliases}); any other key is a 400",
        )
    ]
    groups: dict[tuple[str, str], list[str]] = {}
    for name, (unset, why) in UNSET_ONLY_SAMPLING_FIELDS.items():
        groups.setdefault((why, json.dumps(unset)), []).append(name)
    for (why, _), names in groups.items():
        unset = UNSET_ONLY_SAMPLING_FIELDS[names[0]][0]
        rules.append(FieldRule(tuple(names), ("sampling_params",), R, why, unset))
    return rules


def _structured_rules() -> list[FieldRule]:
    """Structured output and tool calls."""
    return [
        FieldRule(
            ("response_format",),
            OPENAI,
            H,
            "`text`, `json_object` (a JSON object), `json_schema` (`name`, `schema`; output "
            "constrained by --grammar-backend), `structural_tag`",
        ),
        FieldRule(
            CONSTRAINT_FIELDS,
            OPENAI,
            H,
            "SGLang's constraint extras (one per request, or response_format)",
        ),
        FieldRule(
            GUIDED_FIELDS,
            OPENAI,
            H,
            "vLLM's guided decoding, read as `json_schema`, `regex`, `ebnf`, and `guided_choice` "
            "as a regex of the escaped choices (one of them exactly); one constraint per "
            "request, of these, the SGLang extras and response_format",
        ),
        FieldRule(
            ("guided_decoding_backend", "guided_whitespace_pattern"),
            OPENAI,
            R,
            "vLLM's per-request backend and whitespace; rsgl's are server options "
            "(`--grammar-backend`, `--constrained-json-max-whitespace`)",
            (None, ""),
        ),
        FieldRule(
            ("tools",),
            ("chat",),
            H,
            "function tools (`name`, `description`, `parameters`, `strict`); they reach the "
            'chat template unless `tool_choice` is `"none"`',
        ),
        FieldRule(
            ("tool_choice",),
            ("chat",),
            H,
            '`"none"`, `"auto"` (calls read by --tool-call-parser), `"required"` or a named '
            "function (the output constrained to calls that parse)",
        ),
        FieldRule(
            ("parallel_tool_calls",),
            ("chat",),
            H,
            '`false`: a `"required"` or named call is one call (with `"auto"`, every call '
            "the model writes is returned)",
        ),
        FieldRule(
            ("functions",),
            ("chat",),
            R,
            "OpenAI's deprecated spelling of `tools`; give `tools`",
            (None, []),
        ),
        FieldRule(
            ("function_call",),
            ("chat",),
            R,
            "OpenAI's deprecated spelling of `tool_choice`; give `tool_choice`",
            (None, "none", "auto"),
        ),
    ]


RULES: tuple[FieldRule, ...] = (
    # ------------------------------------------------------------- honoured: OpenAI
    FieldRule(("model",), OPENAI, H, "the served model's name; any other is a 404"),
    FieldRule(("prompt",), ("completions",), H, "text, token ids, or a batch of either"),
    FieldRule(
        ("messages",),
        ("chat",),
        H,
        "text content only (content parts of type text); assistant `tool_calls` and `tool` "
        "messages reach the template",
    ),
    FieldRule(
        ("best_of",),
        OPENAI,
        H,
        "as vLLM: `best_of` candidates per prompt, the `n` with the highest cumulative "
        "logprob returned (best first); `n <= best_of`; no streaming unless `best_of == n`; "
        "usage counts every candidate's tokens",
    ),
    FieldRule(
        ("n", "temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty"),
        OPENAI,
        H,
        "",
    ),
    FieldRule(("logit_bias",), OPENAI, H, "at most 300 tokens, values in [-100, 100]"),
    FieldRule(
        ("max_tokens",), OPENAI, H, "completions: 16 by default; chat: what the context leaves"
    ),
    FieldRule(("max_completion_tokens",), ("chat",), H, "wins over `max_tokens`"),
    FieldRule(("logprobs",), OPENAI, H, "completions: how many top logprobs; chat: a flag"),
    FieldRule(("top_logprobs",), ("chat",), H, "needs `logprobs: true`"),
    FieldRule(("echo",), ("completions",), H, "not with `logprobs` (no prompt logprobs)"),
    FieldRule(("stream",), OPENAI, H, "server-sent events, logprobs on every chunk"),
    FieldRule(
        ("stream_options", "stream_options.include_usage"),
        OPENAI,
        H,
        "only with `stream`; a last chunk carries the usage",
    ),
    FieldRule(
        ("stream_options.include_obfuscation",),
        OPENAI,
        N,
        "OpenAI pads chunks against side channels; rsgl sends none to pad",
    ),
    FieldRule(
        ("user", "safety_identifier", "metadata"),
        OPENAI,
        N,
        "OpenAI's end-user tags for abuse monitoring; rsgl keeps no per-user records",
    ),
    FieldRule(
        ("prompt_cache_key",),
        OPENAI,
        N,
        "a routing hint for OpenAI's prompt cache; rsgl's radix cache reuses any prefix",
    ),
    # ------------------------------------------------- honoured: SGLang's OpenAI extras
    FieldRule(
        (
            "top_k",
            "min_p",
            "min_tokens",
            "repetition_penalty",
            "stop_token_ids",
            "ignore_eos",
            "skip_special_tokens",
            "no_stop_trim",
        ),
        OPENAI,
        H,
        "SGLang's sampling extras",
    ),
    FieldRule(("rid",), OPENAI, H, "the request id (`<rid>-<i>` per choice)"),
    FieldRule(("priority",), OPENAI, H, "with `--schedule-policy priority`"),
    FieldRule(
        ("data_parallel_rank", "routed_dp_rank"),
        EVERYWHERE,
        H,
        "serve on this data-parallel rank (SGLang's old and new names)",
    ),
    FieldRule(
        ("continue_final_message",),
        ("chat",),
        H,
        "the prompt ends inside the last (assistant) message",
    ),
    FieldRule(
        ("chat_template_kwargs",),
        ("chat",),
        H,
        "the chat template's own variables; with `--reasoning-parser qwen3`, "
        "`enable_thinking: false` means no reasoning",
    ),
    FieldRule(("input_ids",), ("chat",), H, "the prompt's token ids, instead of the template's"),
    FieldRule(
        ("separate_reasoning",),
        ("chat",),
        H,
        "with a `--reasoning-parser` (default true, as SGLang): the reasoning comes as "
        "`message.reasoning_content` and stream deltas' `reasoning_content`, apart from the "
        "content; false: all in the content (a constraint still waits for the reasoning)",
    ),
    FieldRule(
        ("stream_reasoning",),
        ("chat",),
        H,
        "with a `--reasoning-parser` (default true): false sends the reasoning in one delta "
        "when it ends",
    ),
    # ------------------------------------------------------- refused: OpenAI
    FieldRule(("suffix",), ("completions",), R, "no fill-in-the-middle", (None, "")),
    FieldRule(("store",), ("chat",), R, "no stored completions"),
    FieldRule(("audio",), ("chat",), R, "text output only"),
    FieldRule(("modalities",), ("chat", "generate"), R, "text only", (None, ["text"])),
    FieldRule(("prediction",), ("chat",), R, "no predicted outputs"),
    FieldRule(("web_search_options",), ("chat",), R, "no web search"),
    FieldRule(("reasoning_effort", "verbosity", "task"), ("chat",), R, "no reasoning controls"),
    FieldRule(("service_tier",), ("chat",), R, "one tier", (None, "auto", "default")),
    FieldRule(
        ("prompt_cache_retention",),
        ("chat",),
        R,
        "the prefix cache lives in memory only",
        (None, "in-memory", "in_memory"),
    ),
    FieldRule(
        ("stream_options.continuous_usage_stats",),
        OPENAI,
        R,
        "usage comes once, at the end (`include_usage`)",
    ),
    # ---------------------------------------- refused: SGLang's OpenAI and /generate extras
    FieldRule(
        ("return_token_ids", "return_meta_info", "return_cached_tokens_details"),
        OPENAI,
        R,
        "SGLang's answer extras; /generate answers with `output_ids` and `meta_info`",
    ),
    FieldRule(
        ("return_prompt_token_ids",),
        ("chat",),
        R,
        "/generate's `return_prompt_token_ids` echoes them",
    ),
    FieldRule(
        ("return_hidden_states", "return_routed_experts"),
        EVERYWHERE,
        R,
        "no hidden states or expert routes",
    ),
    FieldRule(("routed_experts_start_len",), EVERYWHERE, R, "no expert routes", (None, 0)),
    FieldRule(("lora_path",), EVERYWHERE, R, "no LoRA adapters"),
    FieldRule(("lora_id",), ("generate",), R, "no LoRA adapters"),
    FieldRule(("session_id", "session_params"), EVERYWHERE, R, "no sessions"),
    FieldRule(("custom_logit_processor",), EVERYWHERE, R, "no custom logit processors"),
    FieldRule(("custom_params",), OPENAI, R, "no custom logit processors"),
    FieldRule(("stop_regex",), OPENAI, R, "no stop regexes", (None, "", [])),
    FieldRule(
        ("bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank"),
        EVERYWHERE,
        R,
        "no prefill/decode disaggregation",
    ),
    FieldRule(
        ("bootstrap_pair_key", "decode_tp_size"),
        ("generate",),
        R,
        "no prefill/decode disaggregation",
    ),
    FieldRule(
        ("extra_key", "cache_salt"),
        EVERYWHERE,
        R,
        "prefix-cache namespaces: ignoring them would share a cache the client keeps apart",
    ),
    FieldRule(("ngram_corpus_id",), EVERYWHERE, R, "no n-gram speculative decoding"),
    FieldRule(("custom_labels",), EVERYWHERE, R, "no per-request metric labels"),
    FieldRule(
        ("images_config", "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video"),
        EVERYWHERE,
        R,
        "text-only models",
    ),
    # ------------------------------------------------------------ /generate
    FieldRule(("text", "input_ids"), ("generate",), H, "one prompt, or a batch (a list)"),
    FieldRule(
        ("sampling_params", "rid", "return_logprob", "top_logprobs_num", "token_ids_logprob"),
        ("generate",),
        H,
        "once, or one per prompt of a batch; the logprob fields act with `return_logprob`",
    ),
    FieldRule(
        ("logprob_start_len",),
        ("generate",),
        H,
        "-1 or null only: no prompt logprobs (any other value is a 400)",
    ),
    FieldRule(
        ("stream", "return_text_in_logprobs", "return_prompt_token_ids", "priority"),
        ("generate",),
        H,
        "",
    ),
    FieldRule(
        ("require_reasoning",),
        ("generate",),
        H,
        "the output starts with a reasoning: its constraint applies once the "
        "`--reasoning-parser`'s end marker has been generated (400 without a parser)",
    ),
    FieldRule(
        ("model",),
        ("generate", "tokenize", "detokenize"),
        N,
        "not checked, as SGLang, whose routers add it",
    ),
    FieldRule(
        ("log_metrics", "no_logs"),
        ("generate",),
        N,
        "rsgl logs no request contents and counts every request in its metrics",
    ),
    FieldRule(
        ("conversation_id", "external_trace_header", "routing_key"),
        ("generate",),
        N,
        "SGLang's tracking and routing tags; they change no answer",
    ),
    FieldRule(
        ("received_time", "http_worker_ipc"),
        ("generate",),
        N,
        "SGLang-internal (its own frontend fills them in)",
    ),
    FieldRule(
        ("image_data", "video_data", "audio_data", "input_embeds", "mm_hashes"),
        ("generate",),
        R,
        "text-only models",
    ),
    FieldRule(
        (
            "mm_content_hashes",
            "video_config",
            "image_max_dynamic_patch",
            "video_max_dynamic_patch",
            "mm_processor_kwargs",
            "positional_embed_overrides",
            "need_wait_for_mm_inputs",
            "num_items_assigned",
            "encoder_urls",
        ),
        ("generate",),
        R,
        "text-only models",
    ),
    FieldRule(
        (
            "return_indexer_topk",
            "return_entropy",
            "return_bytes",
            "return_sampling_mask",
            "sampling_logprobs_mode",
            "return_flat_raw_top_logprobs",
            "return_flat_raw_top_logprobs_b64",
            "return_flat_raw_output_top_logprobs",
        ),
        ("generate",),
        R,
        "SGLang's answer extras rsgl does not compute",
    ),
    FieldRule(
        ("watermark", "max_thinking_tokens", "background"),
        ("generate",),
        R,
        "no watermarks, reasoning budgets or background responses",
    ),
    FieldRule(
        ("multi_item_delimiter_indices", "token_indices_to_pool", "kv_hints", "kv_router_hint"),
        ("generate",),
        R,
        "no scoring, pooling or cache hints",
    ),
    # ------------------------------------------------------------ /tokenize, /detokenize
    FieldRule(
        ("prompt", "messages", "add_special_tokens"), ("tokenize",), H, "one of prompt, messages"
    ),
    FieldRule(("tokens", "skip_special_tokens"), ("detokenize",), H, ""),
    *_sampling_rules(),
    *_structured_rules(),
)


def rules_for(endpoint: str, *handlings: Handling) -> Iterator[tuple[str, FieldRule]]:
    """(field, rule) of every field `endpoint` reads, of these handlings (all if none)."""
    for rule in RULES:
        if endpoint in rule.endpoints and (not handlings or rule.handling in handlings):
            for name in rule.names:
                yield name, rule


def _refusals(endpoint: str) -> dict[str, FieldRule]:
    return dict(rules_for(endpoint, Handling.REFUSED))


_REFUSED = {endpoint: _refusals(endpoint) for endpoint in ENDPOINTS}


def refuse_unsupported(endpoint: str, fields: Mapping[str, Any]) -> None:
    """InvalidRequest naming the first field of `fields` (a body's fields that its model does
    not declare; nested ones as `outer.inner`) that `endpoint` refuses at its value."""
    refused = _REFUSED[endpoint]
    for name, value in fields.items():
        rule = refused.get(name)
        if rule is None:
            continue
        if not _unset(value, rule.unset):
            shown = " or ".join(json.dumps(u) for u in rule.unset)
            raise InvalidRequest(
                f"{name} is not supported by this server ({rule.note}); leave it unset ({shown})",
                name,
            )


def _unset(value: Any, unset: tuple[Any, ...]) -> bool:
    """Whether `value` asks for nothing: one of `unset`, or a list of them (one per prompt)."""
    if any(isinstance(value, bool) == isinstance(u, bool) and value == u for u in unset):
        return True
    return isinstance(value, list) and all(_unset(v, unset) for v in value)


def markdown_table() -> str:
    """The README's table of request fields."""
    lines = ["| field | endpoints | handling | notes |", "|---|---|---|---|"]
    for rule in RULES:
        names = ", ".join(f"`{n}`" for n in rule.names)
        where = ", ".join(ENDPOINTS[e] for e in rule.endpoints)
        handling = rule.handling.value
        if rule.handling is Handling.REFUSED:
            handling += " (unset: " + ", ".join(f"`{json.dumps(u)}`" for u in rule.unset) + ")"
        lines.append(f"| {names} | {where} | {handling} | {rule.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
