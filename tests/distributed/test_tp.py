"""Tensor parallelism on the embedded SmolLM2 (CPU, gloo): TP=2 against TP=1 (with n-gram
speculation, an int8 KV cache and K-quant weights too).

SmolLM2 has 9 query heads over 3 KV heads, so at tp_size 2 the ranks hold 2 and 1 KV heads
(6 and 3 query heads). Every engine here shares the options below: float32, radix cache on,
chunked prefill of 64 tokens (one prompt is longer), one thread per rank. Each TP engine
starts a follower process that loads the model, so an engine is shared by the tests of this
module (TP=2 with overlap; TP=2 without, which the last test breaks on purpose).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from kquants import k_quant_copy

import rsgl
from rsgl._core import Plan
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.model_executor.tp_worker import StepMessage, decode_message, encode_step, plan_of
from rsgl.sampling_params import SamplingParams

OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "max_total_tokens": 8192,
    "max_running_requests": 16,
    "chunked_prefill_size": 64,
    "cpu_threads": 1,
}
GREEDY = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}
SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely, and say when you do not "
    "know. Prefer plain words to jargon and short sentences to long ones. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    SYSTEM + "What is the boiling point of water at sea level?",
    SYSTEM + "Name three primary colors.",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: good morning, my friend.",
    # Over 100 tokens: prefilled in chunks of 64.
    "Summarize: " + " ".join(f"Item {i} costs {3 * i + 1} dollars." for i in range(20)),
    # Copied rare words: ids in rank 1's half of the vocabulary (each rank embeds its own
    # half), which drafts carry too; a rank without rank 0's drafts would embed zeros.
    "Words: addicted, treasured, psychiatrist, prolific, evacuate, Buckingham, blossoms, "
    "Midwest, Thoreau, primordial, bonsai, pumpkin, Augusta, Beethoven, jade, Clayton.\n"
    "The same words again: addicted, treasured,",
]
# A near-tie may legitimately flip between TP=1 and TP=2 (float32 sums in another order);
# anything wider is a bug.
NEAR_TIE = 1e-4
# Seeded sampling with a penalty: each rank samples from its own copy of the logits and of
# the per-slot state, so a rank that drifted would feed its shard a different token and the
# text would change. (A flip needs two tokens' sampling scores within ~1e-6 of each other;
# the computation is deterministic, so such a test would fail every run, not now and then.)
SAMPLED = [
    {
        "temperature": 0.8,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
        "seed": 100 + i,
        "max_new_tokens": 16,
        "ignore_eos": True,
    }
    for i in range(4)
]


# Constrained rows beside a free one in each batch: greedy rows take the sharded argmax over
# masked vocabulary slices, the sampled one the all-gathered logits under the whole mask.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes": {"type": "array", "items": {"enum": ["tea", "jazz", "cats"]}, "maxItems": 2},
    },
    "required": ["name", "age", "likes"],
    "additionalProperties": False,
}
PHONE = r" \(\d{3}\) \d{3}-\d{4}"
CONSTRAINED_PROMPTS = [
    "Describe a person as JSON:",
    "Call me at",
    "Call the office at",
    "The capital of France is",
]
CONSTRAINED: list[dict[str, Any]] = [
    {"temperature": 0.0, "max_new_tokens": 48, "json_schema": json.dumps(PERSON)},
    {"temperature": 0.0, "max_new_tokens": 24, "regex": PHONE},
    {"temperature": 0.9, "seed": 7, "max_new_tokens": 24, "regex": PHONE},
    {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
]


def check_constrained(outs: list[dict[str, Any]]) -> None:
    """The constrained outputs are in their languages (the masks were applied)."""
    jsonschema.validate(json.loads(outs[0]["text"]), PERSON)
    for out in outs[1:3]:
        assert re.fullmatch(PHONE, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def child_pids() -> set[int]:
    """This process's live children (Linux /proc)."""
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids.update(int(p) for p in f.read().split())
    return pids


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def step_logits(engine: rsgl.Engine, prompt_ids: list[int]) -> torch.Tensor:
    """The logits of one prefill step and of the decode step after it ([2, vocab]), run
    through the engine's own core and runner before its loop starts (the loop owns them
    once it runs)."""
    core, runner = engine.core, engine.runner
    assert isinstance(runner, ModelRunner)
    core.add_request(10**9, np.asarray(prompt_ids, dtype=np.int64), 2)
    rows = []
    for _ in range(2):
        plan = core.schedule()
        if len(plan.admitted):
            runner.admit(int(plan.req_slots[0]), SamplingParams(temperature=0.0), prompt_ids)
        out = runner.step(plan, return_logits=True)
        core.commit(plan.id, out.next_token_ids.numpy())
        assert out.logits is not None
        rows.append(out.logits[0])
    return torch.stack(rows)


