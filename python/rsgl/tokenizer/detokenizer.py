"""Incremental detokenization with stop strings.

Decoding each request's whole output every step costs O(n^2). Two incremental ways instead:

- byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM: a `ByteLevel` decoder) map every
  token to fixed bytes: a `ByteTable` of them feeds `rsgl._core.Detokenizer`, which decodes
  one step's tokens of every request in one call (incremental UTF-8, stop strings);
- any other tokenizer decodes a short window per step (`IncrementalDetokenizer`): the
  tokens since the last emitted text plus a few before them for context, released only
  once the text no longer ends in U+FFFD (a multi-byte character still incomplete).

Both give exactly the tokenizer's `decode` (tests/tokenizer check it). While a stop string
could still be completing, the tail that might be its start is held back, so streamed chunks
always concatenate to the final text. Both keep only that tail and the tokens not yet
decoded, so a token costs the same however long the output already is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rsgl._core import Detokenizer

# Tokens of context decoded before the new ones (byte-level BPE and sentencepiece both need
# some left context to place spaces correctly).
CONTEXT_TOKENS = 5

# (token ids, skip_special_tokens) -> text.
DecodeFn = Callable[[list[int], bool], str]


class Decoder(Protocol):
    """The part of a HF tokenizer the detokenizer uses."""

    def decode(self, token_ids: Any, skip_special_tokens: bool = ..., **kwargs: Any) -> Any: ...


def fast_decode(tokenizer: Decoder) -> DecodeFn:
    """`tokenizer.decode`, straight from its Rust backend where it has one: the same text
    (the backend is what HF's fast tokenizers call) at a quarter of the cost per call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: str(tokenizer.decode(ids, skip_special_tokens=skip))
    decode = backend.decode
    return lambda ids, skip: str(decode(ids, skip_special_tokens=skip))


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for code points from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    extra = 0x100
    for b in range(256):
        if b not in chars:
            chars[b] = extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class ByteTable:
    """The bytes of every token of a byte-level BPE tokenizer, and which ids are special."""

    def __init__(self, token_bytes: list[bytes], special: frozenset[int]) -> None:
        self.token_bytes = token_bytes
        self.special = special

    @classmethod
    def of(cls, tokenizer: Any) -> ByteTable | None:
        """The table of `tokenizer` (a HF fast tokenizer or a `tokenizers.Tokenizer`), or
        None when its decoding is not plain byte-level BPE."""
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
            return None
        try:
            added = backend.get_added_tokens_decoder()
            size = backend.get_vocab_size(with_added_tokens=True)
        except AttributeError:
            return None
        alphabet = _byte_level_alphabet()
        table: list[bytes] = []
        for i in range(size):
            if i in added:
                table.append(added[i].content.encode())
                continue
            token = backend.id_to_token(i)
            if token is None or any(c not in alphabet for c in token):
                return None
            table.append(bytes(alphabet[c] for c in token))
        special = frozenset(i for i, t in added.items() if t.special)
        return cls(table, special)

    def detokenizer(self) -> Detokenizer:
        """A batched detokenizer over this table (no requests yet)."""
        return Detokenizer(self.token_bytes, self.special)


# What a request's tokens of one step made: newly final text, and (tokens, stop string) when
# a stop string was completed by the `tokens`-th of them (the later ones are not its text).
Delta = tuple[str, tuple[int, str] | None]


class IncrementalDetokenizer:
    """One request's output text, built token by token, for tokenizers without a
    `ByteTable` (decoded windows).

    `add(token)` returns the text that became final; `finish()` returns what is left. A stop
    string found in the text ends it there (the string itself is trimmed, unless
    `no_stop_trim`) and is reported in `matched_stop`. `tokenizer` is a HF tokenizer or a
    `DecodeFn` (`fast_decode` of one, shared by all requests).
    """

    def __init__(
        self,
        tokenizer: Decoder | DecodeFn,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> None:
        # HF tokenizers are callable too (they encode): tell them apart by `decode`.
        self.decode: DecodeFn = (
            fast_decode(tokenizer) if hasattr(tokenizer, "decode") else tokenizer
        )
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        # Decoded text not released yet: at most `holdback` characters between tokens (every
        # earlier character was released because no stop string can start there).
        self.held = ""
        self.matched_stop: str | None = None
        # The window: context tokens, then from `read_offset` on those whose text is not
        # final yet. Tokens before the context are dropped as the window moves on.
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.read_offset = len(self.ids)

    def add(self, token: int) -> str:
        """Account one output token; returns newly final text ("" while holding back)."""
        if self.matched_stop is not None:
            return ""
        new = self._window_text(token)
        if not new:
            return ""
        self.held += new
        if self._find_stop():
            return self._release(len(self.held))
        return self._release(len(self.held) - self.holdback)

    def push(self, tokens: list[int]) -> Delta:
        """One step's tokens at once, as `rsgl._core.Detokenizer.step` gives them."""
        parts = []
        for i, token in enumerate(tokens):
            parts.append(self.add(token))
            if self.matched_stop is not None:
                return "".join(parts), (i + 1, self.matched_stop)
        return "".join(parts), None

    def _window_text(self, token: int) -> str:
        self.ids.append(token)
        prefix = self._decode(self.ids[: self.read_offset])
        full = self._decode(self.ids)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        # The tokens just decoded are the next window's context.
        del self.ids[: self.read_offset]
        self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, self.skip_special_tokens)

    def _find_stop(self) -> bool:
        """Looks for a stop string in the held text (the one starting first, the first
        listed among equal starts); cuts the text after it."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.held.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        end = best[0] + len(best[1]) if self.no_stop_trim else best[0]
        self.held = self.held[:end]
        self.matched_stop = best[1]
        return True

    def _release(self, upto: int) -> str:
        if upto <= 0:
            return ""
        chunk, self.held = self.held[:upto], self.held[upto:]
        return chunk

    def finish(self) -> str:
        """The rest of the text once the request is over (held-back tail included). An
        incomplete character at the very end is dropped rather than shown as U+FFFD."""
        if self.matched_stop is None:
            tail = self._decode(self.ids)
            prefix = self._decode(self.ids[: self.read_offset])
            if len(tail) > len(prefix):
                self.held += tail[len(prefix) :].rstrip("\ufffd")
                del self.ids[: self.read_offset]
                self.read_offset = len(self.ids)
        return self._release(len(self.held))
