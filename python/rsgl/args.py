"""Engine and server options, with SGLang's names: the one place they and their defaults live.

Every option is a dataclass field with its help text; `rsgl serve`'s parser is generated from
them (`add_cli_args`). The core's own defaults (`rsgl._core.default_config()`) agree with
these (tests/test_args.py). Torch-free, so the server's frontend process reads them cheaply.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rsgl.cpu_features import parse_cpu_list
from rsgl.reasoning import FORMATS as REASONING_PARSERS
from rsgl.tool_calls.parsers import FORMATS as TOOL_CALL_PARSERS
from rsgl.validation import RequestLimits

# Values of `--quantization` (SGLang's option name): gguf reads a GGUF file's blocks;
# gguf_a8 reads them with int8 activations (as llama.cpp does Q4_0/Q4_1/Q8_0's); int8 and
# int4 quantize any model's projections when it loads; none runs the weights as loaded;
# None (auto) picks gguf for GGUF files where it can run.
QUANTIZATIONS = ("gguf", "gguf_a8", "int8", "int4", "none")

# kv_cache_dtype values -> the torch dtype's name (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "float32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "fp8_e5m2": "float8_e5m2",
    "fp8_e4m3": "float8_e4m3fn",
    "int8": "int8",
}

LOAD_FORMATS = ("auto", "dummy", "null")

# How the data-parallel dispatcher picks a rank for a request (SGLang's names; cache_aware
# is sglang-router's).
LOAD_BALANCE_METHODS = ("round_robin", "total_requests", "total_tokens", "cache_aware")

# Constrained-decoding backends (rsgl.grammar; none: constraints are refused with a 400).
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")

# Speculative decoding algorithms (SGLang's names).
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
# Values of --speculative-algorithm: an algorithm, none (off; None too, SGLang's default),
# or auto (rsgl.speculative.choice: NGRAM where it was measured to pay, else off).
SPECULATIVE_CHOICES = ("auto", "none", *SPECULATIVE_ALGORITHMS)

# Tokens a verify step computes per request unless --speculative-num-draft-tokens says. NGRAM:
# on a 2-core Zen 3, copying at concurrency 1 served 2.68x plain's tok/s with 8 and 2.40x
# with 5 (`rsgl bench speculative`), and the adaptive policy keeps batch 64 within 3% of plain
# with either. STANDALONE: each draft is a forward of the draft model.
DEFAULT_DRAFT_TOKENS = {"NGRAM": 8, "STANDALONE": 5}

# Model dtypes (auto: chosen at start-up by rsgl.models.dtype_choice).
DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_dtype(name: str) -> None:
    """ValueError naming the field unless `name` is a dtype value."""
    if name not in DTYPES:
        raise ValueError(f"invalid dtype {name!r}: expected one of {', '.join(DTYPES)}")


def check_kv_cache_dtype(name: str) -> None:
    """ValueError naming the field unless `name` is a kv_cache_dtype value."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"invalid kv_cache_dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
        )