def generate_twice(engine: rsgl.Engine, **extra: Any) -> list[list[dict[str, Any]]]:
    """The prompts, then again (the second round reads the radix cache)."""
    params = dict(GREEDY, **extra)
    return [engine.generate(PROMPTS, params) for _ in range(2)]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """TP=1: the step logits and both rounds' outputs, with top-2 logprobs for near-ties."""
    with rsgl.Engine(**OPTIONS) as engine:
        ids = engine.tokenizer.encode(PROMPTS[0])
        logits = step_logits(engine, ids)
        rounds = generate_twice(engine, return_logprob=True, top_logprobs_num=2)
        sampled = engine.generate(PROMPTS[: len(SAMPLED)], SAMPLED)
        constrained = engine.generate(CONSTRAINED_PROMPTS, CONSTRAINED)
    check_constrained(constrained)
    return {
        "prompt_ids": ids,
        "logits": logits,
        "rounds": rounds,
        "sampled": sampled,
        "constrained": constrained,
    }


def start_tp2(reference: dict[str, Any], **options: Any) -> tuple[rsgl.Engine, torch.Tensor]:
    engine = rsgl.Engine(tp_size=2, **OPTIONS, **options)
    return engine, step_logits(engine, reference["prompt_ids"])


@pytest.fixture(scope="module")
def tp2(reference: dict[str, Any]) -> Iterator[tuple[rsgl.Engine, torch.Tensor]]:
    engine, logits = start_tp2(reference)
    yield engine, logits
    engine.shutdown()


@pytest.fixture(scope="module")
def tp2_no_overlap(reference: dict[str, Any]) -> Iterator[tuple[rsgl.Engine, torch.Tensor]]:
    engine, logits = start_tp2(reference, disable_overlap_schedule=True)
    yield engine, logits
    engine.shutdown()


def assert_same_tokens_or_near_tie(
    ref: dict[str, Any], out: dict[str, Any], near_tie: float = NEAR_TIE
) -> None:
    a, b = ref["output_ids"], out["output_ids"]
    if a == b:
        return
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    top = ref["meta_info"]["output_token_logprobs"][i]["top_logprobs"]
    gap = top[0]["logprob"] - top[1]["logprob"]  # = the top-2 logits' gap
    assert gap < near_tie, f"TP=2 diverged at token {i} ({a[i]} vs {b[i]}); TP=1 gap {gap}"


def test_a_step_message_carries_every_array_of_its_plan() -> None:
    # A verify step of two requests (2 and 0 drafts) after an extend: each array distinct.
    plan = Plan(
        id=7,
        forward_mode="decode",
        rids=[11, 12],
        req_slots=[3, 5],
        prefix_lens=[0, 0],
        extend_lens=[3, 1],
        seq_lens=[40, 9],
        sample=[True, False],
        input_ids=[101, 102, 103, 104],
        positions=[37, 38, 39, 8],
        out_cache_loc=[60, 61, 62, 70],
        write_rows=[3, 3, 3, 5],
        write_cols=[37, 38, 39, 8],
        write_slots=[60, 61, 62, 70],
        draft_lens=[2, 0],
    )
    message = decode_message(encode_step(plan, []))
    assert isinstance(message, StepMessage)
    got = plan_of(message)
    assert (got.id, got.forward_mode, got.num_extends) == (plan.id, "decode", plan.num_extends)
    for name in [
        "rids",
        "req_slots",
        "prefix_lens",
        "extend_lens",
        "seq_lens",
        "draft_lens",
        "sample",
        "input_ids",
        "positions",
        "out_cache_loc",
        "write_rows",
        "write_cols",
        "write_slots",
    ]:
        assert np.array_equal(getattr(got, name), getattr(plan, name)), name


def test_a_split_tp2_cannot_make_is_refused_before_any_process_starts() -> None:
    before = child_pids()
    with pytest.raises(ValueError, match=r"9 query heads over 3 KV heads"):
        rsgl.Engine(tp_size=4, **OPTIONS)
    assert child_pids() == before


