"""ModelRunner: runs one scheduled step (forward + sampling) against the paged KV cache."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rsgl._core import Plan
from rsgl.layers.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    create_attention_backend,
)
from rsgl.layers.host_copy import to_device
from rsgl.layers.parallel import sharded_argmax
from rsgl.layers.sampler import SampleOutput, Sampler, SlotSamplingState, plain_greedy
from rsgl.layers.vocab_mask import VocabMask, apply_token_bitmask
from rsgl.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    TorchCudaGraph,
    pad_decode_arrays,
    padded_size,
)
from rsgl.model_executor.draft_model import DraftModel
from rsgl.model_executor.forward_batch import ForwardBatch, ForwardMode
from rsgl.model_executor.future_map import FutureMap
from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool, resolve_kv_cache_dtype
from rsgl.models.loader import LoadedModel, load_model
from rsgl.sampling_params import SamplingParams
from rsgl.speculative.accept import accept_drafts, record_accepted

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepOutput:
    """What one step produced: a next token per request (plus logprobs / logits if asked)."""

    sample: SampleOutput
    logits: torch.Tensor | None = None  # [B, vocab], only with return_logits=True
    # A verify step: tokens per request (its accepted drafts + 1), and `sample` has a row
    # per token, request after request. None: one token per request.
    accept_lens: torch.Tensor | None = None

    @property
    def next_token_ids(self) -> torch.Tensor:
        return self.sample.next_token_ids

    def to_host(self) -> StepOutput:
        """This output with its tensors on the host. From a GPU the copies go to pinned
        memory without blocking: read them only once the step's event has fired."""
        if self.next_token_ids.device.type == "cpu":
            return self

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)

        s = self.sample
        sample = SampleOutput(
            next_token_ids=s.next_token_ids.to("cpu", non_blocking=True),
            token_logprobs=host(s.token_logprobs),
            top_logprob_ids=host(s.top_logprob_ids),
            top_logprobs=host(s.top_logprobs),
            token_ids_logprobs=host(s.token_ids_logprobs),
        )
        return StepOutput(sample, host(self.logits), host(self.accept_lens))


@dataclass(slots=True)
class PreparedStep:
    """A plan with its inputs on the device (`ModelRunner.prepare`), ready to execute."""

    plan: Plan
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    batch: ForwardBatch | None  # None for an idle plan
    graph: bool  # replay a CUDA graph (the batch is padded to a captured size)
    num_requests: int  # the batch's rows before padding


def default_attention_backend(
    device: torch.device, model_dtype: torch.dtype, kv_dtype: torch.dtype
) -> str:
    """torch_native on CPU. On CUDA flashinfer (it falls back to triton when missing) where
    it can run: a 16-bit model with a KV cache of the same dtype; triton otherwise."""
    if device.type != "cuda":
        return "torch_native"
    if model_dtype in (torch.float16, torch.bfloat16) and kv_dtype == model_dtype:
        return "flashinfer"
    return "triton"


