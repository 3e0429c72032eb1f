"""ForwardBatch: one step's work (extends and decodes) as tensors, built from plan arrays."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rsgl.layers.host_copy import to_device

if TYPE_CHECKING:
    from rsgl._core import Plan


class ForwardMode(enum.Enum):
    """What a step computes: prompt chunks, single-token decodes, both, or nothing."""

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"


@dataclass(slots=True)
class ForwardBatch:
    """Inputs of one forward pass.

    Requests are laid out contiguously in token order; extends come first and single-token
    decodes last (the scheduling core's mixed layout). Per-request tensors have length B,
    per-token tensors length T = sum(extend_lens). The `*_host` arrays mirror the per-request
    lengths and request slots on the host: whatever a step decides on the host reads these,
    never a device tensor (on a GPU that would wait for the device).
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_slots: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    req_slots_host: np.ndarray
    prefix_lens_host: np.ndarray
    extend_lens_host: np.ndarray
    seq_lens_host: np.ndarray
    num_decodes: int
    # A verify step (a plan with drafts): per request its draft count, the token indices
    # whose logits the step needs (every position of a request with drafts, the last of
    # the others; None: each request's last position) and those of the drafts.
    draft_lens_host: np.ndarray | None = None
    logit_rows: torch.Tensor | None = None
    draft_index: torch.Tensor | None = None
    # Set by the attention backend once per step and read by every layer.
    attn_metadata: object | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_slots.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_extends(self) -> int:
        return self.batch_size - self.num_decodes

    @property
    def last_token_index(self) -> torch.Tensor:
        """Token index of each request's last computed position."""
        return self.extend_start_loc + self.extend_lens - 1

    @property
    def lm_head_rows(self) -> torch.Tensor:
        """The token indices the LM head sees: `logit_rows`, else each last position."""
        return self.last_token_index if self.logit_rows is None else self.logit_rows

    def token_req_slots(self) -> torch.Tensor:
        """The request slot of every token ([T])."""
        return torch.repeat_interleave(
            self.req_slots, self.extend_lens, output_size=self.num_tokens
        )

    @classmethod
    def from_arrays(
        cls,
        *,
        forward_mode: ForwardMode | str,
        req_slots: np.ndarray,
        prefix_lens: np.ndarray,
        extend_lens: np.ndarray,
        input_ids: np.ndarray,
        positions: np.ndarray | None = None,
        out_cache_loc: np.ndarray,
        seq_lens: np.ndarray | None = None,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Build from per-request and per-token arrays; positions/seq_lens are derived if absent."""
        mode = forward_mode if isinstance(forward_mode, ForwardMode) else ForwardMode(forward_mode)
        prefix = np.asarray(prefix_lens, dtype=np.int64)
        extend = np.asarray(extend_lens, dtype=np.int64)
        seq = prefix + extend if seq_lens is None else np.asarray(seq_lens, dtype=np.int64)
        if not np.array_equal(seq, prefix + extend):
            raise ValueError("seq_lens must equal prefix_lens + extend_lens")
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.shape[0] != int(extend.sum()):
            raise ValueError(f"{ids.shape[0]} input ids for {int(extend.sum())} extend tokens")
        starts = np.zeros_like(extend)
        if extend.size:
            np.cumsum(extend[:-1], out=starts[1:])
        if positions is None:
            offsets = np.arange(ids.shape[0], dtype=np.int64) - np.repeat(starts, extend)
            positions = np.repeat(prefix, extend) + offsets
        # The trailing run of one-token requests is the batched decode part.
        not_one = np.flatnonzero(extend != 1)
        num_decodes = int(extend.size - (not_one[-1] + 1 if not_one.size else 0))

        (ids_d, pos_d, loc_d, slots_d, prefix_d, extend_d, seq_d, starts_d) = to_device(
            [ids, positions, out_cache_loc, req_slots, prefix, extend, seq, starts], device
        )
        return cls(
            forward_mode=mode,
            input_ids=ids_d,
            positions=pos_d,
            out_cache_loc=loc_d,
            req_slots=slots_d,
            prefix_lens=prefix_d,
            extend_lens=extend_d,
            seq_lens=seq_d,
            extend_start_loc=starts_d,
            req_slots_host=np.asarray(req_slots, dtype=np.int64),
            prefix_lens_host=prefix,
            extend_lens_host=extend,
            seq_lens_host=seq,
            num_decodes=num_decodes,
        )

    @classmethod
    def from_plan(cls, plan: Plan, device: torch.device | str = "cpu") -> ForwardBatch:
        """Build from a scheduling-core plan (its req_to_token writes are applied elsewhere).
        A plan with drafts is a verify step: its requests with drafts compute 1 + k tokens
        (an extend over their KV), and the LM head sees each of those positions."""
        drafts = np.asarray(plan.draft_lens, dtype=np.int64)
        if not drafts.any():
            return cls._from_plan_arrays(plan, plan.forward_mode, device)
        batch = cls._from_plan_arrays(plan, ForwardMode.MIXED, device)
        # Request i's rows are its last 1 + drafts[i] tokens; its drafts, the last drafts[i].
        ends = np.cumsum(batch.extend_lens_host)
        batch.draft_lens_host = drafts
        batch.logit_rows, batch.draft_index = to_device(
            [_last_runs(ends, drafts + 1), _last_runs(ends, drafts)], device
        )
        return batch

    @classmethod
    def _from_plan_arrays(
        cls, plan: Plan, mode: ForwardMode | str, device: torch.device | str
    ) -> ForwardBatch:
        return cls.from_arrays(
            forward_mode=mode,
            req_slots=plan.req_slots,
            prefix_lens=plan.prefix_lens,
            extend_lens=plan.extend_lens,
            seq_lens=plan.seq_lens,
            input_ids=plan.input_ids,
            positions=plan.positions,
            out_cache_loc=plan.out_cache_loc,
            device=device,
        )


def _last_runs(ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of `arange(end - n, end)` for each (end, n)."""
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    runs: np.ndarray = np.repeat(ends - lengths, lengths) + offsets
    return runs