def test_one_prefill_and_decode_step_gives_tp1_logits(
    reference: dict[str, Any], tp2: tuple[rsgl.Engine, torch.Tensor]
) -> None:
    ref, got = reference["logits"], tp2[1]
    diff = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"TP=2 vs TP=1 logits: max abs diff {diff:.3g} (logits up to {scale:.3g})")
    # float32 sums the row-parallel halves in another order: ~1e-7 relative per layer.
    assert diff <= 1e-5 * scale
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("engine_name", ["tp2", "tp2_no_overlap"])
def test_greedy_tokens_match_tp1_with_radix_and_chunked_prefill(
    reference: dict[str, Any], engine_name: str, request: pytest.FixtureRequest
) -> None:
    engine, _ = request.getfixturevalue(engine_name)
    rounds = generate_twice(engine)
    for ref_round, got_round in zip(reference["rounds"], rounds, strict=True):
        for ref, out in zip(ref_round, got_round, strict=True):
            assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
            assert_same_tokens_or_near_tie(ref, out)
    assert sum(o["meta_info"]["cached_tokens"] for o in rounds[1]) > 0
    sampled = engine.generate(PROMPTS[: len(SAMPLED)], SAMPLED)
    assert [o["output_ids"] for o in sampled] == [o["output_ids"] for o in reference["sampled"]]
    engine.check_integrity()


@pytest.mark.parametrize("engine_name", ["tp2", "tp2_no_overlap"])
def test_constrained_tokens_match_tp1(
    reference: dict[str, Any], engine_name: str, request: pytest.FixtureRequest
) -> None:
    engine, _ = request.getfixturevalue(engine_name)
    outs = engine.generate(CONSTRAINED_PROMPTS, CONSTRAINED)
    check_constrained(outs)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in reference["constrained"]]
    engine.check_integrity()


def test_server_info_reports_each_ranks_slice(tp2: tuple[rsgl.Engine, torch.Tensor]) -> None:
    info = tp2[0].get_server_info()
    assert info["tp_size"] == 2
    # Each rank serves its slice of the GGUF file's own blocks (the greedy and logits tests
    # above compare them with TP=1's, which reads the whole file's).
    assert info["quantization"] == "gguf"
    assert [(s["q_heads"], s["kv_heads"]) for s in info["tp_shards"]] == [
        ([0, 6], [0, 2]),
        ([6, 9], [2, 3]),
    ]


def test_shutdown_stops_the_followers(tp2: tuple[rsgl.Engine, torch.Tensor]) -> None:
    engine = tp2[0]
    pids = list(engine.runner.followers.pids.values())  # type: ignore[union-attr]
    assert pids and all(alive(p) for p in pids)
    engine.shutdown()
    assert not any(alive(p) for p in pids)  # exited and reaped: no orphan, no zombie


def test_a_killed_follower_fails_requests_naming_its_rank_instead_of_hanging(
    tp2_no_overlap: tuple[rsgl.Engine, torch.Tensor],
) -> None:
    engine = tp2_no_overlap[0]
    (pid,) = engine.runner.followers.pids.values()  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        out = pool.submit(engine.generate, "Hello", GREEDY).result(timeout=60)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "rank 1" in reason["message"], reason
    stopping = threading.Thread(target=engine.shutdown, daemon=True)
    stopping.start()
    stopping.join(timeout=120)
    assert not stopping.is_alive(), "shutdown hangs on the dead follower"
    assert not alive(pid)


def test_an_int8_kv_cache_shards_like_tp1s(reference: dict[str, Any]) -> None:
    # Each (token, kv head) has its own scale, so a rank holding some of the heads quantizes
    # them as TP=1 does. The row-parallel sums' order moves a key's last float bits, which
    # flips the odd value on a rounding boundary one int8 step (measured: logits 0.146
    # apart at most, as the fused and eager paths of one rank are; a rank reading another's
    # scales, or none, is off by whole units).
    ids = reference["prompt_ids"]
    with rsgl.Engine(**OPTIONS, kv_cache_dtype="int8") as engine:
        one = step_logits(engine, ids)
    with rsgl.Engine(tp_size=2, **OPTIONS, kv_cache_dtype="int8") as engine:
        two = step_logits(engine, ids)
        outs = engine.generate(PROMPTS[:4], GREEDY)
        engine.check_integrity()
        info = engine.get_server_info()
    assert info["kv_cache_storage_dtype"] == "int8"
    diff = (two - one).abs().max().item()
    assert diff < 0.4
    assert torch.equal(two.argmax(-1), one.argmax(-1))
    # Near the float32 cache's logits too (a rank reading the wrong scales would not be).
    assert (two - reference["logits"]).abs().max().item() < 1.0
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)