class ModelRunner:
    """Owns the model, the KV cache, req_to_token, the FutureMap and per-slot sampling state.

    The scheduling core owns every decision (which slots, which tokens); the runner applies
    a plan's req_to_token writes, runs the forward for its tokens, samples one token per
    request from its last position and records it in the FutureMap. `kv_buffer_size` is
    `(num_pages + 1) * page_size`: the first page is padding the core never hands out.

    A step is `prepare(plan)` (inputs to the device: the executor runs it on the schedule
    stream) then `execute(prepared)` (the forward stream); `step(plan)` does both. On CUDA,
    decode steps of up to `cuda_graph_max_bs` requests replay captured graphs unless
    `disable_cuda_graph`.

    A tensor-parallel rank's runner (`loaded.tp`) holds the KV of its heads only, in the same
    slots as every other rank, so one plan serves them all; it captures no CUDA graphs (the
    collectives run eagerly).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kv_buffer_size: int,
        max_running_requests: int,
        context_len: int | None = None,
        attention_backend: str | None = None,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        cuda_graph_max_bs: int = 160,
        disable_cuda_graph: bool = False,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.context_len = context_len or self.config.max_position_embeddings
        self.max_running_requests = max_running_requests
        cfg = self.config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if loaded.tp is not None:
            heads, kv_heads = loaded.tp.shard.num_heads, loaded.tp.shard.num_kv_heads
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.kv_cache = KVCache.for_model(cfg, kv_buffer_size, kv_dtype, self.device, kv_heads)
        self.req_to_token = ReqToTokenPool(max_running_requests, self.context_len, self.device)
        self.attn: AttentionBackend = create_attention_backend(
            attention_backend or default_attention_backend(self.device, self.dtype, kv_dtype),
            self.kv_cache,
            self.req_to_token,
            heads,
            kv_heads,
            cfg.head_dim,
            model_dtype=self.dtype,
        )
        # The backend that runs (flashinfer falls back to triton when it cannot).
        self.attention_backend = next(
            name for name, cls in ATTENTION_BACKENDS.items() if type(self.attn) is cls
        )
        self.future_map = FutureMap(max_running_requests, self.device)
        self.sampling = SlotSamplingState(
            max_running_requests, cfg.vocab_size, cfg.eos_token_ids, self.device
        )
        self.sampler = Sampler(self.device, seed)
        # STANDALONE speculation's draft model (`attach_draft`), over this runner's slots.
        self.draft: DraftModel | None = None
        # Under tensor parallelism with a draft model: rank 0's draft model (unsharded, on
        # rank 0 only) proposes a verify step's drafts, and every rank takes rank 0's input
        # ids for the step (set by `attach_draft` on rank 0, by its RunnerSpec on a follower).
        self.drafts_from_rank0 = False
        self.graphs: CudaGraphRunner | None = None
        if (
            self.device.type == "cuda"
            and not disable_cuda_graph
            and self.attn.supports_cuda_graph
            and loaded.tp is None
        ):
            self.graphs = self._capture_graphs(min(cuda_graph_max_bs, max_running_requests))

    def attach_draft(self, loaded: LoadedModel) -> None:
        """Drafts come from `loaded` from now on (`rsgl.model_executor.draft_model`): it gets
        a KV cache of this runner's size and reads this runner's req_to_token rows. Decode
        steps then run without CUDA graphs (the draft follows each step eagerly)."""
        self.draft = DraftModel(
            loaded,
            target_vocab_size=self.config.vocab_size,
            kv_buffer_size=self.kv_cache.size,
            kv_dtype=self.kv_cache.dtype,
            req_to_token=self.req_to_token,
            attention_backend=self.attention_backend,
        )
        self.graphs = None
        self.drafts_from_rank0 = self.loaded.tp is not None

    def _capture_graphs(self, max_bs: int) -> CudaGraphRunner:
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        graphs = CudaGraphRunner(
            self.model,
            self.attn,
            self.future_map,
            max_bs=max_bs,
            max_context_len=self.context_len,
            device=self.device,
            make_graph=lambda pool: TorchCudaGraph(stream, pool),
        )
        start = time.perf_counter()
        with torch.inference_mode():
            graphs.capture(self.req_to_token.padding_row)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (decode batches up to %d) in %.1f s",
            len(graphs.sizes),
            max_bs,
            time.perf_counter() - start,
        )
        return graphs

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
        attention_backend: str | None = None,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        load_format: str = "auto",
        cuda_graph_max_bs: int = 160,
        disable_cuda_graph: bool = False,
        quantization: str | None = None,
        quantization_group_size: int | None = None,
    ) -> ModelRunner:
        """Load `model` (None: the embedded SmolLM2) and allocate its cache."""
        loaded = load_model(
            model,
            device=device,
            dtype=dtype,
            max_positions=context_len,
            load_format=load_format,
            seed=seed,
            quantization=quantization,
            quantization_group_size=quantization_group_size,
        )
        return cls(
            loaded,
            kv_buffer_size=kv_buffer_size,
            max_running_requests=max_running_requests,
            context_len=context_len,
            attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype,
            seed=seed,
            cuda_graph_max_bs=cuda_graph_max_bs,
            disable_cuda_graph=disable_cuda_graph,
        )

    def close(self) -> None:
        """Frees the runner's memory now (weights, KV cache, graphs, workspaces), so another
        engine can use the device in this process; the runner is unusable afterwards. The
        engine's objects live in reference cycles that start-up froze out of the garbage
        collector, so waiting for them to be collected would wait forever."""
        for name in (
            "graphs",
            "draft",
            "attn",
            "kv_cache",
            "req_to_token",
            "future_map",
            "sampling",
        ):
            self.__dict__.pop(name, None)
        self.__dict__.pop("model", None)
        self.__dict__.pop("loaded", None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

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
        return self.execute(self.prepare(plan), return_logits=return_logits)

    def prepare(self, plan: Plan) -> PreparedStep:
        """Copies the plan's arrays to the device (one pinned, non-blocking copy each for
        the req_to_token writes and the batch); a decode batch that a graph will replay is
        padded to the graph's size first."""
        writes = None
        if len(plan.write_rows):
            rows, cols, slots = to_device(
                [plan.write_rows, plan.write_cols, plan.write_slots], self.device
            )
            writes = (rows, cols, slots)
        if plan.forward_mode == ForwardMode.IDLE.value:
            return PreparedStep(plan, writes, None, False, 0)
        n = len(plan.req_slots)
        mode = ForwardMode(plan.forward_mode)
        size = None
        verify = bool(plan.draft_lens.any())
        if self.graphs is not None and not verify and self.graphs.can_run(n, mode):
            size = padded_size(self.graphs.sizes, n)
        if size is None:
            return PreparedStep(plan, writes, ForwardBatch.from_plan(plan, self.device), False, n)
        arrays = {
            "req_slots": plan.req_slots,
            "prefix_lens": plan.prefix_lens,
            "extend_lens": plan.extend_lens,
            "seq_lens": plan.seq_lens,
            "input_ids": plan.input_ids,
            "positions": plan.positions,
            "out_cache_loc": plan.out_cache_loc,
        }
        padded = pad_decode_arrays(arrays, size, self.req_to_token.padding_row)
        batch = ForwardBatch.from_arrays(forward_mode=mode, device=self.device, **padded)
        return PreparedStep(plan, writes, batch, True, n)

    def execute(
        self,
        prepared: PreparedStep,
        *,
        return_logits: bool = False,
        vocab_mask: VocabMask | None = None,
    ) -> StepOutput:
        """Applies the req_to_token writes, then forward + sampling (under `vocab_mask`'s
        grammar masks, waited for after the forward; masked rows' returned logits are -inf
        where forbidden)."""
        if prepared.writes is not None:
            rows, cols, slots = prepared.writes
            self.req_to_token.apply_writes(rows, cols, slots)
        if prepared.batch is None:
            return _empty_output(self.device)
        if not prepared.graph:
            return self.forward(prepared.batch, return_logits=return_logits, vocab_mask=vocab_mask)
        assert self.graphs is not None
        with torch.inference_mode():
            logits = self.graphs.replay(prepared.batch)[: prepared.num_requests]
            out = self._sample(
                prepared.batch, logits, prepared.num_requests, return_logits, vocab_mask
            )
        if out.logits is not None:
            # The graph's output buffer is overwritten by the next replay of its size.
            out.logits = out.logits.clone()
        return out

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        *,
        return_logits: bool = False,
        vocab_mask: VocabMask | None = None,
    ) -> StepOutput:
        """Forward + sample for a batch whose req_to_token rows are already written."""
        if batch.forward_mode == ForwardMode.IDLE or batch.batch_size == 0:
            return _empty_output(self.device)
        input_ids = self.future_map.resolve(batch.input_ids, batch.token_req_slots())
        verify = batch.logit_rows is not None
        tp = self.loaded.tp
        if self.draft is not None and verify:
            input_ids = self.draft.propose(input_ids, batch)  # fills the placeholder drafts
        elif self.draft is not None:
            self.draft.follow(input_ids, batch)  # the draft's KV of the step's positions
        if tp is not None and verify and self.drafts_from_rank0:
            input_ids = tp.group.broadcast(input_ids.contiguous())  # rank 0's drafts
        self.attn.prepare(batch)
        greedy = tp is not None and plain_greedy(self.sampling, batch.req_slots_host)
        if tp is not None and greedy and not return_logits and not verify:
            # Greedy under tensor parallelism: the ranks exchange their best (value, id)
            # per row instead of all-gathering the logits (SmolLM2 at batch 64 over gloo:
            # a [64, 2] gather instead of 2 x [64, 24576] floats, ~15 ms). Grammar rows
            # mask each rank's slice first: the same tokens every rank (one bitmask).
            local = self.model(input_ids, batch, self.attn, gather_logits=False)
            if vocab_mask is not None:
                local = local.float()
                start = tp.shard.vocab.start
                apply_token_bitmask(local, vocab_mask.rows, vocab_mask.wait(), start)
            ids = sharded_argmax(local, tp.shard.vocab.start, tp.group)
            return self._record(batch, SampleOutput(ids), batch.batch_size, None)
        logits = self.model(input_ids, batch, self.attn)
        if verify:
            return self._verify(batch, input_ids, logits, vocab_mask)
        return self._sample(batch, logits, batch.batch_size, return_logits, vocab_mask)

    def _verify(
        self,
        batch: ForwardBatch,
        input_ids: torch.Tensor,
        logits: torch.Tensor,
        vocab_mask: VocabMask | None,
    ) -> StepOutput:
        """A verify step's tokens: every request's accepted drafts and one more token
        (`rsgl.speculative.accept`). Rows under a grammar carry no drafts (the core
        drafts only for requests that may speculate): their one row is masked as a plain
        step masks it."""
        drafts, draft_index = batch.draft_lens_host, batch.draft_index
        assert drafts is not None and draft_index is not None
        raw = logits  # logprobs are the model's, before any mask
        if vocab_mask is not None:
            firsts = np.cumsum(drafts + 1) - (drafts + 1)  # each request's first row
            logits = logits.float().clone()
            apply_token_bitmask(logits, firsts[vocab_mask.rows], vocab_mask.wait())
        accepted = accept_drafts(
            logits,
            batch.req_slots_host,
            drafts,
            input_ids[draft_index],
            self.sampling,
            self.sampler,
            batch.seq_lens_host - drafts,
            raw_logits=raw,
        )
        record_accepted(self.sampling, batch.req_slots_host, accepted)
        self.future_map.store(batch.req_slots, accepted.last_token_ids)
        return StepOutput(accepted.sample, None, accepted.accept_lens)

    @torch.inference_mode()
    def teacher_forced_logits(self, token_ids: list[int], *, decode: bool = False) -> torch.Tensor:
        """The logits of every position of `token_ids` ([T, vocab] float32: row t predicts
        token t + 1), from one prefill in request slot 0 over KV slots 1..T (which the
        caller must not be using). With `decode`, the first token is a prefill and each
        later one a decode step of its own, which reads the KV cache as serving's decode
        steps do (the C kernels' attention where they serve). For quality measurements,
        not for serving."""
        n = len(token_ids)
        if not 0 < n < min(self.kv_cache.size, self.context_len + 1):
            raise ValueError(f"{n} tokens do not fit the KV cache or the context")
        slots = np.arange(1, n + 1, dtype=np.int64)
        self.req_to_token.apply_writes(np.zeros(n, dtype=np.int64), np.arange(n), slots)
        if decode:
            rows = []
            for t in range(n):
                step = ForwardBatch.from_arrays(
                    forward_mode=ForwardMode.DECODE if t else ForwardMode.EXTEND,
                    req_slots=np.zeros(1, dtype=np.int64),
                    prefix_lens=np.array([t], dtype=np.int64),
                    extend_lens=np.ones(1, dtype=np.int64),
                    input_ids=np.array([token_ids[t]], dtype=np.int64),
                    out_cache_loc=slots[t : t + 1],
                    device=self.device,
                )
                self.attn.prepare(step)
                rows.append(self.model(step.input_ids, step, self.attn).float())
            return torch.cat(rows)
        batch = ForwardBatch.from_arrays(
            forward_mode=ForwardMode.EXTEND,
            req_slots=np.zeros(1, dtype=np.int64),
            prefix_lens=np.zeros(1, dtype=np.int64),
            extend_lens=np.array([n], dtype=np.int64),
            input_ids=np.asarray(token_ids, dtype=np.int64),
            out_cache_loc=slots,
            device=self.device,
        )
        self.attn.prepare(batch)
        logits = self.model(batch.input_ids, batch, self.attn, all_positions=True)
        out: torch.Tensor = logits.float()
        return out

    def _sample(
        self,
        batch: ForwardBatch,
        logits: torch.Tensor,
        n: int,
        return_logits: bool,
        vocab_mask: VocabMask | None = None,
    ) -> StepOutput:
        """Samples the first `n` rows of `batch` (the rest are graph padding)."""
        req_slots, seq_lens = batch.req_slots[:n], batch.seq_lens[:n]
        slots_host = batch.req_slots_host[:n]
        lens_host = batch.seq_lens_host[:n]
        sample = self.sampler(
            logits, self.sampling, req_slots, seq_lens, slots_host, lens_host, vocab_mask
        )
        return self._record(batch, sample, n, logits if return_logits else None)

    def _record(
        self, batch: ForwardBatch, sample: SampleOutput, n: int, logits: torch.Tensor | None
    ) -> StepOutput:
        """The sampled tokens of the first `n` rows go to the FutureMap (placeholders of
        the next step) and the per-slot sampling state."""
        req_slots, seq_lens = batch.req_slots[:n], batch.seq_lens[:n]
        tokens = sample.next_token_ids
        self.future_map.store(req_slots, tokens)
        self.sampling.record(
            req_slots, seq_lens, tokens, batch.req_slots_host[:n], batch.seq_lens_host[:n]
        )
        return StepOutput(sample, logits)


def _empty_output(device: torch.device) -> StepOutput:
    return StepOutput(SampleOutput(torch.zeros(0, dtype=torch.int64, device=device)))


__all__ = ["ModelRunner", "PreparedStep", "StepOutput"]
