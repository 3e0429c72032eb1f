"""The scheduler process: rsgl._core, the model and the loop, fed by the frontend over ZeroMQ.

It owns no HTTP and no text: requests arrive tokenized, and each step's `TokenUpdate`s go
back as one message (the frontend detokenizes and reports stop strings back).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import zmq

from rsgl.args import EngineArgs
from rsgl.engine import build_stack
from rsgl.gc_tuning import freeze_startup_objects
from rsgl.outputs import TokenUpdate
from rsgl.sampling_params import SamplingParams
from rsgl.scheduler.loop import SchedulerLoop
from rsgl.server import ipc

logger = logging.getLogger("rsgl.scheduler")

STATS_INTERVAL_S = 1.0


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


def run_scheduler_process(args: EngineArgs, command_addr: str, event_addr: str) -> None:
    """Process entry point: serve commands until `Shutdown` (or the frontend goes away)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ctx = zmq.Context()
    events = ctx.socket(zmq.PUSH)
    events.connect(event_addr)
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_addr)
    outbox = _Outbox(events)
    stack = build_stack(args)
    loop = SchedulerLoop(
        stack.core, stack.runner, outbox.emit, overlap=not args.disable_overlap_schedule
    )
    info = {
        "context_length": stack.context_length,
        "max_total_tokens": stack.max_total_tokens,
        "kv_buffer_size": stack.core.kv_buffer_size,
        "max_prompt_len": stack.core.max_prompt_len,
        "vocab_size": stack.config.vocab_size,
        "model_dir": str(stack.model_dir),
        "eos_token_ids": list(stack.config.eos_token_ids),
        "scheduler_pid": os.getpid(),
        **stack.info(),
    }
    freeze_startup_objects()
    outbox.send(ipc.Ready(info))
    loop.start()
    stop = threading.Event()

    def send_stats() -> None:
        stats: dict[str, Any] = dict(stack.core.stats())
        stats["steps"] = loop.steps
        stats["step_failures"] = loop.step_failures
        stats["rss_bytes"] = _rss_bytes()
        outbox.send(ipc.Stats(stats))

    def stats_timer() -> None:
        while not stop.wait(STATS_INTERVAL_S):
            loop.post(send_stats)

    threading.Thread(target=stats_timer, name="rsgl-stats", daemon=True).start()
    try:
        while True:
            if not commands.poll(1000):
                if loop.error is not None:
                    raise RuntimeError("the scheduler loop failed") from loop.error
                continue
            command = ipc.command_decoder.decode(commands.recv())
            if isinstance(command, ipc.Shutdown):
                break
            _dispatch(command, loop, stack.core, outbox)
            if loop.error is not None:
                raise RuntimeError("the scheduler loop failed") from loop.error
    finally:
        stop.set()
        loop.shutdown()
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


def _dispatch(command: ipc.Command, loop: SchedulerLoop, core: Any, outbox: _Outbox) -> None:
    if isinstance(command, ipc.AddRequest):
        params = SamplingParams(**command.params)
        loop.submit(command.rid, command.prompt_ids, params, priority=command.priority)
    elif isinstance(command, ipc.AbortRequest):
        loop.abort(command.rid, command.message, wait=False)
    elif isinstance(command, ipc.FinishRequest):
        loop.finish(command.rid, command.matched)
    elif isinstance(command, ipc.FlushCache):
        token = command.token
        loop.post(lambda: outbox.send(ipc.FlushResult(token, bool(core.flush_cache()))))
