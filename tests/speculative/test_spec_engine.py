"""Speculative decoding end to end (rsgl.Engine on the embedded SmolLM2, float32): NGRAM
drafts verified in one forward change no greedy token and no seeded sampled token, drafts
are accepted on text that quotes its prompt, finishes and logprobs behave as without
speculation, and the core's bookkeeping is intact after every run."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import rsgl
from rsgl.bench.speculative import copy_heavy_messages
from rsgl.engine import Engine
from rsgl.layers.cpu_kernels import load_cpu_kernels
from rsgl.scheduler.step_shape import StepShape, steps_of_log
from rsgl.speculative.policy import DENSE_MARGIN, DraftPolicy, ladder

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5}
PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Write one sentence about the ocean.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "List three facts about coffee:\n1.",
    "The cat sat on the mat. The dog sat on the log. The cat sat on",
]


def make_engine(**options: Any) -> Engine:
    options.setdefault("dtype", "float32")
    options.setdefault("max_total_tokens", 16384)
    return rsgl.Engine(**options)


@pytest.fixture(scope="module")
def plain() -> Iterator[Engine]:
    with make_engine() as llm:
        yield llm


@pytest.fixture(scope="module")
def spec() -> Iterator[Engine]:
    with make_engine(**SPEC) as llm:
        yield llm


@pytest.fixture(scope="module")
def drafting() -> Iterator[Engine]:
    """Speculation on every step it can: how many drafts are accepted, whatever the
    adaptive policy would choose from this machine's step costs."""
    with make_engine(**SPEC, disable_speculative_adaptive=True) as llm:
        yield llm


def _spec(engine: Engine) -> dict[str, float]:
    stats: dict[str, float] = engine.get_server_info()["speculative"]
    return stats


