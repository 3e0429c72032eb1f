"""xgrammar (SGLang's default backend): grammars compiled to a pushdown automaton with a
per-state token-mask cache; masks filled by its C++ threads without the GIL."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from rsgl.grammar.backend import (
    GrammarBackend,
    GrammarError,
    GrammarOptions,
    Matcher,
    compiler_message,
)
from rsgl.grammar.constraint import Constraint

# tvm-ffi, which xgrammar imports, would otherwise compile a torch DLPack add-on with the
# system C++ compiler on first import (seconds, and a failure without one); rsgl hands it
# CPU int32 bitmasks, which need no DLPack bridge to torch.
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

import xgrammar as xgr  # noqa: E402


class _XMatcher(Matcher):
    __slots__ = ("inner",)

    def __init__(self, inner: xgr.GrammarMatcher) -> None:
        self.inner = inner

    def accept(self, token: int) -> bool:
        return bool(self.inner.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        options: GrammarOptions,
    ) -> None:
        super().__init__(vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # rsgl's GrammarCompiler caches (with a byte cap) and dedupes; xgrammar's own cache
        # is unbounded by default.
        self.compiler = xgr.GrammarCompiler(info, max_threads=options.threads, cache_enabled=False)
        self.options = options
        self.batch = xgr.BatchGrammarMatcher(max_threads=options.threads)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        try:
            return self._compile(constraint)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(compiler_message(exc)) from None

    def _compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        kind, source = constraint.kind, constraint.source
        if kind == "json_schema":
            opts = self.options
            if opts.disable_any_whitespace:
                # Compact separators: without them xgrammar forces ", " and ": ".
                return self.compiler.compile_json_schema(
                    source, any_whitespace=False, separators=(",", ":")
                )
            return self.compiler.compile_json_schema(
                source, any_whitespace=True, max_whitespace_cnt=opts.max_whitespace
            )
        if kind == "regex":
            return self.compiler.compile_regex(source)
        if kind == "ebnf":
            return self.compiler.compile_grammar(source)
        return self.compiler.compile_structural_tag(source)

    def size_bytes(self, compiled: xgr.CompiledGrammar) -> int:
        return int(compiled.memory_size_bytes)

    def matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        return _XMatcher(xgr.GrammarMatcher(compiled))

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
        inner = [m.inner for m in matchers]  # type: ignore[attr-defined]
        if len(inner) == 1:
            inner[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(inner, bitmask)


__all__ = ["XGrammarBackend"]
