"""Sampler semantics on hand-made logits: greedy, filters, seeds, penalties, validation;
the host/device split of the per-slot state, and a sampler that never waits for a GPU."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from rsgl.layers.sampler import (
    SampleOutput,
    Sampler,
    SlotSamplingState,
    exponential_noise,
    filtered_probs,
)
from rsgl.sampling_params import GREEDY_TEMPERATURE, SamplingParams

VOCAB = 64
EOS = 7


def _state(n: int = 8) -> SlotSamplingState:
    return SlotSamplingState(n, VOCAB, [EOS], "cpu")


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _batch(slots: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """(req_slots, seq_lens) on the device, then the same on the host."""
    slots_host = np.array(slots, dtype=np.int64)
    lens_host = np.array(seq_lens, dtype=np.int64)
    return torch.from_numpy(slots_host), torch.from_numpy(lens_host), slots_host, lens_host


def _call(
    sampler: Sampler,
    state: SlotSamplingState,
    logits: torch.Tensor,
    slots: list[int],
    seq_lens: list[int],
) -> SampleOutput:
    req_slots, lens, slots_host, lens_host = _batch(slots, seq_lens)
    return sampler(logits, state, req_slots, lens, slots_host, lens_host)


def _record(state: SlotSamplingState, slots: list[int], seq_lens: list[int], tokens: torch.Tensor):
    req_slots, lens, slots_host, lens_host = _batch(slots, seq_lens)
    state.record(req_slots, lens, tokens, slots_host, lens_host)


def _sample(
    state: SlotSamplingState, logits: torch.Tensor, slots: list[int], seq_len: int = 10
) -> torch.Tensor:
    sampler = Sampler("cpu", seed=123)
    return _call(sampler, state, logits, slots, [seq_len] * len(slots)).next_token_ids


def test_temperature_zero_is_argmax() -> None:
    state = _state()
    for slot in range(4):
        state.admit(slot, SamplingParams(temperature=0.0, top_p=0.5), [1, 2])
    logits = _logits(4)
    assert torch.equal(_sample(state, logits, [0, 1, 2, 3]), logits.argmax(-1))


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    state = _state()
    for slot in range(4):
        state.admit(slot, SamplingParams(temperature=1.5, top_k=1), [1])
    logits = _logits(4, seed=1)
    assert torch.equal(_sample(state, logits, [0, 1, 2, 3]), logits.argmax(-1))


def test_seeded_sampling_is_reproducible_across_batch_compositions() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=1.0, seed=42), [1])
    state.admit(1, SamplingParams(temperature=1.0, seed=42), [1])
    state.admit(2, SamplingParams(temperature=0.8, top_p=0.9), [1])
    state.admit(3, SamplingParams(temperature=0.0), [1])
    row = _logits(1, seed=5)
    alone = [int(_sample(state, row, [0], seq_len=n)[0]) for n in range(10, 40)]
    batch = torch.cat([_logits(1, seed=6), row, _logits(1, seed=7)])
    mixed = [int(_sample(state, batch, [2, 1, 3], seq_len=n)[1]) for n in range(10, 40)]
    assert alone == mixed
    assert len(set(alone)) > 3, "a seeded request must still sample, not repeat one token"
    other = SlotSamplingState(8, VOCAB, [EOS], "cpu")
    other.admit(0, SamplingParams(temperature=1.0, seed=43), [1])
    assert alone != [int(_sample(other, row, [0], seq_len=n)[0]) for n in range(10, 40)]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    noise = exponential_noise(torch.arange(20000), torch.zeros(20000, dtype=torch.int64), 3)
    draws = (probs.unsqueeze(0) / noise).argmax(-1)
    freq = torch.bincount(draws, minlength=3).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_the_noise_is_never_zero() -> None:
    # (seed 125, position 0, token 45437) hashes to the largest uniform, which float32 rounds
    # to 1.0: its noise was 0, so p / 0 won the race whatever p (and 0 / 0 was NaN for a
    # token a grammar had forbidden, which then won too).
    noise = exponential_noise(torch.tensor([125]), torch.tensor([0]), 49152)[0]
    assert noise[45437] > 0 and torch.isfinite(noise).all() and (noise > 0).all()
    probs = torch.zeros(49152)
    probs[7] = 1e-3  # the only token allowed, however unlikely
    assert int((probs / noise).argmax()) == 7


def test_top_k_top_p_min_p_filters() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]] * 3))
    probs = filtered_probs(
        logits,
        temperature=torch.ones(3),
        top_k=torch.tensor([2, 4, 4]),
        top_p=torch.tensor([1.0, 0.7, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.4]),
        truncate=True,
        use_min_p=True,
    )
    kept = probs > 0
    assert kept.tolist() == [
        [True, True, False, False],  # top-k 2
        [True, True, False, False],  # top-p 0.7: 0.5 + 0.25 reaches it
        [True, True, False, False],  # min-p 0.4: threshold 0.2
    ]


def test_penalties_change_logits_exactly_as_defined() -> None:
    from rsgl.layers.sampler import apply_penalties

    state = _state()
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    state.admit(0, params, prompt_ids=[1, 2])
    # Output so far: token 3 twice, token 1 once (a real output: seq_len >= fill_len).
    slots = torch.tensor([0])
    for token in (3, 3, 1):
        _record(state, [0], [10], torch.tensor([token]))
    logits = torch.tensor([[1.0, 4.0, -2.0, 3.0, 5.0] + [0.0] * (VOCAB - 5)])
    out = apply_penalties(logits, state, slots)
    expected = logits.clone()
    expected[0, 1] = 4.0 / 2 - 0.5 * 1 - 0.25  # prompt + output: repetition, freq, presence
    expected[0, 2] = -2.0 * 2  # prompt only: repetition
    expected[0, 3] = 3.0 / 2 - 0.5 * 2 - 0.25  # output twice
    torch.testing.assert_close(out, expected)
    # A fresh admission to the slot forgets the history.
    state.admit(0, params, prompt_ids=[])
    state.flush()
    torch.testing.assert_close(apply_penalties(logits, state, slots), logits)


def test_non_final_prefill_chunk_samples_are_not_history() -> None:
    state = _state()
    state.admit(0, SamplingParams(frequency_penalty=1.0), prompt_ids=list(range(20)))
    _record(state, [0], [7], torch.tensor([5]))  # chunk 7 of 20
    assert state.output_counts is not None and int(state.output_counts[0].sum()) == 0
    assert state.output_len[0] == 0
    _record(state, [0], [20], torch.tensor([5]))  # final chunk
    assert int(state.output_counts[0, 5]) == 1
    assert state.output_len[0] == 1


def test_min_new_tokens_masks_stop_ids_until_reached() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[9]), [1])
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 4] = 8.0
    for expected in (4, 4, EOS):
        token = _sample(state, logits, [0], seq_len=1)
        assert int(token[0]) == expected
        _record(state, [0], [1], token)


def test_logprobs_of_chosen_and_top_tokens() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=3), [1])
    logits = _logits(1, seed=3)
    out = _call(Sampler("cpu"), state, logits, [0], [5])
    logprobs = torch.log_softmax(logits, -1)
    assert out.token_logprobs is not None and out.top_logprob_ids is not None
    torch.testing.assert_close(out.token_logprobs, logprobs.max(-1).values)
    assert out.top_logprob_ids[0].tolist() == logprobs[0].topk(3).indices.tolist()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("min_new_tokens", -1),
    ],
)
def test_invalid_values_raise_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_flush_uploads_only_the_rows_admitted_since_the_last_flush() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=0.5, top_k=3, seed=9, stop_token_ids=[1, 2]), [1])
    state.admit(1, SamplingParams(logit_bias={4: 1.5, 5: -2.0}, token_ids_logprob=[6]), [1, 2])
    assert float(state.temperature.device[0]) == 0.0, "admit writes the host arrays only"
    state.flush()
    for array in state.slot_arrays:
        assert torch.equal(array.device, torch.from_numpy(array.host))
    assert state.temperature.host[0] == np.float32(0.5) and state.top_k.host[0] == 3
    assert state.seed.host[0] == 9 and state.seed.host[1] == -1  # -1: draw a seed
    assert state.stop_ids.host[0].tolist() == [1, 2, EOS]
    assert state.bias_ids.host[1].tolist() == [4, 5]
    assert state.bias_values.host[1].tolist() == [1.5, -2.0]
    assert state.bias_ids.host[0].tolist() == [-1, -1]
    assert state.fill_len.host[1] == 2 and state.logprob_ids.host[1].tolist() == [6]

    # Rows of slot 1 changed behind the state's back survive a flush of slot 0 alone, and
    # the widened stop-id table keeps them. (The state's tensors are updated in inference
    # mode, as the model runner runs.)
    with torch.inference_mode():
        state.temperature.device[1] = 9.0
        state.stop_ids.device[1, 0] = 42
    state.admit(0, SamplingParams(temperature=0.25, stop_token_ids=[8, 9, 10, 11]), [1])
    state.flush()
    assert float(state.temperature.device[1]) == 9.0
    assert state.stop_ids.device[1].tolist() == [42, -1, -1, -1, -1]
    assert float(state.temperature.device[0]) == 0.25
    assert state.stop_ids.device[0].tolist() == [8, 9, 10, 11, EOS]
    state.flush()  # nothing admitted: nothing copied
    assert float(state.temperature.device[1]) == 9.0


@dataclass
class _Request:
    """What the reference knows of a request: its parameters and its history."""

    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)

    @property
    def fill_len(self) -> int:
        return len(self.prompt) + len(self.output)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _reference_row(req: _Request, row: torch.Tensor, position: int, seed: int) -> int:
    """The sampler's documented semantics for one request, written out plainly."""
    p, row = req.params, row.clone()
    if p.has_penalties:
        counts = torch.bincount(torch.tensor(req.output, dtype=torch.int64), minlength=VOCAB)
        counts = counts.float()
        seen = counts > 0
        seen[req.prompt] = True
        rep = _f32(p.repetition_penalty)
        row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
        row = row - _f32(p.frequency_penalty) * counts
        row = row - _f32(p.presence_penalty) * (counts > 0).float()
    for token, bias in p.logit_bias.items():
        row[token] += _f32(bias)
    if len(req.output) < p.min_new_tokens:
        row[p.stop_token_ids + ([] if p.ignore_eos else [EOS])] = float("-inf")
    if p.is_greedy:
        return int(row.argmax())
    probs = torch.softmax(row / _f32(p.temperature).clamp(min=GREEDY_TEMPERATURE), -1)
    top_k = VOCAB if p.top_k < 0 else p.top_k
    if top_k < VOCAB or p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = (torch.arange(VOCAB) >= top_k) | (mass_before > _f32(p.top_p))
        probs[order[drop]] = 0.0
    if p.min_p > 0:
        probs[probs < probs.max() * _f32(p.min_p)] = 0.0
    if p.seed is not None:
        seed = p.seed & ((1 << 63) - 1)
    noise = exponential_noise(torch.tensor([seed]), torch.tensor([position]), VOCAB)[0]
    return int((probs / noise).argmax())