def _ids(outs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_greedy_tokens_are_the_same_with_speculation(plain: Engine, spec: Engine) -> None:
    params = {"temperature": 0.0, "max_new_tokens": 48}
    before = _spec(spec)
    assert _ids(spec.generate(PROMPTS, params)) == _ids(plain.generate(PROMPTS, params))
    after = _spec(spec)
    rows = after["spec_drafted_rows"] - before["spec_drafted_rows"]
    assert rows > 0  # drafts were verified
    assert after["spec_committed_tokens"] - before["spec_committed_tokens"] > rows  # accepted
    # Measuring plain steps' cost needs two in a row: the second overlaps the first.
    assert spec.get_server_info()["overlapped_steps"] > 0
    spec.check_integrity()


def test_one_request_at_a_time_gives_the_same_tokens(plain: Engine, spec: Engine) -> None:
    params = {"temperature": 0.0, "max_new_tokens": 40}
    for prompt in PROMPTS[:3]:
        assert (
            spec.generate(prompt, params)["output_ids"]
            == (plain.generate(prompt, params)["output_ids"])
        )
    spec.check_integrity()


def test_copy_heavy_chat_accepts_most_drafts(plain: Engine, drafting: Engine) -> None:
    # The adaptive policy may run this batch plain after its first tries (on an AMD Zen 3
    # it committed 6 tokens in 4 verified rows, then stopped drafting), so the engine here
    # drafts on every step.
    messages = copy_heavy_messages(3, seed=1)
    params = {"temperature": 0.0, "max_new_tokens": 64}
    before = _spec(drafting)
    got = drafting.generate(messages=messages, sampling_params=params)
    assert _ids(got) == _ids(plain.generate(messages=messages, sampling_params=params))
    after = _spec(drafting)
    rows = after["spec_drafted_rows"] - before["spec_drafted_rows"]
    tokens = after["spec_committed_tokens"] - before["spec_committed_tokens"]
    # Each verified request row committed well over its one plain token on average.
    assert tokens / rows > 1.5
    # Each request's meta_info reports its share (SGLang's fields); together, the totals.
    metas = [o["meta_info"] for o in got]
    assert sum(m["spec_verify_ct"] for m in metas) == rows
    drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    assert sum(m["spec_draft_token_num"] for m in metas) == drafts
    assert sum(m["spec_accept_token_num"] for m in metas) == tokens - rows
    for m in metas:
        assert m["spec_accept_token_num"] <= m["spec_draft_token_num"]
        assert m["spec_accept_rate"] == pytest.approx(
            m["spec_accept_token_num"] / m["spec_draft_token_num"]
        )
        accepted_per_verify = m["spec_accept_token_num"] / m["spec_verify_ct"]
        assert m["spec_accept_length"] == pytest.approx(1 + accepted_per_verify)
    assert "spec_verify_ct" not in plain.generate("Hi", {"max_new_tokens": 2})["meta_info"]
    drafting.check_integrity()


def test_the_step_log_records_each_step_s_draft_limit_and_accepted_drafts(
    plain: Engine, tmp_path: Path
) -> None:
    log = tmp_path / "steps.jsonl"
    messages = copy_heavy_messages(2, seed=2)
    params = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
    with make_engine(**SPEC, disable_speculative_adaptive=True, step_log=str(log)) as engine:
        got = engine.generate(messages=messages, sampling_params=params)
        stats = _spec(engine)
        steps = engine.get_server_info()["steps"]
        engine.check_integrity()
    assert _ids(got) == _ids(plain.generate(messages=messages, sampling_params=params))
    lines = log.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == steps
    assert all(r["draft_limit"] >= 0 and r["accepted_drafts"] >= 0 for r in records)
    # The log's accepted drafts are the loop's own count of them, step by step.
    accepted = stats["spec_committed_tokens"] - stats["spec_drafted_rows"]
    assert accepted > 0
    assert sum(r["accepted_drafts"] for r in records) == accepted
    assert all(r["draft_limit"] >= 1 for r in records if r["accepted_drafts"])
    # `--calibrate-server` reads the shapes off these lines and leaves the extra fields out.
    shapes, seconds = steps_of_log(lines)
    fields = [f.name for f in dataclasses.fields(StepShape)]
    assert [dataclasses.asdict(s) for s in shapes] == [{k: r[k] for k in fields} for r in records]
    assert seconds == [r["seconds"] for r in records]


def test_seeded_sampling_gives_the_same_tokens(plain: Engine, spec: Engine) -> None:
    params = [
        {"temperature": 0.7, "top_p": 0.9, "seed": 7 + i, "max_new_tokens": 40}
        for i in range(len(PROMPTS))
    ]
    assert _ids(spec.generate(PROMPTS, params)) == _ids(plain.generate(PROMPTS, params))
    spec.check_integrity()


def test_without_overlap_scheduling_the_tokens_are_the_same(plain: Engine) -> None:
    # The module's engines overlap the steps without drafts; this one never overlaps.
    greedy = {"temperature": 0.0, "max_new_tokens": 40, "frequency_penalty": 0.3}
    sampled = [{"temperature": 0.8, "seed": i, "max_new_tokens": 40} for i in range(len(PROMPTS))]
    with make_engine(disable_overlap_schedule=True, **SPEC) as llm:
        for params in (greedy, sampled):
            assert _ids(llm.generate(PROMPTS, params)) == _ids(plain.generate(PROMPTS, params))
        assert _spec(llm)["spec_drafted_rows"] > 0
        # A prompt cached whole: its extend computes the last token's KV again, and its
        # commit swaps that copy for the tree's. The overlap loop commits such a step before
        # planning the next, so its first decode reads the tree's copy too: the same bits
        # as here, where nothing overlaps (before, a warm prompt's logprobs differed).
        warm = {"temperature": 0.0, "max_new_tokens": 12, "return_logprob": True}
        runs = []
        for engine in (plain, llm):
            engine.generate(PROMPTS[3], warm)  # caches it
            out = engine.generate(PROMPTS[3], warm)
            meta = out["meta_info"]
            assert meta["cached_tokens"] == meta["prompt_tokens"] - 1
            runs.append([t["logprob"] for t in meta["output_token_logprobs"]])
        assert runs[0] == runs[1]
        assert llm.get_server_info()["overlapped_steps"] == 0
        llm.check_integrity()


def test_penalties_and_bias_match(plain: Engine, spec: Engine) -> None:
    params = {
        "temperature": 0.0,
        "max_new_tokens": 40,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "repetition_penalty": 1.2,
        "min_new_tokens": 30,
    }
    assert _ids(spec.generate(PROMPTS, params)) == _ids(plain.generate(PROMPTS, params))
    spec.check_integrity()


def test_finishes_cut_an_accepted_run(plain: Engine, spec: Engine) -> None:
    prompt = PROMPTS[1]
    for params in (
        {"temperature": 0.0, "max_new_tokens": 7},
        {"temperature": 0.0, "max_new_tokens": 40, "stop": [" 16,"]},
        {"temperature": 0.0, "max_new_tokens": 40, "stop_token_ids": [1135]},
    ):
        a, b = spec.generate(prompt, params), plain.generate(prompt, params)
        assert a["text"] == b["text"]
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        assert a["meta_info"]["completion_tokens"] == b["meta_info"]["completion_tokens"]
    spec.check_integrity()


def test_logprobs_of_accepted_tokens(plain: Engine, spec: Engine) -> None:
    params = {
        "temperature": 0.0,
        "max_new_tokens": 32,
        "return_logprob": True,
        "top_logprobs_num": 3,
    }
    a, b = spec.generate(PROMPTS[0], params), plain.generate(PROMPTS[0], params)
    assert a["output_ids"] == b["output_ids"]
    got, want = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
    assert len(got) == len(want) == len(a["output_ids"])
    assert [e["token_id"] for e in got] == a["output_ids"]
    for entry, entry_want in zip(got, want, strict=True):
        assert entry["token_id"] == entry_want["token_id"]
        assert entry["logprob"] == pytest.approx(entry_want["logprob"], abs=1e-3)
        top = [(t["token_id"], t["logprob"]) for t in entry["top_logprobs"]]
        top_want = [(t["token_id"], t["logprob"]) for t in entry_want["top_logprobs"]]
        assert [t for t, _ in top] == [t for t, _ in top_want]
        assert [lp for _, lp in top] == pytest.approx([lp for _, lp in top_want], abs=1e-3)
    spec.check_integrity()


def test_constrained_requests_do_not_speculate_and_stay_legal(plain: Engine, spec: Engine) -> None:
    # A constrained request beside drafting ones: its mask of each position depends on the
    # tokens before it, so it takes one token per step (never an illegal draft).
    pattern = r"(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, )+(11|12)"
    params = [
        {"temperature": 0.0, "max_new_tokens": 48},
        {"temperature": 0.0, "max_new_tokens": 48, "regex": pattern, "return_logprob": True},
        {"temperature": 0.0, "max_new_tokens": 48},
    ]
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    assert _ids(got) == _ids(want)
    # Its logprobs are the model's (before the mask), as without speculation.
    lps = [e["logprob"] for e in got[1]["meta_info"]["output_token_logprobs"]]
    lps_want = [e["logprob"] for e in want[1]["meta_info"]["output_token_logprobs"]]
    assert len(lps) == len(got[1]["output_ids"])
    assert lps == pytest.approx(lps_want, abs=1e-3)
    if got[1]["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch(pattern, got[1]["text"])
    spec.check_integrity()


def test_adaptive_policy_reports_its_limit(spec: Engine) -> None:
    stats = _spec(spec)
    # A rung of the policy's ladder: plain, 1, 2, ... or the maximum.
    assert stats["spec_draft_limit"] in ladder(SPEC["speculative_num_draft_tokens"] - 1)


def test_the_policy_knows_where_steps_leave_the_low_bit_weights(spec: Engine) -> None:
    # The embedded GGUF is served from its blocks: the policy judges rungs whose verify
    # steps would cross the engine's low-bit rows by the wider margin.
    rows = spec.get_server_info()["low_bit_max_rows"]
    assert isinstance(rows, int) and rows > 0
    policy = spec._loop.draft_policy
    assert policy is not None and policy.low_bit_rows == rows
    # The group of batches that reach those rows: any verify step of theirs leaves them.
    assert policy._group(DraftPolicy.group_of(rows)).margins[1] == DENSE_MARGIN


def test_plain_steps_measure_the_drafts_reach_with_shadow_drafts() -> None:
    # A fresh engine measures plain steps first: their commits check the drafts a verify
    # would have carried, and the policy learns every draft's reach from them.
    with make_engine(**SPEC) as engine:
        engine.generate(PROMPTS[1], {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True})
        policy = engine._loop.draft_policy
        assert policy is not None
        group = policy.groups[1]
        assert group.shadowed and len(group.reach) == policy.max_drafts
        # The counting of "1, 2, 3, ..." is copied from its prompt: some draft would be
        # accepted, so the first draft's reach is above zero.
        assert group.reach[0].value > 0
        engine.check_integrity()


def test_speculation_turns_mixed_chunks_off(plain: Engine) -> None:
    # A mixed step's prefill rows are no verify rows (a non-final chunk samples nothing).
    with make_engine(enable_mixed_chunk=True, chunked_prefill_size=16, **SPEC) as llm:
        assert llm.core.config["enable_mixed_chunk"] is False
        params = {"temperature": 0.0, "max_new_tokens": 32, "frequency_penalty": 0.4}
        assert _ids(llm.generate(PROMPTS, params)) == _ids(plain.generate(PROMPTS, params))
        llm.check_integrity()


def test_bfloat16_greedy_tokens_are_the_same_with_speculation() -> None:
    # In bfloat16 an extend's kernels round otherwise than a decode step's, so a verify run
    # through them could turn a near-tie. A verify of 4 rows (within every machine's
    # low-bit rows) runs its tokens as the decode steps would, through the decode stack.
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler: the decode stack is a C kernel")
    params = {"temperature": 0.0, "max_new_tokens": 40}
    with make_engine(dtype="bfloat16") as llm:
        want = [llm.generate(p, params)["output_ids"] for p in PROMPTS]
    options = {**SPEC, "speculative_num_draft_tokens": 4}
    with make_engine(dtype="bfloat16", **options) as llm:
        before = _spec(llm)
        got = [llm.generate(p, params)["output_ids"] for p in PROMPTS]
        after = _spec(llm)
        rows = after["spec_drafted_rows"] - before["spec_drafted_rows"]
        assert rows > 0
        assert after["spec_committed_tokens"] - before["spec_committed_tokens"] > rows
        llm.check_integrity()
    assert got == want
