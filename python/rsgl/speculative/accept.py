"""The acceptance step of speculative decoding for deterministic (chain) drafts.

A verify forward gives request i `1 + k_i` rows of logits: row j predicts the token after
its last committed token and its first j drafts. Every row is turned into a *candidate*
exactly as a plain step would turn it into its next token (`Sampler`): penalties, logit
bias, stop ids masked below min_new_tokens, then the argmax for greedy requests or, for
sampled ones, temperature, top-k, top-p and min-p and the exponential race argmax(p / E)
with E a pure function of (seed, position, token id). Row j takes the penalties and the
min_new_tokens count of a plain step that had already emitted the first j drafts.

Request i then emits its drafts while each equals its row's candidate, followed by the
candidate of the first row whose draft differs (or of the last row: the bonus token).

Why this is the exact rule for a draft t that is a point mass (SPECULATIVE.md section 3):
the race winner W follows p, so t is accepted (W = t) with probability p(t), and a
rejected position emits W given W != t, which is p with t removed and renormalised. Each
position's noise is independent of the others' (its position is part of the hash), so
the accepted prefix and the token after it follow the target's sequential distribution.
A greedy request emits the argmax chain, as without speculation. And because the noise is
the plain sampler's, a seeded request emits with speculation the very tokens it emits
without: the same seed and position give the same race.

Draw order: one fresh 63-bit seed per sampled request without a seed, taken from the
sampler's generator in batch order (one `randint` per call); its rows use that seed at
positions seq_len, seq_len + 1, ... . Seeded requests take no draw.

Not handled here: grammar-constrained rows (the mask of each position depends on the
grammar state after the drafts before it): such requests must not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rsgl.layers.host_copy import to_device
from rsgl.layers.sampler import (
    SampleOutput,
    Sampler,
    SlotSamplingState,
    apply_logit_bias,
    argmax_rows,
    exponential_noise,
    mask_stop_ids,
    plain_greedy,
    slot_filtered_probs,
)

_SEED_BOUND = (1 << 63) - 1


@dataclass(slots=True)
class Accepted:
    """What a verify step emits: per request, its accepted drafts and one more token.

    `sample` has one row per emitted token, request after request (request i's
    `accept_lens[i]` tokens in order), with the fields a plain step's `SampleOutput` has
    per request, computed for each emitted token from the row of logits that produced it
    (the model's raw log-probabilities, as a plain step reports them).
    """

    sample: SampleOutput
    accept_lens: torch.Tensor  # [B] int64, 1 ..= 1 + k_i: accepted drafts + 1
    accept_lens_host: np.ndarray  # the same on the host
    last_token_ids: torch.Tensor  # [B] int64: each request's last emitted token
    # [sum(1 + k_i)] int64: every row's candidate, emitted or not (for diagnostics).
    row_candidates: torch.Tensor

    @property
    def token_ids(self) -> torch.Tensor:
        """[sum(accept_lens)] int64: the emitted tokens, flat."""
        return self.sample.next_token_ids


@dataclass(slots=True, frozen=True)
class DraftLayout:
    """Host index arrays of a verify batch: its rows (`1 + k_i` per request) and drafts.

    Row r is position `row_pos[r]` (0 ..= k_i) of request `row_req[r]`; draft d is draft
    `draft_pos[d]` of request `draft_req[d]` and is checked against row `draft_row[d]`.
    (`pair_rows[n]`, `pair_drafts[n]`) lists every draft that a later row of the same
    request counts as already generated (for its penalties).
    """

    num_requests: int
    max_drafts: int
    row_start: np.ndarray  # [B]
    row_req: np.ndarray  # [R]
    row_pos: np.ndarray  # [R]
    draft_req: np.ndarray  # [D]
    draft_pos: np.ndarray  # [D]
    draft_row: np.ndarray  # [D]
    pair_rows: np.ndarray  # [P], P = sum k_i (k_i + 1) / 2
    pair_drafts: np.ndarray  # [P]

    @property
    def num_rows(self) -> int:
        return len(self.row_req)

    @staticmethod
    def build(draft_lens: np.ndarray) -> DraftLayout:
        """The layout of requests with `draft_lens` drafts each (k_i >= 0)."""
        k = np.asarray(draft_lens, dtype=np.int64)
        if k.ndim != 1 or (k < 0).any():
            raise ValueError("draft_lens must be a 1-d array of counts >= 0")
        reqs = np.arange(len(k), dtype=np.int64)
        rows_per = k + 1
        row_start = np.cumsum(rows_per) - rows_per
        row_req = np.repeat(reqs, rows_per)
        row_pos = np.arange(len(row_req), dtype=np.int64) - row_start[row_req]
        draft_start = np.cumsum(k) - k
        draft_req = np.repeat(reqs, k)
        draft_pos = np.arange(len(draft_req), dtype=np.int64) - draft_start[draft_req]
        draft_row = row_start[draft_req] + draft_pos
        # Draft m of a request counts for its rows m + 1 ..= k_i.
        later = k[draft_req] - draft_pos
        pair_rows = _ranges(draft_row + 1, later)
        pair_drafts = np.repeat(np.arange(len(draft_req), dtype=np.int64), later)
        return DraftLayout(
            num_requests=len(k),
            max_drafts=int(k.max()) if len(k) else 0,
            row_start=row_start,
            row_req=row_req,
            row_pos=row_pos,
            draft_req=draft_req,
            draft_pos=draft_pos,
            draft_row=draft_row,
            pair_rows=pair_rows,
            pair_drafts=pair_drafts,
        )


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of `arange(s, s + n)` for each (s, n)."""
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


@dataclass(slots=True)
class _Rows:
    """Per-row host arrays and their device copies."""

    slots_host: np.ndarray  # [R] request slot of each row
    positions_host: np.ndarray  # [R] the seq_len a plain step would sample this row at
    slots: torch.Tensor
    positions: torch.Tensor
    row_req: torch.Tensor
    row_pos: torch.Tensor
    row_start: torch.Tensor
    draft_req: torch.Tensor
    draft_pos: torch.Tensor
    draft_row: torch.Tensor
    pair_rows: torch.Tensor
    pair_drafts: torch.Tensor


def _upload(
    layout: DraftLayout, req_slots: np.ndarray, seq_lens: np.ndarray, device: torch.device
) -> _Rows:
    slots_host = req_slots[layout.row_req]
    positions_host = seq_lens[layout.row_req] + layout.row_pos
    parts = to_device(
        [
            slots_host,
            positions_host,
            layout.row_req,
            layout.row_pos,
            layout.row_start,
            layout.draft_req,
            layout.draft_pos,
            layout.draft_row,
            layout.pair_rows,
            layout.pair_drafts,
        ],
        device,
        share_on_cpu=False,
    )
    return _Rows(slots_host, positions_host, *parts)


@torch.no_grad()
def accept_drafts(
    logits: torch.Tensor,
    req_slots: np.ndarray,
    draft_lens: np.ndarray,
    draft_tokens: torch.Tensor,
    state: SlotSamplingState,
    sampler: Sampler,
    seq_lens: np.ndarray,
    raw_logits: torch.Tensor | None = None,
) -> Accepted:
    """Accepts each request's longest valid draft prefix and adds one token after it.

    logits: [sum(1 + k_i), vocab] (any float dtype), request after request, row j of
    request i being the target's logits after its last committed token and its first j
    drafts. req_slots, draft_lens (k_i >= 0), seq_lens: [B] host arrays; seq_lens[i] is the
    seq_len a plain decode step of request i would have now (its committed length), so
    row j samples at position seq_lens[i] + j. draft_tokens: [sum(k_i)] int64 on the
    device, request after request. The requests are decode requests (every row is an
    output) and distinct; none is under a grammar.

    `raw_logits` (default: `logits`): the rows logprobs are reported from, when `logits`
    were masked (a grammar's rows): logprobs are the model's, as in a plain step.

    Syncs with the device once (to size the flat output). The state is not updated: call
    `record_accepted` with the result.
    """
    req_slots = np.asarray(req_slots, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    layout = DraftLayout.build(draft_lens)
    if len(req_slots) != layout.num_requests or len(seq_lens) != layout.num_requests:
        raise ValueError("req_slots, draft_lens and seq_lens must have one entry per request")
    if logits.shape[0] != layout.num_rows:
        raise ValueError(f"{logits.shape[0]} rows of logits for {layout.num_rows} positions")
    if draft_tokens.shape != (len(layout.draft_req),):
        raise ValueError(f"draft_tokens must be [{len(layout.draft_req)}]")
    state.flush()
    rows = _upload(layout, req_slots, seq_lens, logits.device)
    drafts = draft_tokens.to(device=logits.device, dtype=torch.int64)
    processed = _processed_logits(logits, state, req_slots, layout, rows, drafts)
    candidates = _candidates(processed, state, req_slots, layout, rows, sampler)
    accepted = _accepted_drafts(candidates, drafts, layout, rows)
    emitted = rows.row_pos <= accepted[rows.row_req]
    (index,) = torch.nonzero(emitted, as_tuple=True)
    tokens = candidates[index]
    sample = SampleOutput(next_token_ids=tokens)
    if state.return_logprob[req_slots].any():
        raw = logits if raw_logits is None else raw_logits
        _add_logprobs(sample, raw[index], state, req_slots, rows.slots[index])
    accept_lens = accepted + 1
    return Accepted(
        sample=sample,
        accept_lens=accept_lens,
        accept_lens_host=accept_lens.cpu().numpy(),
        last_token_ids=candidates[rows.row_start + accepted],
        row_candidates=candidates,
    )


def _processed_logits(
    logits: torch.Tensor,
    state: SlotSamplingState,
    req_slots: np.ndarray,
    layout: DraftLayout,
    rows: _Rows,
    drafts: torch.Tensor,
) -> torch.Tensor:
    """Each row's logits as the plain sampler would modify them before choosing, had the
    row's earlier drafts been generated: penalties, bias, stop ids below min_new_tokens."""
    if not plain_greedy(state, req_slots):
        logits = logits.float()
    if state.penalized[req_slots].any():
        logits = _penalize_rows(logits, state, rows, drafts[rows.pair_drafts])
    if state.has_bias[req_slots].any():
        logits = apply_logit_bias(logits, state, rows.slots)
    slots = rows.slots_host
    below_min = state.output_len[slots] + layout.row_pos < state.min_new_tokens[slots]
    if below_min.any():
        (below_min_d,) = to_device([below_min], logits.device, torch.bool, share_on_cpu=False)
        logits = mask_stop_ids(logits, state, rows.slots, below_min_d)
    return logits


def _penalize_rows(
    logits: torch.Tensor, state: SlotSamplingState, rows: _Rows, pair_tokens: torch.Tensor
) -> torch.Tensor:
    """`apply_penalties` per row, with each row's earlier drafts added to its output counts
    (the same operations in the same order, so row 0 matches a plain step bit for bit)."""
    counts_all, prompt_all = state._penalty_buffers()
    counts_int = counts_all[rows.slots]
    ones = torch.ones_like(pair_tokens, dtype=counts_int.dtype)
    counts_int.index_put_((rows.pair_rows, pair_tokens), ones, accumulate=True)
    counts = counts_int.to(logits.dtype)
    seen = prompt_all[rows.slots] | (counts > 0)
    rep = state.repetition_penalty.device[rows.slots].unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = state.frequency_penalty.device[rows.slots].unsqueeze(1)
    pres = state.presence_penalty.device[rows.slots].unsqueeze(1)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def _candidates(
    logits: torch.Tensor,
    state: SlotSamplingState,
    req_slots: np.ndarray,
    layout: DraftLayout,
    rows: _Rows,
    sampler: Sampler,
) -> torch.Tensor:
    """[R] the token a plain step would choose from each processed row."""
    greedy_reqs = state.greedy[req_slots]
    if greedy_reqs.all():
        return argmax_rows(logits)
    if greedy_reqs.any():
        candidates = argmax_rows(logits)
    else:
        candidates = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    sampled = np.flatnonzero(~greedy_reqs[layout.row_req])
    # Request i's seed is the rank of i among the sampled requests.
    seed_index = (np.cumsum(~greedy_reqs) - 1)[layout.row_req[sampled]]
    sampled_d, seed_index_d = to_device([sampled, seed_index], logits.device, share_on_cpu=False)
    slots = rows.slots[sampled_d]
    sampled_slots = req_slots[~greedy_reqs]
    vocab = logits.shape[1]
    probs = slot_filtered_probs(logits[sampled_d], state, slots, sampled_slots)
    drawn = torch.randint(
        0,
        _SEED_BOUND,
        (len(sampled_slots),),
        generator=sampler.generator,
        device=sampler.device,
    ).to(logits.device)
    seeds = state.seed.device[slots]
    seeds = torch.where(seeds >= 0, seeds, drawn[seed_index_d])
    noise = exponential_noise(seeds, rows.positions[sampled_d], vocab)
    candidates[sampled_d] = (probs / noise).argmax(dim=-1)
    return candidates


def _accepted_drafts(
    candidates: torch.Tensor, drafts: torch.Tensor, layout: DraftLayout, rows: _Rows
) -> torch.Tensor:
    """[B] int64: how many leading drafts of each request equal their row's candidate."""
    if layout.max_drafts == 0:
        return torch.zeros(layout.num_requests, dtype=torch.int64, device=candidates.device)
    shape = (layout.num_requests, layout.max_drafts)
    matches = torch.zeros(shape, dtype=torch.int64, device=candidates.device)
    matches[rows.draft_req, rows.draft_pos] = (candidates[rows.draft_row] == drafts).long()
    return matches.cumprod(dim=1).sum(dim=1)


def _add_logprobs(
    sample: SampleOutput,
    raw: torch.Tensor,
    state: SlotSamplingState,
    req_slots: np.ndarray,
    emitted_slots: torch.Tensor,
) -> None:
    """The logprob fields of a plain step, for each emitted token from its raw row."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    tokens = sample.next_token_ids
    sample.token_logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    n = int(state.top_logprobs_num[req_slots].max())
    if n:
        top = logprobs.topk(n, dim=-1)
        sample.top_logprobs, sample.top_logprob_ids = top.values, top.indices
    if (state.logprob_ids.host[req_slots] >= 0).any():
        ids = state.logprob_ids.device[emitted_slots]
        sample.token_ids_logprobs = logprobs.gather(1, ids.clamp(min=0))


@torch.inference_mode()
def record_accepted(state: SlotSamplingState, req_slots: np.ndarray, accepted: Accepted) -> None:
    """Accounts every emitted token as output (min_new_tokens count, penalty counts), as
    `SlotSamplingState.record` does for a plain step. Tokens a finish check later drops
    are counted too: their request has finished."""
    state.flush()
    req_slots = np.asarray(req_slots, dtype=np.int64)
    lens = accepted.accept_lens_host
    state.output_len[req_slots] += lens
    if state.output_counts is not None:
        (slots,) = to_device([np.repeat(req_slots, lens)], state.device, share_on_cpu=False)
        ones = torch.ones_like(slots, dtype=torch.int32)
        state.output_counts.index_put_((slots, accepted.token_ids), ones, accumulate=True)


__all__ = ["Accepted", "DraftLayout", "accept_drafts", "record_accepted"]
