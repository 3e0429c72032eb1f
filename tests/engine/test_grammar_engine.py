"""Constrained decoding through the whole stack (Engine, loop, sampler, both backends):
outputs stay in their grammar, and overlap, retraction, chunking, the prefix cache and n > 1
change nothing about them (the null model's tokens depend only on the prompt and position,
so every option must give the same constrained outputs, as for free ones)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest

from rsgl.bench.grammar import load_corpus, pathological_regex
from rsgl.engine import Engine
from rsgl.errors import InvalidRequest

SCHEMAS: dict[str, Any] = load_corpus()
BACKENDS = ("xgrammar", "llguidance")
NEAR_TIE = 0.125

# Constraints a random walk ends quickly in (the null model picks uniformly among the
# allowed tokens, so an open string would run to max_new_tokens).
SHORT: list[dict[str, Any]] = [
    {"regex": "(yes|no|maybe)"},
    {"regex": r"[0-9]{1,3}"},
    {"ebnf": 'root ::= "a" | "b" "c"'},
    {"json_schema": json.dumps({"enum": ["red", "green", {"rgb": [1, 2, 3]}]})},
    {"regex": "[a-z]{2,6}"},
]


def requests() -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Free and constrained requests interleaved, some sharing a prefix."""
    rng = np.random.default_rng(11)
    shared = rng.integers(1000, 40000, size=40).tolist()
    prompts, params = [], []
    for i in range(20):
        tail = rng.integers(1000, 40000, size=int(rng.integers(5, 50))).tolist()
        prompts.append(shared + tail if i % 2 else tail)
        p: dict[str, Any] = {"max_new_tokens": int(rng.integers(4, 40))}
        if i % 3:
            p.update(SHORT[i % len(SHORT)])
        if i % 4 == 0:
            p["n"] = 2
        params.append(p)
    return prompts, params


def run_null(backend: str, **options: Any) -> list[dict[str, Any]]:
    prompts, params = requests()
    with Engine(load_format="null", grammar_backend=backend, **options) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        engine.check_integrity()
        again = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        engine.check_integrity()
        stats = engine.core.stats()
    assert again == outs or _same_outputs(again, outs)
    assert stats["running"] == 0 and stats["waiting"] == 0
    return outs


def _same_outputs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    def key(o: dict[str, Any]) -> tuple[Any, ...]:
        return (o["text"], o["output_ids"], o["meta_info"]["finish_reason"])

    return [key(x) for x in a] == [key(x) for x in b]


