"""A scheduler process: rsgl._core, the model and the loop, fed by the frontend over ZeroMQ.

It owns no HTTP and no text: requests arrive tokenized, and each step's `TokenUpdate`s go
back as one message (the frontend detokenizes and reports stop strings back). With
`--dp-size N` the frontend runs N of these, one per data-parallel rank, each a full replica.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

import zmq

from rsgl.args import EngineArgs
from rsgl.gc_tuning import freeze_startup_objects
from rsgl.outputs import TokenUpdate
from rsgl.sampling_params import SamplingParams
from rsgl.scheduler.loop import SchedulerLoop
from rsgl.server import ipc
from rsgl.stack import build_loop, build_stack

logger = logging.getLogger("rsgl.scheduler")

STATS_INTERVAL_S = 1.0
# How long a command poll waits: also how often the loop's health and the parent are checked.
POLL_MS = 1000


class _Outbox:
    """Sends the scheduler's events; used on the loop thread only (after `Ready`)."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self.socket = socket

    def emit(self, updates: list[TokenUpdate]) -> None:
        """The loop's emit: one message per step."""
        if updates:
            self.send(ipc.StepOutputs(updates))

    def send(self, event: ipc.Event) -> None:
        self.socket.send(ipc.encoder.encode(event), copy=False)


def run_scheduler_process(
    args: EngineArgs, command_addr: str, event_addr: str, dp_rank: int = 0
) -> None:
    """Process entry point: serve commands until `Shutdown`, or until the frontend process
    is gone (this process is not a daemon, so that it may start tensor-parallel workers of
    its own; without this check an orphan would keep its model in memory forever)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    events = ctx.socket(zmq.PUSH)
    events.connect(event_addr)
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_addr)
    outbox = _Outbox(events)
    stack = build_stack(args)
    loop = build_loop(stack, args, outbox.emit, dp_rank=dp_rank)
    info = {
        "context_length": stack.context_length,
        "max_total_tokens": stack.max_total_tokens,
        "kv_buffer_size": stack.core.kv_buffer_size,
        "max_prompt_len": stack.core.max_prompt_len,
        "vocab_size": stack.config.vocab_size,
        "model_dir": str(stack.model_dir),
        "eos_token_ids": list(stack.config.eos_token_ids),
        "scheduler_pid": os.getpid(),
        "dp_rank": dp_rank,
        "kv_cache_storage_dtype": stack.kv_cache_dtype,
        "attention_backend": getattr(stack.runner, "attention_backend", None),
        "cuda_graphs": getattr(stack.runner, "graphs", None) is not None,
        **stack.info(),
    }
    freeze_startup_objects()
    outbox.send(ipc.Ready(info, dp_rank))
    loop.start()
    stop = threading.Event()

    def send_stats(token: int | None = None) -> None:
        stats: dict[str, Any] = dict(stack.core.stats())
        stats["steps"] = loop.steps
        stats["step_failures"] = loop.step_failures
        stats["rss_bytes"] = _rss_bytes()
        stats.update(loop.grammar_stats())
        stats.update(loop.spec_stats())
        outbox.send(ipc.Stats(stats, dp_rank, token))

    def stats_timer() -> None:
        while not stop.wait(STATS_INTERVAL_S):
            loop.post(send_stats)

    threading.Thread(target=stats_timer, name="rsgl-stats", daemon=True).start()
    try:
        while True:
            if not commands.poll(POLL_MS):
                if loop.error is not None:
                    raise RuntimeError("the scheduler loop failed") from loop.error
                if os.getppid() != parent:
                    logger.error("data-parallel rank %d: the frontend process is gone", dp_rank)
                    break
                continue
            command = ipc.command_decoder.decode(commands.recv())
            if isinstance(command, ipc.Shutdown):
                break
            if isinstance(command, ipc.GetStats):
                loop.post(functools.partial(send_stats, command.token))
            else:
                _dispatch(command, loop, stack.core, outbox, dp_rank)
            if loop.error is not None:
                raise RuntimeError("the scheduler loop failed") from loop.error
    finally:
        stop.set()
        loop.shutdown()
        # Frees the model; a tensor-parallel runner also stops its other ranks.
        close = getattr(stack.runner, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                logger.exception("closing the model runner failed")
        events.close(linger=1000)
        commands.close(linger=0)
        ctx.term()


def _rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _dispatch(
    command: ipc.Command, loop: SchedulerLoop, core: Any, outbox: _Outbox, dp_rank: int
) -> None:
    if isinstance(command, ipc.AddRequest):
        params = SamplingParams(**command.params)
        loop.submit(command.rid, command.prompt_ids, params, priority=command.priority)
    elif isinstance(command, ipc.AbortRequest):
        loop.abort(command.rid, command.message, wait=False)
    elif isinstance(command, ipc.FinishRequest):
        loop.finish(command.rid, command.matched)
    elif isinstance(command, ipc.FlushCache):
        token = command.token
        loop.post(lambda: outbox.send(ipc.FlushResult(token, bool(core.flush_cache()), dp_rank)))
    elif isinstance(command, ipc.CheckIntegrity):
        check_token = command.token

        def check() -> None:
            try:
                core.check()
            except Exception as exc:  # noqa: BLE001 - reported to the caller, not raised here
                outbox.send(ipc.IntegrityResult(check_token, str(exc), dp_rank))
            else:
                outbox.send(ipc.IntegrityResult(check_token, None, dp_rank))

        loop.post(check)
