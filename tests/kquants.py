"""K-quant test data: round-to-nearest Q4_K and Q6_K quantizers (gguf-py dequantizes
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


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q4_K rows (uint8 [rows, K / 256 * 144]):
    each group of 32 gets a scale and a minimum of its own, stored as 6-bit multiples of
    its super-block's fp16 d and dmin, and nibbles rounded to the nearest level."""
    rows, k = w.shape
    groups = w.reshape(rows, k // QK_K, 8, 32).astype(np.float32)
    low = np.minimum(groups.min(-1), 0.0)
    scale, minimum = (groups.max(-1) - low) / 15, -low
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minimum.max(-1) / 63).astype(np.float16)
    sc = _levels(scale, d.astype(np.float32)[..., None], 63)
    mn = _levels(minimum, dmin.astype(np.float32)[..., None], 63)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    q = _levels(groups + offset[..., None], step[..., None], 15)
    packed = np.empty((rows, k // QK_K, 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    pairs = q.reshape(rows, k // QK_K, 4, 2, 32)
    nibbles = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
    out = np.concatenate(
        [
            d[..., None].view(np.uint8),
            dmin[..., None].view(np.uint8),
            packed,
            nibbles.reshape(rows, k // QK_K, 128),
        ],
        axis=-1,
    )
    return out.reshape(rows, -1)


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


QUANTIZERS = {
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}


def requantized_copy(source: Path, target: Path, names: dict[str, GGMLQuantizationType]) -> None:
    """`source` written to `target` with each tensor of `names` (GGUF name -> Q4_K or Q6_K)
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
    """The embedded file written under `root` with every ffn_down in a K-quant, Q4_K and
    Q6_K in turn, as llama.cpp's Q4_K_M mixes them (the other projections' rows, 576
    weights, are no multiple of a 256-weight super-block), and converted into a cache of its
    own, `root / "cache"` (the kernels it compiles are the user cache's): serve it with
    RSGL_CACHE_DIR set to that, which processes started for it inherit."""
    path = root / "SmolLM2-135M-Instruct.K-quant-down.gguf"
    types = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)
    names = {f"blk.{i}.ffn_down.weight": types[i % 2] for i in range(30)}
    requantized_copy(embedded_gguf_path(), path, names)
    kernels = rsgl_cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (root / "cache").mkdir()
    (root / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    with mock.patch.dict(os.environ, {"RSGL_CACHE_DIR": str(root / "cache")}):
        resolve_model_dir(path)
    return path
