"""Which slice of a Llama-family model a tensor-parallel rank holds.

Attention is split by KV groups: rank r holds a contiguous, balanced range of KV heads and
exactly the query heads that attend to them, so no KV head is stored twice and no query head
needs a key from another rank. The split may be uneven: SmolLM2's 3 KV heads (9 query heads)
over 2 ranks give ranks 0 and 1 two and one KV heads (6 and 3 query heads). With more ranks
than KV heads, each KV head is replicated on `tp_size / num_kv_heads` consecutive ranks, which
split its query heads evenly (SGLang's rule), so `tp_size` must be a multiple of the KV heads
and divide the query heads; any other `tp_size` is refused before a process starts.

The MLP's intermediate size and the vocabulary are cut into contiguous ranges, evenly when
they divide by `tp_size` and otherwise balanced (the first `n % tp_size` ranks hold one more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rsgl.models.config import ModelConfig


class TensorParallelError(ValueError):
    """A model cannot be split over the asked number of tensor-parallel ranks."""


def balanced_range(total: int, parts: int, index: int) -> range:
    """Part `index` of `range(total)` cut into `parts` contiguous pieces whose sizes differ by
    at most one (the larger pieces first)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True, slots=True)
class TPShard:
    """The slice of the model rank `tp_rank` of `tp_size` holds, in the checkpoint's indices.

    `q_heads` and `kv_heads` index the query and KV heads, `intermediate` the MLP's hidden
    units and `vocab` the embedding / LM-head rows. `vocab_sizes` lists every rank's vocabulary
    slice, which the logits all-gather needs to put the pieces back together.
    """

    tp_size: int
    tp_rank: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_sizes: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @classmethod
    def of(cls, config: ModelConfig, tp_size: int, tp_rank: int) -> TPShard:
        """Rank `tp_rank`'s slice of `config`; TensorParallelError if the model cannot be
        split over `tp_size` ranks (the message names the head counts and the sizes that
        work)."""
        if not 0 <= tp_rank < tp_size:
            raise TensorParallelError(f"tp_rank {tp_rank} is outside [0, tp_size={tp_size})")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        q_ranges = _head_ranges(heads, kv_heads, tp_size)
        if q_ranges is None:
            valid = [n for n in range(1, heads + 1) if _head_ranges(heads, kv_heads, n)]
            raise TensorParallelError(
                f"tp_size={tp_size} cannot split {heads} query heads over {kv_heads} KV heads: "
                f"with more ranks than KV heads, tp_size must be a multiple of "
                f"num_key_value_heads ({kv_heads}) and divide num_attention_heads ({heads}) "
                f"so that each replicated KV head serves whole query heads; this model "
                f"splits over tp_size in {valid}"
            )
        for name, size in (
            ("intermediate_size", config.intermediate_size),
            ("vocab_size", config.vocab_size),
        ):
            if size < tp_size:
                raise TensorParallelError(f"{name} {size} is smaller than tp_size {tp_size}")
        q, kv = q_ranges[tp_rank]
        return cls(
            tp_size=tp_size,
            tp_rank=tp_rank,
            q_heads=q,
            kv_heads=kv,
            intermediate=balanced_range(config.intermediate_size, tp_size, tp_rank),
            vocab=balanced_range(config.vocab_size, tp_size, tp_rank),
            vocab_sizes=tuple(
                len(balanced_range(config.vocab_size, tp_size, r)) for r in range(tp_size)
            ),
        )

    @classmethod
    def all_of(cls, config: ModelConfig, tp_size: int) -> list[TPShard]:
        """Every rank's slice (raises as `of` does)."""
        return [cls.of(config, tp_size, rank) for rank in range(tp_size)]

    def to_dict(self) -> dict[str, Any]:
        """`[start, stop)` of each range, for get_server_info."""
        return {
            "tp_rank": self.tp_rank,
            "q_heads": [self.q_heads.start, self.q_heads.stop],
            "kv_heads": [self.kv_heads.start, self.kv_heads.stop],
            "intermediate": [self.intermediate.start, self.intermediate.stop],
            "vocab": [self.vocab.start, self.vocab.stop],
        }


def _head_ranges(heads: int, kv_heads: int, tp_size: int) -> list[tuple[range, range]] | None:
    """(query heads, KV heads) of every rank, or None when `tp_size` cannot split them."""
    if kv_heads < 1 or heads % kv_heads:
        return None
    group = heads // kv_heads  # query heads per KV head
    if tp_size <= kv_heads:
        out = []
        for rank in range(tp_size):
            kv = balanced_range(kv_heads, tp_size, rank)
            out.append((range(kv.start * group, kv.stop * group), kv))
        return out
    if tp_size % kv_heads or heads % tp_size:
        return None
    # Replicated: `replicas` consecutive ranks share a KV head and split its query heads.
    replicas, q_per_rank = tp_size // kv_heads, heads // tp_size
    return [
        (
            range(rank * q_per_rank, (rank + 1) * q_per_rank),
            range(rank // replicas, rank // replicas + 1),
        )
        for rank in range(tp_size)
    ]


__all__ = ["TPShard", "TensorParallelError", "balanced_range"]
