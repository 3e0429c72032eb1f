"""Tiny random Qwen3 (q/k norm) and Llama-3 (rope scaling, untied LM head) match HF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from plan_builder import Driver

from rsgl.model_executor.model_runner import ModelRunner
from rsgl.models.config import ModelConfig, UnsupportedModelError

COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=1e6)


def _llama3() -> Any:
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(
        **COMMON, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=scaling
    )


def _save_random_model(config: Any, path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # HF inits norms to 1; perturb them so a skipped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, max_shard_size="100KB")  # exercises the sharded index
    return model


@pytest.mark.parametrize("make_config", [_qwen3, _llama3], ids=["qwen3", "llama3"])
def test_tiny_model_greedy_matches_hf(make_config: Any, tmp_path: Path) -> None:
    hf = _save_random_model(make_config(), tmp_path)
    config = ModelConfig.from_model_dir(tmp_path)
    if config.architecture == "Qwen3ForCausalLM":
        assert config.qk_norm and not config.tie_word_embeddings
    else:
        assert config.rope.rope_type == "llama3" and not config.tie_word_embeddings
    runner = ModelRunner.from_pretrained(
        tmp_path, kv_buffer_size=512, max_running_requests=4, context_len=128
    )
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    driver = Driver(runner)
    ours, _ = driver.greedy(driver.admit(0, prompt), 16)
    hf.generation_config.eos_token_id = None  # exactly 16 tokens, nothing masked
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=0
        )
    assert ours == ref[0, len(prompt) :].tolist()


def test_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
