"""Rotary position embeddings with Llama-3 and linear scaling.

HF checkpoints rotate the two halves of each head ("rotate half"). rsgl permutes the q/k
projection rows at load time so that the two elements of each rotated pair sit next to each
other; rotation is then one complex multiplication per tensor instead of a dozen slicing
ops. Attention scores are unchanged because q and k get the same permutation, and v is not
permuted, so the output is the same.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from rsgl.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies for each rotated pair, after the configured scaling."""
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # in between interpolated smoothly (the formula of Meta's reference code).
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def interleave_rotary_pairs(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows [x0..x(h-1), y0..y(h-1)] to [x0, y0, x1, y1, ...].

    Applied to q/k projection weights and biases (dim 0 = heads * head_dim) and to q/k norm
    weights (dim 0 = head_dim).
    """
    half = head_dim // 2
    order = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()
    heads = weight.shape[0] // head_dim
    rest = weight.shape[1:]
    return weight.reshape(heads, head_dim, *rest)[:, order].reshape(weight.shape)


class RotaryEmbedding(nn.Module):
    """Rotation tables for packed q/k rows (pair-interleaved layout) by absolute position.

    cos + i*sin is precomputed for every position up to `max_positions`, so a step only
    gathers its tokens' rows, once for all layers (`cis`), and `apply_rotary` rotates. The
    table is stored as real pairs ([..., 2]) so that moving the model to another dtype never
    casts a complex tensor to a real one.
    """

    cis_cache: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cis = torch.view_as_real(torch.polar(torch.ones_like(freqs), freqs))
        self.register_buffer("cis_cache", cis, persistent=False)

    def cis(self, positions: torch.Tensor) -> torch.Tensor:
        """cos + i*sin per token ([T, 1, head_dim / 2] complex64); gather once per step."""
        return torch.view_as_complex(self.cis_cache[positions].float()).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate x ([T, heads, head_dim], pair-interleaved) by `RotaryEmbedding.cis` rows."""
    t, heads, dim = x.shape
    pairs = torch.view_as_complex(x.float().reshape(t, heads, dim // 2, 2))
    return torch.view_as_real(pairs * cis).reshape(t, heads, dim).to(x.dtype)
