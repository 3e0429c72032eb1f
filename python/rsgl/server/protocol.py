"""OpenAI-compatible and SGLang-native request bodies, and OpenAI-shaped errors."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat (OpenAI names plus the usual extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    rid: str | None = None

    def sampling_params(self) -> dict[str, Any]:
        """SGLang sampling_params for this request (the caller adds max_new_tokens, n and
        logprobs, which the two APIs spell differently)."""
        params: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "seed": self.seed,
            "logit_bias": self.logit_bias or {},
        }
        return params


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class GenerateRequest(BaseModel):
    """POST /generate (SGLang native)."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None


class AbortBody(BaseModel):
    rid: str


class ApiError(Exception):
    """An error with an HTTP status, rendered OpenAI-style."""

    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, code: Any = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
    }


def sum_usage(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage of a request with several choices: the prompt counts once per prompt."""
    prompts: dict[int, tuple[int, int]] = {}
    completion = 0
    for i, m in enumerate(metas):
        prompts.setdefault(m.get("prompt_index", i), (m["prompt_tokens"], m["cached_tokens"]))
        completion += m["completion_tokens"]
    prompt = sum(p for p, _ in prompts.values())
    cached = sum(c for _, c in prompts.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
