"""rsgl._core driven from Python with a fake model: plans, commits, caching, chunking,
retraction, aborts, priorities, lpm and input validation. The fake executor checks after every
step that each request reads exactly its own tokens from the KV slots the plan points at."""

from __future__ import annotations

import numpy as np
import pytest
from core_harness import FakeExecutor, fake_token

from rsgl._core import FUTURE_TOKEN, FinishReason, Scheduler


def make(
    max_total_tokens: int = 4096,
    max_running: int = 16,
    context_len: int = 2048,
    **kwargs: object,
) -> FakeExecutor:
    core = Scheduler(
        max_total_tokens,
        max_running_requests=max_running,
        context_len=context_len,
        eos_token_ids=[0],
        **kwargs,
    )
    return FakeExecutor(core, max_running, context_len)


def prompt_of(rid: int, n: int, prefix: list[int] | None = None) -> list[int]:
    body = [fake_token(rid + 5000, i) for i in range(n)]
    return (prefix or []) + body


def test_plan_arrays_describe_an_extend_then_decodes() -> None:
    ex = make()
    ex.add(1, prompt_of(1, 10), 3, ignore_eos=True)
    ex.add(2, prompt_of(2, 5), 3, ignore_eos=True)
    plan = ex.core.schedule()
    assert plan.forward_mode == "extend"
    assert plan.rids.tolist() == [1, 2]
    assert plan.extend_lens.tolist() == [10, 5]
    assert plan.prefix_lens.tolist() == [0, 0]
    assert plan.positions.tolist() == list(range(10)) + list(range(5))
    assert plan.input_ids.dtype == np.int64
    assert plan.input_ids.tolist() == prompt_of(1, 10) + prompt_of(2, 5)
    assert len(set(plan.out_cache_loc.tolist())) == 15
    ex.land(plan, ex.execute(plan))
    plan = ex.core.schedule()
    assert plan.forward_mode == "decode"
    assert plan.positions.tolist() == [10, 5]
    assert plan.input_ids.tolist() == [fake_token(1, 0), fake_token(2, 0)]
    ex.land(plan, ex.execute(plan))
    ex.run()
    assert ex.outputs[1] == [fake_token(1, i) for i in range(3)]
    assert ex.finished[1] == FinishReason.max_length(3)
    assert ex.core.stats()["held"] == 0


def test_overlap_uses_placeholders_and_drops_the_token_after_eos() -> None:
    ex = make()
    ex.add(1, prompt_of(1, 8), 10)
    ex.eos_at[1] = 2  # third output is EOS
    first = ex.core.schedule()
    sampled = ex.execute(first)
    second = ex.core.schedule()  # planned before the first step's token is known
    assert second.forward_mode == "decode"
    assert second.input_ids.tolist() == [FUTURE_TOKEN]
    second_sampled = ex.execute(second)  # resolves the placeholder from the FutureMap
    ex.land(first, sampled)
    ex.land(second, second_sampled)
    ex.run(overlap=True)
    assert ex.outputs[1] == [fake_token(1, 0), fake_token(1, 1), 0]
    assert ex.finished[1] == FinishReason.stop_token(0)
    # The step planned after EOS computed one extra token; it was dropped and its slot freed.
    assert ex.core.stats()["held"] == 0 and ex.core.stats()["live"] == 0


def test_repeated_prompt_hits_the_cache_and_reads_the_same_kv() -> None:
    ex = make()
    shared = prompt_of(0, 100)
    ex.add(1, shared + [7, 8, 9], 4, ignore_eos=True)
    ex.run()
    ex.add(2, shared + [5, 6], 4, ignore_eos=True)
    plan = ex.core.schedule()
    assert plan.prefix_lens.tolist() == [100]
    assert plan.extend_lens.tolist() == [2]
    ex.land(plan, ex.execute(plan))
    ex.run()
    stats = ex.core.stats()
    assert stats["cached_tokens"] == 100
    assert ex.outputs[2] == [fake_token(2, i) for i in range(4)]


