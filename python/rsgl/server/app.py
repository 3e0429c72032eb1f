"""The FastAPI app: OpenAI-compatible and SGLang-native endpoints over the Frontend."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from rsgl.errors import InvalidRequest
from rsgl.sampling_params import SamplingParams
from rsgl.server.body_limit import BodyLimitMiddleware
from rsgl.server.frontend import EngineUnavailable, Frontend, ReqState, Update
from rsgl.server.protocol import (
    AbortBody,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    bad_request,
    sum_usage,
    usage,
)
from rsgl.validation import (
    DEFAULT_MAX_NEW_TOKENS,
    RequestLimits,
    check_int64,
    check_messages,
    check_prompt,
    check_text,
    make_sampling_params,
)

OPEN_PATHS = {"/health", "/health_generate", "/metrics"}
HEALTH_GENERATE_TIMEOUT_S = 20.0
DISCONNECT_POLL_S = 0.25
DEFAULT_MAX_REQUEST_BYTES = 32 << 20

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


@dataclass
class ServerState:
    """What the routes need: the frontend, the tokenizer and the served model's identity."""

    frontend: Frontend
    tokenizer: Any
    model_name: str
    limits: RequestLimits
    api_key: str | None = None
    is_alive: Callable[[], bool] = lambda: True
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(slots=True)
class Choice:
    """One generation of a request (prompt i, copy k)."""

    index: int
    prompt_index: int
    state: ReqState
    prefix: str = ""  # echo


def _is_ids(p: Any) -> bool:
    return bool(p) and all(isinstance(t, int) for t in p)


class StateHolder:
    """Where the app finds its ServerState, which exists only once start-up has finished."""

    state: ServerState | None = None


