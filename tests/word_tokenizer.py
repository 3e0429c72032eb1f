"""A stand-in HF tokenizer for the benchmark clients' datasets (no model files needed)."""

from __future__ import annotations


class WordTokenizer:
    """Token i is the word " w{i}"; ids 0-2 are special."""

    all_special_ids = (0, 1, 2)

    def __len__(self) -> int:
        return 500

    def decode(self, ids: list[int]) -> str:
        return "".join(f" w{i}" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(word[1:]) for word in text.split()]
