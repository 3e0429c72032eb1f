"""ModelRunner: runs one scheduled step (forward + sampling) against the paged KV cache."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rsgl._core import Plan
from rsgl.layers.attention import AttentionBackend, create_attention_backend
from rsgl.layers.sampler import SampleOutput, Sampler, SlotSamplingState
from rsgl.model_executor.forward_batch import ForwardBatch, ForwardMode
from rsgl.model_executor.future_map import FutureMap
from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool, resolve_kv_cache_dtype
from rsgl.models.loader import LoadedModel, load_model
from rsgl.sampling_params import SamplingParams


@dataclass(slots=True)
class StepOutput:
    """What one step produced: a next token per request (plus logprobs / logits if asked)."""

    sample: SampleOutput
    logits: torch.Tensor | None = None  # [B, vocab], only with return_logits=True

    @property
    def next_token_ids(self) -> torch.Tensor:
        return self.sample.next_token_ids


class ModelRunner:
    """Owns the model, the KV cache, req_to_token, the FutureMap and per-slot sampling state.

    The scheduling core owns every decision (which slots, which tokens); the runner applies
    a plan's req_to_token writes, runs the forward for its tokens, samples one token per
    request from its last position and records it in the FutureMap. `kv_buffer_size` is
    `(num_pages + 1) * page_size`: the first page is padding the core never hands out.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kv_buffer_size: int,
        max_running_requests: int,
        context_len: int | None = None,
        attention_backend: str = "torch_native",
        kv_cache_dtype: str = "auto",
        seed: int = 0,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.context_len = context_len or self.config.max_position_embeddings
        self.max_running_requests = max_running_requests
        cfg = self.config
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.kv_cache = KVCache.for_model(cfg, kv_buffer_size, kv_dtype, self.device)
        self.req_to_token = ReqToTokenPool(max_running_requests, self.context_len, self.device)
        self.attn: AttentionBackend = create_attention_backend(
            attention_backend,
            self.kv_cache,
            self.req_to_token,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            model_dtype=self.dtype,
        )
        self.future_map = FutureMap(max_running_requests, self.device)
        self.sampling = SlotSamplingState(
            max_running_requests, cfg.vocab_size, cfg.eos_token_ids, self.device
        )
        self.sampler = Sampler(self.device, seed)

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        kv_buffer_size: int,
        max_running_requests: int,
        context_len: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        attention_backend: str = "torch_native",
        kv_cache_dtype: str = "auto",
        seed: int = 0,
    ) -> ModelRunner:
        """Load `model` (None: the embedded SmolLM2) and allocate its cache."""
        loaded = load_model(model, device=device, dtype=dtype, max_positions=context_len)
        return cls(
            loaded,
            kv_buffer_size=kv_buffer_size,
            max_running_requests=max_running_requests,
            context_len=context_len,
            attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype,
            seed=seed,
        )

    def admit(
        self,
        req_slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None:
        """A request takes `req_slot`: reset its sampling state and penalty history."""
        self.sampling.admit(req_slot, params, prompt_ids, output_ids)

    def step(self, plan: Plan, *, return_logits: bool = False) -> StepOutput:
        """Run one scheduling-core plan end to end."""
        self.req_to_token.apply_writes(plan.write_rows, plan.write_cols, plan.write_slots)
        if plan.forward_mode == ForwardMode.IDLE.value:
            return _empty_output(self.device)
        return self.forward(ForwardBatch.from_plan(plan, self.device), return_logits=return_logits)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, return_logits: bool = False) -> StepOutput:
        """Forward + sample for a batch whose req_to_token rows are already written."""
        if batch.forward_mode == ForwardMode.IDLE or batch.batch_size == 0:
            return _empty_output(self.device)
        input_ids = self.future_map.resolve(batch.input_ids, batch.token_req_slots())
        self.attn.prepare(batch)
        logits = self.model(input_ids, batch, self.attn)
        sample = self.sampler(logits, self.sampling, batch.req_slots, batch.seq_lens)
        self.future_map.store(batch.req_slots, sample.next_token_ids)
        self.sampling.record(batch.req_slots, batch.seq_lens, sample.next_token_ids)
        return StepOutput(sample, logits if return_logits else None)


def _empty_output(device: torch.device) -> StepOutput:
    return StepOutput(SampleOutput(torch.zeros(0, dtype=torch.int64, device=device)))


__all__ = ["ModelRunner", "StepOutput"]
