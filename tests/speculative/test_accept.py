"""Acceptance of chain drafts (rsgl.speculative.accept): greedy rows emit the argmax chain,
sampled rows the target's distribution (chi-square), and greedy or seeded requests exactly
the tokens, penalties, bias, min_new_tokens masking and logprobs of plain sequential steps
through the real `Sampler`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from rsgl.layers.sampler import (
    SampleOutput,
    Sampler,
    SlotSamplingState,
    argmax_rows,
    filtered_probs,
)
from rsgl.sampling_params import SamplingParams
from rsgl.speculative import Accepted, accept_drafts, record_accepted
from rsgl.speculative.accept import DraftLayout

VOCAB = 64
EOS = 7


def _state(n: int = 8, vocab: int = VOCAB) -> SlotSamplingState:
    return SlotSamplingState(n, vocab, [EOS], "cpu")


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _accept(
    state: SlotSamplingState,
    logits: torch.Tensor,
    slots: list[int],
    drafts: list[list[int]],
    seq_lens: list[int],
    sampler: Sampler | None = None,
) -> Accepted:
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    return accept_drafts(
        logits,
        np.array(slots, dtype=np.int64),
        np.array([len(d) for d in drafts], dtype=np.int64),
        flat,
        state,
        sampler or Sampler("cpu", seed=1),
        np.array(seq_lens, dtype=np.int64),
    )


def _per_request(acc: Accepted) -> list[list[int]]:
    """The emitted tokens split by request (checks the lens against the flat output)."""
    lens = acc.accept_lens_host.tolist()
    assert lens == acc.accept_lens.tolist()
    assert sum(lens) == acc.token_ids.shape[0]
    return [part.tolist() for part in acc.token_ids.split(lens)]


def _argmax_chain(rows: torch.Tensor, drafts: list[int]) -> list[int]:
    """The reference greedy rule, one position at a time."""
    out: list[int] = []
    for j in range(len(drafts) + 1):
        best = int(argmax_rows(rows[j : j + 1])[0])
        out.append(best)
        if j == len(drafts) or best != drafts[j]:
            break
    return out


def test_layout_indexes_rows_drafts_and_penalty_pairs() -> None:
    layout = DraftLayout.build(np.array([2, 0, 3]))
    assert layout.num_rows == 3 + 1 + 4 and layout.max_drafts == 3
    assert layout.row_start.tolist() == [0, 3, 4]
    assert layout.row_req.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert layout.row_pos.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert layout.draft_req.tolist() == [0, 0, 2, 2, 2]
    assert layout.draft_pos.tolist() == [0, 1, 0, 1, 2]
    assert layout.draft_row.tolist() == [0, 1, 4, 5, 6]
    # Row r counts every earlier draft of its own request.
    pairs = sorted(zip(layout.pair_rows.tolist(), layout.pair_drafts.tolist(), strict=True))
    assert pairs == [(1, 0), (2, 0), (2, 1), (5, 2), (6, 2), (6, 3), (7, 2), (7, 3), (7, 4)]
    empty = DraftLayout.build(np.zeros(0, dtype=np.int64))
    assert empty.num_rows == 0 and empty.max_drafts == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_emits_the_argmax_chain(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    state = _state(16)
    drafts: list[list[int]] = []
    blocks = []
    for slot in range(16):
        state.admit(slot, SamplingParams(temperature=0.0), [1, 2, 3])
        k = slot % 5  # 0..4 drafts
        rows = _logits(k + 1, seed=100 + slot).to(dtype)
        chain = argmax_rows(rows).tolist()
        # All accepted, none, or accepted up to a wrong draft at `cut`.
        cut = int(torch.randint(0, k + 1, (1,), generator=gen)) if k else 0
        draft = [int(t) for t in chain[:k]]
        if slot % 3 == 1 and k:
            draft[0] = (draft[0] + 1) % VOCAB
        elif slot % 3 == 2 and cut < k:
            draft[cut] = (draft[cut] + 5) % VOCAB
            draft[cut + 1 :] = torch.randint(0, VOCAB, (k - cut - 1,), generator=gen).tolist()
        drafts.append(draft)
        blocks.append(rows)
    logits = torch.cat(blocks)
    acc = _accept(state, logits, list(range(16)), drafts, [10] * 16)
    expected = [_argmax_chain(rows, d) for rows, d in zip(blocks, drafts, strict=True)]
    assert _per_request(acc) == expected
    assert acc.last_token_ids.tolist() == [e[-1] for e in expected]
    assert {len(e) for e in expected} >= {1, 2, 5}, "the cases must cover none/partial/all"


def test_greedy_ties_resolve_as_argmax_rows() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=0.0), [1])
    state.admit(1, SamplingParams(temperature=0.0), [1])
    row = torch.zeros(1, VOCAB)
    row[0, 9] = row[0, 30] = 5.0  # tied best
    first = int(argmax_rows(row)[0])
    other = 39 - first
    logits = row.repeat(5, 1).to(torch.bfloat16)
    acc = _accept(state, logits, [0, 1], [[first], [other, first]], [5, 5])
    assert _per_request(acc) == [[first, first], [first]]


def test_no_drafts_is_exactly_the_plain_sampler() -> None:
    # Same generator seed: the unseeded requests draw their seeds in the same order.
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=20, return_logprob=True, top_logprobs_num=2),
        SamplingParams(temperature=1.1, seed=5, top_p=0.9),
        SamplingParams(temperature=0.7, min_p=0.05, frequency_penalty=0.4),
    ]
    plain, spec = _state(), _state()
    for slot, p in enumerate(params):
        plain.admit(slot, p, [1, 2, 3], [4, 5])
        spec.admit(slot, p, [1, 2, 3], [4, 5])
    logits = _logits(4, seed=8)
    slots = np.array([2, 0, 3, 1], dtype=np.int64)
    lens = np.array([9, 12, 7, 30], dtype=np.int64)
    for step in range(5):
        want = Sampler("cpu", seed=step)(
            logits, plain, torch.from_numpy(slots), torch.from_numpy(lens), slots, lens
        )
        acc = _accept(spec, logits, slots.tolist(), [[]] * 4, lens.tolist(), Sampler("cpu", step))
        assert torch.equal(acc.token_ids, want.next_token_ids)
        assert acc.accept_lens.tolist() == [1, 1, 1, 1]
        _assert_same_logprobs(acc.sample, want)


def _assert_same_logprobs(got: SampleOutput, want: SampleOutput) -> None:
    for name in ("token_logprobs", "top_logprobs", "top_logprob_ids", "token_ids_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


@dataclass
class _Req:
    """A request of the sequential-equivalence test and the drafts it gets: the first
    `accepted` drafts are the plain sampler's own choices, then a wrong one, then noise."""

    params: SamplingParams
    k: int
    accepted: int
    prompt: list[int] = field(default_factory=lambda: [3, 4, 5, 11])
    output: list[int] = field(default_factory=lambda: [12, 12, 13])


