"""Sampling: per-request-slot parameters and penalty counts, and the batched sampler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rsgl.layers.cpu_kernels import ACT_DTYPES, load_cpu_kernels
from rsgl.layers.host_copy import to_device
from rsgl.layers.vocab_mask import VocabMask, apply_token_bitmask
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


class SlotArray:
    """A per-slot array ([n] or [n, K]) held twice: `host` (numpy) is authoritative and is
    what `admit` writes; `device` is the copy the sampler reads, brought up to date by
    `SlotSamplingState.flush`. A table ([n, K]) widens on demand, padded with `pad`."""

    __slots__ = ("device", "host", "pad")

    def __init__(self, host: np.ndarray, device: torch.device, pad: float = 0) -> None:
        self.host = host
        self.pad = pad
        self.device = torch.from_numpy(host.copy()).to(device)

    def widen(self, width: int) -> None:
        """Grows the host table to `width` columns (the device copy follows at the flush)."""
        if width > self.host.shape[1]:
            extra = width - self.host.shape[1]
            self.host = np.pad(self.host, ((0, 0), (0, extra)), constant_values=self.pad)

    def set_row(self, row: int, values: Sequence[float]) -> None:
        """Writes `values` into the host table's `row`, padded; widens the table if needed."""
        self.widen(len(values))
        self.host[row] = self.pad
        self.host[row, : len(values)] = values

    def match_width(self) -> None:
        """Pads the device table to the host table's width."""
        if self.host.ndim == 2 and self.device.shape[1] < self.host.shape[1]:
            extra = self.host.shape[1] - self.device.shape[1]
            self.device = torch.nn.functional.pad(self.device, (0, extra), value=self.pad)


