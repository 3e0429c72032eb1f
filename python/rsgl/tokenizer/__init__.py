"""Tokenizer side: HF tokenizer loading, incremental detokenization, stop strings."""

from rsgl.tokenizer.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
