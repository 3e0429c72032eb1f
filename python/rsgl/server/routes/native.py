"""SGLang's native endpoints: /generate, /abort_request, /flush_cache, the info and load
endpoints sglang-router reads (/server_info, /model_info, /get_load, /version), /tokenize
and /detokenize."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

import rsgl
from rsgl.outputs import Output, merge
from rsgl.server.frontend import EngineUnavailable
from rsgl.server.protocol import (
    AbortBody,
    ApiError,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    bad_request,
)
from rsgl.server.request_fields import refuse_unsupported
from rsgl.server.routes.common import (
    Choice,
    ServerState,
    collect,
    dp_rank,
    merged,
    sampling,
    server_state,
    sse,
    start,
    stream_response,
)
from rsgl.tokenizer.output_processor import RequestRecord
from rsgl.validation import RequestLimits, check_text, check_token_ids, tokenize_prompt

logger = logging.getLogger("rsgl.server")

router = APIRouter()
State = Annotated[ServerState, Depends(server_state)]


@router.post("/generate", response_model=None)
async def generate(req: GenerateRequest, request: Request, st: State) -> Any:
    """SGLang's generate: one prompt (`text` or `input_ids`) or a batch of them, `n` copies
    of each; a batch answers (and streams, with an `index`) its choices prompt by prompt."""
    extra = req.model_extra or {}
    refuse_unsupported("generate", extra)
    if extra:
        logger.debug("/generate: unset or unknown fields %s", sorted(extra))
    prompts, single = _prompts(st, req)
    count = len(prompts)
    raws = _per_prompt(req.sampling_params, count, "sampling_params")
    want_logprob = _per_prompt(req.return_logprob, count, "return_logprob")
    top = _per_prompt(req.top_logprobs_num, count, "top_logprobs_num")
    reasons = _per_prompt(req.require_reasoning, count, "require_reasoning")
    ids_logprob = req.token_ids_logprob
    nested = bool(ids_logprob) and isinstance(ids_logprob[0], list)  # type: ignore[index]
    ids_logprobs = _per_prompt(ids_logprob if nested else None, count, "token_ids_logprob")
    for start_len in _per_prompt(req.logprob_start_len, count, "logprob_start_len"):
        if start_len not in (None, -1):
            raise bad_request(
                "input-token logprobs are not supported: logprob_start_len must be -1",
                "logprob_start_len",
            )
    jobs = []
    copies = set()
    for i, ids in enumerate(prompts):
        raw = dict(raws[i] or {})
        if reasons[i]:
            raw["require_reasoning"] = True
        if want_logprob[i]:
            raw["return_logprob"] = True
            if top[i]:
                raw["top_logprobs_num"] = top[i]
            token_ids = ids_logprobs[i] if nested else ids_logprob
            if token_ids:
                raw["token_ids_logprob"] = token_ids
        params, n = sampling(st, raw, ids, {})
        if params.require_reasoning and st.args.reasoning_parser is None:
            raise bad_request(
                "require_reasoning needs a --reasoning-parser (it says where the reasoning "
                "ends, and a constraint begins)",
                "require_reasoning",
            )
        jobs.append((ids, params))
        copies.add(n)
    if len(copies) > 1:
        raise bad_request("n must be the same for every prompt of a batch", "sampling_params")
    n = copies.pop()
    rank = dp_rank(st, req.data_parallel_rank, req.routed_dp_rank)
    choices = await start(st, jobs, n, req.rid, req.priority or 0, stream=req.stream, dp_rank=rank)
    text_of = _token_text(st) if req.return_text_in_logprobs else None

    def native(c: Choice, u: Output) -> dict[str, Any]:
        out = u.to_dict()
        if req.return_prompt_token_ids:
            out["prompt_token_ids"] = c.record.prompt_ids
        return _sglang_logprobs(out, text_of) if c.record.params.return_logprob else out

    if req.stream:
        incremental = st.args.incremental_streaming_output

        async def body() -> AsyncIterator[str]:
            so_far = {c.index: Output("", []) for c in choices}
            counts = dict.fromkeys(so_far, 0)
            async for c, u in merged(st, choices):
                # SGLang's chunks: the text, ids and logprobs so far (deltas with
                # --incremental-streaming-output), and a meta_info on every chunk.
                counts[c.index] += len(u.token_ids)
                shown = u
                if not incremental:
                    shown = so_far[c.index] = merge([so_far[c.index], u])
                meta = u.meta
                if meta is None:
                    meta = _running_meta(c.record, counts[c.index], shown.logprobs)
                elif incremental and shown.logprobs is not None:
                    meta = dict(meta, output_token_logprobs=shown.logprobs)
                chunk = native(c, Output(shown.text, shown.token_ids, meta))
                if len(choices) > 1:
                    chunk["index"] = c.index
                yield sse(chunk)

        return stream_response(body())
    results = await collect(st, request, choices)
    outs = [native(c, u) for c, u in results]
    return outs[0] if single and n == 1 else outs


def _prompts(st: ServerState, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the request named a single prompt (SGLang's
    `text: str` or a flat `input_ids`) rather than a batch."""
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    if isinstance(req.text, str):
        return [tokenize_prompt(st.tokenizer, st.limits, text=req.text)], True
    ids = req.input_ids
    if ids is not None and not (ids and isinstance(ids[0], list)):
        return [tokenize_prompt(st.tokenizer, st.limits, input_ids=ids)], True
    batch: list[Any] = list(req.text if req.text is not None else ids or [])
    if not batch:
        raise bad_request("the batch is empty", "text" if req.text is not None else "input_ids")
    if req.text is not None:
        return [tokenize_prompt(st.tokenizer, st.limits, text=t) for t in batch], False
    return [tokenize_prompt(st.tokenizer, st.limits, input_ids=x) for x in batch], False


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A field given once for the whole batch or as a list with one entry per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise bad_request(
            f"{name} must have one entry per prompt ({count}), got {len(value)}", name
        )
    return value


