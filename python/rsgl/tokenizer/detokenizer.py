"""Incremental detokenization with stop strings.

Decoding each request's whole output every step costs O(n^2); instead each step decodes a
short window: the tokens since the last emitted text plus a few before them for context.
Text is released only when it no longer ends in U+FFFD (a multi-byte character split across
tokens), and while a stop string could still be completing, the tail that might be its start
is held back, so streamed chunks always concatenate to the final text.
"""

from __future__ import annotations

from typing import Any, Protocol

# Tokens of context decoded before the new ones (byte-level BPE and sentencepiece both need
# some left context to place spaces correctly).
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of a HF tokenizer the detokenizer uses."""

    def decode(self, token_ids: Any, skip_special_tokens: bool = ..., **kwargs: Any) -> Any: ...


class IncrementalDetokenizer:
    """One request's output text, built token by token.

    `add(token)` returns the text that became final; `finish()` returns what is left. A stop
    string found in the text ends it there (the string itself is trimmed) and is reported in
    `matched_stop`.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # decoded so far (stop strings not yet applied to the held tail)
        self.emitted = 0  # characters of `text` already returned
        self.matched_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token: int) -> str:
        """Account one output token; returns newly final text ("" while holding back)."""
        if self.matched_stop is not None:
            return ""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        start = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self._find_stop(start):
            return self._release(len(self.text))
        return self._release(len(self.text) - self.holdback)

    def _find_stop(self, new_from: int) -> bool:
        """Looks for a stop string that ends in the new text; cuts the text before it."""
        if not self.stop:
            return False
        window_start = max(0, new_from - self.holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, window_start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.matched_stop = best[1]
        return True

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        chunk = self.text[self.emitted : upto]
        self.emitted = upto
        return chunk

    def finish(self) -> str:
        """The rest of the text once the request is over (held-back tail included)."""
        if self.matched_stop is None:
            tail = self._decode(self.ids[self.prefix_offset :])
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            if len(tail) > len(prefix):
                # An incomplete character at the very end stays as U+FFFD-free as the
                # tokenizer allows: drop a trailing replacement character.
                self.text += tail[len(prefix) :].rstrip("\ufffd")
                self.read_offset = len(self.ids)
        return self._release(len(self.text))
