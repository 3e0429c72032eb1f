"""torch_native: the reference backend, and the CPU production path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from rsgl.cpu_features import cpu_bf16_features
from rsgl.layers.attention.base import AttentionBackend
from rsgl.layers.cpu_kernels import ACT_DTYPES, CpuKernels, load_cpu_kernels

if TYPE_CHECKING:
    from rsgl.model_executor.forward_batch import ForwardBatch
    from rsgl.model_executor.kv_cache import KVCache, ReqToTokenPool


# Extends of at most this many tokens each run as rows of the fused decode kernel, one per
# token (a verify step's last token and drafts, a prompt or its uncached tail): one call for
# the whole batch instead of one SDPA per request and layer, and where the rows fit the
# low-bit weights (`low_bit_max_rows`) the whole step in the C decode stack. Each row reads
# its whole context, where SDPA reads it once per request, so long float32 extends stay with
# SDPA. SmolLM2's extend steps on a 2-core AMD EPYC Zen 4 in float32 (in process, ms, medians
# of five alternated steps, rows vs SDPA): 32 tokens over 256 cached 82.8 vs 89.3, 64 over
# 512 132.8 vs 135.3, a 64-token prompt 98.7 vs 108.1, 512 tokens 706 vs 696, 2,048 tokens
# 4,296 vs 3,439; built and run for AVX2 (`RSGL_CPU_FEATURES=avx2`), 64 tokens 113.3 vs
# 120.9, 256 tokens 375 vs 369.
TOKEN_ROWS_MAX_EXTEND = 64
# The same in bfloat16 where AMX does not run torch's SDPA: its SDPA was the slower at every
# size measured, so every extend runs as rows. On the same Zen 4 (AVX512-BF16): 32 tokens over
# 1,024 cached 45.4 vs 59.4 ms, 64 over 512 68.3 vs 82.9, 128 over 512 134.8 vs 171.9, a
# 512-token prompt 371 vs 457, 2,048 tokens over 4,096 cached 6,736 vs 7,679. AMX runs SDPA's
# matmuls on its tiles, and SDPA takes over from a few dozen tokens: on a 2-core Xeon with AMX
# (/proc/cpuinfo family 6 model 167; `python benches/extend_rows.py --dtype bfloat16`, medians
# of 5 and of 7, rows vs SDPA) 8 tokens over 1,024 cached 24.5 vs 37.1, 16 over 1,024 45.7 /
# 46.5 vs 50.7 / 51.4, 24 over 1,024 53.0 vs 54.9, 32 over 1,024 59.8 / 64.9 vs 57.1 / 62.4,
# 64 over 512 66.5 / 67.2 vs 58.0 / 59.0, 128 over 512 100.3 vs 75.0, a 512-token prompt 230
# vs 177.
AMX_BF16_TOKEN_ROWS_MAX_EXTEND = 16


def token_rows_max_extend(dtype: torch.dtype, bf16_units: frozenset[str]) -> int | None:
    """The longest extend that runs as rows of the decode kernel for `dtype` activations on a
    CPU with `bf16_units` (`cpu_bf16_features`); None: every extend."""
    if dtype != torch.bfloat16:
        return TOKEN_ROWS_MAX_EXTEND
    return AMX_BF16_TOKEN_ROWS_MAX_EXTEND if "amx_bf16" in bf16_units else None


@dataclass(slots=True)
class _ExtendReq:
    token_start: int
    extend_len: int
    kv_index: torch.Tensor  # [seq_len] KV slots of the whole sequence
    mask: torch.Tensor | None  # [extend_len, seq_len] bool; None = plain causal (no prefix)


@dataclass(slots=True)
class _TorchNativeMetadata:
    extends: list[_ExtendReq]  # those that run SDPA
    decode_start: int  # token index where the decode kernel's rows begin
    decode_req_slots: torch.Tensor  # [rows] int64
    decode_seq_lens: torch.Tensor  # [rows] int64
    # Eager path only: padded KV-slot table [Bd, S] and its validity mask [Bd, 1, 1, S].
    decode_kv_index: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None


class TorchNativeAttnBackend(AttentionBackend):
    """Attention with PyTorch ops (SDPA), reading K/V through req_to_token.

    Extends (few per step, many tokens each) run one SDPA per request with a causal mask
    offset by the cached prefix. Decodes (many per step, one token each) run batched: for a
    float32 or bfloat16 model on CPU through the fused paged kernel of
    `rsgl.layers.cpu_kernels` (over a float32, float16, bfloat16, fp8 or int8 cache) when
    it can be built, otherwise by gathering every decode request's K/V padded to the longest
    sequence and one masked SDPA. With the kernel, a batch whose extends are all short
    enough (`token_rows_max_extend`: any length in bfloat16 without AMX) runs every token as
    a decode row at sequence length position + 1 (the K and V of a step's tokens are stored
    before any row attends, so a row sees the tokens before it in its extend). Index tables
    and masks are built once per step in `prepare`, not per layer. Extends run SDPA in the
    model's dtype: for bfloat16 its flash kernel accumulates in float32.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        model_dtype: torch.dtype,
        use_decode_kernel: bool | None = None,
    ) -> None:
        super().__init__(
            kv_cache, req_to_token, num_heads, num_kv_heads, head_dim, model_dtype=model_dtype
        )
        kernels: CpuKernels | None = None
        if (
            use_decode_kernel is not False
            and kv_cache.device.type == "cpu"
            and model_dtype in ACT_DTYPES
        ):
            kernels = load_cpu_kernels()
            if kernels is not None and not kernels.supports(model_dtype, kv_cache.dtype):
                kernels = None
        if use_decode_kernel and kernels is None:
            raise ValueError(
                "the CPU decode kernel needs a float32 or bfloat16 model on CPU, a C compiler "
                f"and a KV cache dtype the kernels were built for (not {kv_cache.dtype})"
            )
        self.decode_kernel = kernels
        # The longest extend run as rows of the decode kernel (None: any); 0 runs every
        # extend through SDPA.
        self.token_rows_max_extend = token_rows_max_extend(model_dtype, cpu_bf16_features())

    def prepare(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.req_to_token
        device = table.device
        ne = batch.num_extends
        limit = self.token_rows_max_extend
        if (
            ne
            and self.decode_kernel is not None
            and (limit is None or int(batch.extend_lens_host[:ne].max()) <= limit)
        ):
            self._check_decode_bounds(batch)
            rows = _TorchNativeMetadata([], 0, batch.token_req_slots(), batch.positions + 1)
            batch.attn_metadata = rows
            return
        extends = []
        # Host arrays only: on a GPU, reading a device tensor here would wait for the device.
        starts = (np.cumsum(batch.extend_lens_host) - batch.extend_lens_host).tolist()
        slots_host = batch.req_slots_host[: batch.num_extends].tolist()
        for i in range(batch.num_extends):
            prefix = int(batch.prefix_lens_host[i])
            extend = int(batch.extend_lens_host[i])
            seq = prefix + extend
            mask = None
            if prefix:
                # Query j sits at absolute position prefix + j and sees keys 0..prefix + j.
                q_pos = torch.arange(prefix, seq, device=device).unsqueeze(1)
                mask = torch.arange(seq, device=device).unsqueeze(0) <= q_pos
            seq_index = table[slots_host[i], :seq].long()
            extends.append(_ExtendReq(starts[i], extend, seq_index, mask))

        nd = batch.num_decodes
        if nd and self.decode_kernel is not None:
            self._check_decode_bounds(batch)
        dec_slots = batch.req_slots[batch.batch_size - nd :].contiguous()
        dec_lens = batch.seq_lens[batch.batch_size - nd :].contiguous()
        dec_index: torch.Tensor | None = None
        dec_mask: torch.Tensor | None = None
        if nd and self.decode_kernel is None:
            max_len = int(batch.seq_lens_host[batch.batch_size - nd :].max())
            cols = torch.arange(max_len, device=device)
            valid = cols.unsqueeze(0) < dec_lens.unsqueeze(1)
            # Padding reads slot 0, which the core never hands out, then is masked away.
            dec_index = torch.where(valid, table[dec_slots, :max_len], 0).long()
            dec_mask = valid.view(nd, 1, 1, max_len)
        batch.attn_metadata = _TorchNativeMetadata(
            extends=extends,
            decode_start=batch.num_tokens - nd,
            decode_req_slots=dec_slots,
            decode_seq_lens=dec_lens,
            decode_kv_index=dec_index,
            decode_mask=dec_mask,
        )

    def _check_decode_bounds(self, batch: ForwardBatch) -> None:
        """The C kernel indexes raw memory: refuse slots outside the buffers, once per step."""
        table = self.req_to_token.req_to_token
        loc = batch.out_cache_loc
        if loc.numel() and (int(loc.min()) < 0 or int(loc.max()) >= self.kv_cache.size):
            raise IndexError(f"out_cache_loc outside the KV cache of {self.kv_cache.size} slots")
        slots, lens = batch.req_slots, batch.seq_lens_host
        if int(slots.min()) < 0 or int(slots.max()) >= table.shape[0]:
            raise IndexError(f"request slot outside req_to_token's {table.shape[0]} rows")
        if int(lens.min()) < 1 or int(lens.max()) > table.shape[1]:
            raise IndexError(f"sequence length outside 1..{table.shape[1]}")

    def forward_decode_qkv(
        self, qkv: torch.Tensor, cis: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor | None:
        meta = batch.attn_metadata
        assert isinstance(meta, _TorchNativeMetadata), "prepare(batch) was not called"
        if (
            self.decode_kernel is None
            or meta.decode_start  # rows before it run SDPA
            or qkv.dtype != self.model_dtype
            or not qkv.is_contiguous()
        ):
            return None
        return self.decode_kernel.decode_layer(
            qkv,
            torch.view_as_real(cis),
            batch.out_cache_loc,
            self.kv_cache.k_buffers[layer_id],
            self.kv_cache.v_buffers[layer_id],
            self.req_to_token.req_to_token,
            meta.decode_req_slots,
            meta.decode_seq_lens,
            self.num_heads,
            self.scale,
            *self._scales(layer_id),
        )

    def decode_stack_step(
        self, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a batch whose every token is a row of the fused decode kernel (a decode-only
        batch, or one of short extends: see the class), (out_cache_loc, req_to_token, each
        row's request slot, each row's sequence length), what `rsgl_decode_stack` reads
        for every layer's attention, as `forward_decode_qkv` does. Else None. A verify
        step's logits are then the ones decoding without drafts would give, bit for bit."""
        meta = batch.attn_metadata
        if self.decode_kernel is None or not batch.num_tokens:
            return None
        assert isinstance(meta, _TorchNativeMetadata), "prepare(batch) was not called"
        if meta.decode_start:
            return None
        table = self.req_to_token.req_to_token
        return batch.out_cache_loc, table, meta.decode_req_slots, meta.decode_seq_lens

    def layer_caches(
        self, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer_id`'s K and V buffers and (an int8 cache) their scales."""
        cache = self.kv_cache
        return cache.k_buffers[layer_id], cache.v_buffers[layer_id], *self._scales(layer_id)

    def _scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The kernels' scale arguments: an int8 cache's k and v scales, else none."""
        if not self.kv_cache.scaled:
            return None, None
        return self.kv_cache.k_scales[layer_id], self.kv_cache.v_scales[layer_id]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, _TorchNativeMetadata), "prepare(batch) was not called"
        self.kv_cache.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf = self.kv_cache.k_buffers[layer_id]
        v_buf = self.kv_cache.v_buffers[layer_id]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        gqa = self.num_heads != self.num_kv_heads

        for req in meta.extends:
            end = req.token_start + req.extend_len
            qi = q[req.token_start : end].transpose(0, 1)  # [H, E, D]
            ki, vi = self.kv_cache.get_kv(layer_id, req.kv_index, q.dtype)
            ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)  # [Hkv, S, D]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=req.mask, is_causal=req.mask is None, enable_gqa=gqa
            )
            out[req.token_start : end] = oi.transpose(0, 1)

        if meta.decode_start < batch.num_tokens:
            qd = q[meta.decode_start :]
            if self.decode_kernel is not None:
                self.decode_kernel.decode_attention(
                    qd.contiguous(),
                    k_buf,
                    v_buf,
                    self.req_to_token.req_to_token,
                    meta.decode_req_slots,
                    meta.decode_seq_lens,
                    out[meta.decode_start :],  # a contiguous tail: written in place
                    self.scale,
                    *self._scales(layer_id),
                )
            else:
                assert meta.decode_kv_index is not None
                kd, vd = self.kv_cache.get_kv(layer_id, meta.decode_kv_index, q.dtype)
                kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # [Bd, Hkv, S, D]
                od = F.scaled_dot_product_attention(
                    qd.unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, enable_gqa=gqa
                ).squeeze(2)
                out[meta.decode_start :] = od
        return out.view(q.shape[0], -1)
