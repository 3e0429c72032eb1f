"""A grammar that waits for a reasoning to end: a request that thinks first (`--reasoning-
parser`, `rsgl.reasoning`) samples freely until it has generated the reasoning's end marker
(`</think>` as the tokenizer writes it), then under its grammar (SGLang's
ReasonerGrammarObject). The marker is matched on token ids, as SGLang does: a model writes
its end marker as one way of tokens (a special token in the models that think)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rsgl.grammar.backend import Matcher


def reasoning_end_ids(tokenizer: Any, end_marker: str) -> tuple[int, ...]:
    """The token ids the tokenizer writes `end_marker` with; ValueError if none."""
    ids = tuple(int(t) for t in tokenizer.encode(end_marker, add_special_tokens=False))
    if not ids:
        raise ValueError(f"the tokenizer writes the reasoning end {end_marker!r} with no tokens")
    return ids


class ReasoningGate(Matcher):
    """`inner`'s grammar, from the token after `end_ids` on; before that every token is
    accepted and `masking()` is None (any token may follow)."""

    __slots__ = ("end_ids", "inner", "matched", "reasoning")

    def __init__(self, inner: Matcher, end_ids: Sequence[int]) -> None:
        assert end_ids, "a reasoning end is at least one token"
        self.inner = inner
        self.end_ids = tuple(end_ids)
        self.matched = 0  # how many of end_ids the output ends with so far
        self.reasoning = True

    def accept(self, token: int) -> bool:
        if not self.reasoning:
            return self.inner.accept(token)
        self.matched = self._advance(token)
        if self.matched == len(self.end_ids):
            self.reasoning = False
        return True

    def _advance(self, token: int) -> int:
        """The longest start of `end_ids` that the output ends with after `token` (after a
        mismatch a shorter start may still be under way: `</</think>`)."""
        seen = (*self.end_ids[: self.matched], token)
        for n in range(len(seen), 0, -1):
            if seen[-n:] == self.end_ids[:n]:
                return n
        return 0

    def is_terminated(self) -> bool:
        return not self.reasoning and self.inner.is_terminated()

    def masking(self) -> Matcher | None:
        return None if self.reasoning else self.inner

    def may_mask_after_one(self) -> bool:
        # A reasoning long enough to matter samples its steps unmasked, without waiting:
        # only the token that may complete the end marker can open the grammar.
        return not self.reasoning or self.matched == len(self.end_ids) - 1


__all__ = ["ReasoningGate", "reasoning_end_ids"]