def _sequential(
    req: _Req, slot: int, rows: torch.Tensor, seq_len: int, rng: np.random.Generator
) -> tuple[list[int], list[int], list[SampleOutput]]:
    """(drafts, emitted tokens, the plain step of each emitted token): plain single-request
    steps, each recording the previous position's draft as generated."""
    state = _state()
    state.admit(slot, req.params, req.prompt, req.output)
    sampler = Sampler("cpu", seed=77)
    drafts: list[int] = []
    emitted: list[int] = []
    outs: list[SampleOutput] = []
    accepting = True
    for j in range(req.k + 1):
        slots_h, lens_h = np.array([slot]), np.array([seq_len + j])
        slots_d, lens_d = torch.from_numpy(slots_h), torch.from_numpy(lens_h)
        out = sampler(rows[j : j + 1], state, slots_d, lens_d, slots_h, lens_h)
        token = int(out.next_token_ids[0])
        if accepting:
            emitted.append(token)
            outs.append(out)
        if j == req.k:
            break
        if j < req.accepted:
            draft = token
        elif j == req.accepted:
            draft = (token + 1 + int(rng.integers(VOCAB - 1))) % VOCAB
        else:
            draft = int(rng.integers(VOCAB))
        drafts.append(draft)
        accepting = accepting and draft == token
        state.record(slots_d, lens_d, torch.tensor([draft]), slots_h, lens_h)
    return drafts, emitted, outs


