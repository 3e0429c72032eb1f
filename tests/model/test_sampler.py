"""Sampler semantics on hand-made logits: greedy, filters, seeds, penalties, validation."""

from __future__ import annotations

import pytest
import torch

from rsgl.layers.sampler import Sampler, SlotSamplingState, exponential_noise, filtered_probs
from rsgl.sampling_params import SamplingParams

VOCAB = 64
EOS = 7


def _state(n: int = 8) -> SlotSamplingState:
    return SlotSamplingState(n, VOCAB, [EOS], "cpu")


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(
    state: SlotSamplingState, logits: torch.Tensor, slots: list[int], seq_len: int = 10
) -> torch.Tensor:
    sampler = Sampler("cpu", seed=123)
    s = torch.tensor(slots)
    return sampler(logits, state, s, torch.full((len(slots),), seq_len)).next_token_ids


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


def test_top_k_top_p_min_p_filters() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]] * 3))
    probs = filtered_probs(
        logits,
        temperature=torch.ones(3),
        top_k=torch.tensor([2, 4, 4]),
        top_p=torch.tensor([1.0, 0.7, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.4]),
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
        state.record(slots, torch.tensor([10]), torch.tensor([token]))
    logits = torch.tensor([[1.0, 4.0, -2.0, 3.0, 5.0] + [0.0] * (VOCAB - 5)])
    out = apply_penalties(logits, state, slots)
    expected = logits.clone()
    expected[0, 1] = 4.0 / 2 - 0.5 * 1 - 0.25  # prompt + output: repetition, freq, presence
    expected[0, 2] = -2.0 * 2  # prompt only: repetition
    expected[0, 3] = 3.0 / 2 - 0.5 * 2 - 0.25  # output twice
    torch.testing.assert_close(out, expected)
    # A fresh admission to the slot forgets the history.
    state.admit(0, params, prompt_ids=[])
    torch.testing.assert_close(apply_penalties(logits, state, slots), logits)


def test_non_final_prefill_chunk_samples_are_not_history() -> None:
    state = _state()
    state.admit(0, SamplingParams(frequency_penalty=1.0), prompt_ids=list(range(20)))
    state.record(torch.tensor([0]), torch.tensor([7]), torch.tensor([5]))  # chunk 7 of 20
    assert state.output_counts is not None and int(state.output_counts[0].sum()) == 0
    state.record(torch.tensor([0]), torch.tensor([20]), torch.tensor([5]))  # final chunk
    assert int(state.output_counts[0, 5]) == 1


def test_min_new_tokens_masks_stop_ids_until_reached() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[9]), [1])
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 4] = 8.0
    slots, seq = torch.tensor([0]), torch.tensor([1])
    for expected in (4, 4, EOS):
        token = _sample(state, logits, [0], seq_len=1)
        assert int(token[0]) == expected
        state.record(slots, seq, token)


def test_logprobs_of_chosen_and_top_tokens() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=3), [1])
    logits = _logits(1, seed=3)
    out = Sampler("cpu")(logits, state, torch.tensor([0]), torch.tensor([5]))
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
