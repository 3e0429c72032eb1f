"""The OpenAI API: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from rsgl import reasoning, tool_calls
from rsgl.outputs import Output
from rsgl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    bad_request,
    sum_usage,
)
from rsgl.server.request_fields import refuse_unsupported
from rsgl.server.routes.common import (
    Choice,
    ServerState,
    check_model,
    collect,
    dp_rank,
    merged,
    sampling,
    server_state,
    sse,
    start,
    stream_response,
)
from rsgl.validation import check_messages, tokenize_prompt

router = APIRouter()
State = Annotated[ServerState, Depends(server_state)]

# How the OpenAI APIs spell the sampling fields an error may name.
COMPLETION_PARAMS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "top_logprobs": "logprobs",
    "top_logprobs_num": "logprobs",
    "logprobs": "logprobs",
}
CHAT_PARAMS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "top_logprobs_num": "top_logprobs",
}


def _is_ids(p: Any) -> bool:
    return bool(p) and all(isinstance(t, int) for t in p)


def check_fields(req: OpenAIRequest, endpoint: str) -> None:
    """Refuses what `rsgl.server.request_fields` refuses (the body's undeclared fields, the
    stream options' as `stream_options.<name>`), and options that need another one."""
    fields = dict(req.model_extra or {})
    if req.stream_options is not None:
        extra = req.stream_options.model_extra or {}
        fields.update({f"stream_options.{name}": value for name, value in extra.items()})
    refuse_unsupported(endpoint, fields)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")


def candidates(st: ServerState, req: OpenAIRequest) -> int:
    """How many completions to generate per prompt: `best_of` (checked as vLLM does), else
    `n`."""
    if req.best_of is None:
        return req.n
    max_n = st.limits.max_n
    if not 1 <= req.n <= max_n:
        raise bad_request(f"n must be an integer in [1, {max_n}], got {req.n}", "n")
    if not 1 <= req.best_of <= max_n:
        raise bad_request(
            f"best_of must be an integer in [1, {max_n}], got {req.best_of}", "best_of"
        )
    if req.best_of < req.n:
        raise bad_request(
            f"best_of must be greater than or equal to n, got n={req.n}, best_of={req.best_of}",
            "best_of",
        )
    if req.stream and req.best_of > req.n:
        raise bad_request(
            "best_of > n cannot be streamed: the best candidates are known only once all "
            "have finished",
            "best_of",
        )
    return req.best_of


def cumulative_logprob(u: Output) -> float:
    return sum(float(e["logprob"]) for e in u.logprobs or [])


def best_of(results: list[tuple[Choice, Output]], n: int) -> list[tuple[Choice, Output]]:
    """vLLM's best_of: of each prompt's candidates, the `n` with the highest cumulative
    logprob of their tokens, best first (a tie keeps the earlier candidate first); the
    prompts stay in order."""
    by_prompt: dict[int, list[tuple[Choice, Output]]] = {}
    for c, u in results:
        by_prompt.setdefault(c.prompt_index, []).append((c, u))
    chosen: list[tuple[Choice, Output]] = []
    for prompt_index in sorted(by_prompt):
        ranked = sorted(by_prompt[prompt_index], key=lambda r: -cumulative_logprob(r[1]))
        chosen.extend(ranked[:n])
    return chosen


def envelope(
    st: ServerState, cid: str, kind: str, created: int, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """An OpenAI response or stream chunk around `choices`."""
    body = {"id": cid, "object": kind, "created": created, "model": st.model_name}
    return dict(body, choices=choices, **extra)


def finish_reason(meta: dict[str, Any] | None) -> str | None:
    return None if meta is None else str(meta["finish_reason"]["type"])


def _token_text(st: ServerState, token: int) -> str:
    return str(st.tokenizer.decode([token]))


def completion_logprobs(
    st: ServerState, entries: list[dict[str, Any]] | None, offset: int
) -> dict[str, Any] | None:
    """OpenAI's completion logprobs of these tokens, the first one at text `offset`."""
    if entries is None:
        return None
    tokens = [_token_text(st, e["token_id"]) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {_token_text(st, t["token_id"]): t["logprob"] for t in e.get("top_logprobs", [])}
            for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(st: ServerState, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """OpenAI's chat logprobs of these tokens."""
    if entries is None:
        return None

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(st, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            dict(
                item(e["token_id"], e["logprob"]),
                top_logprobs=[item(t["token_id"], t["logprob"]) for t in e.get("top_logprobs", [])],
            )
            for e in entries
        ]
    }


class PendingLogprobs:
    """A stream's log-probability entries not sent yet, per choice. Each chunk carries those
    of the tokens that arrived since the previous chunk; a token whose text is held back
    (a possible stop string) rides with the next chunk that has text."""

    def __init__(self) -> None:
        self.entries: dict[int, list[dict[str, Any]]] = {}
        # Completions: where the next token's text starts in the choice's text.
        self.offset: dict[int, int] = {}

    def add(self, index: int, entries: list[dict[str, Any]] | None) -> None:
        if entries is not None:
            self.entries.setdefault(index, []).extend(entries)

    def take(self, index: int) -> list[dict[str, Any]] | None:
        return self.entries.pop(index, None)

    def completion(self, st: ServerState, index: int) -> dict[str, Any] | None:
        """The completion logprobs of what waits for choice `index`, offsets moving on."""
        out = completion_logprobs(st, self.take(index), self.offset.get(index, 0))
        if out is not None and out["tokens"]:
            self.offset[index] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out


@router.get("/v1/models")
async def models(st: State) -> dict[str, Any]:
    model = {
        "id": st.model_name,
        "object": "model",
        "created": st.created,
        "owned_by": "rsgl",
        "root": st.args.model_path or st.frontend.info.get("model_dir"),
        "max_model_len": st.limits.context_length,
    }
    return {"object": "list", "data": [model]}


@router.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request, st: State) -> Any:
    check_model(st, req.model)
    check_fields(req, "completions")
    if req.echo and req.logprobs is not None:
        raise bad_request(
            "echo with logprobs would need the prompt's logprobs, which this server does not "
            "compute",
            "echo",
        )
    copies = candidates(st, req)
    p: Any = req.prompt
    prompts: list[Any] = [p] if isinstance(p, str) or _is_ids(p) else list(p)
    if not prompts:
        raise bad_request("the prompt is empty", "prompt")
    ids = [
        tokenize_prompt(st.tokenizer, st.limits, text=x, param="prompt")
        if isinstance(x, str)
        else tokenize_prompt(st.tokenizer, st.limits, input_ids=x, param="prompt")
        for x in prompts
    ]
    raw = req.sampling_params()
    raw.update(n=copies, max_new_tokens=req.max_tokens)
    if req.logprobs is not None:
        raw.update(logprobs=True, top_logprobs=req.logprobs)
    elif copies > req.n:
        raw["logprobs"] = True  # to rank the candidates
    jobs = [(x, sampling(st, raw, x, COMPLETION_PARAMS)[0]) for x in ids]
    rank = dp_rank(st, req.data_parallel_rank, req.routed_dp_rank)
    choices = await start(st, jobs, copies, req.rid, req.priority, stream=req.stream, dp_rank=rank)
    if req.echo:
        for c in choices:
            x = prompts[c.prompt_index]
            c.prefix = x if isinstance(x, str) else str(st.tokenizer.decode(x))
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunk(choices_: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
        return sse(envelope(st, cid, "text_completion", created, choices_, **(extra or {})))

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def body() -> AsyncIterator[str]:
            metas: dict[int, dict[str, Any]] = {}
            started: set[int] = set()
            logprobs = PendingLogprobs()
            async for c, u in merged(st, choices):
                text = u.text
                if c.index not in started:
                    started.add(c.index)
                    text = c.prefix + text
                    logprobs.offset[c.index] = len(c.prefix)
                if u.meta is not None:
                    metas[c.index] = dict(u.meta, prompt_index=c.prompt_index)
                logprobs.add(c.index, u.logprobs)
                if not text and u.meta is None:
                    continue
                choice = {
                    "index": c.index,
                    "text": text,
                    "logprobs": logprobs.completion(st, c.index),
                    "finish_reason": finish_reason(u.meta),
                }
                yield chunk([choice])
            if include_usage:
                yield chunk([], {"usage": sum_usage(list(metas.values()))})

        return stream_response(body())

    results = await collect(st, request, choices)
    # Usage counts every candidate's tokens, as OpenAI bills best_of.
    metas = [dict(u.meta or {}, prompt_index=c.prompt_index) for c, u in results]
    if copies > req.n:
        results = best_of(results, req.n)
    out = [
        {
            "index": i,
            "text": c.prefix + u.text,
            "logprobs": (
                completion_logprobs(st, u.logprobs, len(c.prefix))
                if req.logprobs is not None
                else None
            ),
            "finish_reason": finish_reason(u.meta),
        }
        for i, (c, u) in enumerate(results)
    ]
    return envelope(st, cid, "text_completion", created, out, usage=sum_usage(metas))


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request, st: State) -> Any:
    check_model(st, req.model)
    check_fields(req, "chat")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    copies = candidates(st, req)
    tools = tool_calls.plan(
        req.tools, req.tool_choice, req.parallel_tool_calls, st.args.tool_call_parser
    )
    prompt_ids = chat_prompt(st, req, tools.template_tools)
    thinking = reasoning_of(st, req, prompt_ids)
    max_tokens = req.max_completion_tokens
    names = dict(CHAT_PARAMS)
    if max_tokens is None:
        max_tokens = req.max_tokens
    else:
        names["max_new_tokens"] = "max_completion_tokens"
    raw = req.sampling_params()
    if tools.json_schema is not None:
        other = req.constraint_field()
        if other is not None:
            raise bad_request(
                f"tool_choice forces a tool call, which constrains the output itself; "
                f"{other} constrains it too",
                "tool_choice",
            )
        raw["json_schema"] = tools.json_schema
    if thinking is not None and thinking.reasons:
        raw["require_reasoning"] = True  # a constraint waits for the reasoning to end
    # No limit given: whatever the context leaves.
    raw.update(n=copies, max_new_tokens=max_tokens)
    if req.logprobs:
        raw.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    elif copies > req.n:
        raw["logprobs"] = True  # to rank the candidates
    params, n = sampling(st, raw, prompt_ids, names)
    rank = dp_rank(st, req.data_parallel_rank, req.routed_dp_rank)
    choices: list[Choice] = await start(
        st, [(prompt_ids, params)], n, req.rid, req.priority, stream=req.stream, dp_rank=rank
    )
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunk(choices_: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
        return sse(envelope(st, cid, "chat.completion.chunk", created, choices_, **(extra or {})))

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def body() -> AsyncIterator[str]:
            for c in choices:
                delta = {"role": "assistant", "content": ""}
                yield chunk([{"index": c.index, "delta": delta, "finish_reason": None}])
            metas = []
            logprobs = PendingLogprobs()
            fmt = tools.fmt
            calls = {c.index: tool_calls.ToolCallStream(fmt) for c in choices} if fmt else {}
            thoughts: dict[int, reasoning.ReasoningSplitter] = {}
            if thinking is not None and thinking.separate:
                thoughts = {c.index: thinking.splitter() for c in choices}
            async for c, u in merged(st, choices):
                if u.meta is not None:
                    metas.append(dict(u.meta, prompt_index=0))
                ended = u.meta is not None
                logprobs.add(c.index, u.logprobs)
                deltas: list[dict[str, Any]] = []
                text = u.text
                if c.index in thoughts:
                    thought, text = reasoning_pieces(thoughts[c.index], text, ended)
                    if thought:
                        deltas.append({"reasoning_content": thought})
                reason = finish_reason(u.meta)
                if c.index in calls:
                    deltas += stream_deltas(calls[c.index], text, ended)
                    if calls[c.index].calls and reason == "stop":
                        reason = "tool_calls"
                elif text:
                    deltas.append({"content": text})
                if not deltas and u.meta is None:
                    continue
                # A chunk per delta: a call's id and name come before its arguments.
                for i, delta in enumerate(deltas or [{}]):
                    last = i == max(len(deltas), 1) - 1
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": chat_logprobs(st, logprobs.take(c.index)) if i == 0 else None,
                        "finish_reason": reason if last else None,
                    }
                    yield chunk([choice])
            if include_usage:
                yield chunk([], {"usage": sum_usage(metas)})

        return stream_response(body())

    results = await collect(st, request, choices)
    metas = [dict(u.meta or {}, prompt_index=0) for _, u in results]
    if copies > req.n:
        results = best_of(results, req.n)
    out = []
    for i, (_, u) in enumerate(results):
        text, thought = u.text, None
        if thinking is not None and thinking.separate:
            thought, text = thinking.split(text)
        message, reason = chat_message(tools.fmt, text, finish_reason(u.meta))
        if thinking is not None and thinking.separate:
            message["reasoning_content"] = thought or None
        out.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(st, u.logprobs) if req.logprobs else None,
                "finish_reason": reason,
            }
        )
    return envelope(st, cid, "chat.completion", created, out, usage=sum_usage(metas))


