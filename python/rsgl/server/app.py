"""The FastAPI app: the routes of `rsgl.server.routes`, the API key check, and every error
answered as an OpenAI error object (ASCII JSON, the right status and `param`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from rsgl.args import DEFAULT_MAX_REQUEST_BYTES
from rsgl.errors import InvalidRequest
from rsgl.server.body_limit import BodyLimitMiddleware
from rsgl.server.protocol import ApiError, bad_request
from rsgl.server.routes import admin, native, openai
from rsgl.server.routes.common import ServerState, StateHolder


def error_response(err: ApiError, headers: Mapping[str, str] | None = None) -> Response:
    # ASCII JSON: a message quoting the client's input may hold a lone surrogate, which
    # Starlette's JSONResponse (UTF-8, ensure_ascii off) cannot encode.
    body = json.dumps(err.body())
    return Response(body, status_code=err.status, media_type="application/json", headers=headers)


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _invalid_request(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    return error_response(bad_request(exc.message, exc.param))


async def _invalid_body(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        # Its loc is a byte offset, not a parameter.
        where = first.get("loc", ("body", "?"))[-1]
        message = f"the request body is not valid JSON (at byte {where}): {first.get('msg')}"
        return error_response(bad_request(message))
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = f"invalid request: {param or 'body'}: {first.get('msg', 'invalid value')}"
    return error_response(bad_request(message, param))


async def _http_error(_: Request, exc: Exception) -> Response:
    # Starlette's own refusals (unknown path, wrong method, an unreadable body).
    assert isinstance(exc, StarletteHTTPException)
    kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(
        exc.status_code, "BadRequestError"
    )
    return error_response(ApiError(exc.status_code, str(exc.detail), kind), exc.headers)


async def _internal(_: Request, exc: Exception) -> Response:
    return error_response(ApiError(500, f"internal error: {exc!r}", "InternalServerError"))


class ApiKeyMiddleware:
    """Answers 401 to a request without `Authorization: Bearer <--api-key>` (when the server
    has a key; the paths of `admin.OPEN_PATHS` are open).

    Plain ASGI on purpose: Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) hands
    the endpoint a `receive` that never reports the client's disconnect, so a non-streaming
    request whose client left ran to its end (or, waiting for its grammar, started later)."""

    def __init__(self, app: ASGIApp, holder: StateHolder) -> None:
        self.app = app
        self.holder = holder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.holder.state
        key = state.api_key if state is not None else None
        if key and scope["type"] == "http" and scope["path"] not in admin.OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if given != f"Bearer {key}".encode():
                refusal = ApiError(401, "invalid or missing API key", "AuthenticationError")
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    holder: StateHolder, lifespan: Any = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    """Builds the app; `lifespan` fills `holder` before the first request."""
    app = FastAPI(title="rsgl", version="0.1.0", lifespan=lifespan)
    app.state.holder = holder
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(InvalidRequest, _invalid_request)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.add_middleware(ApiKeyMiddleware, holder=holder)
    app.include_router(openai.router)
    app.include_router(native.router)
    app.include_router(admin.router)
    return app


__all__ = ["ServerState", "StateHolder", "create_app"]
