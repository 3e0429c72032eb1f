"""What every route needs: the server's state, request validation and submission, waiting
for results (whole or streamed) and the server-sent-events framing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from rsgl.args import ServerArgs
from rsgl.errors import InvalidRequest
from rsgl.outputs import Output, merge
from rsgl.sampling_params import SamplingParams
from rsgl.server.frontend import EngineUnavailable, Frontend
from rsgl.server.protocol import ApiError, bad_request
from rsgl.tokenizer.output_processor import RequestRecord
from rsgl.validation import (
    DEFAULT_MAX_NEW_TOKENS,
    RequestLimits,
    check_int64,
    expand_requests,
    make_sampling_params,
)

DISCONNECT_POLL_S = 0.25

# The OpenAI error type of each status a request the server ended itself may carry.
ERROR_TYPES = {
    400: "BadRequestError",
    408: "TimeoutError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


@dataclass
class ServerState:
    """What the routes need: the frontend, the tokenizer and the served model's identity."""

    frontend: Frontend
    tokenizer: Any
    model_name: str
    limits: RequestLimits
    # The options it runs with.
    args: ServerArgs = field(default_factory=ServerArgs)
    api_key: str | None = None
    is_alive: Callable[[], bool] = lambda: True
    created: int = field(default_factory=lambda: int(time.time()))


class StateHolder:
    """Where the app finds its ServerState, which exists only once start-up has finished."""

    state: ServerState | None = None


def server_state(request: Request) -> ServerState:
    """The running server's state (`create_app` puts its holder on the app)."""
    holder: StateHolder = request.app.state.holder
    assert holder.state is not None, "the server has not finished starting"
    return holder.state


@dataclass(slots=True)
class Choice:
    """One generation of a request (prompt i, copy k)."""

    index: int
    prompt_index: int
    record: RequestRecord
    prefix: str = ""  # echo


def check_model(st: ServerState, name: str | None) -> None:
    if name is not None and name != st.model_name:
        raise ApiError(
            404, f"The model `{name}` does not exist.", "NotFoundError", "model", "model_not_found"
        )


def dp_rank(
    st: ServerState, data_parallel_rank: int | None, routed_dp_rank: int | None
) -> int | None:
    """The data-parallel rank a request names (SGLang's `routed_dp_rank`, or its older name
    `data_parallel_rank`), checked; None lets --load-balance-method pick."""
    if None not in (data_parallel_rank, routed_dp_rank) and data_parallel_rank != routed_dp_rank:
        raise bad_request(
            "data_parallel_rank and routed_dp_rank name different ranks; give one",
            "routed_dp_rank",
        )
    name, rank = "routed_dp_rank", routed_dp_rank
    if rank is None:
        name, rank = "data_parallel_rank", data_parallel_rank
    if rank is not None and not 0 <= rank < st.frontend.dp_size:
        raise bad_request(f"{name} must be in [0, {st.frontend.dp_size}), got {rank}", name)
    return rank


def sampling(
    st: ServerState,
    raw: dict[str, Any],
    ids: list[int],
    names: dict[str, str],
    default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
) -> tuple[SamplingParams, int]:
    """Validated SamplingParams and `n`; errors name the fields as the API spells them."""
    try:
        return make_sampling_params(
            raw,
            st.limits,
            len(ids),
            default_max_new_tokens=default_max_new_tokens,
            max_tokens_param=names.get("max_new_tokens", "max_new_tokens"),
        )
    except InvalidRequest as exc:
        param = names.get(exc.param, exc.param) if exc.param else None
        raise InvalidRequest(exc.message, param) from exc


async def start(
    st: ServerState,
    jobs: list[tuple[list[int], SamplingParams]],
    n: int,
    rid: str | list[str] | None,
    priority: int,
    *,
    stream: bool,
    dp_rank: int | None = None,
) -> list[Choice]:
    """Submits `n` copies of every validated (prompt, params) job (on data-parallel rank
    `dp_rank` when it is named)."""
    check_int64(priority, "priority")
    expanded = expand_requests([ids for ids, _ in jobs], [(p, n) for _, p in jobs], rid)
    choices: list[Choice] = []
    try:
        for job in expanded:
            record = await st.frontend.submit(
                job.rid, job.prompt_ids, job.params, priority, job.group, stream, dp_rank=dp_rank
            )
            choices.append(Choice(job.index, job.prompt_index, record))
    except EngineUnavailable as exc:
        for c in choices:
            st.frontend.abort(c.record.rid)
        raise ApiError(503, str(exc), "ServiceUnavailableError") from exc
    except ValueError as exc:
        for c in choices:
            st.frontend.abort(c.record.rid)
        raise bad_request(str(exc), "rid") from exc
    return choices


def raise_if_failed(meta: dict[str, Any] | None) -> None:
    """A request the server ended on its own (a failed step, a timeout) is an error."""
    reason = (meta or {}).get("finish_reason") or {}
    status = reason.get("status_code")
    if reason.get("type") == "abort" and status is not None:
        kind = ERROR_TYPES.get(int(status), "InternalServerError")
        raise ApiError(int(status), str(reason.get("message", "")), kind)


async def collect(
    st: ServerState, request: Request, choices: list[Choice]
) -> list[tuple[Choice, Output]]:
    """Waits for every choice; aborts them all if the client disconnects first."""

    async def one(c: Choice) -> tuple[Choice, Output]:
        return c, merge([u async for u in st.frontend.outputs(c.record)])

    async def disconnected() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    work: asyncio.Future[list[tuple[Choice, Output]]] = asyncio.ensure_future(
        asyncio.gather(*(one(c) for c in choices))
    )
    watch: asyncio.Future[Any] = asyncio.ensure_future(disconnected())
    await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not work.done():
        for c in choices:
            st.frontend.abort(c.record.rid, "the client disconnected")
    results = list(await work)
    for _, u in results:
        raise_if_failed(u.meta)
    return results


async def merged(st: ServerState, choices: list[Choice]) -> AsyncIterator[tuple[Choice, Output]]:
    """Outputs of all choices as they come (one consumer task per choice). A choice the
    server ended on its own raises ApiError (the stream reports it)."""
    st.frontend.watch_stream([c.record for c in choices])
    if len(choices) == 1:
        async for u in st.frontend.outputs(choices[0].record):
            raise_if_failed(u.meta)
            yield choices[0], u
        return
    # Bounded, so a client that stops reading backs up into the per-request queues, where
    # the frontend notices the stall.
    out: asyncio.Queue[tuple[Choice, Output]] = asyncio.Queue(maxsize=len(choices))

    async def pump(c: Choice) -> None:
        async for u in st.frontend.outputs(c.record):
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


def sse(obj: Any) -> str:
    # Generated text is valid Unicode; an error event may quote client input, so it is
    # ASCII-escaped like every error body.
    return f"data: {json.dumps(obj, ensure_ascii='error' in obj)}\n\n"


def stream_response(body: AsyncIterator[str]) -> StreamingResponse:
    """SSE of `body`'s events, then `[DONE]`; an error mid-stream becomes an error event."""

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
