"""A GGUF file's weight blocks as they are stored, for `--quantization gguf`.

The loader still converts a GGUF file once to a float32 safetensors directory (the dense
weights, the config, the tokenizer); this module reads the same file's projection and
embedding tensors a second time, without dequantizing them, keyed by the HF names the model
loads under. llama.cpp's converter stores q and k rows in rotary pairs, which is the layout
rsgl's attention uses too, so rows need no reordering; `LlamaForCausalLM.use_gguf_blocks`
checks that sampled rows equal the loaded weights anyway.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rsgl.layers.cpu_kernels import QUANT_FORMATS, CpuKernels
from rsgl.layers.quant_linear import GGUFBlocks

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


def read_blocks(
    path: Path, kernels: CpuKernels, int8_activations: bool = False
) -> dict[str, GGUFBlocks]:
    """Every projection and embedding tensor of `path` stored in a format the kernels read
    (`QUANT_FORMATS`), by HF name; tensors in other formats are left out (they stay dense).
    `int8_activations`: their products quantize the activations (`GGUFBlocks`)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out: dict[str, GGUFBlocks] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        fmt = tensor.tensor_type.name
        if name is None or fmt not in QUANT_FORMATS:
            continue
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
        data = np.array(tensor.data, dtype=np.uint8, copy=True).reshape(rows, -1)
        out[name] = GGUFBlocks(kernels, fmt, torch.from_numpy(data), int8_activations)
    return out


__all__ = ["GGUF_MODES", "hf_name", "read_blocks"]
