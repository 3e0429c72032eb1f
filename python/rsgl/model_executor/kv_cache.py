"""Paged KV storage: per-layer K/V buffers indexed by KV slot, and the req_to_token table."""

from __future__ import annotations

import numpy as np
import torch

from rsgl.args import KV_CACHE_DTYPES, check_kv_cache_dtype
from rsgl.layers.host_copy import to_device
from rsgl.models.config import ModelConfig


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype K/V are stored in for `kv_cache_dtype=name`."""
    check_kv_cache_dtype(name)
    stored = KV_CACHE_DTYPES[name]
    return model_dtype if stored is None else getattr(torch, stored)


# fp8 caches store each value saturated at the format's largest finite value (torch's own
# conversion overflows float8_e5m2 to infinity).
FP8_MAX = {torch.float8_e5m2: 57344.0, torch.float8_e4m3fn: 448.0}
# An int8 cache stores round(x * 127 / amax) per token and kv head, and the scale
# amax * float32(1 / 127) beside it (the C kernels' store, csrc/kv8.h, does the same
# float32 operations, so both paths write the same bytes).
SCALED_KV_DTYPES = (torch.int8,)
_INT8_STEP = torch.tensor(1 / 127, dtype=torch.float32)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as (int8 values [..., D], float32 scales [...]): x ~ values * scale."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # A true float32 division (`127.0 / amax` is a reciprocal times 127 in torch).
    inv = torch.where(amax > 0, amax.new_full(amax.shape, 127.0) / amax, 0.0)
    q = torch.round(x * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, amax * _INT8_STEP


class KVCache:
    """Per-layer K and V buffers of shape [kv_buffer_size, num_kv_heads, head_dim].

    Row `s` holds the key/value of whichever token the Rust core assigned KV slot `s`. The
    first page of slots is never handed out by the core, so slot 0 is a safe padding target
    for gathers over padded index tables. `dtype` may be narrower than the model's (a
    float16/bfloat16 cache for a float32 model, fp8, int8): keys and values are rounded when
    stored, and every attention path reads the rounded values, prefills included. An int8
    cache also keeps `k_scales` / `v_scales`, float32 [kv_buffer_size, num_kv_heads] per
    layer: a token's key for head h is k_buffers[l][s, h] * k_scales[l][s, h].
    """

    def __init__(
        self,
        kv_buffer_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.size = kv_buffer_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (kv_buffer_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.scaled = dtype in SCALED_KV_DTYPES
        scales = (kv_buffer_size, num_kv_heads) if self.scaled else (0,)
        self.k_scales = [torch.zeros(scales, device=device) for _ in range(num_layers)]
        self.v_scales = [torch.zeros(scales, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        kv_buffer_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_kv_heads: int | None = None,
    ) -> KVCache:
        """A cache shaped for `config` holding `kv_buffer_size` slots (of `num_kv_heads`
        heads: a tensor-parallel rank's; default all of the model's)."""
        return cls(
            kv_buffer_size,
            config.num_hidden_layers,
            num_kv_heads or config.num_key_value_heads,
            config.head_dim,
            dtype,
            device,
        )

    @staticmethod
    def bytes_per_slot(
        config: ModelConfig, dtype: torch.dtype, num_kv_heads: int | None = None
    ) -> int:
        """Memory one KV slot costs across all layers (to size the pool from a budget), for
        `num_kv_heads` heads (default all of the model's)."""
        elem = torch.empty((), dtype=dtype).element_size()
        scale = 4 if dtype in SCALED_KV_DTYPES else 0
        heads = num_kv_heads or config.num_key_value_heads
        return 2 * config.num_hidden_layers * heads * (config.head_dim * elem + scale)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys/values ([T, Hkv, D]) at KV slots `loc` ([T])."""
        if self.scaled:
            for x, values, scales in (
                (k, self.k_buffers, self.k_scales),
                (v, self.v_buffers, self.v_scales),
            ):
                q, scale = quantize_int8(x)
                values[layer_id][loc] = q
                scales[layer_id][loc] = scale
            return
        limit = FP8_MAX.get(self.dtype)
        if limit is not None:
            k, v = k.clamp(-limit, limit), v.clamp(-limit, limit)
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    def get_kv(
        self, layer_id: int, index: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at KV slots `index` (any shape I) as `dtype` [*I, Hkv, D]."""
        k = self.k_buffers[layer_id][index]
        v = self.v_buffers[layer_id][index]
        if self.scaled:
            k = k.float() * self.k_scales[layer_id][index].unsqueeze(-1)
            v = v.float() * self.v_scales[layer_id][index].unsqueeze(-1)
        return k.to(dtype), v.to(dtype)


class ReqToTokenPool:
    """The req_to_token table: request slot x position -> KV slot, as an int32 tensor.

    The Rust core decides every entry; this class only applies the writes a plan lists. One
    row more than the core's request slots is kept all zeros (`padding_row`): rows a CUDA
    graph pads a batch with read KV slot 0, the padding slot no request owns.
    """

    def __init__(
        self, max_running_requests: int, context_len: int, device: torch.device | str
    ) -> None:
        self.max_running_requests = max_running_requests
        self.context_len = context_len
        self.padding_row = max_running_requests
        self.req_to_token = torch.zeros(
            (max_running_requests + 1, context_len), dtype=torch.int32, device=device
        )

    def apply_writes(
        self,
        rows: np.ndarray | torch.Tensor,
        cols: np.ndarray | torch.Tensor,
        slots: np.ndarray | torch.Tensor,
    ) -> None:
        """`req_to_token[rows, cols] = slots` in one indexed assignment (one host-to-device
        copy of the three arrays on an accelerator)."""
        if len(rows) == 0:
            return
        dev = self.req_to_token.device
        if isinstance(rows, torch.Tensor):
            r, c, s = (torch.as_tensor(a, device=dev) for a in (rows, cols, slots))
        else:
            r, c, s = to_device([rows, cols, slots], dev)  # type: ignore[list-item]
        self.req_to_token[r, c] = s.to(torch.int32)
