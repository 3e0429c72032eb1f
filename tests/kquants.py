"""K-quant test data: round-to-nearest Q3_K, Q4_K, Q5_K and Q6_K quantizers (gguf-py dequantizes
K-quants but does not quantize them) and a copy of a GGUF file with some tensors
re-quantized."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from rsgl.cache_dir import rsgl_cache_dir
from rsgl.models.loader import embedded_gguf_path, resolve_model_dir

QK_K = 256


def _levels(values: np.ndarray, step: np.ndarray, top: int) -> np.ndarray:
    """round(values / step) clamped to 0..top, 0 where the step is 0."""
    safe = np.where(step > 0, step, 1.0)
    return np.where(step > 0, np.rint(values / safe), 0).clip(0, top).astype(np.uint8)


def _scaled_groups(w: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's shared part of float32 [rows, K] (K a multiple of 256): each group
    of 32 gets a scale and a minimum of its own, stored as 6-bit multiples of its
    super-block's fp16 d and dmin, and quants 0..`top` rounded to the nearest level.
    Returns (the 16 header bytes of each super-block: d, dmin and the packed scales and
    minimums, [rows, K / 256, 16]; the quants, [rows, K / 256, 8, 32])."""
    rows, k = w.shape
    groups = w.reshape(rows, k // QK_K, 8, 32).astype(np.float32)
    low = np.minimum(groups.min(-1), 0.0)
    scale, minimum = (groups.max(-1) - low) / top, -low
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)
    sc = _levels(scale, d.astype(np.float32)[..., None], 63)
    mn = _levels(minimum, dmin.astype(np.float32)[..., None], 63)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    q = _levels(groups + offset[..., None], step[..., None], top)
    packed = np.empty((rows, k // QK_K, 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    header = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed]
    return np.concatenate(header, axis=-1), q


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Quants [rows, blocks, 8, 32] (their low four bits) as a super-block's 128 bytes: each
    pair of groups in 32 bytes, the first's in the low nibbles, weight l in byte l."""
    pairs = (q & 15).reshape(*q.shape[:2], 4, 2, 32)
    return (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:2], 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q4_K rows (uint8 [rows, K / 256 * 144]):
    scales and minimums per 32 (`_scaled_groups`), nibbles."""
    header, q = _scaled_groups(w, 15)
    return np.concatenate([header, _nibble_pairs(q)], axis=-1).reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q5_K rows (uint8 [rows, K / 256 * 176]):
    scales and minimums per 32 as Q4_K's, 5-bit quants as a fifth bit per weight (group g's
    at bit g of byte l, weight l) and Q4_K's nibbles."""
    header, q = _scaled_groups(w, 31)
    fifth = ((q >> 4) << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(-2, dtype=np.uint8)
    return np.concatenate([header, fifth, _nibble_pairs(q)], axis=-1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q6_K rows (uint8 [rows, K / 256 * 210]):
    each group of 16 gets a symmetric scale (max |w| / 32), stored as an int8 multiple of
    its super-block's fp16 d, and 6-bit quants (value + 32) rounded to the nearest level."""
    rows, k = w.shape
    groups = w.reshape(rows, k // QK_K, 16, 16).astype(np.float32)
    scale = np.abs(groups).max(-1) / 32
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = _levels(scale, d.astype(np.float32)[..., None], 127)
    step = d.astype(np.float32)[..., None] * sc
    q = _levels(groups + 32 * step[..., None], step[..., None], 63)  # value + 32
    # Per half (128 weights) and quarter j (32): the low nibbles of quarters 0 and 1 in the
    # low halves of bytes 0-31 and 32-63, those of quarters 2 and 3 in their high halves,
    # and quarter j's top two bits at bits 2j of bytes 64-95.
    quarters = q.reshape(rows, k // QK_K, 2, 4, 32)
    low = (quarters[:, :, :, :2] & 15) | ((quarters[:, :, :, 2:] & 15) << 4)
    high = np.zeros((rows, k // QK_K, 2, 32), dtype=np.uint8)
    for j in range(4):
        high |= (quarters[:, :, :, j] >> 4) << (2 * j)
    out = np.concatenate(
        [
            low.reshape(rows, k // QK_K, 128),
            high.reshape(rows, k // QK_K, 64),
            sc.astype(np.int8).view(np.uint8),
            d[..., None].view(np.uint8),
        ],
        axis=-1,
    )
    return out.reshape(rows, -1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q3_K rows (uint8 [rows, K / 256 * 110]):
    each group of 16 gets a signed scale that puts its largest magnitude on level -4 (the
    levels run -4..3), stored as a 6-bit multiple of its super-block's fp16 d (-32..31, as
    value + 32), and quants rounded to the nearest level, stored as value + 4: its low two
    bits in the 2-bit quants, its third in the high bits."""
    rows, k = w.shape
    blocks = k // QK_K
    groups = w.reshape(rows, blocks, 16, 16).astype(np.float32)
    at = np.abs(groups).argmax(-1)[..., None]
    scale = -np.take_along_axis(groups, at, -1)[..., 0] / 4
    d = (np.abs(scale).max(-1) / 32).astype(np.float16)
    dd = d.astype(np.float32)[..., None]
    sc = np.where(dd > 0, np.rint(scale / np.where(dd > 0, dd, 1)), 0).clip(-32, 31)
    step = (dd * sc)[..., None]
    levels = np.where(step != 0, np.rint(groups / np.where(step != 0, step, 1)), 0)
    v = (levels.clip(-4, 3) + 4).astype(np.uint8).reshape(rows, blocks, 8, 32)
    # Weight 32b + l (b = 0..7): bits 2 * (b % 4) of quant byte 32 * (b // 4) + l, and bit
    # b of high-bit byte l.
    low = (v & 3).reshape(rows, blocks, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    quants_ = low.sum(-2, dtype=np.uint8).reshape(rows, blocks, 64)
    high = ((v >> 2) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)
    # Scale g (stored + 32): its low four bits in the low (g < 8) or high nibble of byte
    # g % 8, its top two at bits 2 * (g // 4) of byte 8 + g % 4.
    stored = (sc + 32).astype(np.uint8)
    packed = np.empty((rows, blocks, 12), dtype=np.uint8)
    packed[..., :8] = (stored[..., :8] & 15) | ((stored[..., 8:] & 15) << 4)
    tops = (stored >> 4).reshape(rows, blocks, 4, 4) << np.array([0, 2, 4, 6], np.uint8)[:, None]
    packed[..., 8:] = tops.sum(-2, dtype=np.uint8)
    out = np.concatenate([high, quants_, packed, d[..., None].view(np.uint8)], axis=-1)
    return out.reshape(rows, -1)


QUANTIZERS = {
    GGMLQuantizationType.Q3_K: quantize_q3_k,
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}


def requantized_copy(source: Path, target: Path, names: dict[str, GGMLQuantizationType]) -> None:
    """`source` written to `target` with each tensor of `names` (GGUF name -> a K-quant)
    quantized to its type from its dequantized values; every other tensor and all metadata
    as they are."""
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        qtype = tensor.tensor_type
        if tensor.name in names:
            dense = quants.dequantize(data, qtype).reshape(-1, int(tensor.shape[0]))
            qtype = names[tensor.name]
            data = QUANTIZERS[qtype](dense)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def k_quant_copy(root: Path) -> Path:
    """The embedded file written under `root` with every ffn_down in a K-quant, Q3_K, Q4_K,
    Q5_K and Q6_K in turn (layer i in the i % 4th), as llama.cpp's K-quant files mix them
    (the other projections' rows, 576 weights, are no multiple of a 256-weight
    super-block), and converted into a cache of its
    own, `root / "cache"` (the kernels it compiles are the user cache's): serve it with
    RSGL_CACHE_DIR set to that, which processes started for it inherit."""
    path = root / "SmolLM2-135M-Instruct.K-quant-down.gguf"
    types = list(QUANTIZERS)
    names = {f"blk.{i}.ffn_down.weight": types[i % len(types)] for i in range(30)}
    requantized_copy(embedded_gguf_path(), path, names)
    kernels = rsgl_cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (root / "cache").mkdir()
    (root / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    with mock.patch.dict(os.environ, {"RSGL_CACHE_DIR": str(root / "cache")}):
        resolve_model_dir(path)
    return path
