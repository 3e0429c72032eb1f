"""flashinfer: paged attention from FlashInfer's kernels (CUDA, float16/bfloat16).

rsgl's per-layer KV buffers `[kv_buffer_size, Hkv, D]` are FlashInfer's "NHD" layout with a
page size of 1 (it reads a 3-D cache as pages of one slot), so the cache is passed as it is,
with `kv_indices` = the slots of every request from `req_to_token` and every
`kv_last_page_len` = 1 (`rsgl.layers.attention.paged_metadata`).

One wrapper covers a whole step:
- decode-only steps: `BatchDecodeWithPagedKVCacheWrapper`, on tensor cores when four or more
  query heads share a KV head (FlashInfer's and SGLang's rule: the CUDA-core kernel wins for
  small groups, and only knows groups of 1, 2, 3, 4, 6 and 8);
- steps with extends (EXTEND, MIXED): `BatchPrefillWithPagedKVCacheWrapper` with
  `causal=True`. FlashInfer aligns the causal mask bottom-right (query i of a request with
  qo_len new tokens and kv_len keys sees keys j <= i + kv_len - qo_len), which is exactly a
  request's new tokens over its cached prefix, and for the one-token decode rows of a mixed
  step, all of the sequence. The step's keys/values are stored before attention, so one
  paged call reads prefix and new tokens alike.

Each wrapper is planned once per step in `prepare` (host work: FlashInfer derives its work
partition from the CPU offsets, which is why they are passed as pinned host tensors and
never read back from the device) and run by every layer. The kernels are compiled on first
use (JIT, nvcc + ninja); the constructor compiles them with a one-token warm-up, so a
machine that cannot build them raises `FlashInferUnavailable` at start-up and
`create_attention_backend` falls back to triton instead of failing mid-request.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rsgl.layers.attention.base import AttentionBackend
from rsgl.layers.attention.paged_metadata import (
    HostIndptrs,
    build_host_indptrs,
    gather_kv_indices,
)

if TYPE_CHECKING:
    from rsgl.model_executor.forward_batch import ForwardBatch
    from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool

logger = logging.getLogger(__name__)

# The float workspace holds split-KV partial outputs; one buffer serves every wrapper, since
# they run one at a time on one stream. SGLang uses 384 MiB, mini-sglang 128 MiB.
WORKSPACE_BYTES = 256 << 20
# The int workspace holds a plan's work partition; FlashInfer's wrappers allocate 8 MiB each,
# rsgl shares one between all of its wrappers (each is re-planned before it runs).
INT_WORKSPACE_BYTES = 8 << 20
# FlashInfer's kernels exist for these query dtypes (its JIT has no float32 variant).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Decode on tensor cores from this many query heads per KV head on.
TENSOR_CORE_MIN_GROUP = 4


class FlashInferUnavailable(RuntimeError):
    """FlashInfer cannot run here: the package is missing or its kernels failed to build or
    launch. `create_attention_backend` catches it and falls back to triton; configuration
    errors (a float32 model, a CPU device) are ValueErrors and do not fall back."""


@dataclass(slots=True)
class _FlashInferMetadata:
    """What every layer of a step reads: the wrapper planned for it (a flashinfer
    BatchDecodeWithPagedKVCacheWrapper or BatchPrefillWithPagedKVCacheWrapper), or None for
    a step without tokens."""

    wrapper: Any


class FlashInferAttnBackend(AttentionBackend):
    """Attention through FlashInfer's paged wrappers (see the module docstring).

    `warmup=False` skips compiling the kernels in the constructor (they are then compiled at
    the first step, and a failure there is an ordinary error, not a fallback).

    CUDA graphs: FlashInfer's decode plan is host work that a graph cannot replay, so each
    captured batch size gets its own decode wrapper over fixed device buffers
    (`use_cuda_graph=True`): the graph captures only the kernels, and `prepare_for_replay`
    re-plans that wrapper on the host before every replay, which rewrites the fixed
    buffers in place. In graph mode FlashInfer sizes the launch from the batch size alone
    (split-KV on or off, the padded grid), so a plan for any sequence lengths fits the
    kernels captured for the capture batch's.
    """

    supports_cuda_graph = True

    def __init__(
        self,
        kv_cache: KVCache,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        model_dtype: torch.dtype,
        warmup: bool | None = None,
    ) -> None:
        super().__init__(
            kv_cache, req_to_token, num_heads, num_kv_heads, head_dim, model_dtype=model_dtype
        )
        device = kv_cache.device
        if device.type != "cuda":
            raise ValueError(
                f"the flashinfer attention backend runs on CUDA only, not {device}; "
                "use torch_native on the CPU"
            )
        if model_dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"the flashinfer attention backend needs a float16 or bfloat16 model, not "
                f"{model_dtype} (FlashInfer has no float32 kernels); use --dtype bfloat16"
            )
        if kv_cache.dtype != model_dtype:
            raise ValueError(
                f"the flashinfer attention backend needs the KV cache in the model's dtype "
                f"({model_dtype}), not {kv_cache.dtype}"
            )
        try:
            # Imported here, not at module level: flashinfer is an optional extra, and
            # importing it costs about two seconds.
            self._flashinfer: Any = importlib.import_module("flashinfer")
        except Exception as exc:  # not installed, or a native library that fails to load
            raise FlashInferUnavailable(
                f"flashinfer cannot be imported: {type(exc).__name__}: {exc}"
            ) from exc

        self.device = device
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        # FlashInfer asks for a zeroed float workspace before its first use.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.int_workspace = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Each plan fills the wrapper's pinned staging buffer on the host and copies it to
        # the int workspace with a non-blocking copy. The next plan must not overwrite the
        # staging buffer before that copy ran, so it waits for this event, recorded after
        # each plan. That copy is queued behind the previous step's work only, never behind
        # the step just launched, so a loop running one step ahead of the device keeps going.
        self._plan_done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's stubs
        # CUDA graphs (init_cuda_graph_state): fixed metadata buffers and a decode wrapper
        # per captured batch size.
        self._graph_kv_indptr: torch.Tensor | None = None
        self._graph_kv_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self._graph_wrappers: dict[int, Any] = {}
        try:
            self.decode_wrapper: Any = self._new_decode_wrapper()
            self.prefill_wrapper: Any = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend="fa2"
            )
            self.prefill_wrapper.reset_workspace_buffer(self.workspace, self.int_workspace)
        except Exception as exc:  # an installed version whose API differs from 0.7's
            raise FlashInferUnavailable(
                f"flashinfer {self._version} rejected the wrapper set-up: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if warmup is not False:
            self._warm_up()

    @property
    def _version(self) -> str:
        return str(getattr(self._flashinfer, "__version__", "?"))

    def _new_decode_wrapper(self, graph_bs: int | None = None) -> Any:
        """A decode wrapper sharing the workspaces; `graph_bs` rows over the fixed graph
        buffers when given, else planned freely per step. fa2 is forced: FlashInfer's
        "auto" may pick kernels that need downloaded cubins, which an offline machine
        lacks."""
        fi = self._flashinfer
        if graph_bs is None:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend="fa2"
            )
        else:
            assert self._graph_kv_indptr is not None and self._graph_kv_indices is not None
            assert self._graph_last_page_len is not None
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self._graph_kv_indptr[: graph_bs + 1],
                paged_kv_indices_buffer=self._graph_kv_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:graph_bs],
                backend="fa2",
            )
        wrapper.reset_workspace_buffer(self.workspace, self.int_workspace)
        return wrapper

    def _warm_up(self) -> None:
        """Compile (or load from FlashInfer's cache) and launch both kernels once on a
        one-token batch that reads KV slot 0 (padding no request owns), so a machine that
        cannot build or run them is found now, with the time it took logged."""
        start = time.perf_counter()
        try:
            one = np.ones(1, dtype=np.int64)
            host = build_host_indptrs(one, one, pin=True)
            indices = torch.zeros(1, dtype=torch.int32, device=self.device)
            q = torch.zeros(
                (1, self.num_heads, self.head_dim), dtype=self.model_dtype, device=self.device
            )
            kv = (self.kv_cache.k_buffers[0], self.kv_cache.v_buffers[0])
            self._plan_decode(self.decode_wrapper, host, indices)
            self.decode_wrapper.run(q, kv)
            self._plan_extend(host, indices)
            self.prefill_wrapper.run(q, kv)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # nvcc, ninja, a launch: anything means "cannot run here"
            raise FlashInferUnavailable(
                f"flashinfer kernels failed to build or run: {type(exc).__name__}: {exc}"
            ) from exc
        logger.info(
            "flashinfer %s ready (kernels compiled or loaded in %.1f s; head_dim %d, "
            "%d/%d heads, %s, decode on %s)",
            self._version,
            time.perf_counter() - start,
            self.head_dim,
            self.num_heads,
            self.num_kv_heads,
            self.model_dtype,
            "tensor cores" if self.use_tensor_cores else "CUDA cores",
        )

    def _plan_decode(self, wrapper: Any, host: HostIndptrs, kv_indices: torch.Tensor) -> None:
        """Plan `wrapper` for a decode-only batch (one query token per request)."""
        self._plan_done.synchronize()
        wrapper.plan(
            host.kv_indptr,
            kv_indices,
            host.kv_last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,  # page size: one KV slot per page
            q_data_type=self.model_dtype,
            kv_data_type=self.kv_cache.dtype,
            sm_scale=self.scale,
            seq_lens=host.kv_lens,
            non_blocking=True,
        )
        self._plan_done.record()

    def _plan_extend(self, host: HostIndptrs, kv_indices: torch.Tensor) -> None:
        """Plan the prefill wrapper for a batch with extends (decode rows may follow)."""
        self._plan_done.synchronize()
        self.prefill_wrapper.plan(
            host.qo_indptr,
            host.kv_indptr,
            kv_indices,
            host.kv_last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,  # page size: one KV slot per page
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.model_dtype,
            kv_data_type=self.kv_cache.dtype,
            seq_lens=host.kv_lens,
            # Known on the host already; spares FlashInfer a Python loop over the offsets.
            max_token_per_sequence=host.max_extend_len,
            non_blocking=True,
        )
        self._plan_done.record()

    def _host_metadata(self, batch: ForwardBatch) -> tuple[HostIndptrs, torch.Tensor]:
        """The step's offsets (pinned host) and kv_indices (gathered on the device)."""
        host = build_host_indptrs(batch.extend_lens_host, batch.seq_lens_host, pin=True)
        kv_indices = gather_kv_indices(
            self.req_to_token.req_to_token, batch.req_slots, batch.seq_lens, host.num_kv_indices
        )
        return host, kv_indices

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.num_tokens == 0:
            batch.attn_metadata = _FlashInferMetadata(wrapper=None)
            return
        host, kv_indices = self._host_metadata(batch)
        if batch.num_extends == 0:
            self._plan_decode(self.decode_wrapper, host, kv_indices)
            batch.attn_metadata = _FlashInferMetadata(wrapper=self.decode_wrapper)
        else:
            self._plan_extend(host, kv_indices)
            batch.attn_metadata = _FlashInferMetadata(wrapper=self.prefill_wrapper)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, _FlashInferMetadata), "prepare(batch) was not called"
        num_tokens = q.shape[0]
        out = torch.empty(
            (num_tokens, self.num_heads * self.head_dim), dtype=q.dtype, device=q.device
        )
        if num_tokens == 0:
            return out
        self.kv_cache.set_kv(layer_id, batch.out_cache_loc, k, v)
        kv = (self.kv_cache.k_buffers[layer_id], self.kv_cache.v_buffers[layer_id])
        # Written in place: the prefill wrapper would otherwise zero-fill a fresh output.
        meta.wrapper.run(
            q.contiguous(), kv, out=out.view(num_tokens, self.num_heads, self.head_dim)
        )
        return out

    # CUDA graphs (rsgl.model_executor.cuda_graph_runner), decode batches only.

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Fixed buffers the graph wrappers read: offsets for up to `max_bs` requests and
        room for every one of them to hold `max_context_len` slots (kv_indices is as long
        as the sum of the sequence lengths, shared prefixes counted once per request)."""
        dev = self.device
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._graph_kv_indices = torch.zeros(
            max_bs * max_context_len, dtype=torch.int32, device=dev
        )
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._graph_wrappers = {}

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        """Points the batch at the graph wrapper of its size. Nothing runs on the device
        here: FlashInfer's metadata is refreshed by `prepare_for_replay`, on the host, before
        every replay. The first call for a size (the runner's warm-up forward, outside
        capture) creates and plans that wrapper for the capture batch."""
        bs = batch.batch_size
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            if self._graph_kv_indptr is None:
                raise RuntimeError("init_cuda_graph_state was not called")
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"the flashinfer graph wrapper for batch size {bs} must be planned "
                    "before capture: run the forward once outside the graph first"
                )
            wrapper = self._new_decode_wrapper(graph_bs=bs)
            self._graph_wrappers[bs] = wrapper
            self._plan_graph(wrapper, batch)
        batch.attn_metadata = _FlashInferMetadata(wrapper=wrapper)

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        """Re-plans the graph wrapper of `batch`'s (padded) size for its sequence lengths:
        the plan writes this batch's offsets, slots and work partition into the fixed
        buffers the captured kernels read."""
        self._plan_graph(self._graph_wrappers[batch.batch_size], batch)

    def _plan_graph(self, wrapper: Any, batch: ForwardBatch) -> None:
        # kv_indices is gathered into a temporary and copied into the fixed buffer by plan():
        # handing plan() a view of its own buffer would make it copy the buffer onto itself.
        host, kv_indices = self._host_metadata(batch)
        self._plan_decode(wrapper, host, kv_indices)


__all__ = ["FlashInferAttnBackend", "FlashInferUnavailable"]
