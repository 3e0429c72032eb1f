"""CUDA-graph bookkeeping on CPU: sizes, padding, and replay equivalence with a stand-in graph.

A stand-in graph re-runs the captured callable on replay and writes into the tensor the
capture returned: that is exactly what a CUDA graph replay must be equivalent to, and it
holds only if the callable reads nothing but the static buffers. The model runs on CPU with
the triton backend under Triton's interpreter, so every device-side metadata op the real
graph captures runs here too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rsgl.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    capture_batch_sizes,
    pad_decode_arrays,
    padded_size,
)


def test_sizes_are_powers_of_two_then_steps_of_eight() -> None:
    assert capture_batch_sizes(160) == [1, 2, 4, 8, *range(16, 161, 8)]
    assert capture_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(1) == [1]


def test_a_batch_pads_to_the_next_captured_size() -> None:
    sizes = capture_batch_sizes(160)
    assert [padded_size(sizes, b) for b in (1, 3, 5, 8, 9, 17, 160)] == [1, 4, 8, 8, 16, 24, 160]
    assert padded_size(sizes, 161) is None


def test_padding_rows_touch_only_padding_state() -> None:
    arrays = {
        "req_slots": np.array([5, 2, 7]),
        "prefix_lens": np.array([10, 3, 8]),
        "extend_lens": np.array([1, 1, 1]),
        "seq_lens": np.array([11, 4, 9]),
        "input_ids": np.array([-1, 42, -1]),
        "positions": np.array([10, 3, 8]),
        "out_cache_loc": np.array([100, 101, 102]),
    }
    padded = pad_decode_arrays(arrays, 8, padding_row=16)
    for name, values in arrays.items():
        assert padded[name].tolist()[:3] == values.tolist()
    assert padded["req_slots"][3:].tolist() == [16] * 5
    assert padded["out_cache_loc"][3:].tolist() == [0] * 5  # the padding KV slot
    assert padded["seq_lens"][3:].tolist() == [1] * 5
    assert padded["input_ids"][3:].tolist() == [0] * 5


class RerunGraph:
    """Replays by re-running what was captured, into the captured output tensor."""

    def __init__(self, pool: Any) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None
        self.out.copy_(self.fn())


TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 0,
}


def _triton_runner(tmp_path: Path) -> Any:
    pytest.importorskip("triton", reason="the triton backend needs triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 to run Triton kernels on CPU")
    from rsgl.model_executor.model_runner import ModelRunner

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return ModelRunner.from_pretrained(
        tmp_path,
        kv_buffer_size=256,
        max_running_requests=6,
        context_len=64,
        attention_backend="triton",
        load_format="dummy",
        seed=3,
    )


def test_replay_gives_the_eager_logits_and_touches_only_padding(tmp_path: Path) -> None:
    from plan_builder import Driver

    eager = _triton_runner(tmp_path)
    graphed = _triton_runner(tmp_path)
    graphed.graphs = CudaGraphRunner(
        graphed.model,
        graphed.attn,
        graphed.future_map,
        max_bs=4,
        max_context_len=64,
        device=graphed.device,
        make_graph=RerunGraph,
    )
    graphed.graphs.capture(graphed.req_to_token.padding_row)
    prompts = [[5, 9, 11, 3], [7, 7], [20, 30, 40, 50, 60]]  # 3 requests: padded to 4
    results = []
    for runner in (eager, graphed):
        driver = Driver(runner)
        seqs = [driver.admit(slot, p) for slot, p in enumerate(prompts)]
        out = driver.run([driver.work(s, len(s.tokens)) for s in seqs])
        steps = []
        for _ in range(6):
            assert out.logits is not None
            # Kept without a copy: a replay's logits must outlive the next replay.
            steps.append((out.next_token_ids.tolist(), out.logits))
            for seq, token in zip(seqs, out.next_token_ids.tolist(), strict=True):
                seq.tokens.append(token)
            out = driver.run([driver.work(s, 1) for s in seqs])
        results.append(steps)
    for (tokens_a, logits_a), (tokens_b, logits_b) in zip(*results, strict=True):
        assert tokens_a == tokens_b
        # Padding changes the matmuls' row count, which may change their blocking: equal
        # to rounding, not bit for bit.
        torch.testing.assert_close(logits_a, logits_b, rtol=1e-5, atol=1e-5)
    for layer in range(2):
        for buffers in ("k_buffers", "v_buffers"):
            a = getattr(eager.kv_cache, buffers)[layer][1:]
            b = getattr(graphed.kv_cache, buffers)[layer][1:]
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