class SlotSamplingState:
    """Sampling parameters and token history, indexed by request slot.

    The engine calls `admit` when a request takes a slot. Every value lives on the host
    (numpy), where `admit` writes it and where the sampler makes its per-batch decisions
    (does any request want a penalty, a bias, logprobs?) without waiting for the device.
    The values the sampler reads on the device are `SlotArray`s; `flush` copies the rows
    admitted since the last flush in one transfer per dtype, so on CUDA neither `admit` nor
    a step ever blocks on the device. Output token counts and prompt masks
    ([max_running, vocab]) exist only on the device, and only once some request uses a
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

        def mirrored(dtype: type, width: int = 0, pad: float = 0) -> SlotArray:
            shape = (n, width) if width else (n,)
            return SlotArray(np.full(shape, pad, dtype=dtype), self.device, pad)

        self.temperature = mirrored(np.float32)
        self.top_p = mirrored(np.float32)
        self.top_k = mirrored(np.int64)
        self.min_p = mirrored(np.float32)
        self.repetition_penalty = mirrored(np.float32)
        self.frequency_penalty = mirrored(np.float32)
        self.presence_penalty = mirrored(np.float32)
        # The request's seed masked to 63 bits, or -1 for "draw one from the sampler".
        self.seed = mirrored(np.int64)
        self.fill_len = mirrored(np.int64)
        # Stop ids masked until min_new_tokens: [n, K], -1 padded; K grows on demand.
        self.stop_ids = mirrored(np.int64, 1, -1)
        # logit_bias as (token id, bias) pairs, and token_ids_logprob: [n, K], -1 padded;
        # bias_values is 0 wherever bias_ids is -1.
        self.bias_ids = mirrored(np.int64, 1, -1)
        self.bias_values = mirrored(np.float32, 1, 0)
        self.logprob_ids = mirrored(np.int64, 1, -1)
        # Every array `flush` keeps on the device.
        self.slot_arrays = (
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.repetition_penalty,
            self.frequency_penalty,
            self.presence_penalty,
            self.seed,
            self.fill_len,
            self.stop_ids,
            self.bias_ids,
            self.bias_values,
            self.logprob_ids,
        )
        # Host only: what the sampler decides per batch, and the output length that
        # min_new_tokens is checked against.
        self.greedy = np.zeros(n, dtype=bool)
        self.penalized = np.zeros(n, dtype=bool)
        self.has_bias = np.zeros(n, dtype=bool)
        self.return_logprob = np.zeros(n, dtype=bool)
        self.top_logprobs_num = np.zeros(n, dtype=np.int64)
        self.min_new_tokens = np.zeros(n, dtype=np.int64)
        self.output_len = np.zeros(n, dtype=np.int64)
        self.output_counts: torch.Tensor | None = None  # [n, vocab] int32, lazily
        self.prompt_mask: torch.Tensor | None = None  # [n, vocab] bool, lazily
        self._dirty: set[int] = set()
        # Slots whose penalty history the next flush resets: (prompt ids, output ids).
        self._history: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._tracks_history = False

    def admit(
        self,
        req_slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None:
        """Reset `req_slot` for a request; `output_ids` are tokens it already produced
        (a retracted request being re-prefilled). Host arrays only: `flush` uploads."""
        s = req_slot
        self.temperature.host[s] = params.temperature
        self.top_p.host[s] = params.top_p
        self.top_k.host[s] = self.vocab_size if params.top_k < 0 else params.top_k
        self.min_p.host[s] = params.min_p
        self.repetition_penalty.host[s] = params.repetition_penalty
        self.frequency_penalty.host[s] = params.frequency_penalty
        self.presence_penalty.host[s] = params.presence_penalty
        self.seed.host[s] = -1 if params.seed is None else params.seed & _MASK64
        self.fill_len.host[s] = len(prompt_ids) + len(output_ids)

        stops = list(params.stop_token_ids)
        if not params.ignore_eos:
            stops += [t for t in self.eos_token_ids if t not in stops]
        self.stop_ids.set_row(s, stops)
        # Both bias tables are widened before either row is written, so a failure (memory)
        # cannot leave them with different widths.
        self.bias_ids.widen(len(params.logit_bias))
        self.bias_values.widen(len(params.logit_bias))
        self.bias_ids.set_row(s, list(params.logit_bias))
        self.bias_values.set_row(s, list(params.logit_bias.values()))
        self.logprob_ids.set_row(s, params.token_ids_logprob)

        self.greedy[s] = params.is_greedy
        self.penalized[s] = params.has_penalties
        self.has_bias[s] = bool(params.logit_bias)
        self.return_logprob[s] = params.return_logprob
        self.top_logprobs_num[s] = params.top_logprobs_num
        self.min_new_tokens[s] = params.min_new_tokens
        self.output_len[s] = len(output_ids)
        self._dirty.add(s)
        # Once any request used a penalty, every admission resets its slot's history: the
        # counts of all slots keep accumulating from then on.
        self._tracks_history |= params.has_penalties
        if self._tracks_history:
            self._history[s] = (
                np.asarray(prompt_ids, dtype=np.int64),
                np.asarray(output_ids, dtype=np.int64),
            )

    @torch.inference_mode()
    def flush(self) -> None:
        """Copies the slots admitted since the last flush to the device and resets their
        penalty history there.

        The model runner calls it at the start of a step, on the stream the step runs on
        and on the thread that admits (the two must not interleave); the sampler and `record`
        call it too, a no-op when nothing changed. The rows of all arrays go in one
        host-to-device copy per dtype (pinned and non-blocking on CUDA).
        """
        if not self._dirty:
            return
        slots = np.fromiter(sorted(self._dirty), dtype=np.int64, count=len(self._dirty))
        history, self._history = self._history, {}
        self._dirty.clear()
        ints = [a for a in self.slot_arrays if a.host.dtype == np.int64]
        floats = [a for a in self.slot_arrays if a.host.dtype == np.float32]
        hist_slots = np.fromiter(history, dtype=np.int64, count=len(history))
        prompts = [prompt for prompt, _ in history.values()]
        outputs = [output for _, output in history.values()]
        none = np.zeros(0, dtype=np.int64)
        int_parts = to_device(
            [
                slots,
                *(a.host[slots] for a in ints),
                hist_slots,
                np.repeat(hist_slots, [len(p) for p in prompts]),
                np.concatenate([none, *prompts]),
                np.repeat(hist_slots, [len(o) for o in outputs]),
                np.concatenate([none, *outputs]),
            ],
            self.device,
            torch.int64,
            share_on_cpu=False,
        )
        float_parts = to_device(
            [a.host[slots] for a in floats], self.device, torch.float32, share_on_cpu=False
        )
        slots_d = int_parts[0]
        rows_of = int_parts[1 : 1 + len(ints)] + float_parts
        for array, rows in zip(ints + floats, rows_of, strict=True):
            array.match_width()
            array.device.index_copy_(0, slots_d, rows)
        if history:
            hist_d, prompt_rows, prompt_ids, output_rows, output_ids = int_parts[1 + len(ints) :]
            counts, prompt_mask = self._penalty_buffers()
            counts.index_fill_(0, hist_d, 0)
            prompt_mask.index_fill_(0, hist_d, False)
            ones = torch.ones_like(output_ids, dtype=torch.int32)
            counts.index_put_((output_rows, output_ids), ones, accumulate=True)
            marks = torch.ones_like(prompt_ids, dtype=torch.bool)
            prompt_mask.index_put_((prompt_rows, prompt_ids), marks)

    def _penalty_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output_counts is None or self.prompt_mask is None:
            shape = (self.greedy.shape[0], self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.output_counts, self.prompt_mask

    @torch.inference_mode()
    def record(
        self,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        tokens: torch.Tensor,
        req_slots_host: np.ndarray,
        seq_lens_host: np.ndarray,
    ) -> None:
        """Account the step's sampled tokens of requests whose sample is a real output.
        The request slots of a batch are distinct."""
        self.flush()
        self.output_len[req_slots_host] += seq_lens_host >= self.fill_len.host[req_slots_host]
        if self.output_counts is not None:
            # Adding 0 for the samples that are not outputs keeps this free of a
            # boolean-mask selection (which would wait for the device to count the rows).
            counted = (seq_lens >= self.fill_len.device[req_slots]).to(torch.int32)
            self.output_counts.index_put_((req_slots, tokens), counted, accumulate=True)


class Sampler:
    """Turns last-position logits into next tokens, per request with its own parameters.

    Order: repetition penalty (HF: divide positive logits, multiply negative ones, over
    prompt and output tokens), frequency and presence penalties (OpenAI: subtract
    `f * count + p * [count > 0]` over output tokens), masking of stop ids until
    `min_new_tokens`, then greedy argmax, or temperature, top-k, top-p, min-p and a draw.
    The draw is an exponential race, argmax(p / E) with E ~ Exp(1), which samples from p;
    E comes from a counter-based hash of (seed, position, token id), so a seeded request gets
    the same tokens whatever else is in its batch. Unseeded requests take a fresh seed from
    the sampler's generator each step (one draw per sampled request, in batch order).

    Which of these steps a batch needs is decided from the host arrays of the state and
    the batch's `req_slots_host`, never from a device tensor: on CUDA a call queues its
    kernels and returns without waiting for the device.
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
        req_slots_host: np.ndarray,
        seq_lens_host: np.ndarray,
        vocab_mask: VocabMask | None = None,
    ) -> SampleOutput:
        """logits: [B, vocab] for request slots `req_slots` whose next position is `seq_lens`;
        the `*_host` arrays hold the same values on the host. `vocab_mask`: the rows under a
        grammar and their allowed tokens (applied last, after penalties and bias, as
        SGLang does; waited for only here, after the forward)."""
        state.flush()
        raw = logits
        greedy = state.greedy[req_slots_host]
        below_min = state.output_len[req_slots_host] < state.min_new_tokens[req_slots_host]
        # Plain greedy rows take the argmax of the logits as they come (widening bfloat16
        # is exact, so it is the float32 argmax); everything else works in float32.
        if vocab_mask is not None or not plain_greedy(state, req_slots_host):
            logits = logits.float()
        if state.penalized[req_slots_host].any():
            logits = apply_penalties(logits, state, req_slots)
        if state.has_bias[req_slots_host].any():
            logits = apply_logit_bias(logits, state, req_slots)
        if below_min.any():
            (rows_below_min,) = to_device([below_min], self.device, torch.bool, share_on_cpu=False)
            logits = mask_stop_ids(logits, state, req_slots, rows_below_min)
        if vocab_mask is not None:
            if logits is raw and state.return_logprob[req_slots_host].any():
                logits = logits.clone()  # logprobs are the model's, before the mask
            apply_token_bitmask(logits, vocab_mask.rows, vocab_mask.wait())

        if greedy.all():
            next_ids = argmax_rows(logits)
        elif not greedy.any():
            next_ids = self._draw(logits, state, req_slots, seq_lens, req_slots_host)
        else:
            next_ids = argmax_rows(logits)
            rows = np.flatnonzero(~greedy)
            slots_host = req_slots_host[rows]
            rows_d, slots_d, positions = to_device(
                [rows, slots_host, seq_lens_host[rows]], self.device, share_on_cpu=False
            )
            next_ids[rows_d] = self._draw(logits[rows_d], state, slots_d, positions, slots_host)

        out = SampleOutput(next_token_ids=next_ids)
        if state.return_logprob[req_slots_host].any():
            logprobs = torch.log_softmax(raw.float(), dim=-1)
            out.token_logprobs = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            n = int(state.top_logprobs_num[req_slots_host].max())
            if n:
                top = logprobs.topk(n, dim=-1)
                out.top_logprobs, out.top_logprob_ids = top.values, top.indices
            if (state.logprob_ids.host[req_slots_host] >= 0).any():
                ids = state.logprob_ids.device[req_slots]
                out.token_ids_logprobs = logprobs.gather(1, ids.clamp(min=0))
        return out

    def _draw(
        self,
        logits: torch.Tensor,
        state: SlotSamplingState,
        req_slots: torch.Tensor,
        positions: torch.Tensor,
        req_slots_host: np.ndarray,
    ) -> torch.Tensor:
        """A token from each row's filtered distribution (the exponential race)."""
        vocab = logits.shape[1]
        probs = slot_filtered_probs(logits, state, req_slots, req_slots_host)
        seeds = state.seed.device[req_slots]
        drawn = torch.randint(
            0, _MASK64, (seeds.shape[0],), generator=self.generator, device=self.device
        )
        seeds = torch.where(seeds >= 0, seeds, drawn)
        noise = exponential_noise(seeds, positions, vocab)
        return (probs / noise).argmax(dim=-1)


