"""An int8 KV cache with the rest of the engine (float32 SmolLM2): speculative verify
(extends reading the cache) beside plain decodes (the fused kernel), grammar masks, the
radix cache's shared prefixes and the overlap loop, with nothing leaked."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

import rsgl

OPTIONS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 8192, "kv_cache_dtype": "int8"}
PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "The cat sat on the mat. The dog sat on the log. The cat sat on",
    "Write one sentence about the ocean.",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 32}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _run(**options: Any) -> tuple[list[list[int]], dict[str, Any], dict[str, Any]]:
    with rsgl.Engine(**OPTIONS, **options) as engine:
        # Twice: the second round reads the first's prefixes from the radix cache.
        outs = [engine.generate(PROMPTS, GREEDY) for _ in range(2)]
        constrained = engine.generate(
            "A person as JSON:", {**GREEDY, "max_new_tokens": 48, "json_schema": json.dumps(PERSON)}
        )
        engine.check_integrity()
        info = engine.get_server_info()
    assert [o["output_ids"] for o in outs[0]] == [o["output_ids"] for o in outs[1]]
    assert sum(o["meta_info"]["cached_tokens"] for o in outs[1]) > 0
    jsonschema.validate(json.loads(constrained["text"]), PERSON)
    return [o["output_ids"] for o in outs[0]], constrained, info


def test_speculation_grammar_and_the_radix_cache_over_an_int8_cache() -> None:
    plain, plain_json, _ = _run()
    spec, spec_json, info = _run(
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=5,
        disable_speculative_adaptive=True,
    )
    assert info["kv_cache_storage_dtype"] == "int8"
    counts = info["speculative"]
    assert counts["spec_committed_tokens"] > counts["spec_drafted_rows"] > 0  # drafts accepted
    # A verify stores its keys through the extend path, a plain step through the fused
    # kernel: a key on an int8 rounding boundary may land one step apart, which can flip a
    # near-tie; the copy-heavy prompts have none (measured: all identical).
    same = sum(a == b for a, b in zip(plain, spec, strict=True))
    assert same >= len(PROMPTS) - 1, (plain, spec)
    assert spec_json["text"] == plain_json["text"]
