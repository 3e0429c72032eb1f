"""The cost of `accept_drafts` against a plain sampler step over the same requests.

`python -m rsgl.speculative.bench_accept [--vocab 49152] [--drafts 4] [--batch 1 16 64]`
prints one JSON line per (batch, mode): the median milliseconds of the acceptance of a
verify batch (1 + k rows per request) and of a plain sampler step (1 row per request).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from rsgl.layers.sampler import Sampler, SlotSamplingState
from rsgl.sampling_params import SamplingParams
from rsgl.speculative.accept import accept_drafts

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "sampled": SamplingParams(temperature=0.7, top_p=0.9),
    "penalized": SamplingParams(temperature=0.7, top_p=0.9, frequency_penalty=0.5),
}


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(batch: int, drafts: int, vocab: int, mode: str, repeats: int) -> dict[str, object]:
    """Median ms of accept_drafts and of a plain step for `batch` requests of `mode`."""
    device = torch.device("cpu")
    state = SlotSamplingState(batch, vocab, [0], device)
    for slot in range(batch):
        state.admit(slot, MODES[mode], list(range(1, 65)), list(range(100, 132)))
    state.flush()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch * (1 + drafts), vocab, generator=gen)
    draft_tokens = torch.randint(0, vocab, (batch * drafts,), generator=gen)
    slots = np.arange(batch, dtype=np.int64)
    lens = np.full(batch, 200, dtype=np.int64)
    draft_lens = np.full(batch, drafts, dtype=np.int64)
    sampler = Sampler(device, seed=0)
    plain_logits = logits[:: 1 + drafts].contiguous()
    slots_d, lens_d = torch.from_numpy(slots), torch.from_numpy(lens)

    def spec() -> None:
        accept_drafts(logits, slots, draft_lens, draft_tokens, state, sampler, lens)

    def plain() -> None:
        sampler(plain_logits, state, slots_d, lens_d, slots, lens)

    return {
        "batch": batch,
        "drafts": drafts,
        "vocab": vocab,
        "mode": mode,
        "accept_ms": round(_median_ms(spec, repeats), 3),
        "plain_step_ms": round(_median_ms(plain, repeats), 3),
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--mode", choices=sorted(MODES), nargs="+", default=sorted(MODES))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    with torch.inference_mode():
        for batch in args.batch:
            for mode in args.mode:
                row = measure(batch, args.drafts, args.vocab, mode, args.repeats)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
