"""Weight loading: the embedded default is converted once and then served from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from rsgl.models import loader
from rsgl.models.loader import embedded_gguf_path, load_model, resolve_model_dir


def test_embedded_default_resolves_to_a_cached_conversion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = resolve_model_dir(None)  # converts on a cold cache
    written = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    def convert_again(*args: object) -> None:
        raise AssertionError("a cached conversion must not be redone")

    monkeypatch.setattr(loader, "_convert_gguf", convert_again)
    model_dir = resolve_model_dir(None)
    assert model_dir == first
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == written
    assert embedded_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", ".rsgl-complete"):
        assert (model_dir / name).is_file(), name
    assert "SmolLM2-135M-Instruct" in model_dir.name


def test_a_directory_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load_model(tmp_path / "nothing-here")
