"""A grammar that waits for a reasoning to end: a request that thinks first (`--reasoning-
parser`, `rsgl.reasoning`) samples freely until it has generated the reasoning's end marker
(`</think>` as the tokenizer writes it), then under its grammar (SGLang's
ReasonerGrammarObject). The marker is matched on token ids, as SGLang does: a model writes
its end marker as one way of tokens (a special token in the models that think)."""

from __future__ import annotations

from collections.abc import Sequence

from rsgl.grammar.backend import Matcher
from rsgl.reasoning import MarkerWatch


class ReasoningGate(Matcher):
    """`inner`'s grammar, from the token after `end_ids` on; before that every token is
    accepted and `masking()` is None (any token may follow)."""

    __slots__ = ("end", "inner")

    def __init__(self, inner: Matcher, end_ids: Sequence[int]) -> None:
        self.inner = inner
        self.end = MarkerWatch(end_ids)

    def accept(self, token: int) -> bool:
        if self.end.done:
            return self.inner.accept(token)
        self.end.feed(token)
        return True

    def is_terminated(self) -> bool:
        return self.end.done and self.inner.is_terminated()

    def masking(self) -> Matcher | None:
        return self.inner if self.end.done else None

    def may_mask_after_one(self) -> bool:
        # A reasoning long enough to matter samples its steps unmasked, without waiting:
        # only the token that may complete the end marker can open the grammar.
        return self.end.done or self.end.one_short()


__all__ = ["ReasoningGate"]
