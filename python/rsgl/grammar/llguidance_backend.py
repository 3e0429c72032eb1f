"""llguidance (Microsoft's guidance engine, Rust): an Earley parser over a lexer with a
token trie, computing each mask on the fly (microseconds even where xgrammar's per-state
cache misses, e.g. inside length-bounded strings); masks for a batch filled on its own
threads without the GIL."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance import gbnf_to_lark

from rsgl.grammar.backend import GrammarBackend, GrammarError, GrammarOptions, Matcher
from rsgl.grammar.constraint import Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


class _LLMatcher(Matcher):
    __slots__ = ("ended", "inner", "stop_ids")

    def __init__(self, inner: llguidance.LLMatcher, stop_ids: frozenset[int]) -> None:
        self.inner = inner
        self.stop_ids = stop_ids
        self.ended = False

    def accept(self, token: int) -> bool:
        ok = bool(self.inner.consume_token(token)) and not self.inner.is_error()
        self.ended = ok and token in self.stop_ids
        return ok

    def is_terminated(self) -> bool:
        # llguidance stops as soon as only a stop token can follow; a grammar ends (as in
        # xgrammar) once that stop token is accepted.
        return self.ended and bool(self.inner.is_stopped())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        options: GrammarOptions,
    ) -> None:
        super().__init__(vocab_size)
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )
        self.stop_ids = frozenset(stop_token_ids)
        self.options = options
        self.executor = llguidance.LLExecutor(num_threads=options.threads)

    def _json_options(self) -> JsonCompileOptions:
        opts = self.options
        if opts.disable_any_whitespace:
            return {"whitespace_flexible": False}
        if opts.max_whitespace is None:
            return {"whitespace_flexible": True}
        return {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{opts.max_whitespace}}}"}

    def grammar_of(self, constraint: Constraint) -> str:
        """The constraint as an llguidance grammar (its own JSON form or Lark)."""
        kind, source = constraint.kind, constraint.source
        try:
            if kind == "json_schema":
                return str(
                    llguidance.LLMatcher.grammar_from_json_schema(
                        source, defaults=self._json_options()
                    )
                )
            if kind == "regex":
                return str(llguidance.LLMatcher.grammar_from_regex(source))
            if kind == "ebnf":
                lark = gbnf_to_lark.any_to_lark(source)
                return str(llguidance.LLMatcher.grammar_from_lark(lark))
        except (ValueError, TypeError, RuntimeError, gbnf_to_lark.GbnfToLarkError) as exc:
            raise GrammarError(str(exc)) from None
        raise GrammarError(
            f"{kind} needs --grammar-backend xgrammar (llguidance takes json_schema, regex, ebnf)"
        )

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        # Building the matcher is the compile (the parser tables; it drops the GIL); each
        # request then takes a deep copy of this one.
        prototype = llguidance.LLMatcher(self.tokenizer, self.grammar_of(constraint), log_level=0)
        if prototype.is_error():
            raise GrammarError(prototype.get_error())
        return prototype

    def size_bytes(self, compiled: llguidance.LLMatcher) -> int:
        # llguidance does not report its tables' size; its lexer and parser are built
        # lazily per matcher, so the prototype is small. Count a fixed share.
        return 64 * 1024

    def matcher(self, compiled: llguidance.LLMatcher) -> Matcher:
        return _LLMatcher(compiled.deep_copy(), self.stop_ids)

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
        pairs = [(m.inner, i) for i, m in enumerate(matchers)]  # type: ignore[attr-defined]
        if len(pairs) == 1:
            llguidance.torch.fill_next_token_bitmask(pairs[0][0], bitmask, 0)
        else:
            llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)


__all__ = ["LLGuidanceBackend"]