def option(default: Any, help: str, *, choices: Sequence[str] = (), alias: str = "") -> Any:
    """A field of an args dataclass: its default, and how `rsgl serve --help` explains it."""
    meta = {"help": help, "choices": tuple(choices), "alias": alias}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Engine options, with SGLang's names (`rsgl.Engine(**options)`, `rsgl serve --flags`)."""

    model_path: str | None = option(
        None, "HF model directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)"
    )
    tokenizer_path: str | None = option(None, "tokenizer directory (default: the model's)")
    device: str = option("cpu", "torch device to run the model on (cpu, cuda, cuda:N)")
    dtype: str = option(
        "auto",
        "model dtype (auto: bfloat16 on CUDA; on CPU bfloat16 where it has AMX-BF16 or "
        "AVX512-BF16 units and a start-up calibration measures bfloat16 projections faster, "
        "else float32)",
        choices=DTYPES,
    )
    quantization: str | None = option(
        None,
        "weights: gguf reads a GGUF file's projections and LM head from its own 4/8-bit "
        "blocks (Q4_0, Q4_1, Q8_0, Q3_K-Q6_K; the same numbers as the dequantized model, "
        "a fraction of the bytes per step); gguf_a8 the same blocks with activations "
        "quantized to int8 per block of 32, as llama.cpp computes Q4_0/Q4_1/Q8_0 (faster, not "
        "the float32 logits); int8 / "
        "int4 quantize any model's projections when it loads (CPU), and its LM head to "
        "int8; none runs the weights as loaded (default: gguf for GGUF files on CPU, else "
        "none)",
        choices=list(QUANTIZATIONS),
    )
    quantization_group_size: int | None = option(
        None,
        "weights per scale for int8 / int4 (a multiple of 32 dividing the layers' input "
        "sizes; default: int8 one scale per output channel, int4 groups of 32)",
    )
    cpu_threads: int | None = option(
        None,
        "torch intra-op threads for the model's CPU math (default: one per physical core of "
        "the scheduler's CPU affinity)",
    )
    cpu_omp_threads_bind: str = option(
        "auto",
        "CPUs the model's compute threads are pinned to, one each: auto (one per physical "
        "core, where the node runs one model process), nobind (left to the OS), or a list "
        "such as 0-3 (that many threads)",
    )
    kv_cache_dtype: str = option(
        "auto",
        "K/V storage dtype (auto: the model's; float16/bfloat16 halve a float32 cache; "
        "fp8_e5m2/fp8_e4m3 store 8-bit floats, saturated; int8 stores 8-bit integers with a "
        "float32 scale per token and kv head: a quarter of float32's bytes, and the pool "
        "holds that many more tokens)",
        choices=list(KV_CACHE_DTYPES),
    )
    context_length: int | None = option(None, "context length (default: the model's)")
    mem_fraction: float | None = option(
        None,
        "CPU: share of memory for the KV pool (default: 0.15, at most 2^18 tokens); CUDA: "
        "share of the GPU for weights and KV pool together, as SGLang's --mem-fraction-static "
        "(default: 0.85; the rest holds activations and CUDA graphs)",
        alias="--mem-fraction-static",
    )
    max_total_tokens: int | None = option(None, "KV pool size in tokens (overrides mem-fraction)")
    max_running_requests: int = option(256, "request slots: most requests decoding at once")
    max_prefill_tokens: int = option(16384, "input-token budget of one prefill step")
    chunked_prefill_size: int = option(2048, "longest prefill chunk in tokens (-1: no chunking)")
    page_size: int = option(1, "tokens per KV page")
    schedule_policy: str = option(
        "fcfs",
        "waiting-queue order",
        choices=["fcfs", "lpm", "dfs-weight", "lof", "random", "priority"],
    )
    schedule_conservativeness: float = option(
        1.0, "scales the KV reserved for running requests' future tokens (higher: safer)"
    )
    disable_radix_cache: bool = option(False, "turn the radix prefix cache off")
    disable_overlap_schedule: bool = option(
        False, "run each step's scheduling after its forward instead of during it"
    )
    enable_mixed_chunk: bool = option(False, "run decodes in the same step as a prefill chunk")
    attention_backend: str | None = option(
        None,
        "attention implementation: torch_native, triton or flashinfer (default: torch_native "
        "on CPU, flashinfer on CUDA when installed, else triton)",
        choices=["torch_native", "triton", "flashinfer"],
    )
    cuda_graph_max_bs: int = option(
        160, "largest decode batch replayed from a CUDA graph (CUDA only)"
    )
    disable_cuda_graph: bool = option(False, "run decode steps eagerly on CUDA")
    load_format: str = option(
        "auto",
        "auto: load the weights; dummy: seeded random weights from config.json (benchmarks "
        "without a download); null: no weights and no math, seeded-random tokens (measures "
        "everything but the forward)",
        choices=LOAD_FORMATS,
    )
    null_step_ms: float = option(0.0, "with load-format null: each step's stand-in forward time")
    seed: int = option(0, "random seed (sampling, the random policy)")
    allow_auto_truncate: bool = option(
        False, "clamp max_tokens to what the context leaves instead of answering 400"
    )
    max_n: int = option(128, "largest n a request may ask for")
    max_logprobs: int = option(20, "largest (top_)logprobs a request may ask for")
    max_stop_strings: int = option(64, "most stop strings per request")
    max_stop_string_len: int = option(1024, "most characters per stop string")
    stream_interval: int = option(
        1, "tokens per streamed chunk (a request's last chunk comes when it ends)"
    )
    grammar_backend: str = option(
        "llguidance",
        "constrained decoding (json_schema, regex, ebnf, structural_tag, response_format): "
        "llguidance (the default: measured faster per mask), xgrammar, or none (refused)",
        choices=GRAMMAR_BACKENDS,
    )
    constrained_json_disable_any_whitespace: bool = option(
        False, "JSON constraints allow no whitespace between tokens (compact JSON)"
    )
    constrained_json_max_whitespace: int = option(
        16,
        "most whitespace characters a JSON constraint allows in one place (0: unbounded), so "
        "a model cannot run to max_tokens on whitespace",
    )
    grammar_compile_timeout: float = option(
        30.0, "seconds a request waits for its grammar to compile before it fails (400)"
    )
    grammar_cache_mb: int = option(256, "memory for compiled grammars, least recently used out")
    reasoning_parser: str | None = option(
        None,
        "how a thinking model marks its reasoning (SGLang's names: deepseek-r1, qwen3): chat "
        "answers carry it as reasoning_content, and a constraint applies after it ends",
        choices=list(REASONING_PARSERS),
    )
    speculative_algorithm: str | None = option(
        "auto",
        "speculative decoding (SGLang's name): NGRAM drafts each request's next tokens from "
        "its own prompt and output, STANDALONE from a draft model "
        "(--speculative-draft-model-path), and one forward verifies them (greedy output is "
        "unchanged, sampled output keeps its distribution); a step with drafts waits for the "
        "step before it, steps without drafts overlap. auto: NGRAM where it was measured to "
        "pay (bfloat16 on a CPU's AMX tiles, one rank, one replica), else none (off)",
        choices=list(SPECULATIVE_CHOICES),
    )
    speculative_num_draft_tokens: int | None = option(
        None,
        "tokens a verify step computes per request: its last token and up to n - 1 drafts "
        "(default: 8 for NGRAM, 5 for STANDALONE)",
    )
    disable_speculative_adaptive: bool = option(
        False,
        "speculation drafts on every decode step it can (as SGLang does), not only at the "
        "batch sizes where measured verify steps cost less per token than plain ones",
    )
    speculative_num_steps: int | None = option(
        None,
        "STANDALONE: draft decodes per verify step (SGLang's name); sets "
        "--speculative-num-draft-tokens to n + 1 (a chain of drafts); NGRAM ignores it",
    )
    speculative_draft_model_path: str | None = option(
        None,
        "STANDALONE: the draft model, a smaller model of the target's tokenizer (a directory "
        "or a .gguf file, as --model-path takes; default: the target model itself)",
    )
    speculative_draft_load_format: str | None = option(
        None, "STANDALONE: how the draft's weights load (auto or dummy; default: --load-format)"
    )
    speculative_ngram_min_match_window_size: int = option(
        1, "NGRAM: shortest suffix of a request's tokens looked up in its earlier tokens"
    )
    speculative_ngram_max_match_window_size: int = option(
        12, "NGRAM: longest suffix looked up (the longest match is drafted from)"
    )

    tp_size: int = option(
        1,
        "tensor-parallel ranks: each holds a shard of every layer and of the KV cache",
        alias="--tp",
    )
    dp_size: int = option(
        1,
        "data-parallel replicas: scheduler processes, each with its own model and KV pool",
        alias="--dp",
    )
    load_balance_method: str = option(
        "round_robin",
        "how a request picks its data-parallel replica",
        choices=LOAD_BALANCE_METHODS,
    )
    nnodes: int = option(1, "nodes the tensor-parallel ranks are spread over")
    node_rank: int = option(
        0, "this node's rank (0 runs the frontend; the others run only their model ranks)"
    )
    dist_init_addr: str | None = option(
        None, "host:port of node 0 for torch.distributed's rendezvous (needed when nnodes > 1)"
    )
    step_log: str | None = option(
        None,
        "append one JSON line per step to this file: its shape (rows, tokens, extends, KV "
        "read, cached prefix, attention pairs), the data-parallel rank and its seconds in "
        "the loop (`rsgl bench simulate --calibrate --calibrate-server` fits them)",
    )

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.cpu_omp_threads_bind not in ("auto", "nobind"):
            bound = len(parse_cpu_list(self.cpu_omp_threads_bind))
            if self.cpu_threads not in (None, bound):
                raise ValueError(
                    f"cpu_threads {self.cpu_threads} disagrees with cpu_omp_threads_bind "
                    f"{self.cpu_omp_threads_bind!r} ({bound} CPUs)"
                )
            if self.dp_size * self.tp_size // max(self.nnodes, 1) > 1:
                raise ValueError(
                    "cpu_omp_threads_bind takes a CPU list for one model process per node "
                    "only; with data- or tensor-parallel ranks use auto or nobind"
                )
        if self.load_format not in LOAD_FORMATS:
            expected = ", ".join(LOAD_FORMATS)
            raise ValueError(
                f"invalid load_format {self.load_format!r}: expected one of {expected}"
            )
        if not 0 <= self.null_step_ms < float("inf"):
            raise ValueError(f"null_step_ms must be finite and >= 0, got {self.null_step_ms}")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        limits = (
            "max_n",
            "max_stop_strings",
            "max_stop_string_len",
            "stream_interval",
            "cuda_graph_max_bs",
        )
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            expected = ", ".join(GRAMMAR_BACKENDS)
            raise ValueError(
                f"invalid grammar_backend {self.grammar_backend!r}: expected one of {expected}"
            )
        if not 0 < self.grammar_compile_timeout < float("inf"):
            timeout = self.grammar_compile_timeout
            raise ValueError(f"grammar_compile_timeout must be finite and > 0, got {timeout}")
        for name in ("constrained_json_max_whitespace", "grammar_cache_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            expected = ", ".join(REASONING_PARSERS)
            raise ValueError(
                f"invalid reasoning_parser {self.reasoning_parser!r}: expected one of {expected}"
            )
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"invalid quantization {self.quantization!r}: expected one of "
                + ", ".join(QUANTIZATIONS)
            )
        group = self.quantization_group_size
        if group is not None and (group < 32 or group % 32):
            raise ValueError(f"quantization_group_size must be a multiple of 32, got {group}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            expected = ", ".join(LOAD_BALANCE_METHODS)
            raise ValueError(
                f"invalid load_balance_method {self.load_balance_method!r}: "
                f"expected one of {expected}"
            )
        if not 0 <= self.node_rank < max(self.nnodes, 1):
            raise ValueError(
                f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (host:port of node 0) is needed when nnodes > 1")
        if self.nnodes > 1 and self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes}): "
                "each node runs the same number of tensor-parallel ranks"
            )
        self._check_speculative()
        parallel = ("tp_size", "dp_size", "nnodes")
        for name in ("max_running_requests", "max_prefill_tokens", "page_size", *limits, *parallel):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def _check_speculative(self) -> None:
        """ValueError naming what is wrong with the speculative options."""
        if self.speculative_algorithm not in (None, *SPECULATIVE_CHOICES):
            raise ValueError(
                f"invalid speculative_algorithm {self.speculative_algorithm!r}: expected one "
                f"of {', '.join(SPECULATIVE_CHOICES)}"
            )
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 1:
            raise ValueError(
                "speculative_num_draft_tokens must be at least 1, got "
                f"{self.speculative_num_draft_tokens}"
            )
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError(
                "speculative_ngram_min_match_window_size and _max_ must satisfy 1 <= min <= "
                f"max, got {low} and {high}"
            )
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise ValueError(
                f"speculative_num_steps must be at least 1, got {self.speculative_num_steps}"
            )
        standalone = self.speculative_algorithm == "STANDALONE"
        for name in ("speculative_draft_model_path", "speculative_draft_load_format"):
            if getattr(self, name) is not None and not standalone:
                raise ValueError(f"{name} is for speculative_algorithm STANDALONE")
        draft_format = self.speculative_draft_load_format
        if draft_format not in (None, "auto", "dummy"):
            raise ValueError(
                f"invalid speculative_draft_load_format {draft_format!r}: expected auto or dummy"
            )
        if standalone and self.load_format == "null":
            raise ValueError("STANDALONE speculation needs a model (load_format null has none)")

    @property
    def speculates(self) -> bool:
        """Whether requests are decoded speculatively (drafts verified in one forward);
        False for auto until `rsgl.speculative.choice` resolves it."""
        return self.speculative_algorithm in SPECULATIVE_ALGORITHMS and self.verified_tokens > 1

    @property
    def verified_tokens(self) -> int:
        """Tokens a verify step computes per drafting request: STANDALONE's
        `speculative_num_steps` drafts + 1 when given, else `speculative_num_draft_tokens`."""
        steps = self.speculative_num_steps
        if self.speculative_algorithm == "STANDALONE" and steps is not None:
            return steps + 1
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens
        return DEFAULT_DRAFT_TOKENS.get(self.speculative_algorithm or "", 1)

    @classmethod
    def from_options(cls, model_path: str | None, options: dict[str, Any]) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model_path=model_path, **options)

    def request_limits(
        self, vocab_size: int, context_length: int, max_prompt_len: int
    ) -> RequestLimits:
        """The limits requests are validated against, for a model of these sizes."""
        return RequestLimits(
            vocab_size=vocab_size,
            context_length=context_length,
            max_prompt_len=max_prompt_len,
            allow_auto_truncate=self.allow_auto_truncate,
            max_n=self.max_n,
            max_logprobs=self.max_logprobs,
            max_stop_strings=self.max_stop_strings,
            max_stop_string_len=self.max_stop_string_len,
        )


