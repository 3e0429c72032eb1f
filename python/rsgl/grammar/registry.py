"""The grammar backends by name (`--grammar-backend`): each is imported only when chosen
(xgrammar and llguidance each load a native library)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rsgl.grammar.backend import GrammarBackend, GrammarOptions

BACKEND_NAMES = ("xgrammar", "llguidance", "none")


def make_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    options: GrammarOptions | None = None,
) -> GrammarBackend | None:
    """The backend `name` (`BACKEND_NAMES`; "none": None, no constrained decoding) for a HF
    tokenizer, the model's vocabulary width and its EOS ids (which end a grammar)."""
    options = options or GrammarOptions()
    if name == "none":
        return None
    if name == "xgrammar":
        from rsgl.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, options)
    if name == "llguidance":
        from rsgl.grammar.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids, options)
    raise ValueError(f"unknown grammar backend {name!r}: expected one of {BACKEND_NAMES}")


__all__ = ["BACKEND_NAMES", "make_backend"]
