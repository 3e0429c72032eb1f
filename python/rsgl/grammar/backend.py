"""The grammar backends behind one small interface (`--grammar-backend`): compile a
`Constraint`, make a per-request `Matcher` of the result, and fill allowed-token bitmasks for
a batch of matchers at once.

A bitmask row is int32 `[ceil(vocab / 32)]`: token j is allowed when bit `j % 32` of word
`j // 32` is set (xgrammar's and llguidance's layout). `vocab` is the model's LM-head width,
so ids past the tokenizer's vocabulary are never allowed.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rsgl.grammar.constraint import Constraint

# Whitespace a JSON constraint allows between tokens by default: enough for indented output,
# too little for a model stuck emitting spaces to run to max_tokens on them (SGLang #8250).
DEFAULT_MAX_JSON_WHITESPACE = 16


class GrammarError(ValueError):
    """A constraint that does not compile; the message is the compiler's, cleaned of its
    source locations (the request answers 400 with it)."""


@dataclass(frozen=True, slots=True)
class GrammarOptions:
    """How JSON constraints treat whitespace: `disable_any_whitespace` allows none (compact
    JSON, SGLang's `--constrained-json-disable-any-whitespace`); otherwise at most
    `max_whitespace` characters between tokens (None: unbounded)."""

    disable_any_whitespace: bool = False
    max_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE
    threads: int = 2


class Matcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advances by `token`; False (and the matcher is then unusable) if not allowed."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""

    def masking(self) -> Matcher | None:
        """The matcher whose mask the next token samples under (None: any token may
        follow, e.g. while a reasoning runs before the grammar applies)."""
        return self

    def may_mask_after_one(self) -> bool:
        """Whether, one token (still in flight) from now, `masking()` may be a matcher: a
        step whose rows all say no samples without waiting for masks."""
        return True


class GrammarBackend(ABC):
    """Compiles constraints and fills masks for one tokenizer and vocabulary width."""

    name: str

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32

    @abstractmethod
    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (shared by every matcher of it); GrammarError if it does not
        compile. Runs on the compiler's threads: must not touch per-request state."""

    @abstractmethod
    def size_bytes(self, compiled: Any) -> int:
        """What `compiled` holds in memory, for the cache's byte cap."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of `compiled`."""

    @abstractmethod
    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
        """Writes row i of `bitmask` (int32 [len(matchers), words], CPU) for matchers[i]."""


_LOCATION = re.compile(r"\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def compiler_message(exc: BaseException) -> str:
    """A compiler's exception as a message for the client (no C++ file names or times)."""
    return _LOCATION.sub("", str(exc)).strip() or type(exc).__name__


__all__ = [
    "DEFAULT_MAX_JSON_WHITESPACE",
    "GrammarBackend",
    "GrammarError",
    "GrammarOptions",
    "Matcher",
    "compiler_message",
]
