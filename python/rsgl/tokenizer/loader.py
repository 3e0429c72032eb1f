"""Loading a model's tokenizer without torch, so the server's frontend process stays light.

transformers' `AutoTokenizer` imports torch for its auto-class machinery (seconds of start-up
and hundreds of MB in a process that never runs a model). A directory with a `tokenizer.json`
needs none of it: `PreTrainedTokenizerFast` is the class AutoTokenizer would pick for it, with
the same encode, decode and chat template. Other tokenizers still go through AutoTokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The HF tokenizer stored at `path` (chat template included)."""
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
