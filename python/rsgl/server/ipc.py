"""Messages between the frontend and the scheduler process (ZeroMQ + msgpack via msgspec).

The frontend PUSHes commands; the scheduler PUSHes one `StepOutputs` per step (the loop's
`TokenUpdate`s: every request's new tokens and finishes of that step) plus `Ready` once and
`Stats` periodically.
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
    token: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


Command = AddRequest | AbortRequest | FinishRequest | FlushCache | Shutdown


class Ready(msgspec.Struct, tag="ready"):
    """The scheduler process is up; `info` describes the model and the pool."""

    info: dict[str, Any]


class StepOutputs(msgspec.Struct, tag="step"):
    """What the loop emitted for one step (or one finish outside a step)."""

    updates: list[TokenUpdate]


class Stats(msgspec.Struct, tag="stats"):
    stats: dict[str, Any]


class FlushResult(msgspec.Struct, tag="flushed"):
    token: int
    ok: bool


Event = Ready | StepOutputs | Stats | FlushResult

encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)
command_decoder = msgspec.msgpack.Decoder(Command)
event_decoder = msgspec.msgpack.Decoder(Event, dec_hook=decode_hook)
