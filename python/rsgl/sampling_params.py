"""Per-request sampling parameters (SGLang names), validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rsgl.errors import SamplingParamError
from rsgl.grammar.constraint import Constraint

# The float-valued fields, in the order they are checked; each must be finite.
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)

# The sampler computes in float32: larger magnitudes cannot even be stored.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
# Integers go into int64 tensors and the core's int64 fields; a seed may also be unsigned
# (the sampler hashes its low 63 bits).
INT64_MAX = (1 << 63) - 1
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1

# Below this temperature a request is decoded greedily (dividing by ~0 would overflow).
GREEDY_TEMPERATURE = 1e-6


@dataclass(slots=True)
class SamplingParams:
    """How one request picks its next tokens.

    Invalid values raise ValueError naming the field. `top_k=-1` disables top-k;
    `temperature=0` (or `top_k=1`) means greedy. `repetition_penalty` (HF semantics) applies to
    prompt and generated tokens; `frequency_penalty`/`presence_penalty` (OpenAI semantics) to
    generated tokens only. `seed` makes sampling reproducible whatever the batch it runs in.
    `return_logprob` reports the chosen token's log-probability, `top_logprobs_num` the N most
    likely tokens, both under the model's raw distribution (before penalties and temperature),
    `token_ids_logprob` those of the given ids. `logit_bias` is added to the logits first.
    Token ids are checked against the vocabulary by `rsgl.validation`, which knows its size.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # SGLang's and HF's decode option. Fast (Rust `tokenizers`) tokenizers, the only kind
    # rsgl loads, decode the same either way, as HF's own decode does; kept so that SGLang
    # requests carrying it are served.
    spaces_between_special_tokens: bool = True
    # Keep the matched stop string (or the stop token's text) at the end of the text.
    no_stop_trim: bool = False
    seed: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Token ids whose log-probabilities are reported at every output position (SGLang).
    token_ids_logprob: list[int] = field(default_factory=list)
    # Tokens per streamed chunk for this request; None or 0: the server's (or Engine's)
    # --stream-interval, as SGLang reads its per-request `stream_interval`.
    stream_interval: int | None = None
    # Structured output (SGLang's names): at most one constraint, compiled by the grammar
    # backend; json_schema and structural_tag are JSON text, ebnf is GBNF-style EBNF.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # SGLang's: the output starts with a reasoning (a thinking model's), and the constraint
    # applies only once the reasoning has ended (--reasoning-parser's end marker).
    require_reasoning: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def constraint(self) -> Constraint | None:
        """The output constraint these params ask for, normalised (None: free text)."""
        return Constraint.of(
            {
                "json_schema": self.json_schema,
                "regex": self.regex,
                "ebnf": self.ebnf,
                "structural_tag": self.structural_tag,
            }
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self) -> None:
        """Raise SamplingParamError (a ValueError) naming the first out-of-range field."""
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            # The magnitude first: math.isfinite(10**400) raises OverflowError.
            if not isinstance(value, (int, float)) or abs(value) > FLOAT32_MAX:
                _bad(name, value, "must be a number that fits a float32")
            if not math.isfinite(value):
                _bad(name, value, "must be a finite number")
        if self.temperature < 0:
            _bad("temperature", self.temperature, "must be >= 0")
        if not 0 < self.top_p <= 1:
            _bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k == 0 or not -1 <= self.top_k <= INT64_MAX:
            _bad("top_k", self.top_k, "must be -1 (disabled) or in [1, 2**63)")
        if not 0 <= self.min_p <= 1:
            _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty < FLOAT32_TINY:
            # Smaller values round to 0 in float32, and the sampler divides by them.
            _bad("repetition_penalty", self.repetition_penalty, "must be > 0 (>= 1.2e-38)")
        if not -2 <= self.frequency_penalty <= 2:
            _bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            _bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not 0 <= self.max_new_tokens <= INT64_MAX:
            _bad("max_new_tokens", self.max_new_tokens, "must be in [0, 2**63)")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            _bad("min_new_tokens", self.min_new_tokens, "must be in [0, max_new_tokens]")
        if any(t < 0 for t in self.stop_token_ids):
            _bad("stop_token_ids", self.stop_token_ids, "must be non-negative token ids")
        if not 0 <= self.top_logprobs_num <= INT64_MAX:
            _bad("top_logprobs_num", self.top_logprobs_num, "must be in [0, 2**63)")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            _bad("seed", self.seed, "must be an integer that fits 64 bits, or None")
        if any(t < 0 for t in self.logit_bias) or any(
            not math.isfinite(v) for v in self.logit_bias.values()
        ):
            _bad("logit_bias", self.logit_bias, "must map token ids to finite numbers")
        if any(t < 0 for t in self.token_ids_logprob):
            _bad("token_ids_logprob", self.token_ids_logprob, "must be non-negative token ids")
        if self.stream_interval is not None and not 0 <= self.stream_interval <= INT64_MAX:
            _bad("stream_interval", self.stream_interval, "must be in [0, 2**63), or None")
        self.constraint()  # InvalidRequest naming the field: two constraints, bad JSON


def _bad(name: str, value: object, rule: str) -> None:
    raise SamplingParamError(f"invalid sampling parameter {name}={value!r}: {rule}", name)