def _running_meta(
    record: RequestRecord, completion_tokens: int, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """meta_info of a request still generating (finish_reason null), as SGLang streams it."""
    meta: dict[str, Any] = {
        "id": record.rid,
        "finish_reason": None,
        "prompt_tokens": len(record.prompt_ids),
        "completion_tokens": completion_tokens,
        "cached_tokens": record.cached_tokens,
    }
    if record.params.return_logprob:
        meta["output_token_logprobs"] = logprobs or []
    return meta


def _token_text(st: ServerState) -> Callable[[int], str]:
    return lambda t: str(st.tokenizer.decode([t]))


def _sglang_logprobs(out: dict[str, Any], text_of: Callable[[int], str] | None) -> dict[str, Any]:
    """meta_info's logprobs in SGLang's layout: `[logprob, token_id, text or null]` triples
    (`output_token_logprobs`), per position lists of them (`output_top_logprobs`,
    `output_token_ids_logprobs`), and no input-token logprobs."""
    meta = out.get("meta_info")
    if meta is None or "output_token_logprobs" not in meta:
        return out

    def triple(e: dict[str, Any]) -> list[Any]:
        return [e["logprob"], e["token_id"], text_of(e["token_id"]) if text_of else None]

    entries = meta["output_token_logprobs"]
    meta = dict(meta, input_token_logprobs=[], input_top_logprobs=[])
    meta["output_token_logprobs"] = [triple(e) for e in entries]
    meta["output_top_logprobs"] = [[triple(t) for t in e.get("top_logprobs", [])] for e in entries]
    if any("token_ids_logprob" in e for e in entries):
        meta["output_token_ids_logprobs"] = [
            [triple(t) for t in e.get("token_ids_logprob", [])] for e in entries
        ]
    return dict(out, meta_info=meta)


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


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(st: State) -> dict[str, Any]:
    """SGLang's keys (what sglang-router and dashboards read), then rsgl's own.
    `internal_states` has one entry per data-parallel rank (its latest statistics, its
    process and whether it lives); `stats` sums the live ones."""
    f = st.frontend
    info, stats, args = f.info, f.stats, st.args
    ranks = [
        dict(
            f.rank_stats[rank],
            dp_rank=rank,
            scheduler_pid=f.rank_infos[rank].get("scheduler_pid"),
            alive=rank not in f.dead_ranks,
            **({"exit_code": f.dead_ranks[rank]} if rank in f.dead_ranks else {}),
        )
        for rank in range(f.dp_size)
    ]
    return dict(
        info,
        model_path=args.model_path or info["model_dir"],
        served_model_name=st.model_name,
        tokenizer_path=args.tokenizer_path or info["model_dir"],
        version=rsgl.__version__,
        max_total_num_tokens=info["max_total_tokens"],
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        page_size=args.page_size,
        context_length=info["context_length"],
        dp_size=f.dp_size,
        load_balance_method=args.load_balance_method,
        dp_ranks_alive=f.dp_size - len(f.dead_ranks),
        internal_states=ranks,
        model_name=st.model_name,
        stats=stats,
    )


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(st: State) -> dict[str, Any]:
    config = _model_config(Path(st.frontend.info["model_dir"]))
    return {
        "model_path": st.args.model_path or st.frontend.info["model_dir"],
        "served_model_name": st.model_name,
        "tokenizer_path": st.args.tokenizer_path or st.frontend.info["model_dir"],
        "is_generation": True,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


@router.get("/get_load")
async def get_load(st: State) -> list[dict[str, Any]]:
    """One entry per live data-parallel rank, as SGLang answers: requests in the engine,
    waiting ones, KV tokens in use; from each scheduler's last statistics (sent every
    second). A dead rank is left out: it has no load, and a zero would read as room."""
    f = st.frontend
    loads = []
    for rank, s in enumerate(f.rank_stats):
        if rank in f.dead_ranks:
            continue
        used = int(s.get("capacity", 0)) - int(s.get("available", 0)) - int(s.get("evictable", 0))
        running, waiting = int(s.get("running", 0)), int(s.get("waiting", 0))
        loads.append(
            {
                "dp_rank": rank,
                "num_reqs": running + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": max(0, used),
            }
        )
    return loads


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": rsgl.__version__}


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(req: TokenizeRequest, st: State) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if req.messages is not None:
        tokens: Any = tokenize_prompt(st.tokenizer, _no_limits(st), messages=req.messages)
        count: Any = len(tokens)
    else:
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt or [])
        lists = [_encode(st, p, req.add_special_tokens) for p in prompts]
        tokens = lists[0] if isinstance(req.prompt, str) else lists
        count = len(tokens) if isinstance(req.prompt, str) else [len(t) for t in lists]
    return {"tokens": tokens, "count": count, "max_model_len": st.limits.context_length}


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(req: DetokenizeRequest, st: State) -> dict[str, Any]:
    nested = bool(req.tokens) and isinstance(req.tokens[0], list)
    lists: list[list[int]] = req.tokens if nested else [req.tokens]  # type: ignore[assignment,list-item]
    for ids in lists:
        check_token_ids(ids, st.limits, "tokens")
    texts = [
        str(st.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)) for ids in lists
    ]
    return {"text": texts if nested else texts[0]}


def _encode(st: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    ids = st.tokenizer.encode(check_text(text, "prompt"), add_special_tokens=add_special_tokens)
    return [int(t) for t in ids]


def _no_limits(st: ServerState) -> RequestLimits:
    """The server's limits without the prompt-length ones (tokenizing is not generating)."""
    big = 1 << 62
    return dataclasses.replace(st.limits, context_length=big, max_prompt_len=big)


@functools.cache
def _model_config(model_dir: Path) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config
