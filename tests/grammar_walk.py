"""Grammar test helpers: backends over the embedded model's tokenizer, and a walker that
drives a matcher to the end of its grammar the way a model would (through the masks only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rsgl.bench.grammar import load_corpus
from rsgl.grammar.backend import GrammarBackend, GrammarOptions, Matcher
from rsgl.grammar.registry import make_backend
from rsgl.models.loader import resolve_model_dir
from rsgl.tokenizer.loader import load_tokenizer

SCHEMAS: dict[str, Any] = load_corpus()
BACKENDS = ("xgrammar", "llguidance")


def embedded_tokenizer() -> Any:
    return load_tokenizer(resolve_model_dir(None))


_built: dict[tuple[str, GrammarOptions], GrammarBackend] = {}


def backend_for(name: str, tokenizer: Any, options: GrammarOptions | None = None) -> GrammarBackend:
    options = options or GrammarOptions()
    key = (name, options)
    if key not in _built:
        made = make_backend(name, tokenizer, len(tokenizer), [tokenizer.eos_token_id], options)
        assert made is not None
        _built[key] = made
    return _built[key]


def allowed_ids(backend: GrammarBackend, matcher: Matcher) -> np.ndarray:
    """The ids the mask of `matcher` allows now (as the loop fills it: all when it has no
    mask yet, e.g. while a reasoning runs)."""
    masking = matcher.masking()
    if masking is None:
        return np.arange(backend.vocab_size)
    bitmask = torch.zeros((1, backend.words), dtype=torch.int32)
    backend.fill([masking], bitmask)
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[: backend.vocab_size])


def walk(
    backend: GrammarBackend, matcher: Matcher, tokenizer: Any, seed: int, max_tokens: int = 400
) -> list[int]:
    """Tokens a matcher accepts until its grammar ends (EOS included): at each step one the
    mask allows, preferring tokens that close what is open so the walk ends, else random."""
    rng = np.random.default_rng(seed)
    closing = [tokenizer.eos_token_id]
    closing += [tokenizer.convert_tokens_to_ids(t) for t in ['"', "}", "]", "!", "0", "1", "a"]]
    out: list[int] = []
    while not matcher.is_terminated():
        assert len(out) < max_tokens, f"no end after {max_tokens} tokens: {out}"
        allowed = allowed_ids(backend, matcher)
        assert len(allowed), f"nothing allowed after {tokenizer.decode(out)!r}"
        allowed_set = set(allowed.tolist())
        preferred = [t for t in closing if t in allowed_set]
        explore = not preferred or rng.random() >= 0.7
        token = int(rng.choice(allowed)) if explore else preferred[0]
        assert matcher.accept(token), f"the mask allowed {token}, the matcher refused it"
        out.append(token)
    return out
