"""Operations: /health, /health_generate (a real one-token generation), /metrics."""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from rsgl.sampling_params import SamplingParams
from rsgl.server.frontend import EngineUnavailable
from rsgl.server.routes.common import ServerState, server_state

router = APIRouter()
State = Annotated[ServerState, Depends(server_state)]

HEALTH_GENERATE_TIMEOUT_S = 20.0
# Paths open without the API key.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


@router.get("/health")
async def health(st: State) -> Response:
    """200 while the server takes requests, 503 when it cannot (every scheduler gone, or
    draining for shutdown).

    A data-parallel server that lost some ranks is *degraded*: still 200, with a JSON body
    naming the dead ranks. Its live ranks answer every request correctly, so a router
    (sglang-router drops a worker whose /health fails) should keep sending it work rather
    than lose that capacity too; an operator or orchestrator that wants the lost ranks back
    reads the body, `rsgl_dp_ranks_alive`, or /server_info, and restarts the server.
    """
    f = st.frontend
    ok = f.healthy and not f.draining and st.is_alive()
    if not ok:
        return Response(status_code=503)
    if f.degraded:
        body = {
            "status": "degraded",
            "dp_size": f.dp_size,
            "dp_ranks_alive": f.dp_size - len(f.dead_ranks),
            "dead_dp_ranks": [
                {"dp_rank": rank, "exit_code": code} for rank, code in sorted(f.dead_ranks.items())
            ],
        }
        return JSONResponse(body, status_code=200)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(st: State) -> Response:
    if not (st.frontend.healthy and st.is_alive()):
        return Response(status_code=503)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    rid = f"health-{uuid.uuid4().hex}"
    try:
        record = await st.frontend.submit(
            rid, [int(t) for t in st.tokenizer.encode("ping")], params
        )

        async def drain() -> None:
            async for _ in st.frontend.outputs(record):
                pass

        await asyncio.wait_for(drain(), HEALTH_GENERATE_TIMEOUT_S)
    except (TimeoutError, EngineUnavailable):
        st.frontend.abort(rid, "health check timed out")
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(st: State) -> Response:
    return Response(st.frontend.metrics.render(), media_type=CONTENT_TYPE_LATEST)
