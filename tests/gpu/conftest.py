"""GPU tests: skipped cleanly where torch sees no CUDA device.

The model is `RSGL_GPU_TEST_MODEL` (a directory with config.json and a tokenizer) with
seeded random weights when `RSGL_GPU_TEST_DUMMY=1` (the GPU machine has no copy of the
embedded model's weights), else the embedded SmolLM2 with its real weights.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the GPU tests run where torch sees one")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_model() -> dict[str, Any]:
    """Engine/runner options naming the test model."""
    path = os.environ.get("RSGL_GPU_TEST_MODEL")
    dummy = os.environ.get("RSGL_GPU_TEST_DUMMY") == "1"
    return {"model_path": path, "load_format": "dummy" if dummy else "auto"}