SEQUENTIAL_CASES = [
    _Req(SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5), 4, 2),
    _Req(SamplingParams(temperature=0.9, top_k=10, seed=1, presence_penalty=1.0), 3, 3),
    _Req(SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, seed=2), 4, 0),
    _Req(SamplingParams(temperature=0.0, logit_bias={20: 4.0}, min_new_tokens=5), 3, 1),
    _Req(
        SamplingParams(
            temperature=0.7,
            top_k=30,
            seed=3,
            logit_bias={21: 2.5},
            min_new_tokens=6,
            frequency_penalty=0.8,
            return_logprob=True,
            top_logprobs_num=3,
            token_ids_logprob=[1, EOS, 21],
        ),
        5,
        4,
    ),
    _Req(SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=3), 0, 0),
    _Req(SamplingParams(temperature=0.8, top_p=0.95, seed=4, repetition_penalty=0.8), 4, 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_and_seeded_requests_emit_the_tokens_of_plain_steps(dtype: torch.dtype) -> None:
    """Penalties that count the earlier drafts, bias, min_new_tokens and seeds at every
    position, against the real sampler stepping one position at a time."""
    rng = np.random.default_rng(0)
    state = _state()
    slots = [6, 0, 3, 1, 5, 2, 4]
    seq_lens = [20, 31, 9, 14, 40, 8, 17]
    blocks, drafts, expected, outs = [], [], [], []
    for req, slot, seq_len in zip(SEQUENTIAL_CASES, slots, seq_lens, strict=True):
        rows = _logits(req.k + 1, seed=slot + 50)
        rows[:, EOS] += 6.0  # stop is likely: masking below min_new_tokens matters
        rows[:, 12] += 3.0  # an output token: penalties matter
        rows = rows.to(dtype)
        d, e, o = _sequential(req, slot, rows, seq_len, rng)
        assert len(e) == min(req.accepted, req.k) + 1
        state.admit(slot, req.params, req.prompt, req.output)
        blocks.append(rows)
        drafts.append(d)
        expected.append(e)
        outs.append(o)
    acc = _accept(state, torch.cat(blocks), slots, drafts, seq_lens)
    assert _per_request(acc) == expected
    # Logprobs of every emitted token, as each plain step reported them.
    starts = np.cumsum(acc.accept_lens_host) - acc.accept_lens_host
    for req, start, steps in zip(SEQUENTIAL_CASES, starts, outs, strict=True):
        if not req.params.return_logprob:
            continue
        for j, out in enumerate(steps):
            row = SampleOutput(
                next_token_ids=acc.token_ids[start + j : start + j + 1],
                token_logprobs=_row(acc.sample.token_logprobs, start + j),
                top_logprobs=_row(acc.sample.top_logprobs, start + j),
                top_logprob_ids=_row(acc.sample.top_logprob_ids, start + j),
                token_ids_logprobs=(
                    None
                    if out.token_ids_logprobs is None
                    else _row(acc.sample.token_ids_logprobs, start + j)
                ),
            )
            _assert_same_logprobs(row, out)


def _row(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
    return None if t is None else t[i : i + 1]


def test_every_position_masks_stop_ids_below_min_new_tokens_and_applies_bias() -> None:
    state = _state()
    # Two outputs so far, five required: rows 0..2 mask EOS, row 3 may pick it.
    state.admit(0, SamplingParams(temperature=0.0, min_new_tokens=5), [1], [2, 3])
    state.admit(1, SamplingParams(temperature=0.0, logit_bias={40: 100.0}), [1])
    masked = torch.zeros(5, VOCAB)
    masked[:, EOS] = 10.0
    masked[:, 30] = 5.0
    biased = _logits(4, seed=2)
    acc = _accept(state, torch.cat([masked, biased]), [0, 1], [[30, 30, 30, 30], [40] * 3], [9, 2])
    assert _per_request(acc) == [[30, 30, 30, EOS], [40, 40, 40, 40]]


def test_penalties_see_the_drafts_accepted_before_them() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=0.0, frequency_penalty=1.0), [1])
    state.admit(1, SamplingParams(temperature=0.0, repetition_penalty=2.0), [1])
    state.admit(2, SamplingParams(temperature=0.0), [1])
    rows = torch.zeros(3, VOCAB)
    rows[:, 20] = 2.0  # best unless penalised
    rows[:, 21] = 1.5
    logits = rows.repeat(3, 1)
    acc = _accept(state, logits, [0, 1, 2], [[20, 20]] * 3, [5, 5, 5])
    # Row 1 sees draft 20 once: 2.0 - 1.0 (frequency) or 2.0 / 2 (repetition) < 1.5.
    assert _per_request(acc) == [[20, 21], [20, 21], [20, 20, 20]]


