"""The frontend's torch-free tokenizer is AutoTokenizer's, and the frontend never loads torch."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from transformers import AutoTokenizer

from rsgl.models.loader import resolve_model_dir
from rsgl.tokenizer.loader import load_tokenizer

TEXTS = [
    "Hello, world!",
    "東京は日本の首都です。émigré 🎉",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "  spaces\tand\nnewlines  ",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 東京?"},
    ],
]


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    path = resolve_model_dir(None)
    return load_tokenizer(path), AutoTokenizer.from_pretrained(path)


def test_it_encodes_decodes_and_templates_as_autotokenizer(pair: tuple[Any, Any]):
    ours, auto = pair
    assert type(ours) is type(auto)
    assert (ours.eos_token_id, len(ours)) == (auto.eos_token_id, len(auto))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == auto.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip
            )
    for chat in CHATS:
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "return_dict": False}
        assert ours.apply_chat_template(chat, tokenize=True, **kwargs) == (
            auto.apply_chat_template(chat, tokenize=True, **kwargs)
        )
        assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == (
            auto.apply_chat_template(chat, tokenize=False, **kwargs)
        )


FRONTEND_PROBE = """
import json, sys
import rsgl.server.launch, rsgl.server.app, rsgl.server.frontend, rsgl.server.protocol
from rsgl.tokenizer.loader import load_tokenizer
from rsgl.tokenizer.output_processor import OutputProcessor
tok = load_tokenizer(sys.argv[1])
OutputProcessor(tok, on_stop=lambda rid, matched: None)
loaded = [m for m in ("torch", "rsgl.engine", "rsgl.model_executor", "rsgl.models.loader")
          if m in sys.modules]
print(json.dumps(loaded))
"""


def test_the_frontend_process_imports_neither_torch_nor_the_model_runner():
    path = str(resolve_model_dir(None))
    out = subprocess.run(
        [sys.executable, "-c", FRONTEND_PROBE, path], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.splitlines()[-1]) == []