def create_app(
    holder: StateHolder, lifespan: Any = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    """Builds the app; `lifespan` fills `holder` before the first request."""
    app = FastAPI(title="rsgl", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)

    def error_response(err: ApiError, headers: Mapping[str, str] | None = None) -> Response:
        # ASCII JSON: a message quoting the client's input may hold a lone surrogate, which
        # Starlette's JSONResponse (UTF-8, ensure_ascii off) cannot encode.
        return Response(
            json.dumps(err.body()),
            status_code=err.status,
            media_type="application/json",
            headers=headers,
        )

    def st() -> ServerState:
        assert holder.state is not None, "the server has not finished starting"
        return holder.state

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(InvalidRequest)
    async def invalid_request(_: Request, exc: InvalidRequest) -> Response:
        return error_response(bad_request(exc.message, exc.param))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            # Its loc is a byte offset, not a parameter.
            where = first.get("loc", ("body", "?"))[-1]
            message = f"the request body is not valid JSON (at byte {where}): {first.get('msg')}"
            return error_response(bad_request(message))
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"invalid request: {param or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # Starlette's own refusals (unknown path, wrong method, an unreadable body).
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(
            exc.status_code, "BadRequestError"
        )
        err = ApiError(exc.status_code, str(exc.detail), kind)
        return error_response(err, exc.headers)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> Response:
        err = ApiError(500, f"internal error: {exc!r}", "InternalServerError")
        return error_response(err)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Any) -> Response:
        key = holder.state.api_key if holder.state is not None else None
        authorized = request.headers.get("authorization") == f"Bearer {key}"
        if key and request.url.path not in OPEN_PATHS and not authorized:
            err = ApiError(401, "invalid or missing API key", "AuthenticationError")
            return error_response(err)
        response: Response = await call_next(request)
        return response

    # ---------------------------------------------------------------- helpers

    def check_model(name: str | None) -> None:
        if name is not None and name != st().model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist.",
                "NotFoundError",
                "model",
                "model_not_found",
            )

    def sampling(
        raw: dict[str, Any],
        ids: list[int],
        names: dict[str, str],
        default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
    ) -> tuple[SamplingParams, int]:
        """Validated SamplingParams and `n`; errors name the fields as the API spells them."""
        try:
            return make_sampling_params(
                raw,
                st().limits,
                len(ids),
                default_max_new_tokens=default_max_new_tokens,
                max_tokens_param=names.get("max_new_tokens", "max_new_tokens"),
            )
        except InvalidRequest as exc:
            param = names.get(exc.param, exc.param) if exc.param else None
            raise InvalidRequest(exc.message, param) from exc

    def encode(text: str, param: str) -> list[int]:
        return [int(t) for t in st().tokenizer.encode(check_text(text, param))]

    async def start(
        jobs: list[tuple[list[int], SamplingParams]], n: int, rid: str | None, priority: int
    ) -> list[Choice]:
        """Submits `n` copies of every validated (prompt, params) job."""
        check_int64(priority, "priority")
        base = rid or uuid.uuid4().hex
        choices: list[Choice] = []
        try:
            for i, (ids, params) in enumerate(jobs):
                for k in range(n):
                    index = i * n + k
                    sub = base if len(jobs) * n == 1 else f"{base}-{index}"
                    state = await st().frontend.submit(sub, ids, params, priority, base)
                    choices.append(Choice(index, i, state))
        except EngineUnavailable as exc:
            for c in choices:
                st().frontend.abort(c.state.rid)
            raise ApiError(503, str(exc), "ServiceUnavailableError") from exc
        except ValueError as exc:
            for c in choices:
                st().frontend.abort(c.state.rid)
            raise bad_request(str(exc), "rid") from exc
        return choices

    async def collect(request: Request, choices: list[Choice]) -> list[tuple[Choice, Update]]:
        """Waits for every choice; aborts them all if the client disconnects first."""

        async def one(c: Choice) -> tuple[Choice, Update]:
            text, ids, meta = [], [], None
            async for u in st().frontend.updates(c.state):
                text.append(u.text)
                ids.extend(u.token_ids)
                meta = u.meta
            return c, Update("".join(text), ids, meta)

        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        work: asyncio.Future[list[tuple[Choice, Update]]] = asyncio.ensure_future(
            asyncio.gather(*(one(c) for c in choices))
        )
        watch: asyncio.Future[Any] = asyncio.ensure_future(disconnected())
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not work.done():
            for c in choices:
                st().frontend.abort(c.state.rid, "the client disconnected")
        results = list(await work)
        for _, u in results:
            raise_if_failed(u.meta)
        return results

    def raise_if_failed(meta: dict[str, Any] | None) -> None:
        """A request the server ended on its own (a failed step, a timeout) is an error."""
        reason = (meta or {}).get("finish_reason") or {}
        status = reason.get("status_code")
        if reason.get("type") == "abort" and status is not None:
            kind = str(reason.get("err_type") or "InternalServerError")
            raise ApiError(int(status), str(reason.get("message", "")), kind)

    async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Update]]:
        """Updates of all choices as they come (one consumer task per choice). A choice the
        server ended on its own raises ApiError (the stream reports it)."""
        st().frontend.watch_stream([c.state for c in choices])
        if len(choices) == 1:
            async for u in st().frontend.updates(choices[0].state):
                raise_if_failed(u.meta)
                yield choices[0], u
            return
        # Bounded, so a client that stops reading backs up into the per-request outboxes,
        # where the frontend notices the stall.
        out: asyncio.Queue[tuple[Choice, Update]] = asyncio.Queue(maxsize=len(choices))

        async def pump(c: Choice) -> None:
            async for u in st().frontend.updates(c.state):
                await out.put((c, u))

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        open_choices = len(choices)
        try:
            while open_choices:
                c, u = await out.get()
                raise_if_failed(u.meta)
                open_choices -= u.meta is not None
                yield c, u
        finally:
            for t in tasks:
                t.cancel()

    def envelope(
        cid: str, kind: str, created: int, choices: list[dict[str, Any]], **extra: Any
    ) -> dict[str, Any]:
        """An OpenAI response or stream chunk around `choices`."""
        body = {
            "id": cid,
            "object": kind,
            "created": created,
            "model": st().model_name,
            "choices": choices,
        }
        return dict(body, **extra)

    def sse(obj: Any) -> str:
        # Generated text is valid Unicode; an error event may quote client input, so it is
        # ASCII-escaped like every error body.
        return f"data: {json.dumps(obj, ensure_ascii='error' in obj)}\n\n"

    def stream_response(body: AsyncIterator[str]) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            try:
                async for line in body:
                    yield line
            except ApiError as exc:
                yield sse(exc.body())
            except Exception as exc:  # noqa: BLE001 - reported to the client in-stream
                yield sse(ApiError(500, f"internal error: {exc!r}", "InternalServerError").body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(guarded(), media_type="text/event-stream")

    def finish_reason(meta: dict[str, Any] | None) -> str | None:
        return None if meta is None else str(meta["finish_reason"]["type"])

    def tok_text(t: int) -> str:
        return str(st().tokenizer.decode([t]))

    def completion_logprobs(meta: dict[str, Any], offset: int) -> dict[str, Any] | None:
        entries = meta.get("output_token_logprobs")
        if entries is None:
            return None
        tokens = [tok_text(e["token_id"]) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {tok_text(t["token_id"]): t["logprob"] for t in e.get("top_logprobs", [])}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def chat_logprobs(meta: dict[str, Any]) -> dict[str, Any] | None:
        entries = meta.get("output_token_logprobs")
        if entries is None:
            return None

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = tok_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                dict(
                    item(e["token_id"], e["logprob"]),
                    top_logprobs=[
                        item(t["token_id"], t["logprob"]) for t in e.get("top_logprobs", [])
                    ],
                )
                for e in entries
            ]
        }

    def with_prompt_index(choices: list[Choice], metas: list[dict[str, Any]]) -> list[Any]:
        return [dict(m, prompt_index=c.prompt_index) for c, m in zip(choices, metas)]

    # ---------------------------------------------------------------- OpenAI

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": st().model_name,
                    "object": "model",
                    "created": st().created,
                    "owned_by": "rsgl",
                    "max_model_len": st().limits.context_length,
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        check_model(req.model)
        p: Any = req.prompt
        prompts: list[Any] = [p] if isinstance(p, str) or _is_ids(p) else list(p)
        if not prompts:
            raise bad_request("the prompt is empty", "prompt")
        ids = [
            check_prompt(encode(x, "prompt") if isinstance(x, str) else x, st().limits)
            for x in prompts
        ]
        raw = req.sampling_params()
        raw.update(n=req.n, max_new_tokens=req.max_tokens)
        if req.logprobs is not None:
            raw.update(logprobs=True, top_logprobs=req.logprobs)
        jobs = [(x, sampling(raw, x, COMPLETION_PARAMS)[0]) for x in ids]
        choices = await start(jobs, req.n, req.rid, req.priority)
        if req.echo:
            for c in choices:
                x = prompts[c.prompt_index]
                c.prefix = x if isinstance(x, str) else str(st().tokenizer.decode(x))
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def chunk(choices_: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
            return sse(envelope(cid, "text_completion", created, choices_, **(extra or {})))

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body() -> AsyncIterator[str]:
                metas: dict[int, dict[str, Any]] = {}
                started: set[int] = set()
                async for c, u in merged(choices):
                    text = u.text
                    if c.index not in started:
                        started.add(c.index)
                        text = c.prefix + text
                    if u.meta is not None:
                        metas[c.index] = dict(u.meta, prompt_index=c.prompt_index)
                    if not text and u.meta is None:
                        continue
                    logprobs = None if u.meta is None else completion_logprobs(u.meta, 0)
                    yield chunk(
                        [
                            {
                                "index": c.index,
                                "text": text,
                                "logprobs": logprobs,
                                "finish_reason": finish_reason(u.meta),
                            }
                        ]
                    )
                if include_usage:
                    yield chunk([], {"usage": sum_usage(list(metas.values()))})

            return stream_response(body())

        results = await collect(request, choices)
        metas = [u.meta or {} for _, u in results]
        return envelope(
            cid,
            "text_completion",
            created,
            [
                {
                    "index": c.index,
                    "text": c.prefix + u.text,
                    "logprobs": completion_logprobs(u.meta or {}, len(c.prefix)),
                    "finish_reason": finish_reason(u.meta),
                }
                for c, u in results
            ],
            usage=sum_usage(with_prompt_index([c for c, _ in results], metas)),
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        check_model(req.model)
        messages = check_messages(req.messages)
        try:
            templated = st().tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:
            raise bad_request(f"invalid messages: {exc}", "messages") from exc
        prompt_ids = check_prompt([int(t) for t in templated], st().limits, "messages")
        max_tokens = req.max_completion_tokens
        names = dict(CHAT_PARAMS)
        if max_tokens is None:
            max_tokens = req.max_tokens
        else:
            names["max_new_tokens"] = "max_completion_tokens"
        raw = req.sampling_params()
        # No limit given: whatever the context leaves.
        raw.update(n=req.n, max_new_tokens=max_tokens)
        if req.logprobs:
            raw.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
        params, n = sampling(raw, prompt_ids, names)
        choices = await start([(prompt_ids, params)], n, req.rid, req.priority)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def chunk(choices_: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
            return sse(envelope(cid, "chat.completion.chunk", created, choices_, **(extra or {})))

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def body() -> AsyncIterator[str]:
                for c in choices:
                    delta = {"role": "assistant", "content": ""}
                    yield chunk([{"index": c.index, "delta": delta, "finish_reason": None}])
                metas = []
                async for c, u in merged(choices):
                    if u.meta is not None:
                        metas.append(u.meta)
                    if not u.text and u.meta is None:
                        continue
                    delta = {"content": u.text} if u.text else {}
                    logprobs = None if u.meta is None else chat_logprobs(u.meta)
                    yield chunk(
                        [
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": logprobs,
                                "finish_reason": finish_reason(u.meta),
                            }
                        ]
                    )
                if include_usage:
                    yield chunk([], {"usage": sum_usage([dict(m, prompt_index=0) for m in metas])})

            return stream_response(body())

        results = await collect(request, choices)
        metas = [dict(u.meta or {}, prompt_index=0) for _, u in results]
        return envelope(
            cid,
            "chat.completion",
            created,
            [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": u.text},
                    "logprobs": chat_logprobs(u.meta or {}),
                    "finish_reason": finish_reason(u.meta),
                }
                for c, u in results
            ],
            usage=sum_usage(metas),
        )

    # ---------------------------------------------------------------- native

    @app.post("/generate", response_model=None)
    async def generate(req: GenerateRequest, request: Request) -> Any:
        if (req.text is None) == (req.input_ids is None):
            raise bad_request("give exactly one of text or input_ids", "text")
        if req.text is not None:
            ids = check_prompt(encode(req.text, "text"), st().limits, "text")
        else:
            ids = check_prompt(req.input_ids, st().limits, "input_ids")
        params, n = sampling(req.sampling_params or {}, ids, {})
        choices = await start([(ids, params)], n, req.rid, 0)

        def native(u: Update) -> dict[str, Any]:
            out: dict[str, Any] = {"text": u.text, "output_ids": u.token_ids}
            if u.meta is not None:
                out["meta_info"] = u.meta
            return out

        if req.stream:

            async def body() -> AsyncIterator[str]:
                async for _, u in merged(choices):
                    yield sse(native(u))

            return stream_response(body())
        results = await collect(request, choices)
        outs = [native(u) for _, u in results]
        return outs if n > 1 else outs[0]

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> dict[str, Any]:
        return {"aborted": st().frontend.abort_group(body.rid)}

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        try:
            flushed = await st().frontend.flush_cache()
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc), "ServiceUnavailableError") from exc
        if not flushed:
            raise bad_request("cannot flush the cache while requests are running")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return dict(st().frontend.info, model_name=st().model_name, stats=st().frontend.stats)

    # ---------------------------------------------------------------- health, metrics

    @app.get("/health")
    async def health() -> Response:
        f = st().frontend
        ok = f.healthy and not f.draining and st().is_alive()
        return Response(status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not (st().frontend.healthy and st().is_alive()):
            return Response(status_code=503)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        rid = f"health-{uuid.uuid4().hex}"
        try:
            state = await st().frontend.submit(
                rid, [int(t) for t in st().tokenizer.encode("ping")], params
            )

            async def drain() -> None:
                async for _ in st().frontend.updates(state):
                    pass

            await asyncio.wait_for(drain(), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, EngineUnavailable):
            st().frontend.abort(rid, "health check timed out")
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st().frontend.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = ["ServerState", "StateHolder", "create_app", "usage"]