def test_chunked_prefill_of_a_long_prompt_is_page_aligned() -> None:
    ex = make(max_total_tokens=16384, context_len=12000, page_size=16, chunked_prefill_size=512)
    ex.add(1, prompt_of(1, 10_000), 2, ignore_eos=True)
    chunks = []
    while True:
        plan = ex.core.schedule()
        ex.core.check()
        chunks.append((int(plan.prefix_lens[0]), int(plan.extend_lens[0]), bool(plan.sample[0])))
        ex.land(plan, ex.execute(plan))
        if plan.sample[0]:
            break
    assert sum(n for _, n, _ in chunks) == 10_000
    assert all(n == 512 for _, n, _ in chunks[:-1])
    assert all(prefix % 16 == 0 for prefix, _, _ in chunks)
    assert [s for _, _, s in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1] == (9728, 272, True)
    ex.run()
    assert ex.outputs[1] == [fake_token(1, 0), fake_token(1, 1)]


def test_other_requests_share_a_chunked_prompt_prefix_while_it_prefills() -> None:
    ex = make(max_total_tokens=8192, page_size=16, chunked_prefill_size=256)
    long = prompt_of(1, 1000)
    ex.add(1, long, 2, ignore_eos=True)
    for _ in range(2):
        plan = ex.core.schedule()
        ex.land(plan, ex.execute(plan))
    ex.add(2, long[:512] + [3, 4, 5], 2, ignore_eos=True)
    ex.run()
    assert ex.core.stats()["cached_tokens"] >= 256
    ex.assert_outputs_undisturbed()


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_in_a_tiny_pool_keeps_outputs_and_finishes_everyone(overlap: bool) -> None:
    def workload(ex: FakeExecutor) -> None:
        for rid in range(12):
            ex.add(rid, prompt_of(rid, 20 + rid), 60, ignore_eos=True)

    roomy = make(max_total_tokens=8192)
    workload(roomy)
    roomy.run(overlap=overlap)

    tiny = make(max_total_tokens=400, schedule_conservativeness=0.05)
    workload(tiny)
    tiny.run(overlap=overlap)
    stats = tiny.core.stats()
    assert stats["retractions"] > 0, "the pool was meant to force retraction"
    assert any(len(p.retracted) for p in tiny.plans)
    assert stats["new_token_ratio"] > 0.05 * 0.7 * 0.14
    assert dict(tiny.outputs) == dict(roomy.outputs)
    assert all(len(out) == 60 for out in tiny.outputs.values())
    assert stats["held"] == 0 and stats["protected"] == 0


def test_abort_of_waiting_and_running_requests_leaks_nothing() -> None:
    ex = make(max_running=1)
    ex.add(1, prompt_of(1, 30), 50, ignore_eos=True)
    ex.add(2, prompt_of(2, 30), 50, ignore_eos=True)
    plan = ex.core.schedule()
    assert plan.rids.tolist() == [1]  # one request slot: 2 waits
    assert ex.core.abort(2, "client went away") == "removed"
    ex.core.check()
    assert ex.core.abort(1, "cancelled") == "deferred"  # its step is in flight
    assert ex.core.abort(1) == "unknown"
    outcome = ex.land(plan, ex.execute(plan))
    assert outcome.tokens.tolist() == []  # the in-flight token is dropped
    assert ex.finished[1] == FinishReason.abort("cancelled")
    assert ex.core.abort(12345) == "unknown"
    stats = ex.core.stats()
    assert stats["live"] == 0 and stats["held"] == 0 and stats["free_req_slots"] == 1
    assert stats["aborts"] == 2
    assert not ex.core.has_work


def test_finish_with_a_stop_string_releases_the_request() -> None:
    ex = make()
    ex.add(1, prompt_of(1, 12), 50, ignore_eos=True)
    plan = ex.core.schedule()
    ex.land(plan, ex.execute(plan))
    assert ex.core.finish(1, "</s>")
    assert not ex.core.finish(1, "</s>")
    ex.core.check()
    assert ex.core.stats()["live"] == 0
    # Its KV went into the prefix cache.
    assert ex.core.stats()["evictable"] == 12


def test_stop_token_ids_and_min_new_tokens() -> None:
    ex = make()
    stop = fake_token(1, 1)
    ex.add(1, prompt_of(1, 5), 20, stop_token_ids=[stop])
    ex.add(2, prompt_of(2, 5), 20, stop_token_ids=[fake_token(2, 1)], min_new_tokens=3)
    ex.run()
    assert ex.finished[1] == FinishReason.stop_token(stop)
    assert len(ex.outputs[1]) == 2
    assert len(ex.outputs[2]) == 20  # the stop token came before min_new_tokens
    ex.add(3, prompt_of(3, 5), 20, stop_token_ids=[fake_token(3, 1)], ignore_eos=True)
    ex.run()
    assert len(ex.outputs[3]) == 20  # ignore_eos turns stop_token_ids off too


