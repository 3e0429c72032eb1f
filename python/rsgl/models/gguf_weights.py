"""A GGUF file's weight blocks as they are stored, for `--quantization gguf`.

The loader still converts a GGUF file once to a float32 safetensors directory (the dense
weights, the config, the tokenizer); this module reads the same file's projection and
embedding tensors a second time, without dequantizing them, keyed by the HF names the model
loads under. llama.cpp's converter stores q and k rows in rotary pairs, which is the layout
rsgl's attention uses too, so rows need no reordering; `LlamaForCausalLM.use_gguf_blocks`
checks that sampled rows equal the loaded weights anyway.

K-quant Q4_K super-blocks (256 weights: fp16 d and dmin, eight 6-bit scales and minimums,
nibbles) are rewritten once into the load-time int4 form (`GroupQuantized`, groups of 32):
the nibbles reordered into GGUF's 32-weight order, and each group's scale d * sc and
minimum -dmin * m computed in float32 as gguf's dequantize computes them. Both products
are exact (11 by 6 significant bits), and so is the scale times a nibble, so each weight
is rounded once, at the minimum, by the int4 kernels as by the dequantizer: the same
numbers, read as 6 bits a weight instead of 4.5 (the int4 kernels' float32 scale and
minimum per 32) and 32.

Q6_K super-blocks (256 weights: 6-bit quants split into a low nibble and two high bits, an
int8 scale per 16 weights, fp16 d), the rest of a `Q4_K_M` file, become int8 groups of 16:
each weight's quant minus 32 as an int8, each group's scale d * sc in float32 (exact: 11
by 8 significant bits), so that the int8 kernels' s * q is gguf's product, rounded once.

Q5_K super-blocks (Q4_K's header and scales, a fifth bit per weight, nibbles), the rest of
a `Q5_K_M` file with Q6_K, become int8 groups of 32 with a minimum each: the 5-bit quant
(0..31) as an int8, the scale and minimum as Q4_K's. The scale times a quant is exact (11
by 6 by 5 significant bits), so the one rounding is again the minimum's, as in gguf's
dequantize: the same numbers, read as 10 bits a weight (8, and a float32 scale and minimum
per 32) instead of 5.5.

Q3_K super-blocks (256 weights: 2-bit quants and a high bit each, a 6-bit scale per 16
weights, fp16 d), the bulk of a `Q3_K_M` file, become int8 groups of 16 as Q6_K's do: each
weight's quant (-4..3) as an int8, each group's scale d * (sc - 32) in float32 (exact: 11
by 6 significant bits), so the product is gguf's (8 bits a weight and 2 per scale instead
of 3.4). Q2_K (a minimum per 16 weights, which the int8 kernels take per 32 only) and the
other K-quants stay dense.

Under `--quantization gguf_a8` the K-quants' groups, like the GGUF blocks, multiply
activations quantized to int8 per block of 32 (`csrc/quant_a8.c`): each group's integer dot
product scaled by its float32 scale (Q6_K's two per 32 each take their half), the
minimum's term from the block's sum.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from rsgl.layers.cpu_kernels import QUANT_BLOCK, QUANT_FORMATS, CpuKernels
from rsgl.layers.quant_linear import GGUFBlocks, GroupQuantized, LoadedWeight

# The `--quantization` values (rsgl.args.QUANTIZATIONS) that read a GGUF file's blocks.
GGUF_MODES = ("gguf", "gguf_a8")

# GGUF tensor name (after `blk.N.`) -> HF parameter name (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`), or None for tensors rsgl keeps dense."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    return None


# Q4_K: weights per super-block, bytes per super-block, and the 32-weight groups in one.
QK_K = 256
Q4_K_BYTES = 144
Q4_K_GROUPS = QK_K // QUANT_BLOCK


def _groups(
    kernels: CpuKernels,
    bits: int,
    group: int,
    q: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray | None,
) -> GroupQuantized:
    """The load-time groups of a K-quant's rows: its quant bytes, scales and minimums (each
    [rows, ...] in row order) as contiguous [rows, -1] tensors."""

    def rows(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(q.shape[0], -1)))

    return GroupQuantized(
        kernels, bits, group, rows(q), rows(scales), None if mins is None else rows(mins)
    )


def _k_scales_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float32 scales d * sc and minimums -dmin * m of the eight 32-weight groups of Q4_K
    or Q5_K super-blocks (uint8 [rows, blocks, bytes], the header first: fp16 d and dmin, then
    twelve bytes of 6-bit scales and minimums) as [rows, blocks, 8]."""
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    # Twelve bytes: the low six bits of scales 0-3 (bytes 0-3) and of minimums 0-3 (4-7),
    # then scales 4-7 and minimums 4-7 with their low four bits in bytes 8-11 (scale in the
    # low nibble) and their top two in the free top bits of bytes 0-3 and 4-7.
    low, mid, high = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([low & 63, (high & 15) | ((low >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def q4_k_groups(kernels: CpuKernels, data: np.ndarray) -> GroupQuantized:
    """Q4_K rows (uint8 [rows, K / 256 * 144]) as the int4 groups of 32 they hold (see the
    module doc)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, Q4_K_BYTES)
    scales, mins = _k_scales_mins(blocks)
    # Each 64 weights are 32 bytes: group 2c in their low nibbles, group 2c + 1 in their
    # high ones, weight l in byte l. GGUF's 32-weight order puts weights j and j + 16 of a
    # group in byte j.
    qs = blocks[..., 16:].reshape(rows, -1, Q4_K_GROUPS // 2, 1, 32)
    values = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15
    values = values.reshape(rows, -1, QUANT_BLOCK)
    packed = values[..., :16] | (values[..., 16:] << 4)
    return _groups(kernels, 4, QUANT_BLOCK, packed, scales, mins)


# Q5_K: bytes per super-block (the header and scales as Q4_K's, 32 bytes of fifth bits, 128
# of nibbles).
Q5_K_BYTES = 176


def q5_k_groups(kernels: CpuKernels, data: np.ndarray) -> GroupQuantized:
    """Q5_K rows (uint8 [rows, K / 256 * 176]) as the int8 groups of 32 with minimums they
    hold (see the module doc)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, Q5_K_BYTES)
    scales, mins = _k_scales_mins(blocks)
    # Group g of a super-block takes, for weight l, the low (g even) or high (g odd) nibble
    # of nibble byte 32 * (g // 2) + l and bit g of fifth-bit byte l.
    nibbles = blocks[..., 48:].reshape(rows, -1, Q4_K_GROUPS // 2, 1, 32)
    nibbles = (nibbles >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15
    fifth = blocks[..., 16:48].reshape(rows, -1, 1, 32)
    fifth = (fifth >> np.arange(Q4_K_GROUPS, dtype=np.uint8).reshape(-1, 1)) & 1
    q = nibbles.reshape(rows, -1, Q4_K_GROUPS, 32) | (fifth << 4)
    return _groups(kernels, 8, QUANT_BLOCK, q, scales, mins)


# Q6_K: bytes per super-block (128 of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16
# d) and the weights per scale.
Q6_K_BYTES = 210
Q6_K_GROUP = 16


def q6_k_groups(kernels: CpuKernels, data: np.ndarray) -> GroupQuantized:
    """Q6_K rows (uint8 [rows, K / 256 * 210]) as the int8 groups of 16 they hold (see the
    module doc)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, Q6_K_BYTES)
    # Each half of a super-block (128 weights) has 64 bytes of nibbles and 32 of high bits.
    # Its quarter j (32 weights) takes, for weight l, the low (j = 0, 1) or high (j = 2, 3)
    # nibble of byte l (j even) or l + 32 (j odd), and bits 2j, 2j + 1 of high byte l.
    low = blocks[..., :128].reshape(rows, -1, 2, 1, 2, 32)
    nibbles = (low >> np.array([0, 4], dtype=np.uint8).reshape(2, 1, 1)) & 15
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    tops = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    quants = nibbles.reshape(rows, -1, 2, 4, 32) | (tops << 4)
    q = (quants.astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)
    return _groups(kernels, 8, Q6_K_GROUP, q.view(np.uint8), d * sc, None)


# Q3_K: bytes per super-block (32 of high bits, 64 of 2-bit quants, 12 of 6-bit scales, fp16
# d).
Q3_K_BYTES = 110


def q3_k_groups(kernels: CpuKernels, data: np.ndarray) -> GroupQuantized:
    """Q3_K rows (uint8 [rows, K / 256 * 110]) as the int8 groups of 16 they hold (see the
    module doc)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, Q3_K_BYTES)
    # Weight w of a super-block: its low two bits at bits 2 * (w // 32 % 4) of quant byte
    # 32 * (w // 128) + w % 32, its third at bit w // 32 of high-bit byte w % 32, set for
    # the values 0..3 and clear for -4..-1.
    low = blocks[..., 32:96].reshape(rows, -1, 2, 1, 32)
    low = (low >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    high = blocks[..., None, :32] >> np.arange(8, dtype=np.uint8).reshape(8, 1) & 1
    q = low.reshape(rows, -1, 8, 32).astype(np.int8) - 4 * (1 - high.astype(np.int8))
    # Scale g (g = 0..15, one per 16 weights): its low four bits in the low (g < 8) or high
    # nibble of byte g % 8, its top two at bits 2 * (g // 4) of byte 8 + g % 4; minus 32.
    packed = blocks[..., 96:108]
    nibbles = np.concatenate([packed[..., :8] & 15, packed[..., :8] >> 4], axis=-1)
    tops = packed[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8) & 3
    tops = tops.transpose(0, 1, 3, 2).reshape(rows, -1, 16)
    sc = (nibbles | (tops << 4)).astype(np.float32) - 32
    d = blocks[..., 108:110].copy().view(np.float16).astype(np.float32)
    return _groups(kernels, 8, Q6_K_GROUP, q.view(np.uint8), d * sc, None)


# The K-quants read as load-time groups.
_K_QUANTS = {"Q3_K": q3_k_groups, "Q4_K": q4_k_groups, "Q5_K": q5_k_groups, "Q6_K": q6_k_groups}


def read_blocks(
    path: Path, kernels: CpuKernels, int8_activations: bool = False, bf16_dot: bool = False
) -> dict[str, LoadedWeight]:
    """Every projection and embedding tensor of `path` stored in a format the kernels read
    (`QUANT_FORMATS`, and Q3_K to Q6_K as groups), by HF name; tensors in other formats are
    left out (they stay dense). `int8_activations`: the products quantize the activations
    to int8 per block of 32 (`--quantization gguf_a8`), the K-quants' groups' too.
    `bf16_dot`: GGUF's blocks multiply bfloat16 activations through AVX512-BF16
    (`GGUFBlocks.bf16_dot`)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out: dict[str, LoadedWeight] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        fmt = tensor.tensor_type.name
        if name is None or (fmt not in QUANT_FORMATS and fmt not in _K_QUANTS):
            continue
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
        data = np.array(tensor.data, dtype=np.uint8, copy=True).reshape(rows, -1)
        if fmt in _K_QUANTS:
            groups = _K_QUANTS[fmt](kernels, data)
            out[name] = dataclasses.replace(groups, int8_activations=int8_activations)
        else:
            blocks = torch.from_numpy(data)
            out[name] = GGUFBlocks(kernels, fmt, blocks, int8_activations, bf16_dot)
    return out


__all__ = [
    "GGUF_MODES",
    "hf_name",
    "q3_k_groups",
    "q4_k_groups",
    "q5_k_groups",
    "q6_k_groups",
    "read_blocks",
]
