"""Model classes by HF `architectures` name."""

from __future__ import annotations

from torch import nn

from rsgl.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from rsgl.models.llama import LlamaForCausalLM

# Every supported architecture is the same decoder; ModelConfig carries the differences
# (qkv bias, q/k norm, tied embeddings, rope scaling).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = dict.fromkeys(
    SUPPORTED_ARCHITECTURES, LlamaForCausalLM
)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class implementing `config.architecture`."""
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported architecture {config.architecture!r}; "
            f"rsgl supports {', '.join(sorted(MODEL_CLASSES))}"
        ) from None
