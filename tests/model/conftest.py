"""Shared fixtures: the embedded SmolLM2 (rsgl runner + HF reference), loaded once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from plan_builder import Driver

from rsgl.model_executor.model_runner import ModelRunner
from rsgl.models.loader import load_tokenizer

# Without a GPU the Triton kernels run in Triton's interpreter, which triton reads when it is
# first imported: switch it on before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smol_runner() -> ModelRunner:
    # The first run converts the embedded GGUF (~25 s); later runs load the cached copy.
    return ModelRunner.from_pretrained(
        None, kv_buffer_size=8192, max_running_requests=16, context_len=1024
    )


@pytest.fixture(scope="session")
def smol_tokenizer(smol_runner: ModelRunner) -> Any:
    return load_tokenizer(smol_runner.loaded.model_dir)


@pytest.fixture(scope="session")
def hf_smol(smol_runner: ModelRunner) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_runner.loaded.model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval()


@pytest.fixture
def driver(smol_runner: ModelRunner) -> Iterator[Driver]:
    yield Driver(smol_runner)