def test_priority_preemption_retracts_a_much_less_important_request() -> None:
    ex = make(max_total_tokens=256, max_running=4, schedule_policy="priority")
    ex.add(1, prompt_of(1, 100), 60, ignore_eos=True, priority=0)
    plan = ex.core.schedule()
    ex.land(plan, ex.execute(plan))
    ex.add(2, prompt_of(2, 100), 60, ignore_eos=True, priority=5)  # gap 5: waits
    plan = ex.core.schedule()
    assert plan.forward_mode == "decode" and plan.rids.tolist() == [1]
    ex.land(plan, ex.execute(plan))
    ex.add(3, prompt_of(3, 100), 60, ignore_eos=True, priority=20)  # gap 20: preempts
    plan = ex.core.schedule()
    assert plan.retracted.tolist() == [1]
    assert plan.rids.tolist() == [3]
    ex.land(plan, ex.execute(plan))
    ex.run()
    assert ex.core.stats()["preemptions"] == 1
    assert all(len(ex.outputs[r]) == 60 for r in (1, 2, 3))
    ex.assert_outputs_undisturbed()


def test_lpm_orders_by_cached_prefix_and_defers_in_batch_duplicates() -> None:
    ex = make(schedule_policy="lpm", max_running=2)
    cached = prompt_of(0, 64)
    ex.add(100, cached, 1, ignore_eos=True)
    ex.run()
    group = prompt_of(50, 48)
    ex.add(1, prompt_of(1, 40), 1, ignore_eos=True)  # no cache
    ex.add(2, group + [1], 1, ignore_eos=True)  # no cache, starts a group
    ex.add(3, group + [2], 1, ignore_eos=True)  # shares 48 tokens with 2: waits a round
    ex.add(4, cached + [9], 1, ignore_eos=True)  # 64 cached tokens: goes first
    plan = ex.core.schedule()
    assert plan.rids.tolist() == [4, 1]
    ex.land(plan, ex.execute(plan))
    plan = ex.core.schedule()
    assert plan.rids.tolist() == [2]  # 3 is still deferred behind its group leader
    ex.land(plan, ex.execute(plan))
    plan = ex.core.schedule()
    assert plan.rids.tolist() == [3]
    assert plan.prefix_lens.tolist() == [48]  # it now hits the cache 2 filled
    ex.land(plan, ex.execute(plan))
    ex.run()


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random", "priority"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True])
def test_every_policy_serves_a_shared_prefix_workload(
    policy: str, page_size: int, overlap: bool
) -> None:
    ex = make(max_total_tokens=640, schedule_policy=policy, page_size=page_size, max_running=8)
    systems = [prompt_of(900 + g, 70) for g in range(3)]
    for rid in range(24):
        if rid == 12:
            ex.run(overlap=overlap, steps_limit=3)  # the rest arrive while these run
        priority = 30 * (rid % 3)  # priority policy: later arrivals can preempt
        ex.add(
            rid,
            systems[rid % 3] + prompt_of(rid, 5 + rid % 7),
            8 + rid % 5,
            ignore_eos=True,
            priority=priority,
        )
    ex.run(overlap=overlap)
    assert len(ex.finished) == 24
    ex.assert_outputs_undisturbed()
    assert ex.core.stats()["cached_tokens"] > 0


def test_mixed_chunk_puts_decodes_into_prefill_steps() -> None:
    ex = make(enable_mixed_chunk=True, chunked_prefill_size=64)
    ex.add(1, prompt_of(1, 10), 30, ignore_eos=True)
    plan = ex.core.schedule()
    ex.land(plan, ex.execute(plan))
    ex.add(2, prompt_of(2, 200), 5, ignore_eos=True)
    plan = ex.core.schedule()
    assert plan.forward_mode == "mixed"
    assert plan.num_extends == 1 and plan.rids.tolist() == [2, 1]
    assert plan.extend_lens.tolist() == [63, 1]  # the chunk budget shrinks by the decodes
    ex.land(plan, ex.execute(plan))
    ex.run()
    ex.assert_outputs_undisturbed()


