"""Tensor parallelism's step stream: rank 0 plans, the other ranks execute.

Only rank 0 has a scheduling core and a `SchedulerLoop`; its runner is a `TPRunner`. On the
executor (the loop's "stream", in launch order) each step's message, the plan's arrays plus
the request slots admitted for it (slot, sampling parameters, prompt and output ids), is
pushed to every follower over ZeroMQ before rank 0 runs its own shard of the step. A
follower (`follow_steps`) admits, runs `execute(prepare(plan))` and drops the output. Why
this shape:

- Determinism. One core makes every plan, so the ranks cannot diverge; there is no second
  scheduler whose bookkeeping must agree with rank 0's call for call.
- Overlap is unchanged. Rank 0's loop still launches step N+1 before reading step N; a
  follower simply executes steps in the order they arrive. A decode input that is a future
  placeholder resolves from each rank's own FutureMap, which is identical on every rank:
  the logits are all-gathered, so every rank samples the same token with the same seeds and
  per-slot state (penalties included), and no token is ever broadcast.
- Grammar masks travel as tensors. A step's message names the rows that sample under a
  grammar, but their bitmask is filled on rank 0 only after the step is sent (it depends on
  the previous step's tokens, accepted while this step's forward runs); at sampling time
  every rank meets in a broadcast of it (`BroadcastMask`), so all ranks mask the same tokens
  of their identical logits, or of their vocabulary slices before the sharded argmax.
- Control over ZeroMQ, tensors over torch.distributed. An idle server sends nothing; a
  follower blocked in a gloo broadcast would time out, a follower blocked on a socket waits
  for ever. The collectives inside the forward use gloo (CPU) or NCCL (CUDA).
- Failure is shared. A rank that dies makes the others' next collective fail (gloo at once:
  the connections close), so the whole group fails together, as SGLang's does. Rank 0 also
  watches its local followers' processes and names the dead rank; from then on every step
  fails fast with that reason instead of hanging. A step that fails on rank 0 likewise
  leaves the followers out of step, so it breaks the group for good. A follower whose
  connection to rank 0 drops (rank 0 died) exits; a stop message ends it cleanly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
import torch
import zmq

from rsgl._core import Plan
from rsgl.distributed.group import TPGroup
from rsgl.errors import FatalStepError
from rsgl.layers.vocab_mask import VocabMask
from rsgl.model_executor.model_runner import ModelRunner, PreparedStep, StepOutput
from rsgl.models.loader import LoadedModel
from rsgl.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class TPGroupBroken(FatalStepError):
    """The tensor-parallel group cannot run another step (a rank died, or a step failed
    part-way and left the ranks out of step); the message names the cause."""


class RankZeroLost(RuntimeError):
    """A follower's connection to rank 0 dropped without a stop message: rank 0 is gone."""


class Admission(msgspec.Struct, array_like=True):
    """A request took `req_slot` in this step: what `ModelRunner.admit` needs."""

    req_slot: int
    params: SamplingParams
    prompt_ids: bytes  # int64
    output_ids: bytes  # int64


class StepMessage(msgspec.Struct, tag="step", array_like=True):
    """One plan, as flat int64 arrays in one buffer, with the step's admissions.

    `ints` holds, in order, the per-request arrays (rids, req_slots, prefix_lens,
    extend_lens, seq_lens, draft_lens: `batch_size` each), the per-token arrays (input_ids,
    positions, out_cache_loc: `num_tokens` each) and the req_to_token writes (rows, cols, slots:
    `num_writes` each); `sample` is the per-request bool array. `return_logits` is part of
    the step: with it every rank gathers the whole logits, without it a greedy batch
    gathers only each rank's best (value, id), and the ranks' collectives must match.
    `mask_rows` (int64) are the batch rows under a grammar: non-empty, every rank joins the
    broadcast of their bitmask when it samples.
    """

    plan_id: int
    forward_mode: str
    num_extends: int
    batch_size: int
    num_tokens: int
    num_writes: int
    ints: bytes
    sample: bytes
    admissions: list[Admission]
    return_logits: bool = False
    mask_rows: bytes = b""


