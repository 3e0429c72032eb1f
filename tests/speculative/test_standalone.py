"""STANDALONE speculation end to end (rsgl.Engine, float32): a draft model proposes each
verify step's drafts from its own KV cache in the target's slots. With the embedded model as
its own draft nearly every draft is accepted; with dummy (random) draft weights nearly none
is; either way the tokens are the plain engine's, through chunked prefill, the prefix cache,
retraction, n > 1 and seeded sampling, and the core's bookkeeping stays intact."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import rsgl
from rsgl.args import EngineArgs
from rsgl.engine import Engine

# Drafting on every step (not only where it measures cheaper: a draft as large as its
# target never is), so that every request verifies drafts.
STANDALONE = {
    "speculative_algorithm": "STANDALONE",
    "speculative_num_steps": 3,
    "disable_speculative_adaptive": True,
}
SHARED = "You are a helpful assistant. Answer in one short paragraph. "
PROMPTS = [
    "Write one sentence about the ocean.",
    SHARED + "What is the boiling point of water?",
    SHARED + "Name three primary colors.",
    "List three facts about coffee:\n1.",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):",
    SHARED + "Why is the sky blue?",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}


def make_engine(**options: Any) -> Engine:
    options.setdefault("dtype", "float32")
    options.setdefault("max_total_tokens", 16384)
    return rsgl.Engine(**options)


def _ids(outs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _accept_rate(outs: list[dict[str, Any]]) -> float:
    drafted = sum(o["meta_info"]["spec_draft_token_num"] for o in outs)
    accepted = sum(o["meta_info"]["spec_accept_token_num"] for o in outs)
    assert drafted > 0
    return accepted / drafted


@pytest.fixture(scope="module")
def plain() -> Iterator[Engine]:
    with make_engine() as llm:
        yield llm


@pytest.fixture(scope="module")
def self_draft() -> Iterator[Engine]:
    # Small chunks: the prompts prefill in several steps, which the draft must follow.
    with make_engine(chunked_prefill_size=16, **STANDALONE) as llm:
        yield llm


def test_num_steps_sets_the_drafts_per_verify() -> None:
    assert EngineArgs(**STANDALONE).verified_tokens == 4  # type: ignore[arg-type]
    assert EngineArgs(speculative_algorithm="STANDALONE").verified_tokens == 5
    # NGRAM ignores the steps: its default (or the draft tokens given) holds.
    assert EngineArgs(speculative_algorithm="NGRAM", speculative_num_steps=3).verified_tokens == 8
    for algorithm, tokens in (("NGRAM", 6), ("STANDALONE", 4)):
        args = EngineArgs(
            speculative_algorithm=algorithm, speculative_num_steps=3, speculative_num_draft_tokens=6
        )
        assert args.verified_tokens == tokens
    assert not EngineArgs().speculates
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be at least 1"):
        EngineArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative_draft_model_path is for"):
        EngineArgs(speculative_algorithm="NGRAM", speculative_draft_model_path="x")
    with pytest.raises(ValueError, match="speculative_num_steps must be at least 1"):
        EngineArgs(speculative_algorithm="STANDALONE", speculative_num_steps=0)
    assert EngineArgs(speculative_algorithm="NGRAM", tp_size=2).speculates
    assert EngineArgs(speculative_algorithm="STANDALONE", tp_size=2).speculates


def test_the_model_as_its_own_draft_is_nearly_always_right(
    plain: Engine, self_draft: Engine
) -> None:
    outs = self_draft.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(outs) == _ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    # The draft computes what the target computes, one token at a time where the target
    # verifies several: only a near-tie rounded another way can reject a draft.
    assert _accept_rate(outs) > 0.9
    for o in outs:
        assert o["meta_info"]["spec_verify_ct"] > 0
    self_draft.check_integrity()


def test_shared_prefixes_keep_the_drafts_cache_right(self_draft: Engine) -> None:
    # The second round's prompts hit the prefix cache: the draft reads the KV it wrote for
    # the first round in the same slots, so its drafts stay as good.
    prompts = [SHARED + q for q in ("What is rain?", "What is snow?", "What is hail?")]
    first = self_draft.generate(prompts[:1], GREEDY, use_tqdm=False)
    again = self_draft.generate(prompts, GREEDY, use_tqdm=False)
    assert again[0]["meta_info"]["cached_tokens"] > 0
    assert again[0]["output_ids"] == first[0]["output_ids"]
    assert _accept_rate(again) > 0.9
    self_draft.check_integrity()


def test_seeded_sampling_and_n_gt_1_give_the_plain_tokens(
    plain: Engine, self_draft: Engine
) -> None:
    params = [
        {"temperature": 0.8, "top_p": 0.95, "seed": 3 + i, "max_new_tokens": 32, "n": 2}
        for i in range(3)
    ]
    got = self_draft.generate(PROMPTS[:3], params, use_tqdm=False)
    assert len(got) == 6
    assert _ids(got) == _ids(plain.generate(PROMPTS[:3], params, use_tqdm=False))
    self_draft.check_integrity()


def test_retraction_in_a_small_pool_keeps_the_tokens(plain: Engine) -> None:
    params = dict(GREEDY, max_new_tokens=60)
    want = _ids(plain.generate(PROMPTS, params, use_tqdm=False))
    with make_engine(max_total_tokens=300, schedule_conservativeness=0.05, **STANDALONE) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.get_server_info()["stats"]["retractions"] > 0, "meant to force retraction"
        assert _ids(outs) == want
        assert _accept_rate(outs) > 0.9
        llm.check_integrity()


def test_a_dummy_draft_is_rejected_and_changes_nothing(plain: Engine) -> None:
    with make_engine(speculative_draft_load_format="dummy", **STANDALONE) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _ids(outs) == _ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert _accept_rate(outs) < 0.1  # random weights rarely guess the next token
        llm.check_integrity()


def test_the_adaptive_policy_mixes_overlapped_plain_steps_and_verifies(plain: Engine) -> None:
    # The draft follows overlapped plain steps too (their inputs still on the device): when
    # drafting resumes, its cache must hold every position, or its drafts go wrong.
    options = dict(STANDALONE, disable_speculative_adaptive=False)
    with make_engine(**options) as llm:
        llm._loop.draft_policy.explore_every = 4  # type: ignore[union-attr]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _ids(outs) == _ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
        info = llm.get_server_info()
        assert info["overlapped_steps"] > 0
        stats = info["speculative"]
        accepted = stats["spec_committed_tokens"] - stats["spec_drafted_rows"]
        assert stats["spec_draft_tokens"] > 0
        assert accepted / stats["spec_draft_tokens"] > 0.9
        llm.check_integrity()
