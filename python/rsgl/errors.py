"""Errors that cross the engine's public surface."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses before queueing it; `param` names the offending field
    (OpenAI's `param`). The server answers 400 with it; the Engine raises it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class SamplingParamError(InvalidRequest):
    """A sampling parameter out of its range; `param` is its SamplingParams name (callers
    translate it to their API's spelling)."""


class FatalStepError(RuntimeError):
    """A step failed in a way that leaves the engine unable to run another (a dead
    tensor-parallel rank, ranks out of step): the loop stops at once instead of failing
    step after step."""
