"""Sampling: per-request-slot parameters and penalty counts, and the batched sampler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rsgl.sampling_params import GREEDY_TEMPERATURE, SamplingParams

_MASK64 = (1 << 63) - 1


@dataclass(slots=True)
class SampleOutput:
    """One sampled token per request, plus log-probabilities where any request asked."""

    next_token_ids: torch.Tensor  # [B] int64
    token_logprobs: torch.Tensor | None = None  # [B] float32
    top_logprob_ids: torch.Tensor | None = None  # [B, N] int64 (N = largest request)
    top_logprobs: torch.Tensor | None = None  # [B, N] float32
    # Log-probabilities of each request's `token_ids_logprob` ([B, K], K = longest list).
    token_ids_logprobs: torch.Tensor | None = None


class SlotSamplingState:
    """Sampling parameters and token history, indexed by request slot.

    The engine calls `admit` when a request takes a slot; per step the sampler only indexes
    these tensors by the batch's request slots, so no per-request Python runs in the hot
    path. Output token counts ([max_running, vocab]) exist only once some request uses a
    penalty. A step's token counts as output only when the request has computed all its
    known tokens (`seq_len >= fill_len`): a non-final prefill chunk's sample is ignored.
    """

    def __init__(
        self,
        max_running_requests: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | str,
    ) -> None:
        n = max_running_requests
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)

        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        self.temperature = zeros(torch.float32)
        self.top_p = zeros(torch.float32)
        self.top_k = zeros(torch.int64)
        self.min_p = zeros(torch.float32)
        self.repetition_penalty = zeros(torch.float32)
        self.frequency_penalty = zeros(torch.float32)
        self.presence_penalty = zeros(torch.float32)
        self.min_new_tokens = zeros(torch.int64)
        self.seed = zeros(torch.int64)
        self.has_seed = zeros(torch.bool)
        self.greedy = zeros(torch.bool)
        self.penalized = zeros(torch.bool)
        self.top_logprobs_num = zeros(torch.int64)
        self.return_logprob = zeros(torch.bool)
        self.fill_len = zeros(torch.int64)
        self.output_len = zeros(torch.int64)
        # Stop ids masked until min_new_tokens: [n, K], -1 padded; K grows on demand.
        self.stop_ids = torch.full((n, 1), -1, dtype=torch.int64, device=device)
        # logit_bias as (token id, bias) pairs, and token_ids_logprob: [n, K], -1 padded.
        self.bias_ids = torch.full((n, 1), -1, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((n, 1), dtype=torch.float32, device=device)
        self.has_bias = zeros(torch.bool)
        self.logprob_ids = torch.full((n, 1), -1, dtype=torch.int64, device=device)
        self.output_counts: torch.Tensor | None = None  # [n, vocab] int32, lazily
        self.prompt_mask: torch.Tensor | None = None  # [n, vocab] bool, lazily

    def admit(
        self,
        req_slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None:
        """Reset `req_slot` for a request; `output_ids` are tokens it already produced
        (a retracted request being re-prefilled)."""
        s = req_slot
        self.temperature[s] = params.temperature
        self.top_p[s] = params.top_p
        self.top_k[s] = self.vocab_size if params.top_k < 0 else params.top_k
        self.min_p[s] = params.min_p
        self.repetition_penalty[s] = params.repetition_penalty
        self.frequency_penalty[s] = params.frequency_penalty
        self.presence_penalty[s] = params.presence_penalty
        self.min_new_tokens[s] = params.min_new_tokens
        self.seed[s] = (params.seed or 0) & _MASK64
        self.has_seed[s] = params.seed is not None
        self.greedy[s] = params.temperature < GREEDY_TEMPERATURE or params.top_k == 1
        self.penalized[s] = params.has_penalties
        self.return_logprob[s] = params.return_logprob
        self.top_logprobs_num[s] = params.top_logprobs_num
        self.fill_len[s] = len(prompt_ids) + len(output_ids)
        self.output_len[s] = len(output_ids)

        stops = list(params.stop_token_ids)
        if not params.ignore_eos:
            stops += [t for t in self.eos_token_ids if t not in stops]
        self.stop_ids = _set_row(self.stop_ids, s, stops, -1)
        # Both bias tables are widened before either row is written, so a failure (memory)
        # cannot leave them with different widths.
        bias_ids = _set_row(self.bias_ids, s, list(params.logit_bias), -1)
        bias_values = _set_row(self.bias_values, s, list(params.logit_bias.values()), 0)
        self.bias_ids, self.bias_values = bias_ids, bias_values
        self.has_bias[s] = bool(params.logit_bias)
        self.logprob_ids = _set_row(self.logprob_ids, s, params.token_ids_logprob, -1)

        if params.has_penalties or self.output_counts is not None:
            counts, prompt_mask = self._penalty_buffers()
            counts[s] = 0
            prompt_mask[s] = False
            if output_ids:
                out = torch.tensor(list(output_ids), dtype=torch.int64, device=self.device)
                counts[s].index_put_((out,), torch.ones_like(out, dtype=torch.int32), True)
            if prompt_ids:
                prompt = torch.tensor(list(prompt_ids), dtype=torch.int64, device=self.device)
                prompt_mask[s, prompt] = True

    def _penalty_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output_counts is None or self.prompt_mask is None:
            shape = (self.temperature.shape[0], self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.output_counts, self.prompt_mask

    def record(self, req_slots: torch.Tensor, seq_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """Account the step's sampled tokens of requests whose sample is a real output."""
        counted = seq_lens >= self.fill_len[req_slots]
        slots = req_slots[counted]
        self.output_len[slots] += 1
        if self.output_counts is not None:
            ones = torch.ones(slots.shape[0], dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((slots, tokens[counted]), ones, accumulate=True)


class Sampler:
    """Turns last-position logits into next tokens, per request with its own parameters.

    Order: repetition penalty (HF: divide positive logits, multiply negative ones, over
    prompt and output tokens), frequency and presence penalties (OpenAI: subtract
    `f * count + p * [count > 0]` over output tokens), masking of stop ids until
    `min_new_tokens`, then greedy argmax, or temperature, top-k, top-p, min-p and a draw.
    The draw is an exponential race, argmax(p / E) with E ~ Exp(1), which samples from p;
    E comes from a counter-based hash of (seed, position, token id), so a seeded request gets
    the same tokens whatever else is in its batch. Unseeded requests take a fresh seed from
    the sampler's generator each step.
    """

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def __call__(
        self,
        logits: torch.Tensor,
        state: SlotSamplingState,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> SampleOutput:
        """logits: [B, vocab] for request slots `req_slots` whose next position is `seq_lens`."""
        logits = logits.float()
        raw = logits
        if bool(state.penalized[req_slots].any()):
            logits = apply_penalties(logits, state, req_slots)
        if bool(state.has_bias[req_slots].any()):
            logits = apply_logit_bias(logits, state, req_slots)
        logits = self._mask_stop_ids(logits, state, req_slots)

        greedy = state.greedy[req_slots]
        next_ids = logits.argmax(dim=-1)
        sampled_rows = torch.nonzero(~greedy).squeeze(1)
        if sampled_rows.numel():
            rows_slots = req_slots[sampled_rows]
            probs = filtered_probs(
                logits[sampled_rows],
                state.temperature[rows_slots],
                state.top_k[rows_slots],
                state.top_p[rows_slots],
                state.min_p[rows_slots],
            )
            seeds = torch.where(
                state.has_seed[rows_slots],
                state.seed[rows_slots],
                torch.randint(
                    0,
                    _MASK64,
                    (rows_slots.shape[0],),
                    generator=self.generator,
                    device=self.device,
                ),
            )
            noise = exponential_noise(seeds, seq_lens[sampled_rows], probs.shape[1])
            next_ids[sampled_rows] = (probs / noise).argmax(dim=-1)

        out = SampleOutput(next_token_ids=next_ids)
        if bool(state.return_logprob[req_slots].any()):
            logprobs = torch.log_softmax(raw, dim=-1)
            out.token_logprobs = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            n = int(state.top_logprobs_num[req_slots].max())
            if n:
                top = logprobs.topk(n, dim=-1)
                out.top_logprobs, out.top_logprob_ids = top.values, top.indices
            ids = state.logprob_ids[req_slots]
            if bool((ids >= 0).any()):
                out.token_ids_logprobs = logprobs.gather(1, ids.clamp(min=0))
        return out

    @staticmethod
    def _mask_stop_ids(
        logits: torch.Tensor, state: SlotSamplingState, req_slots: torch.Tensor
    ) -> torch.Tensor:
        need = state.output_len[req_slots] < state.min_new_tokens[req_slots]
        rows = torch.nonzero(need).squeeze(1)
        if rows.numel() == 0:
            return logits
        ids = state.stop_ids[req_slots[rows]]
        valid = ids >= 0
        logits = logits.clone()
        logits[rows.unsqueeze(1).expand_as(ids)[valid], ids[valid]] = float("-inf")
        return logits


def apply_logit_bias(
    logits: torch.Tensor, state: SlotSamplingState, req_slots: torch.Tensor
) -> torch.Tensor:
    """Adds each request's logit_bias to its row."""
    ids = state.bias_ids[req_slots]
    valid = ids >= 0
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
    values = state.bias_values[req_slots]
    return logits.index_put((rows[valid], ids[valid]), values[valid], accumulate=True)


def _set_row(table: torch.Tensor, row: int, values: Sequence[float], pad: float) -> torch.Tensor:
    """Writes `values` into `table[row]` (padded with `pad`), widening the table if needed;
    returns the table (a new one when it grew)."""
    if len(values) > table.shape[1]:
        table = torch.nn.functional.pad(table, (0, len(values) - table.shape[1]), value=pad)
    table[row] = pad
    if values:
        table[row, : len(values)] = torch.tensor(list(values), dtype=table.dtype)
    return table


def apply_penalties(
    logits: torch.Tensor, state: SlotSamplingState, req_slots: torch.Tensor
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (see `Sampler`)."""
    counts_all, prompt_all = state._penalty_buffers()
    counts = counts_all[req_slots].to(logits.dtype)
    seen = prompt_all[req_slots] | (counts > 0)
    rep = state.repetition_penalty[req_slots].unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = state.frequency_penalty[req_slots].unsqueeze(1)
    pres = state.presence_penalty[req_slots].unsqueeze(1)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Softmax at each row's temperature with top-k/top-p/min-p applied (not renormalised:
    the exponential race does not need it)."""
    probs = torch.softmax(logits / temperature.clamp(min=GREEDY_TEMPERATURE).unsqueeze(1), -1)
    vocab = probs.shape[1]
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
        # Top-p keeps the smallest prefix whose mass reaches p (the first token always).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank >= top_k.unsqueeze(1)) | (mass_before > top_p.unsqueeze(1))
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [n, vocab], a pure function of (seed, position, token id).

    A splitmix64-style integer hash; int64 arithmetic wraps, and the top 24 bits become a
    uniform in (0, 1).
    """
    key = seeds * -7046029254386353131 + positions * 0x632BE59BD9B4E019
    x = key.unsqueeze(1) + torch.arange(vocab, device=seeds.device) * -4658895280553007687
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    uniform = (((x >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)
