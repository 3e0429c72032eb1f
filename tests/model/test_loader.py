"""Weight loading: the embedded default is converted once and then served from the cache."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rsgl.models.loader import embedded_gguf_path, load_model, resolve_model_dir


def test_embedded_default_resolves_to_a_cached_conversion() -> None:
    resolve_model_dir(None)  # converts on a cold cache
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(None)
    assert time.perf_counter() - t0 < 5, "a cached conversion must not be redone"
    assert embedded_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", ".rsgl-complete"):
        assert (model_dir / name).is_file(), name
    assert "SmolLM2-135M-Instruct" in model_dir.name


def test_a_directory_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load_model(tmp_path / "nothing-here")
