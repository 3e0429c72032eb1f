"""Messages between the frontend and the scheduler processes (ZeroMQ + msgpack via msgspec).

The frontend PUSHes commands to each scheduler (one socket per data-parallel rank); every
scheduler PUSHes to the frontend's one event socket: one `StepOutputs` per step (the loop's
`TokenUpdate`s: every request's new tokens and finishes of that step; request ids are
unique across ranks, so these need no rank), plus `Ready` once and `Stats` periodically.
Events that answer for one rank carry its `dp_rank`; answers to a question carry its
`token`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rsgl.outputs import TokenUpdate, decode_hook, encode_hook


class AddRequest(msgspec.Struct, tag="add"):
    """A tokenized request; `params` are SamplingParams fields."""

    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]
    priority: int = 0


class AbortRequest(msgspec.Struct, tag="abort"):
    rid: str
    message: str


class FinishRequest(msgspec.Struct, tag="finish"):
    """The frontend found a stop string: the request ends (nothing more is sent for it)."""

    rid: str
    matched: str


class FlushCache(msgspec.Struct, tag="flush"):
    """Empty the prefix cache; answered by `FlushResult`."""

    token: int


class CheckIntegrity(msgspec.Struct, tag="check"):
    """Run the core's integrity check between steps; answered by `IntegrityResult`."""

    token: int


class GetStats(msgspec.Struct, tag="get_stats"):
    """Send statistics now (not at the next period); answered by a `Stats` with the token."""

    token: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


Command = (
    AddRequest | AbortRequest | FinishRequest | FlushCache | CheckIntegrity | GetStats | Shutdown
)


class Ready(msgspec.Struct, tag="ready"):
    """The scheduler process is up; `info` describes the model and the pool."""

    info: dict[str, Any]
    dp_rank: int = 0


class StepOutputs(msgspec.Struct, tag="step"):
    """What the loop emitted for one step (or one finish outside a step)."""

    updates: list[TokenUpdate]


class Stats(msgspec.Struct, tag="stats"):
    """The core's statistics and the loop's counters; periodic (`token` None) or the
    answer to `GetStats`."""

    stats: dict[str, Any]
    dp_rank: int = 0
    token: int | None = None


class FlushResult(msgspec.Struct, tag="flushed"):
    token: int
    ok: bool
    dp_rank: int = 0


class IntegrityResult(msgspec.Struct, tag="checked"):
    """`error` is the failed check's message, None when the core is consistent."""

    token: int
    error: str | None
    dp_rank: int = 0


Event = Ready | StepOutputs | Stats | FlushResult | IntegrityResult

encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)
command_decoder = msgspec.msgpack.Decoder(Command)
event_decoder = msgspec.msgpack.Decoder(Event, dec_hook=decode_hook)