class StopMessage(msgspec.Struct, tag="stop", array_like=True):
    """Rank 0 is shutting down: the follower returns."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepMessage | StopMessage)
STOP = _encoder.encode(StopMessage())


def encode_step(
    plan: Plan,
    admissions: Sequence[Admission],
    return_logits: bool = False,
    mask_rows: np.ndarray | None = None,
) -> bytes:
    """`plan` and its admissions (and the rows its grammar masks cover) as one message."""
    ints = np.concatenate(
        [
            plan.rids,
            plan.req_slots,
            plan.prefix_lens,
            plan.extend_lens,
            plan.seq_lens,
            plan.draft_lens,
            plan.input_ids,
            plan.positions,
            plan.out_cache_loc,
            plan.write_rows,
            plan.write_cols,
            plan.write_slots,
        ]
    ).astype(np.int64, copy=False)
    message = StepMessage(
        plan_id=plan.id,
        forward_mode=plan.forward_mode,
        num_extends=plan.num_extends,
        batch_size=len(plan.rids),
        num_tokens=len(plan.input_ids),
        num_writes=len(plan.write_rows),
        ints=ints.tobytes(),
        sample=np.asarray(plan.sample, dtype=np.bool_).tobytes(),
        admissions=list(admissions),
        return_logits=return_logits,
        mask_rows=b"" if mask_rows is None else mask_rows.astype(np.int64, copy=False).tobytes(),
    )
    return _encoder.encode(message)


def decode_message(payload: bytes) -> StepMessage | StopMessage:
    """The message `encode_step` (or `STOP`) made."""
    message: StepMessage | StopMessage = _decoder.decode(payload)
    return message


def plan_of(message: StepMessage) -> Plan:
    """The plan a step message carries, rebuilt as rank 0's core made it."""
    b, t, w = message.batch_size, message.num_tokens, message.num_writes
    ints = np.frombuffer(message.ints, dtype=np.int64)
    cuts = np.cumsum([b, b, b, b, b, b, t, t, t, w, w, w])
    arrays = np.split(ints, cuts[:-1])
    rids, slots, prefix, extend, seq, drafts, ids, pos, loc, rows, cols, kv = arrays
    return Plan(
        id=message.plan_id,
        forward_mode=message.forward_mode,  # type: ignore[arg-type]
        rids=rids,
        req_slots=slots,
        prefix_lens=prefix,
        extend_lens=extend,
        seq_lens=seq,
        sample=np.frombuffer(message.sample, dtype=np.bool_).tolist(),
        input_ids=ids,
        positions=pos,
        out_cache_loc=loc,
        write_rows=rows,
        write_cols=cols,
        write_slots=kv,
        num_extends=message.num_extends,
        draft_lens=drafts,
    )


@dataclass(slots=True)
class BroadcastMask:
    """A step's grammar masks as every tensor-parallel rank sees them: `wait` (the sampler's,
    once per step on every rank, at the same point of the step's collectives) broadcasts
    rank 0's bitmask, which `source` (the loop's `StepMask`) holds once filled; a follower
    has no source and receives it. `words` is the bitmask's width (the backend's,
    ceil(vocab / 32))."""

    rows: np.ndarray
    words: int
    group: TPGroup
    device: torch.device
    source: VocabMask | None = None
    _bitmask: torch.Tensor | None = field(default=None, init=False)

    def wait(self) -> torch.Tensor:
        if self._bitmask is None:
            if self.source is not None:
                bitmask = self.source.wait().to(self.device)
            else:
                shape = (len(self.rows), self.words)
                bitmask = torch.empty(shape, dtype=torch.int32, device=self.device)
            self._bitmask = self.group.broadcast(bitmask)
        return self._bitmask


def broadcast_mask(
    runner: ModelRunner, rows: np.ndarray, source: VocabMask | None = None
) -> BroadcastMask:
    """The `BroadcastMask` of `runner`'s group for `rows` (from `source` on rank 0); its
    width is the grammar backend's: one bit per id of the model's vocabulary."""
    tp = runner.loaded.tp
    assert tp is not None, "grammar masks are broadcast under tensor parallelism only"
    words = (runner.loaded.config.vocab_size + 31) // 32
    return BroadcastMask(rows, words, tp.group, runner.device, source)


