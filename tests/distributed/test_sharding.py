"""How a model is cut over tensor-parallel ranks: head, intermediate and vocabulary ranges,
replicated KV heads, and the sizes that are refused (pure arithmetic, no processes)."""

from __future__ import annotations

import pytest

from rsgl.distributed.sharding import TensorParallelError, TPShard, balanced_range
from rsgl.models.config import ModelConfig


def config(heads: int, kv_heads: int, intermediate: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 64 * heads,
            "intermediate_size": intermediate,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


def spans(ranges: list[range]) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in ranges]


def test_balanced_ranges_tile_the_whole_range_larger_pieces_first() -> None:
    assert spans([balanced_range(10, 4, i) for i in range(4)]) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert spans([balanced_range(1536, 2, i) for i in range(2)]) == [(0, 768), (768, 1536)]
    for total in range(0, 40):
        for parts in range(1, 9):
            pieces = [balanced_range(total, parts, i) for i in range(parts)]
            assert [x for p in pieces for x in p] == list(range(total))
            assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_smollm2_at_tp2_splits_kv_groups_unevenly_without_replication() -> None:
    shards = TPShard.all_of(config(9, 3), 2)
    assert spans([s.q_heads for s in shards]) == [(0, 6), (6, 9)]
    assert spans([s.kv_heads for s in shards]) == [(0, 2), (2, 3)]
    assert spans([s.intermediate for s in shards]) == [(0, 768), (768, 1536)]
    assert spans([s.vocab for s in shards]) == [(0, 24576), (24576, 49152)]
    assert shards[0].vocab_sizes == (24576, 24576)


def test_uneven_vocabulary_and_intermediate_are_balanced() -> None:
    shards = TPShard.all_of(config(4, 4, intermediate=10, vocab=11), 3)
    assert spans([s.intermediate for s in shards]) == [(0, 4), (4, 7), (7, 10)]
    assert shards[0].vocab_sizes == (4, 4, 3)


@pytest.mark.parametrize(("heads", "kv_heads", "tp_size"), [(8, 2, 4), (8, 2, 8), (32, 8, 16)])
def test_more_ranks_than_kv_heads_replicate_each_kv_head(
    heads: int, kv_heads: int, tp_size: int
) -> None:
    shards = TPShard.all_of(config(heads, kv_heads), tp_size)
    replicas = tp_size // kv_heads
    assert [s.kv_heads.start for s in shards] == [r // replicas for r in range(tp_size)]
    assert all(s.num_kv_heads == 1 and s.num_heads == heads // tp_size for s in shards)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (32, 8), (12, 4), (6, 6), (7, 1)])
def test_every_query_head_is_on_exactly_one_rank_with_its_kv_head(
    heads: int, kv_heads: int
) -> None:
    group = heads // kv_heads
    for tp_size in range(1, heads + 1):
        try:
            shards = TPShard.all_of(config(heads, kv_heads), tp_size)
        except TensorParallelError:
            continue
        assert [h for s in shards for h in s.q_heads] == list(range(heads))
        for s in shards:
            assert {h // group for h in s.q_heads} == set(s.kv_heads)


def test_a_size_that_cannot_split_the_heads_is_refused_naming_the_counts() -> None:
    with pytest.raises(TensorParallelError) as err:
        TPShard.of(config(9, 3), 4, 0)
    message = str(err.value)
    assert "9 query heads" in message and "3 KV heads" in message
    assert "[1, 2, 3, 9]" in message  # the sizes that work
    with pytest.raises(TensorParallelError):
        TPShard.of(config(9, 3), 6, 0)  # a multiple of the KV heads, not a divisor of 9
