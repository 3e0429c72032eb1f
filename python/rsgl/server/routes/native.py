"""SGLang's native endpoints: /generate, /abort_request, /flush_cache, /get_server_info."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from rsgl.server.frontend import EngineUnavailable
from rsgl.server.protocol import AbortBody, ApiError, GenerateRequest, bad_request
from rsgl.server.routes.common import (
    ServerState,
    collect,
    merged,
    sampling,
    server_state,
    sse,
    start,
    stream_response,
)
from rsgl.validation import tokenize_prompt

router = APIRouter()
State = Annotated[ServerState, Depends(server_state)]


@router.post("/generate", response_model=None)
async def generate(req: GenerateRequest, request: Request, st: State) -> Any:
    ids = tokenize_prompt(st.tokenizer, st.limits, text=req.text, input_ids=req.input_ids)
    params, n = sampling(st, req.sampling_params or {}, ids, {})
    choices = await start(st, [(ids, params)], n, req.rid, 0)
    if req.stream:

        async def body() -> AsyncIterator[str]:
            async for _, u in merged(st, choices):
                yield sse(u.to_dict())

        return stream_response(body())
    results = await collect(st, request, choices)
    outs = [u.to_dict() for _, u in results]
    return outs if n > 1 else outs[0]


@router.post("/abort_request")
async def abort_request(body: AbortBody, st: State) -> dict[str, Any]:
    return {"aborted": st.frontend.abort_group(body.rid)}


@router.post("/flush_cache")
async def flush_cache(st: State) -> JSONResponse:
    try:
        flushed = await st.frontend.flush_cache()
    except EngineUnavailable as exc:
        raise ApiError(503, str(exc), "ServiceUnavailableError") from exc
    if not flushed:
        raise bad_request("cannot flush the cache while requests are running")
    return JSONResponse({"success": True, "message": "cache flushed"})


@router.get("/get_server_info")
async def server_info(st: State) -> dict[str, Any]:
    return dict(st.frontend.info, model_name=st.model_name, stats=st.frontend.stats)