def chat_message(
    fmt: tool_calls.ToolCallFormat | None, text: str, reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole answer's message, and its finish reason: `tool_calls` when the model called
    tools and stopped on its own (cut off by max_tokens, it stays `length`)."""
    parsed = fmt.parse(text, final=True) if fmt is not None else None
    if parsed is None or not parsed.calls:
        return {"role": "assistant", "content": text}, reason
    message = {
        "role": "assistant",
        "content": parsed.content or None,
        "tool_calls": [tool_calls.tool_call(call) for call in parsed.calls],
    }
    return message, "tool_calls" if reason == "stop" else reason


@dataclass(frozen=True, slots=True)
class Thinking:
    """How a chat request reasons (`--reasoning-parser`): whether its output starts inside
    a reasoning (a constraint then waits for the reasoning to end), and whether its answers
    carry the reasoning apart as `reasoning_content` (`separate_reasoning`)."""

    fmt: reasoning.ReasoningFormat
    reasons: bool
    separate: bool
    stream_reasoning: bool

    def split(self, text: str) -> tuple[str, str]:
        return self.fmt.split(text, self.reasons)

    def splitter(self) -> reasoning.ReasoningSplitter:
        return reasoning.ReasoningSplitter(self.fmt, self.reasons, self.stream_reasoning)


def reasoning_of(
    st: ServerState, req: ChatCompletionRequest, prompt_ids: list[int]
) -> Thinking | None:
    """None when the server has no --reasoning-parser. A request reasons as its format says
    for its chat_template_kwargs, or when its prompt has opened the reasoning."""
    name = st.args.reasoning_parser
    if name is None:
        return None
    fmt = reasoning.FORMATS[name]
    tail = str(st.tokenizer.decode(prompt_ids[-8:]))
    reasons = fmt.reasons(req.chat_template_kwargs) or fmt.opened_by(tail)
    return Thinking(fmt, reasons, req.separate_reasoning, req.stream_reasoning)


def reasoning_pieces(
    splitter: reasoning.ReasoningSplitter, text: str, last: bool
) -> tuple[str, str]:
    """The (reasoning, content) of a piece of a streamed answer (the held-back rest too
    when it is the last)."""
    thought, content = splitter.feed(text)
    if last:
        more_thought, more_content = splitter.finish()
        thought, content = thought + more_thought, content + more_content
    return thought, content


def stream_deltas(calls: tool_calls.ToolCallStream, text: str, last: bool) -> list[dict[str, Any]]:
    """The chunk deltas of a piece of a streamed answer read for tool calls: its content,
    then each call's header or arguments."""
    grown = [calls.feed(text)]
    if last:
        grown.append(calls.finish())
    deltas: list[dict[str, Any]] = []
    for d in grown:
        if d.content:
            deltas.append({"content": d.content})
        deltas += [{"tool_calls": [entry]} for entry in d.tool_calls]
    return deltas


def chat_prompt(
    st: ServerState, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt's token ids: the messages (and `tools`) through the chat template, or
    SGLang's `input_ids` (the messages still checked) in place of the template's."""
    if req.input_ids is None:
        return tokenize_prompt(
            st.tokenizer,
            st.limits,
            messages=req.messages,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=tools,
        )
    for name in ("continue_final_message", "chat_template_kwargs"):
        if getattr(req, name):
            raise bad_request(f"{name} shapes the chat template, which input_ids replace", name)
    check_messages(req.messages)
    return tokenize_prompt(st.tokenizer, st.limits, input_ids=req.input_ids)