@pytest.mark.parametrize(("algorithm", "min_accept_length"), [("NGRAM", 1.2), ("STANDALONE", 3.0)])
def test_speculation_keeps_tp1s_tokens(
    reference: dict[str, Any], algorithm: str, min_accept_length: float
) -> None:
    # A verify step gathers its logits on every rank, so every rank accepts the same drafts
    # and samples the same next token (seeded, under the same penalties and grammar mask),
    # and its request state stays rank 0's for the steps after it. NGRAM's drafts are in
    # the step's plan; STANDALONE's come from rank 0's draft model (here the embedded
    # model itself, whole, so its drafts are TP=1's tokens), and every rank takes them from
    # rank 0. Drafting on every step (not adaptive), so that every kind of request verifies
    # drafts here.
    spec = {"speculative_algorithm": algorithm, "disable_speculative_adaptive": True}
    with rsgl.Engine(tp_size=2, **OPTIONS, **spec) as engine:
        rounds = generate_twice(engine)
        sampled = engine.generate(PROMPTS[: len(SAMPLED)], SAMPLED)
        constrained = engine.generate(CONSTRAINED_PROMPTS, CONSTRAINED)
        engine.check_integrity()
        stats = engine.get_server_info()["speculative"]
    for ref_round, got_round in zip(reference["rounds"], rounds, strict=True):
        for ref, out in zip(ref_round, got_round, strict=True):
            assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
            assert_same_tokens_or_near_tie(ref, out)
    assert [o["output_ids"] for o in sampled] == [o["output_ids"] for o in reference["sampled"]]
    check_constrained(constrained)
    assert [o["output_ids"] for o in constrained] == [
        o["output_ids"] for o in reference["constrained"]
    ]
    assert stats["spec_verify_steps"] > 0, stats
    assert stats["spec_accept_length"] > min_accept_length, stats


def test_k_quant_groups_shard_like_tp1s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every ffn_down of this copy is in Q3_K, Q4_K, Q5_K or Q6_K (int8 groups of 16, int4
    # groups of 32, int8 groups of 32 with minimums, int8 groups of 16): row-parallel, so
    # each rank holds half of every row's groups (768 of 1536 inputs).
    path = k_quant_copy(tmp_path)
    monkeypatch.setenv("RSGL_CACHE_DIR", str(tmp_path / "cache"))
    with rsgl.Engine(model_path=str(path), **OPTIONS) as engine:
        ids = engine.tokenizer.encode(PROMPTS[0])
        one = step_logits(engine, ids)
        ref = engine.generate(PROMPTS[:4], dict(GREEDY, return_logprob=True, top_logprobs_num=2))
    with rsgl.Engine(model_path=str(path), tp_size=2, **OPTIONS) as engine:
        two = step_logits(engine, ids)
        outs = engine.generate(PROMPTS[:4], GREEDY)
        engine.check_integrity()
        info = engine.get_server_info()
    assert info["quantization"] == "gguf" and info["tp_size"] == 2
    assert (two - one).abs().max().item() <= 1e-5 * one.abs().max().item()
    assert torch.equal(two.argmax(-1), one.argmax(-1))
    for a, b in zip(ref, outs, strict=True):
        assert_same_tokens_or_near_tie(a, b)


def test_int8_activation_blocks_shard_like_tp1s() -> None:
    # Under gguf_a8 each rank interleaves its slice of the file's blocks by eight weight rows
    # (the q heads split 6 + 3: 384 and 192 rows; the row-parallel o and down projections
    # half of every row's blocks, so each rank quantizes its half of x per block of 32, as
    # TP=1 does the whole row). The all-reduce's other summation order moves x by float32
    # rounding, and int8 activations do not damp that: a value carried across a boundary of
    # its int8 step moves by the step, and the next layers' rounding with it (scaling the
    # embedding by 1 + 1e-7 noise moved TP=1's logits by 0.63, where the exact blocks' moved
    # by 2e-5). So the ranks' logits are held to the size of the int8 rounding itself (the
    # exact blocks' logits against the int8 activations'); a wrong slice, row order or
    # interleaving would move them by the logits' own size (25).
    options = dict(OPTIONS, quantization="gguf_a8")
    with rsgl.Engine(**dict(options, quantization="gguf")) as engine:
        ids = engine.tokenizer.encode(PROMPTS[0])
        exact = step_logits(engine, ids)
    with rsgl.Engine(**options) as engine:
        one = step_logits(engine, ids)
        ref = engine.generate(PROMPTS[:4], dict(GREEDY, return_logprob=True, top_logprobs_num=2))
    with rsgl.Engine(tp_size=2, **options) as engine:
        two = step_logits(engine, ids)
        outs = engine.generate(PROMPTS[:4], GREEDY)
        engine.check_integrity()
        info = engine.get_server_info()
    assert info["quantization"] == "gguf_a8" and info["tp_size"] == 2
    rounding = (one - exact).abs().max().item()
    assert 0 < rounding < 0.1 * one.abs().max().item()
    assert (two - one).abs().max().item() <= 2 * rounding
    assert (two - exact).abs().max().item() <= 2 * rounding
    # Greedy tokens part only where TP=1's top two were within that rounding.
    for a, b in zip(ref, outs, strict=True):
        assert_same_tokens_or_near_tie(a, b, near_tie=2 * rounding)