# The largest request body the server reads (413 beyond it).
DEFAULT_MAX_REQUEST_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class ServerArgs(EngineArgs):
    """`rsgl serve`'s options: the engine's, and the HTTP server's."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "port to listen on")
    api_key: str | None = option(None, "require `Authorization: Bearer <key>`")
    served_model_name: str | None = option(
        None, "model name in the API (default: the model file's name)"
    )
    max_queued_requests: int | None = option(
        None, "answer 503 when this many requests wait for their first token"
    )
    log_requests: bool = option(False, "log every request and its result")
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES, "largest request body accepted (413 beyond it)"
    )
    request_timeout_s: float | None = option(
        None, "abort requests running longer than this (off by default)"
    )
    stream_stall_timeout_s: float = option(
        30.0, "abort a stream whose client has not read its output for this long"
    )
    socket_send_buffer_bytes: int | None = option(
        None,
        "kernel send buffer of each connection (default: the OS autotunes it, up to "
        "net.ipv4.tcp_wmem's maximum, often 4 MB, per client that stops reading)",
    )
    graceful_shutdown_timeout: float = option(
        30.0, "on SIGTERM, how long in-flight requests may take to finish"
    )
    incremental_streaming_output: bool = option(
        False, "stream /generate text and ids as deltas instead of SGLang's text-so-far"
    )
    tool_call_parser: str | None = option(
        None,
        "how tool calls are read from the model's answers under tool_choice auto (SGLang's "
        "names: llama3, qwen25, hermes, mistral, pythonic; default: none are read, the "
        "answer is content). tool_choice required or a named function needs none",
        choices=list(TOOL_CALL_PARSERS),
    )
    enable_metrics_compat: str | None = option(
        None,
        "also export /metrics under another engine's names (sglang: SGLang 0.5's "
        "`sglang:*` series and labels, for its dashboards)",
        choices=["sglang"],
    )

    def __post_init__(self) -> None:
        EngineArgs.__post_init__(self)
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            expected = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(
                f"invalid tool_call_parser {self.tool_call_parser!r}: expected one of {expected}"
            )

    def engine_args(self) -> EngineArgs:
        """The engine's part (what the scheduler process needs)."""
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        return EngineArgs(**{k: getattr(self, k) for k in names})


def add_cli_args(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """One `--flag-name` per field of the args dataclass `cls`: its type from the annotation
    (a bool is a switch), its default and help text from the field."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flags = [f"--{f.name.replace('_', '-')}"]
        if f.metadata.get("alias"):
            flags.append(f.metadata["alias"])
        help_text = f.metadata.get("help", "")
        kind = _scalar_type(hints[f.name])
        if kind is bool:
            parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
            continue
        default_note = "" if f.default is None else f" (default: {f.default})"
        parser.add_argument(
            *flags,
            dest=f.name,
            type=kind,
            default=f.default,
            choices=f.metadata.get("choices") or None,
            help=help_text + default_note,
        )


def from_cli(cls: type[Any], ns: argparse.Namespace) -> Any:
    """An instance of the args dataclass `cls` from a namespace `add_cli_args` parsed."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def _scalar_type(hint: Any) -> type:
    """`int` for `int` and `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _scalar_type(inner)
    if hint not in (str, int, float, bool):
        raise TypeError(f"no command-line type for {hint!r}")
    return typing.cast(type, hint)
