"""ForwardBatch derives what the plan leaves implicit, and rejects inconsistent arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rsgl.model_executor.forward_batch import ForwardBatch, ForwardMode
from rsgl.model_executor.future_map import FutureMap


def _batch(extend_lens: list[int], prefix_lens: list[int]) -> ForwardBatch:
    n = sum(extend_lens)
    return ForwardBatch.from_arrays(
        forward_mode="mixed",
        req_slots=np.arange(len(extend_lens)),
        prefix_lens=np.asarray(prefix_lens),
        extend_lens=np.asarray(extend_lens),
        input_ids=np.arange(n),
        out_cache_loc=np.arange(n) + 1,
    )


def test_positions_last_tokens_and_decode_tail() -> None:
    batch = _batch([3, 1, 2, 1, 1], [0, 4, 5, 7, 2])
    assert batch.forward_mode is ForwardMode.MIXED
    assert batch.positions.tolist() == [0, 1, 2, 4, 5, 6, 7, 2]
    assert batch.last_token_index.tolist() == [2, 3, 5, 6, 7]
    # Only the trailing run of one-token requests is batched as decodes.
    assert batch.num_decodes == 2 and batch.num_extends == 3
    assert batch.token_req_slots().tolist() == [0, 0, 0, 1, 2, 2, 3, 4]


def test_inconsistent_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="input ids"):
        ForwardBatch.from_arrays(
            forward_mode="extend",
            req_slots=np.arange(1),
            prefix_lens=np.zeros(1),
            extend_lens=np.array([3]),
            input_ids=np.arange(2),
            out_cache_loc=np.arange(2),
        )


def test_future_map_resolves_only_placeholders() -> None:
    fm = FutureMap(4, "cpu")
    fm.store(torch.tensor([1, 3]), torch.tensor([11, 33]))
    ids = fm.resolve(torch.tensor([5, -1, 6, -1]), torch.tensor([0, 1, 2, 3]))
    assert ids.tolist() == [5, 11, 6, 33]
