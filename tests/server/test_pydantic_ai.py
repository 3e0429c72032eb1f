"""A client library people use for structured output, against a real server: pydantic-ai's
Agent gets a validated pydantic object back, by its default route (a forced tool call:
`tools` with `tool_choice` "required", read back from `message.tool_calls`), streamed, and by
`NativeOutput` (`response_format` json_schema)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from launcher import launch, stop
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

MODEL = "SmolLM2-135M-Instruct"
SETTINGS = ModelSettings(temperature=0, max_tokens=100)


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=100_000_000)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIChatModel]:
    log_path = tmp_path_factory.mktemp("pydantic-ai") / "server.log"
    proc, url = launch(log_path, "--max-total-tokens", "20000", "--dtype", "float32")
    yield OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{url}/v1", api_key="x"))
    stop(proc, log_path)


def answer_parts(messages: list[object]) -> list[object]:
    responses = [m for m in messages if isinstance(m, ModelResponse)]
    assert len(responses) == 1  # valid the first time: no retry was needed
    return list(responses[0].parts)


def test_an_agent_gets_a_validated_object_from_a_forced_tool_call(model: OpenAIChatModel) -> None:
    agent = Agent(model, output_type=City, model_settings=SETTINGS)
    result = agent.run_sync("Describe Paris.")
    assert isinstance(result.output, City)
    (call,) = answer_parts(result.all_messages())
    assert isinstance(call, ToolCallPart) and call.tool_name == "final_result"
    assert City.model_validate(call.args_as_dict()) == result.output


def test_a_streamed_agent_run_gets_the_same_object(model: OpenAIChatModel) -> None:
    agent = Agent(model, output_type=City, model_settings=SETTINGS)
    whole = agent.run_sync("Describe Rome.").output

    async def streamed() -> City:
        async with agent.run_stream("Describe Rome.") as run:
            return await run.get_output()

    assert asyncio.run(streamed()) == whole


def test_native_output_is_a_json_schema_response_format(model: OpenAIChatModel) -> None:
    agent = Agent(model, output_type=NativeOutput(City), model_settings=SETTINGS)
    result = agent.run_sync("Describe Paris.")
    assert isinstance(result.output, City)
    (text,) = answer_parts(result.all_messages())
    assert isinstance(text, TextPart)
    assert City.model_validate(json.loads(text.content)) == result.output
