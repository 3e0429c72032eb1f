"""`rsgl bench quality`: what low-bit weights and KV caches cost in accuracy, teacher-forced
on a fixed text.

The reference is the model as loaded, in float32 (`--quantization none`, a float32 KV
cache); each mode named by `--modes` loads the same model quantized that way: a
quantization (`gguf`, `gguf_a8`, `int8`, `int4`), a KV cache dtype (`kv:int8`, `kv:fp8_e4m3`,
`kv:fp8_e5m2`, ...), a model dtype (`dtype:bfloat16`, with a KV cache of that dtype unless
one is named), or several joined by `+` (`gguf+kv:int8`, `gguf+dtype:bfloat16`: what
`rsgl serve` runs on a CPU with AVX512-BF16 or AMX). Both read the same shipped text
(`quality_text.txt`, ~1,000 tokens of plain English prose written for this benchmark), and
at every position the two next-token distributions are compared (the metrics of
llama.cpp's perplexity tool, PR #7412):

- `kld_mean` / `kld_p99`: KL divergence of the mode's distribution from the reference's;
- `top1_agreement`: the share of positions where both rank the same token first;
- `ppl` and `delta_ppl`: the mode's perplexity on the text and its difference from the
  reference's.

    rsgl bench quality --modes gguf,int8,int4,kv:int8 [--model DIR_OR_GGUF] [--max-tokens 1024]

`--decode` teacher-forces through decode steps instead (the first token a prefill, every
later one a step of its own), on both sides: a KV cache is then read by the attention that
generation uses (the C decode kernels on a CPU, which score an int8 cache against the
query rounded to 16-bit integers), where the prefill reads it through SDPA.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rsgl.bench.one_batch import DTYPES
from rsgl.layers.quant_linear import QuantLinear
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.models.loader import load_tokenizer

TEXT = Path(__file__).with_name("quality_text.txt")


@dataclass(frozen=True, slots=True)
class Quality:
    """One mode's distance from the reference over `tokens` predicted positions."""

    mode: str
    tokens: int
    kld_mean: float
    kld_p99: float
    top1_agreement: float
    ppl: float
    ref_ppl: float
    delta_ppl: float


def text_tokens(runner: ModelRunner, max_tokens: int) -> list[int]:
    """The shipped text in `runner`'s model's tokens (at most `max_tokens`)."""
    tokenizer = load_tokenizer(runner.loaded.model_dir)
    ids: list[int] = tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"]
    return ids[:max_tokens]


def parse_mode(mode: str) -> tuple[str, str, torch.dtype]:
    """(quantization, kv_cache_dtype, model dtype) of a mode: `int4`, `kv:int8`,
    `gguf+kv:fp8_e4m3`, `gguf+dtype:bfloat16` (KV cache: the model's dtype unless named)."""
    quantization, kv, dtype = "none", "auto", torch.float32
    for part in mode.split("+"):
        if part.startswith("kv:"):
            kv = part.removeprefix("kv:")
        elif part.startswith("dtype:"):
            name = part.removeprefix("dtype:")
            named = DTYPES.get(name)
            if named is None:  # "auto" names no dtype
                dtypes = sorted(k for k, v in DTYPES.items() if v is not None)
                raise ValueError(f"{mode}: dtype {name!r} is not one of {dtypes}")
            dtype = named
        else:
            quantization = part
    return quantization, kv, dtype


def load(
    model: str | None,
    quantization: str,
    group: int | None,
    tokens: int,
    kv_cache_dtype: str = "auto",
    dtype: torch.dtype = torch.float32,
) -> ModelRunner:
    runner = ModelRunner.from_pretrained(
        model,
        kv_buffer_size=tokens + 2,
        max_running_requests=1,
        context_len=tokens + 1,
        dtype=dtype,
        quantization=quantization,
        quantization_group_size=group,
        kv_cache_dtype=kv_cache_dtype,
    )
    if quantization == "gguf_a8":
        # Where prefill chunks multiply the dense copy (its float32 weights as they are: the
        # K-quants' groups, a CPU without AVX2 or with AVX-512), they do not quantize their
        # activations as decode steps do, and that is what is measured here: every row of
        # the teacher-forced prefill goes through the int8 kernels.
        for module in runner.model.modules():
            if isinstance(module, QuantLinear):
                module.max_rows = sys.maxsize
    return runner


def compare(mode: str, ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> Quality:
    """Quality of logits `got` against `ref` ([T, vocab], row t predicting targets[t])."""
    ref_logp = torch.log_softmax(ref.double(), dim=-1)
    got_logp = torch.log_softmax(got.double(), dim=-1)
    kld = (ref_logp.exp() * (ref_logp - got_logp)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean()
    ref_nll = -ref_logp.gather(1, targets[:, None]).mean()
    got_nll = -got_logp.gather(1, targets[:, None]).mean()
    ppl, ref_ppl = math.exp(float(got_nll)), math.exp(float(ref_nll))
    return Quality(
        mode=mode,
        tokens=int(targets.numel()),
        kld_mean=float(kld.mean()),
        kld_p99=float(torch.quantile(kld, 0.99)),
        top1_agreement=float(agree),
        ppl=ppl,
        ref_ppl=ref_ppl,
        delta_ppl=ppl - ref_ppl,
    )


def measure(
    model: str | None,
    modes: list[str],
    group: int | None = None,
    max_tokens: int = 1024,
    decode: bool = False,
) -> list[Quality]:
    """Each mode against the float32 model as loaded, on the shipped text; with `decode`,
    every position after the first a decode step of its own (both sides), as generation
    reads the KV cache."""
    reference = load(model, "none", None, max_tokens)
    ids = text_tokens(reference, max_tokens)
    ref_logits = reference.teacher_forced_logits(ids, decode=decode)[:-1]
    reference.close()
    targets = torch.tensor(ids[1:], dtype=torch.int64)
    results = []
    for mode in modes:
        quantization, kv, dtype = parse_mode(mode)
        runner = load(model, quantization, group, max_tokens, kv, dtype)
        if runner.loaded.quantization != quantization:
            raise ValueError(f"{mode} resolved to {runner.loaded.quantization}")
        got = runner.teacher_forced_logits(ids, decode=decode)[:-1]
        results.append(compare(mode, ref_logits, got, targets))
        runner.close()
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rsgl bench quality", description=__doc__)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument(
        "--modes",
        default="gguf,int8,int4,kv:int8,kv:fp8_e4m3,kv:fp8_e5m2",
        help="comma-separated: a quantization, kv:<KV cache dtype>, dtype:bfloat16, or "
        "several joined by +",
    )
    parser.add_argument("--quantization-group-size", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument(
        "--decode",
        action="store_true",
        help="teacher-force through decode steps (one token each) instead of one prefill",
    )
    args = parser.parse_args(argv)
    results = measure(
        args.model,
        args.modes.split(","),
        args.quantization_group_size,
        args.max_tokens,
        args.decode,
    )
    for result in results:
        row: dict[str, Any] = asdict(result)
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}))
    return 0
