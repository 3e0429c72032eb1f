"""What flows out of the scheduling loop, and what a caller finally receives.

The loop knows token ids, never text: per step it reports one `TokenUpdate` per request that
advanced or ended. `rsgl.tokenizer.output_processor` turns those into `Output`s (text deltas,
token ids and, at the end, SGLang's `meta_info`), in the Engine's process or in the server's
frontend process alike; `TokenUpdate` is also what crosses the process boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from rsgl._core import FinishReason


class TokenUpdate(msgspec.Struct, array_like=True, gc=False):
    """One request's news from one step: its new token ids (a stop token included), their
    log-probability entries when it asked for them, and how it finished, if it did.
    `cached_tokens` and `queue_time` come with its first token and with its finish."""

    rid: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None = None
    finish: FinishReason | None = None
    cached_tokens: int | None = None
    queue_time: float | None = None
    # Speculation: its running (verify steps with its drafts, drafts, accepted drafts).
    spec: tuple[int, int, int] | None = None


@dataclass(slots=True)
class SpecCounts:
    """One request's speculation so far: the verify steps that carried its drafts, those
    drafts, and the ones accepted."""

    verify_ct: int = 0
    drafts: int = 0
    accepted: int = 0

    def add(self, drafts: int, accepted: int) -> None:
        self.verify_ct += 1
        self.drafts += drafts
        self.accepted += accepted

    def to_tuple(self) -> tuple[int, int, int]:
        return self.verify_ct, self.drafts, self.accepted


def spec_meta(counts: tuple[int, int, int]) -> dict[str, Any]:
    """SGLang's meta_info fields for a speculating request: verify steps, drafted and
    accepted draft tokens, their ratio, and the tokens each verify step committed."""
    verify_ct, drafts, accepted = counts
    return {
        "spec_verify_ct": verify_ct,
        "spec_draft_token_num": drafts,
        "spec_accept_token_num": accepted,
        "spec_accept_rate": accepted / drafts if drafts else 0.0,
        "spec_accept_length": (verify_ct + accepted) / verify_ct if verify_ct else 0.0,
    }


def _encode_finish(obj: Any) -> Any:
    if isinstance(obj, FinishReason):
        return obj.to_dict()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _decode_finish(kind: type, obj: Any) -> Any:
    if kind is FinishReason:
        return FinishReason.from_dict(obj)
    raise NotImplementedError(f"cannot decode {kind.__name__}")


# msgpack with FinishReason as its API dict (for the scheduler process -> frontend wire).
encode_hook = _encode_finish
decode_hook = _decode_finish


@dataclass(slots=True)
class Output:
    """What a caller gets for one request: new text and token ids, the log-probability
    entries of those ids when the request asked for them, and `meta` (SGLang's meta_info: id,
    finish_reason, token counts, latencies) once it is over."""

    text: str
    token_ids: list[int]
    meta: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """`{"text", "output_ids"[, "meta_info"]}`, as SGLang's generate answers."""
        out: dict[str, Any] = {"text": self.text, "output_ids": self.token_ids}
        if self.meta is not None:
            out["meta_info"] = self.meta
        return out


def merge(outputs: Iterable[Output]) -> Output:
    """A request's outputs as one: the texts, ids and logprobs concatenated, the last meta."""
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[dict[str, Any]] | None = None
    meta = None
    for o in outputs:
        text.append(o.text)
        ids.extend(o.token_ids)
        if o.logprobs is not None:
            logprobs = [] if logprobs is None else logprobs
            logprobs.extend(o.logprobs)
        meta = o.meta
    return Output("".join(text), ids, meta, logprobs)