def test_record_accepted_counts_as_plain_records() -> None:
    spec, plain = _state(), _state()
    for s in (spec, plain):
        s.admit(0, SamplingParams(temperature=0.0, presence_penalty=0.5), [1])
        s.admit(1, SamplingParams(temperature=0.0, min_new_tokens=3), [1])
    logits = torch.zeros(6, VOCAB)
    logits[:, 25] = 1.0
    acc = _accept(spec, logits, [1, 0], [[25, 25, 25], [25]], [4, 4])
    assert _per_request(acc) == [[25, 25, 25, 25], [25, 25]]
    record_accepted(spec, np.array([1, 0]), acc)
    for slot, n in ((1, 4), (0, 2)):
        for i in range(n):
            slots, lens = np.array([slot]), np.array([4 + i])
            plain.record(
                torch.from_numpy(slots), torch.from_numpy(lens), torch.tensor([25]), slots, lens
            )
    assert spec.output_len.tolist() == plain.output_len.tolist()
    assert spec.output_len[:2].tolist() == [2, 4]
    assert spec.output_counts is not None and plain.output_counts is not None
    assert torch.equal(spec.output_counts, plain.output_counts)


def test_seeded_requests_reproduce_whatever_the_batch_and_generator() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=1.0, seed=11), [1])
    state.admit(1, SamplingParams(temperature=1.0, top_p=0.9), [1])
    state.admit(2, SamplingParams(temperature=0.0), [1])
    rows = torch.zeros(4, VOCAB)  # uniform: many different outcomes
    drafts = [1, 2, 3]
    alone = [
        _per_request(_accept(state, rows, [0], [drafts], [n], Sampler("cpu", n)))[0]
        for n in range(40)
    ]
    mixed_logits = torch.cat([_logits(2, seed=1), rows, _logits(1, seed=2)])
    mixed = [
        _per_request(
            _accept(state, mixed_logits, [1, 0, 2], [[5], drafts, []], [3, n, 7], Sampler("cpu"))
        )[1]
        for n in range(40)
    ]
    assert alone == mixed
    assert len({tuple(t) for t in alone}) > 10, "a seeded request must still sample"