def test_batched_sampling_matches_a_per_request_reference() -> None:
    requests = [
        _Request(SamplingParams(temperature=0.0), [1, 2]),
        _Request(SamplingParams(temperature=0.9, seed=5, top_k=10), [3]),
        _Request(SamplingParams(temperature=2.0, min_p=0.3), [4, 5]),
        _Request(
            SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7),
            [6, 7, 8],
            output=[9, 9],  # a retracted request re-admitted with its output so far
        ),
        _Request(SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=1.0, seed=-4), [10]),
        _Request(SamplingParams(temperature=0.0, logit_bias={11: 8.0, 12: -3.0}), [1]),
        _Request(SamplingParams(temperature=1.0, logit_bias={0: 2.5}, min_new_tokens=3), [2]),
        _Request(
            SamplingParams(
                temperature=0.0, max_new_tokens=8, min_new_tokens=4, stop_token_ids=[13]
            ),
            [3, 4],
        ),
        _Request(
            SamplingParams(
                temperature=0.8, return_logprob=True, top_logprobs_num=3, token_ids_logprob=[1, 2]
            ),
            [5],
        ),
        _Request(SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=1), [6]),
    ]
    state = SlotSamplingState(len(requests), VOCAB, [EOS], "cpu")
    for slot, req in enumerate(requests):
        state.admit(slot, req.params, req.prompt, req.output)
    sampler = Sampler("cpu", seed=77)
    draws = torch.Generator().manual_seed(77)  # the reference's copy of the sampler's
    positions = [req.fill_len for req in requests]
    positions[2] -= 2  # a prefill chunk: its first sample is not an output
    rng = random.Random(0)
    sampled_tokens = set()
    for step in range(16):
        # Batches of every composition: greedy only, sampled only, mixed, any order.
        slots = rng.sample(range(len(requests)), rng.randint(1, len(requests)))
        if step == 0:
            slots = [0, 3, 5, 7]
        elif step == 1:
            slots = [2, 1, 6]
        positions = [n + 1 if s in slots else n for s, n in enumerate(positions)]
        seq_lens = [positions[s] for s in slots]
        logits = torch.randn(len(slots), VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        if step % 2 == 0:  # stop ids on top: only min_new_tokens keeps them from winning
            logits[:, EOS] = logits.max() + 1
            logits[:, 13] = logits.max() + 2
        else:  # the retracted request's output on top: only its history penalises it
            logits[:, 9] = logits.max() + 0.5
        out = _call(sampler, state, logits, slots, seq_lens)

        sampled = [i for i, s in enumerate(slots) if not requests[s].params.is_greedy]
        seeds = torch.randint(0, (1 << 63) - 1, (len(sampled),), generator=draws).tolist()
        seed_of = dict(zip(sampled, seeds, strict=True))
        expected = [
            _reference_row(requests[s], logits[i], seq_lens[i], seed_of.get(i, 0))
            for i, s in enumerate(slots)
        ]
        assert out.next_token_ids.tolist() == expected, step
        sampled_tokens.update(expected[i] for i in sampled)

        logprobs = torch.log_softmax(logits, -1)
        asked = [i for i, s in enumerate(slots) if requests[s].params.return_logprob]
        if not asked:
            assert out.token_logprobs is None
        for i in asked:
            p = requests[slots[i]].params
            assert out.token_logprobs is not None
            torch.testing.assert_close(out.token_logprobs[i], logprobs[i, expected[i]])
            top = logprobs[i].topk(p.top_logprobs_num)
            assert out.top_logprob_ids is not None and out.top_logprobs is not None
            assert out.top_logprob_ids[i, : p.top_logprobs_num].tolist() == top.indices.tolist()
            torch.testing.assert_close(out.top_logprobs[i, : p.top_logprobs_num], top.values)
            if p.token_ids_logprob:
                assert out.token_ids_logprobs is not None
                ids = p.token_ids_logprob
                torch.testing.assert_close(out.token_ids_logprobs[i, : len(ids)], logprobs[i, ids])

        _record(state, slots, seq_lens, out.next_token_ids)
        for i, s in enumerate(slots):
            if seq_lens[i] >= requests[s].fill_len:
                requests[s].output.append(expected[i])
        assert state.output_len.tolist() == [len(req.output) for req in requests]
    assert len(sampled_tokens) > 5, "the sampled requests must actually sample"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_on_cuda_never_waits_for_the_device() -> None:
    device = torch.device("cuda")
    state = SlotSamplingState(8, VOCAB, [EOS], device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=3, top_k=5, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias={3: 4.0}, min_new_tokens=2),
        SamplingParams(return_logprob=True, top_logprobs_num=2, token_ids_logprob=[1, 2]),
    ]
    for slot, p in enumerate(params):
        state.admit(slot, p, [1, 2, 3])
    sampler = Sampler(device, seed=1)
    slots_host = np.arange(len(params), dtype=np.int64)
    lens_host = np.full(len(params), 4, dtype=np.int64)
    req_slots = torch.from_numpy(slots_host).to(device)
    logits = torch.randn(len(params), VOCAB, device=device)
    # A first step outside the check: CUDA's and the caching allocators' warm-up may wait.
    out = sampler(logits, state, req_slots, req_slots + 4, slots_host, lens_host)
    state.record(req_slots, req_slots + 4, out.next_token_ids, slots_host, lens_host)
    torch.cuda.synchronize()

    state.admit(5, SamplingParams(temperature=0.5, stop_token_ids=[9], logit_bias={8: 1.0}), [4])
    slots_host = np.arange(len(params) + 1, dtype=np.int64)
    req_slots = torch.from_numpy(slots_host).to(device)
    logits = torch.randn(len(slots_host), VOCAB, device=device)
    steps = []
    # The debug mode misses some synchronizing calls (it says so), hence a second witness: a
    # kernel that spins for about half a second is still running when the steps return.
    torch.cuda._sleep(1_000_000_000)
    slept = torch.cuda.Event()
    slept.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            lens_host = np.full(len(slots_host), 5 + step, dtype=np.int64)
            seq_lens = torch.full((len(slots_host),), 5 + step, device=device)
            state.flush()
            out = sampler(logits, state, req_slots, seq_lens, slots_host, lens_host)
            state.record(req_slots, seq_lens, out.next_token_ids, slots_host, lens_host)
            steps.append(out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not slept.query(), "a step waited for the device"
    for out in steps:
        ids = out.next_token_ids.tolist()
        assert ids[0] == int(logits[0].argmax()) and all(0 <= t < VOCAB for t in ids)
        assert out.token_logprobs is not None and out.token_ids_logprobs is not None
    assert state.output_len.tolist()[:6] == [4, 4, 4, 4, 4, 3]