def slot_filtered_probs(
    logits: torch.Tensor,
    state: SlotSamplingState,
    req_slots: torch.Tensor,
    req_slots_host: np.ndarray,
) -> torch.Tensor:
    """`filtered_probs` of each row under its request slot's temperature, top-k, top-p and
    min-p (`req_slots` on the device, per row; `req_slots_host`: the slots of those rows,
    to decide on the host which filters any row needs)."""
    return filtered_probs(
        logits,
        state.temperature.device[req_slots],
        state.top_k.device[req_slots],
        state.top_p.device[req_slots],
        state.min_p.device[req_slots],
        truncate=bool(
            (state.top_k.host[req_slots_host] < logits.shape[1]).any()
            or (state.top_p.host[req_slots_host] < 1).any()
        ),
        use_min_p=bool((state.min_p.host[req_slots_host] > 0).any()),
    )


def plain_greedy(state: SlotSamplingState, req_slots_host: np.ndarray) -> bool:
    """Every request of the batch takes the argmax of its raw logits: greedy, with no
    penalties, logit bias, logprobs or stop ids masked below min_new_tokens."""
    rows = req_slots_host
    return bool(
        state.greedy[rows].all()
        and not state.penalized[rows].any()
        and not state.has_bias[rows].any()
        and not state.return_logprob[rows].any()
        and not (state.output_len[rows] < state.min_new_tokens[rows]).any()
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`; on CPU through the C kernel when it is built (torch's CPU
    argmax over a [64, 49152] batch: 2 ms in float32, 5 ms in bfloat16; the kernel: 0.6)."""
    if logits.device.type == "cpu" and logits.is_contiguous() and logits.shape[-1] > 0:
        kernels = load_cpu_kernels()
        if kernels is not None and logits.dtype in ACT_DTYPES:
            return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def mask_stop_ids(
    logits: torch.Tensor, state: SlotSamplingState, req_slots: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """-inf at the stop ids of the `rows` (a [B] bool mask) that are below min_new_tokens.

    A scatter with min: masked ids get min(logit, -inf), padding and the other rows
    min(logit, +inf), so padded and repeated ids need no selection and no order.
    """
    ids = state.stop_ids.device[req_slots]
    masked = (ids >= 0) & rows.unsqueeze(1)
    floor = torch.full(ids.shape, float("inf"), dtype=logits.dtype, device=logits.device)
    floor.masked_fill_(masked, float("-inf"))
    return logits.scatter_reduce(1, ids.clamp(min=0), floor, reduce="amin")


def apply_logit_bias(
    logits: torch.Tensor, state: SlotSamplingState, req_slots: torch.Tensor
) -> torch.Tensor:
    """Adds each request's logit_bias to its row (padding adds 0 to token 0)."""
    ids = state.bias_ids.device[req_slots]
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
    values = state.bias_values.device[req_slots]
    return logits.index_put((rows, ids.clamp(min=0)), values, accumulate=True)


def apply_penalties(
    logits: torch.Tensor, state: SlotSamplingState, req_slots: torch.Tensor
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (see `Sampler`)."""
    counts_all, prompt_all = state._penalty_buffers()
    counts = counts_all[req_slots].to(logits.dtype)
    seen = prompt_all[req_slots] | (counts > 0)
    rep = state.repetition_penalty.device[req_slots].unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = state.frequency_penalty.device[req_slots].unsqueeze(1)
    pres = state.presence_penalty.device[req_slots].unsqueeze(1)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    truncate: bool,
    use_min_p: bool,
) -> torch.Tensor:
    """Softmax at each row's temperature with top-k/top-p/min-p applied (not renormalised:
    the exponential race does not need it).

    The caller says, from its host copies, whether any row has top_k < vocab or top_p < 1
    (`truncate`) and whether any has min_p > 0 (`use_min_p`); the other rows go through the
    same ops unchanged.
    """
    probs = torch.softmax(logits / temperature.clamp(min=GREEDY_TEMPERATURE).unsqueeze(1), -1)
    vocab = probs.shape[1]
    if truncate:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
        # Top-p keeps the smallest prefix whose mass reaches p (the first token always).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank >= top_k.unsqueeze(1)) | (mass_before > top_p.unsqueeze(1))
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if use_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


# The largest float32 below 1.
_BELOW_ONE = 1.0 - 2.0**-24


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [n, vocab], a pure function of (seed, position, token id): -log of
    `race_uniforms`, computed by the C kernel on CPU where it is built (the same bits)."""
    uniform = None
    if seeds.device.type == "cpu":
        kernels = load_cpu_kernels()
        if kernels is not None:
            uniform = kernels.race_uniforms(seeds.contiguous(), positions.contiguous(), vocab)
    if uniform is None:
        uniform = race_uniforms(seeds, positions, vocab)
    return uniform.log_().neg_()


def race_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1) [n, vocab], a pure function of (seed, position, token id).

    A splitmix64-style integer hash; int64 arithmetic wraps, and the top 24 bits become a
    uniform in (0, 1). The largest, (2**24 - 0.5) / 2**24, rounds to 1.0 in float32: it is
    held just below, or its noise would be 0 and p / 0 would win the race whatever p (a
    uniformly random token about once in 340 steps over a 49k vocabulary; and 0 / 0, NaN,
    for a token a grammar forbids).
    """
    key = seeds * -7046029254386353131 + positions * 0x632BE59BD9B4E019
    x = key.unsqueeze(1) + torch.arange(vocab, device=seeds.device) * -4658895280553007687
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    uniform = (((x >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return uniform.clamp_max_(_BELOW_ONE)
