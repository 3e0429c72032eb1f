"""Fixtures of the grammar tests: the embedded model's tokenizer, and each backend over it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from grammar_walk import BACKENDS, backend_for, embedded_tokenizer

from rsgl.grammar.backend import GrammarBackend


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return embedded_tokenizer()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[GrammarBackend]:
    yield backend_for(request.param, tokenizer)