def test_oversized_prompts_are_rejected_with_a_clear_error() -> None:
    ex = make(max_total_tokens=512, context_len=256)
    with pytest.raises(
        ValueError, match="the prompt has 256 tokens, but the context length is 256"
    ):
        ex.core.add_request(1, list(range(256)), 4)
    small_pool = make(max_total_tokens=128, context_len=1024)
    with pytest.raises(ValueError, match="KV cache pool holds only 128 tokens"):
        small_pool.core.add_request(1, list(range(200)), 4)
    with pytest.raises(ValueError, match="prompt is empty"):
        ex.core.add_request(2, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        ex.core.add_request(3, [1, 2], 0)
    with pytest.raises(ValueError, match="invalid token id -3"):
        ex.core.add_request(4, [1, -3], 4)
    ex.add(5, [1, 2, 3], 4)
    with pytest.raises(ValueError, match="request id 5 is already in use"):
        ex.core.add_request(5, [1, 2], 4)
    assert ex.core.stats()["waiting"] == 1  # nothing bad was queued
    ex.core.check()


def test_max_new_tokens_is_clamped_to_the_context() -> None:
    ex = make(context_len=64)
    ex.add(1, prompt_of(1, 60), 100, ignore_eos=True)
    ex.run()
    assert len(ex.outputs[1]) == 4
    assert ex.finished[1] == FinishReason.max_length(4)


def test_commit_protocol_errors_name_the_problem() -> None:
    ex = make()
    ex.add(1, prompt_of(1, 5), 4)
    plan = ex.core.schedule()
    with pytest.raises(RuntimeError, match="1 requests but 2 next tokens"):
        ex.core.commit(plan.id, np.array([1, 2]))
    with pytest.raises(RuntimeError, match="commit of plan 7"):
        ex.core.commit(7, np.array([1]))
    ex.land(plan, ex.execute(plan))
    ex.run()


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ValueError, match='unknown schedule_policy "best"'):
        Scheduler(1024, schedule_policy="best")
    with pytest.raises(ValueError, match="at least four pages"):
        Scheduler(32, page_size=16)


def test_flush_cache_only_when_idle() -> None:
    ex = make()
    ex.add(1, prompt_of(1, 40), 2, ignore_eos=True)
    assert not ex.core.flush_cache()
    ex.run()
    assert ex.core.stats()["evictable"] > 0
    assert ex.core.flush_cache()
    stats = ex.core.stats()
    assert stats["evictable"] == 0 and stats["available"] == stats["capacity"]
    ex.core.check()


def test_a_prefix_computed_twice_is_deduplicated_and_the_row_rewritten() -> None:
    # A and B share 256 tokens and are prefilled in the same step; B is chunked. When B's
    # chunk is cached, A's copy is already in the tree: B's duplicate slots are freed (and
    # soon reused by C), so B's req_to_token row must now point at A's slots.
    ex = make(max_total_tokens=2048, page_size=16, chunked_prefill_size=512)
    shared = prompt_of(0, 256)
    ex.add(1, shared + [1, 2, 3, 4], 1, ignore_eos=True)
    ex.add(2, shared + prompt_of(2, 744), 3, ignore_eos=True)
    ex.add(3, prompt_of(3, 300), 3, ignore_eos=True)
    ex.run()
    assert ex.core.stats()["cached_tokens"] == 0
    ex.assert_outputs_undisturbed()
    assert len(ex.outputs[2]) == 3


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prompt_is_shared_once_its_prefill_commits(page_size: int, overlap: bool) -> None:
    # SGLang's cache_unfinished_req after a completed prefill: a request arriving while the
    # first one decodes finds its page-aligned prompt in the cache.
    ex = make(page_size=page_size)
    shared = prompt_of(0, 100)
    cached = len(shared) // page_size * page_size
    ex.add(1, shared, 30, ignore_eos=True)
    prefill = ex.core.schedule()
    prefill_tokens = ex.execute(prefill)
    if overlap:
        decode = ex.core.schedule()  # planned while the prefill is in flight
        decode_tokens = ex.execute(decode)
        assert ex.core.stats()["protected"] == 0, "a step in flight was shared"
    ex.land(prefill, prefill_tokens)
    assert ex.core.stats()["protected"] == cached
    ex.add(2, shared + [5, 6], 4, ignore_eos=True)
    plan = ex.core.schedule()
    assert plan.rids.tolist()[0] == 2 and plan.prefix_lens.tolist()[0] == cached
    tokens = ex.execute(plan)
    if overlap:
        ex.land(decode, decode_tokens)
    ex.land(plan, tokens)
    ex.run(overlap=overlap)
    ex.assert_outputs_undisturbed()
    assert ex.core.stats()["cached_tokens"] == cached
