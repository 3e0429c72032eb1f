"""K-quant test data: a round-to-nearest Q4_K quantizer (gguf-py dequantizes K-quants but
does not quantize them) and a copy of a GGUF file with some tensors re-quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

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


def requantized_copy(source: Path, target: Path, names: set[str]) -> None:
    """`source` written to `target` with the tensors `names` (GGUF names) quantized to Q4_K
    from their dequantized values; every other tensor and all metadata as they are."""
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
            data, qtype = quantize_q4_k(dense), GGMLQuantizationType.Q4_K
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