def _chi_square_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of `observed` counts against `probs`; cells expecting fewer than 5
    are pooled, and a draw where the probability is 0 fails outright."""
    n = float(observed.sum())
    expected = probs.double() / probs.sum() * n
    assert int(observed[expected == 0].sum()) == 0, "a token of probability 0 was emitted"
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


DRAWS = 30000
CHI_PARAMS = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02)


def _target_probs(rows: torch.Tensor) -> torch.Tensor:
    n = rows.shape[0]
    probs = filtered_probs(
        rows,
        torch.full((n,), CHI_PARAMS.temperature),
        torch.full((n,), CHI_PARAMS.top_k),
        torch.full((n,), CHI_PARAMS.top_p),
        torch.full((n,), CHI_PARAMS.min_p),
        truncate=True,
        use_min_p=True,
    )
    return probs / probs.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("which", ["likely", "unlikely", "filtered"])
def test_sampled_tokens_follow_the_target_distribution(which: str) -> None:
    """DRAWS unseeded copies of one request with the same two drafts: the first emitted
    token follows p0, the second (given the first draft accepted) p1, the bonus (given both
    accepted) p2. Rows 0 and 1 have the same logits, so noise shared between positions
    would show in the second token."""
    torch.manual_seed(0)
    row0 = _logits(1, seed=21) * 0.6
    rows = torch.cat([row0, row0, _logits(1, seed=22) * 0.6])
    p = _target_probs(rows)
    order = p[0].argsort(descending=True)
    kept = int((p[0] > 0).sum())
    d0 = {"likely": order[0], "unlikely": order[kept - 1], "filtered": order[-1]}[which]
    d1 = p[1].argmax()
    assert (p[0, d0] > 0) == (which != "filtered")
    state = SlotSamplingState(DRAWS, VOCAB, [EOS], "cpu")
    for slot in range(DRAWS):
        state.admit(slot, CHI_PARAMS, [1])
    logits = rows.repeat(DRAWS, 1)
    flat = torch.stack([d0, d1]).repeat(DRAWS)
    acc = accept_drafts(
        logits,
        np.arange(DRAWS),
        np.full(DRAWS, 2),
        flat,
        state,
        Sampler("cpu", seed=1),
        np.full(DRAWS, 10),
    )
    lens = acc.accept_lens
    starts = torch.cumsum(lens, 0) - lens
    tokens = acc.token_ids
    first = tokens[starts]
    assert torch.equal(first == d0, lens > 1), "accepted exactly when the draft came out"
    assert _chi_square_pvalue(torch.bincount(first, minlength=VOCAB), p[0]) > 1e-3
    for position in (1, 2):
        given = lens > position  # position - 1 drafts accepted: a token was emitted there
        if int(given.sum()) < 2000:
            assert which != "likely"
            continue
        second = tokens[starts[given] + position]
        pvalue = _chi_square_pvalue(torch.bincount(second, minlength=VOCAB), p[position])
        assert pvalue > 1e-3, position


def test_inconsistent_shapes_raise() -> None:
    state = _state()
    state.admit(0, SamplingParams(temperature=0.0), [1])
    with pytest.raises(ValueError, match="rows of logits"):
        _accept(state, torch.zeros(2, VOCAB), [0], [[1, 2]], [3])
    with pytest.raises(ValueError, match="draft_tokens"):
        accept_drafts(
            torch.zeros(3, VOCAB),
            np.array([0]),
            np.array([2]),
            torch.tensor([1]),
            state,
            Sampler("cpu"),
            np.array([3]),
        )
    with pytest.raises(ValueError, match="draft_lens"):
        _accept(state, torch.zeros(1, VOCAB), [0], [[]], [3, 4])


def _toy_model(context: list[int]) -> torch.Tensor:
    """A deterministic stand-in for a model: logits from the last two tokens."""
    table = torch.randn(2, VOCAB, VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    logits = table[0, context[-1]] + table[1, context[-2]]
    logits[EOS] += 3.0
    return logits


def test_generation_with_any_drafts_equals_generation_without() -> None:
    """Several steps with record_accepted in between (min_new_tokens and penalty counts
    carried across steps): random, oracle and empty drafts give the plain tokens."""
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.3, min_new_tokens=6),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, presence_penalty=0.4),
        SamplingParams(temperature=0.6, top_k=8, seed=6, min_new_tokens=9),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
    ]
    prompts = [[1, 2, 3], [4, 5], [6, 8, 9, 10], [11, 12]]
    length = 24
    slots = np.array([3, 0, 2, 1], dtype=np.int64)

    plain_state = _state()
    for slot, p, prompt in zip(slots, params, prompts, strict=True):
        plain_state.admit(int(slot), p, prompt)
    plain = [list(p) for p in prompts]
    sampler = Sampler("cpu", seed=0)
    for _ in range(length):
        logits = torch.stack([_toy_model(ctx) for ctx in plain])
        lens = np.array([len(ctx) for ctx in plain], dtype=np.int64)
        args = (torch.from_numpy(slots), torch.from_numpy(lens), slots, lens)
        tokens = sampler(logits, plain_state, *args).next_token_ids
        plain_state.record(args[0], args[1], tokens, slots, lens)
        for ctx, token in zip(plain, tokens.tolist(), strict=True):
            ctx.append(token)

    rng = np.random.default_rng(1)
    state = _state()
    for slot, p, prompt in zip(slots, params, prompts, strict=True):
        state.admit(int(slot), p, prompt)
    spec = [list(p) for p in prompts]
    steps = 0
    while min(len(s) - len(p) for s, p in zip(spec, prompts, strict=True)) < length:
        drafts = []
        for ctx, want in zip(spec, plain, strict=True):
            k = int(rng.integers(0, 5))
            oracle = want[len(ctx) : len(ctx) + k]
            drafts.append(oracle if rng.random() < 0.5 else rng.integers(0, VOCAB, k).tolist())
        rows = [
            _toy_model(ctx + d[:j])
            for ctx, d in zip(spec, drafts, strict=True)
            for j in range(len(d) + 1)
        ]
        lens = [len(ctx) for ctx in spec]
        acc = _accept(state, torch.stack(rows), slots.tolist(), drafts, lens, Sampler("cpu", steps))
        record_accepted(state, slots, acc)
        for ctx, emitted in zip(spec, _per_request(acc), strict=True):
            ctx.extend(emitted)
        steps += 1
    for s, p, prompt in zip(spec, plain, prompts, strict=True):
        assert s[: len(prompt) + length] == p
    assert steps < length, "the oracle drafts must have been accepted"