OPTIONS: dict[str, dict[str, Any]] = {
    "overlap": {},
    "no-overlap": {"disable_overlap_schedule": True},
    "chunked": {"chunked_prefill_size": 16},
    "mixed": {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    "no-radix": {"disable_radix_cache": True},
    "retraction": {
        "max_total_tokens": 300,
        "chunked_prefill_size": 64,
        "schedule_conservativeness": 0.05,
    },
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_scheduling_option_gives_the_same_constrained_outputs(backend: str) -> None:
    baseline = run_null(backend, disable_overlap_schedule=True, disable_radix_cache=True)
    _, params = requests()
    flat = [p for p in params for _ in range(p.get("n", 1))]
    constrained = 0
    for out, p in zip(baseline, flat, strict=True):
        reason = out["meta_info"]["finish_reason"]
        if "regex" in p and reason["type"] == "stop":
            assert re.fullmatch(p["regex"], out["text"]), (p, out["text"])
            constrained += 1
        if "ebnf" in p and reason["type"] == "stop":
            assert out["text"] in ("a", "bc")
            constrained += 1
        if "json_schema" in p and reason["type"] == "stop":
            jsonschema.validate(json.loads(out["text"]), json.loads(p["json_schema"]))
            constrained += 1
    assert constrained >= 8
    for name, options in OPTIONS.items():
        got = run_null(backend, **options)
        assert _same_outputs(got, baseline), name


def test_a_refused_constraint_fails_only_its_own_request() -> None:
    with Engine(load_format="null", grammar_backend="xgrammar") as engine:
        outs = engine.generate(
            input_ids=[[1000, 2000], [1000, 3000], [1000, 4000]],
            sampling_params=[
                {"max_new_tokens": 5},
                {"max_new_tokens": 5, "regex": "a("},
                {"max_new_tokens": 5, "json_schema": '{"type": "objekt"}'},
            ],
            use_tqdm=False,
        )
        engine.check_integrity()
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "length"
    for out, kind in zip(outs[1:], ("regex", "json_schema"), strict=True):
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 400, reason
        assert f"{kind} does not compile" in reason["message"]


def test_two_constraints_on_one_request_are_refused_at_the_door() -> None:
    with (
        Engine(load_format="null") as engine,
        pytest.raises(InvalidRequest, match="json_schema and regex are both set"),
    ):
        engine.generate("hi", {"json_schema": "{}", "regex": "a"})


def test_a_compile_past_its_timeout_fails_the_request() -> None:
    # xgrammar compiles each bounded run of this regex for most of a second: far past the
    # timeout, however soon the start-up prewarm built the backend.
    regex = pathological_regex(3, "timeout")
    with Engine(
        load_format="null", grammar_backend="xgrammar", grammar_compile_timeout=0.2
    ) as engine:
        out = engine.generate("hi", {"max_new_tokens": 4, "regex": regex})
        engine.check_integrity()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "--grammar-compile-timeout" in reason["message"]


def test_constraints_are_refused_when_the_backend_is_none() -> None:
    with (
        Engine(load_format="null", grammar_backend="none") as engine,
        pytest.raises(InvalidRequest, match="--grammar-backend none"),
    ):
        engine.generate("hi", {"max_new_tokens": 4, "regex": "[a-z]+"})


# ------------------------------------------------------------------ the real model


@pytest.fixture(scope="module", params=BACKENDS)
def smol(request: pytest.FixtureRequest) -> Iterator[Engine]:
    with Engine(grammar_backend=request.param, max_total_tokens=8192) as engine:
        yield engine


def schema_prompts() -> tuple[list[str], list[dict[str, Any]]]:
    prompts, params = [], []
    for name, schema in sorted(SCHEMAS.items()):
        words = name.replace("_", " ")
        prompts.append(f"Write one JSON value ({words}) for a database of people:")
        params.append({"json_schema": json.dumps(schema), "max_new_tokens": 160})
    return prompts, params


def test_greedy_and_sampled_outputs_validate_against_their_schemas(smol: Engine) -> None:
    prompts, params = schema_prompts()
    greedy = [dict(p, temperature=0) for p in params]
    sampled = [dict(p, temperature=0.8, seed=i) for i, p in enumerate(params)]
    stopped = 0
    for outs, ps in (
        (smol.generate(prompts, greedy, use_tqdm=False), greedy),
        (smol.generate(prompts, sampled, use_tqdm=False), sampled),
    ):
        for out, p in zip(outs, ps, strict=True):
            reason = out["meta_info"]["finish_reason"]
            if reason["type"] == "length":
                continue  # cut off by max_new_tokens: not a whole value yet
            assert reason == {"type": "stop", "matched": 2}, reason
            jsonschema.validate(json.loads(out["text"]), json.loads(p["json_schema"]))
            stopped += 1
    assert stopped >= len(prompts)  # most values end well before 160 tokens
    smol.check_integrity()


def test_one_at_a_time_equals_batched_with_free_requests_beside(smol: Engine) -> None:
    prompts, params = schema_prompts()
    greedy = [dict(p, temperature=0, max_new_tokens=48) for p in params[:4]]
    free = {"temperature": 0, "max_new_tokens": 24}
    batch = smol.generate(prompts[:4] + ["Tell me a story"], [*greedy, free], use_tqdm=False)
    alone = [smol.generate(p, g) for p, g in zip(prompts[:4], greedy, strict=True)]
    for prompt, together, by_itself in zip(prompts[:4], batch, alone, strict=False):
        assert_same_or_tied(smol, prompt, together["output_ids"], by_itself["output_ids"])
    # The free request in the batch is what it is without any grammar beside it.
    story = smol.generate("Tell me a story", free)["output_ids"]
    assert_same_or_tied(smol, "Tell me a story", batch[4]["output_ids"], story)
    smol.check_integrity()


def assert_same_or_tied(engine: Engine, prompt: str, got: list[int], want: list[int]) -> None:
    """Greedy outputs equal up to a near-tie. Five rows and one row may run different
    kernels (bfloat16 blocks for a few rows, dequantized matmuls for more), so two tokens
    whose logits round to within a bfloat16 step of each other may swap; a mask leaking
    between requests would pick a token far from the best, or an illegal one."""
    if got == want:
        return
    i = next(i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y)
    ids = engine.tokenizer(prompt)["input_ids"] + got[:i]
    probe = {"max_new_tokens": 1, "return_logprob": True, "token_ids_logprob": [got[i], want[i]]}
    out = engine.generate(input_ids=ids, sampling_params=probe)
    both = out["meta_info"]["output_token_logprobs"][0]["token_ids_logprob"]
    gap = abs(both[0]["logprob"] - both[1]["logprob"])
    # 1/8 is a bfloat16 step at the logits' scale (16 to 32); float32 ties are far closer.
    assert gap <= NEAR_TIE, f"token {i}: {got[i]} vs {want[i]} are {gap:.3g} apart"