class StepSink(Protocol):
    """Where rank 0's steps go: the followers (`rsgl.model_executor.tp_launch.Followers`)."""

    def send(self, payload: bytes) -> None:
        """Delivers one message to every follower, in order; raises TPGroupBroken when a
        follower is known dead or takes no message for too long."""

    def failure(self, grace_s: float = 0.0) -> str | None:
        """Why the group cannot go on (a dead rank, named), or None; waits up to `grace_s`
        for a rank that is dying to be seen as dead."""

    def close(self) -> None:
        """Stops the followers (idempotent)."""


class TPRunner(ModelRunner):
    """Rank 0's runner: a `ModelRunner` over rank 0's shard whose every step also goes to
    the followers, in the order the executor runs them (see the module's docstring).

    `admit` records the admission for the next step's message; `execute` sends the step,
    then runs rank 0's shard, whose collectives the followers meet. Only `execute` (and
    `step`) reach the followers: calling `forward` directly on rank 0 would wait for ever
    in the first collective. Rank 0's outputs are the step's outputs.
    """

    def __init__(self, loaded: LoadedModel, *, followers: StepSink, **options: Any) -> None:
        super().__init__(loaded, **options)
        self.followers = followers
        self._admissions: list[Admission] = []
        self._broken: str | None = None

    def admit(
        self,
        req_slot: int,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None:
        self._admissions.append(
            Admission(
                req_slot,
                params,
                np.asarray(prompt_ids, dtype=np.int64).tobytes(),
                np.asarray(output_ids, dtype=np.int64).tobytes(),
            )
        )
        super().admit(req_slot, params, prompt_ids, output_ids)

    def execute(
        self,
        prepared: PreparedStep,
        *,
        return_logits: bool = False,
        vocab_mask: VocabMask | None = None,
    ) -> StepOutput:
        if self._broken is None:
            self._broken = self.followers.failure()
        if self._broken is not None:
            raise TPGroupBroken(self._broken)
        rows = None if vocab_mask is None else vocab_mask.rows
        payload = encode_step(prepared.plan, self._admissions, return_logits, rows)
        self._admissions = []
        if vocab_mask is not None:
            vocab_mask = broadcast_mask(self, vocab_mask.rows, source=vocab_mask)
        try:
            self.followers.send(payload)
            return super().execute(prepared, return_logits=return_logits, vocab_mask=vocab_mask)
        except Exception as exc:
            cause = self.followers.failure(grace_s=1.0)
            self._broken = cause or f"step {prepared.plan.id} failed on rank 0: {exc!r}"
            logger.error("tensor parallelism: %s; no further step can run", self._broken)
            raise TPGroupBroken(self._broken) from exc

    def close(self) -> None:
        """Stops the followers, then frees rank 0's memory."""
        self.followers.close()
        super().close()


def follow_steps(runner: ModelRunner, steps: zmq.Socket[bytes]) -> None:
    """A follower's loop: runs the steps arriving on `steps` in order until a stop message.
    Raises RankZeroLost when the connection to rank 0 drops first."""
    monitor = steps.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    poller = zmq.Poller()
    poller.register(steps, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll())
            # Messages first: a stop message sent just before rank 0 closed its socket is
            # read before the disconnection it causes.
            if steps in ready:
                message = decode_message(steps.recv())
                if isinstance(message, StopMessage):
                    return
                for a in message.admissions:
                    ids = np.frombuffer(a.prompt_ids, dtype=np.int64).tolist()
                    out = np.frombuffer(a.output_ids, dtype=np.int64).tolist()
                    runner.admit(a.req_slot, a.params, ids, out)
                prepared = runner.prepare(plan_of(message))
                mask = None
                if message.mask_rows:
                    mask = broadcast_mask(runner, np.frombuffer(message.mask_rows, np.int64))
                runner.execute(prepared, return_logits=message.return_logits, vocab_mask=mask)
            elif monitor in ready:
                raise RankZeroLost("the connection to tensor-parallel rank 0 dropped")
    finally:
        steps.disable_monitor()
        monitor.close(linger=0)


__all__ = [
    "Admission",
    "BroadcastMask",
    "RankZeroLost",
    "StepMessage",
    "StepSink",
    "StopMessage",
    "TPGroupBroken",
    "TPRunner",
    "broadcast_mask",
    "decode_message",
    "encode_step",
    "follow_steps",
    "plan_of",
]
