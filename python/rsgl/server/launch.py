"""`rsgl serve` / `python -m rsgl.launch_server`: start the scheduler process, then HTTP.

Start-up is ordered: the frontend binds its ZeroMQ sockets, spawns the scheduler process and
waits for its `Ready` (model loaded, pool sized) before it accepts connections. SIGINT or
SIGTERM aborts in-flight requests, then stops uvicorn and the scheduler. If the scheduler
process dies, a watchdog logs it and takes the server down instead of leaving it hanging.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI

from rsgl.args import EngineArgs, ServerArgs, add_cli_args, from_cli
from rsgl.gc_tuning import freeze_startup_objects
from rsgl.server import ipc
from rsgl.server.app import ServerState, StateHolder, create_app
from rsgl.server.frontend import Frontend
from rsgl.server.metrics import ServerMetrics
from rsgl.tokenizer.loader import load_tokenizer

logger = logging.getLogger("rsgl.server")

READY_TIMEOUT_S = 900.0
WATCHDOG_INTERVAL_S = 0.5
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_parser() -> argparse.ArgumentParser:
    """`rsgl serve`'s flags: one per `ServerArgs` field."""
    p = argparse.ArgumentParser(prog="rsgl serve", description="OpenAI-compatible rsgl server")
    add_cli_args(p, ServerArgs)
    return p


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    return server_args(ns).engine_args()


def server_args(ns: argparse.Namespace) -> ServerArgs:
    args: ServerArgs = from_cli(ServerArgs, ns)
    return args


class _Server(uvicorn.Server):
    """uvicorn with a graceful drain: the first SIGTERM refuses new requests (503) and lets
    in-flight ones finish for up to `drain_timeout_s`, then aborts the rest and exits 0. A
    second SIGTERM, or SIGINT, aborts in-flight requests at once."""

    frontend: Frontend | None = None
    loop: asyncio.AbstractEventLoop | None = None
    drain_timeout_s: float = 30.0
    # Set when the scheduler process died: the server then exits non-zero.
    scheduler_died = False
    _draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and not self._draining and self.loop and self.frontend:
            self._draining = True
            logger.info("SIGTERM: draining in-flight requests, then shutting down")
            self.loop.call_soon_threadsafe(asyncio.ensure_future, self._drain_then_exit())
            return
        if self.frontend is not None:
            self.frontend.abort_all("the server is shutting down")
        super().handle_exit(sig, frame)

    async def _drain_then_exit(self) -> None:
        assert self.frontend is not None
        await self.frontend.drain(self.drain_timeout_s)
        # Not through handle_exit: uvicorn would re-raise the signal after shutting down,
        # and a drained server exits 0.
        self.should_exit = True


def make_app(ns: argparse.Namespace, server: _Server | None = None) -> FastAPI:
    """The app with a lifespan that owns the scheduler process."""
    args = engine_args(ns)
    model_name = ns.served_model_name or (
        Path(ns.model_path).stem if ns.model_path else DEFAULT_MODEL_NAME
    )
    holder = StateHolder()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ipc_dir = tempfile.mkdtemp(prefix="rsgl-ipc-")
        command_addr = f"ipc://{ipc_dir}/commands"
        event_addr = f"ipc://{ipc_dir}/events"
        ctx = zmq.asyncio.Context()
        commands = ctx.socket(zmq.PUSH)
        commands.bind(command_addr)
        events = ctx.socket(zmq.PULL)
        events.bind(event_addr)
        proc = mp.get_context("spawn").Process(
            target=_scheduler_main,
            args=(args, command_addr, event_addr),
            name="rsgl-scheduler",
            daemon=True,
        )
        proc.start()
        logger.info("scheduler process %d started; loading the model", proc.pid)
        info = await _wait_ready(events, proc)
        tokenizer = load_tokenizer(ns.tokenizer_path or info["model_dir"])
        metrics = ServerMetrics(model_name, ns.enable_metrics_compat)
        frontend = Frontend(
            tokenizer,
            info,
            metrics,
            commands,
            events,
            max_queued_requests=ns.max_queued_requests,
            log_requests=ns.log_requests,
            request_timeout_s=ns.request_timeout_s,
            stream_stall_timeout_s=ns.stream_stall_timeout_s,
            stream_interval=ns.stream_interval,
        )
        state = ServerState(
            frontend=frontend,
            tokenizer=tokenizer,
            model_name=model_name,
            limits=args.request_limits(
                int(info["vocab_size"]), int(info["context_length"]), int(info["max_prompt_len"])
            ),
            args=server_args(ns),
            api_key=ns.api_key,
            is_alive=proc.is_alive,
        )
        holder.state = state
        freeze_startup_objects()
        if server is not None:
            server.frontend = frontend
            server.loop = asyncio.get_running_loop()
            server.drain_timeout_s = ns.graceful_shutdown_timeout
        events_task = asyncio.ensure_future(frontend.run_events())
        timers_task = asyncio.ensure_future(frontend.run_timers())
        watchdog = asyncio.ensure_future(_watchdog(proc, frontend, server))
        logger.info("rsgl is ready on http://%s:%d (model %s)", ns.host, ns.port, model_name)
        try:
            yield
        finally:
            frontend.abort_all("the server is shutting down")
            watchdog.cancel()
            timers_task.cancel()
            if proc.is_alive():
                await commands.send(ipc.encoder.encode(ipc.Shutdown()))
                await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
            if proc.is_alive():
                proc.terminate()
            events_task.cancel()
            commands.close(linger=0)
            events.close(linger=0)
            ctx.term()
            for name in ("commands", "events"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(ipc_dir, name))
            with contextlib.suppress(OSError):
                os.rmdir(ipc_dir)

    return create_app(holder, lifespan, max_request_bytes=ns.max_request_bytes)


def _scheduler_main(args: EngineArgs, command_addr: str, event_addr: str) -> None:
    """The scheduler process's entry point. Its module (torch, the model) is imported here,
    in the child: the frontend process never loads torch."""
    from rsgl.server.scheduler_process import run_scheduler_process

    run_scheduler_process(args, command_addr, event_addr)


async def _wait_ready(events: zmq.asyncio.Socket, proc: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    while loop.time() < deadline:
        if not proc.is_alive():
            raise RuntimeError(
                f"the scheduler process exited with code {proc.exitcode} during start-up"
            )
        if await events.poll(500):
            event = ipc.event_decoder.decode(await events.recv())
            if isinstance(event, ipc.Ready):
                return event.info
    raise RuntimeError(f"the scheduler process was not ready after {READY_TIMEOUT_S:.0f} s")


async def _watchdog(proc: Any, frontend: Frontend, server: _Server | None) -> None:
    while proc.is_alive():
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    logger.error(
        "rsgl: the scheduler process exited unexpectedly (exit code %s); shutting down",
        proc.exitcode,
    )
    frontend.healthy = False
    frontend.abort_all("the scheduler process died")
    if server is not None:
        server.scheduler_died = True
        server.should_exit = True


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rsgl serve`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ns = build_parser().parse_args(argv)
    server = _Server(uvicorn.Config(FastAPI(), host=ns.host, port=ns.port))
    server.config = uvicorn.Config(
        make_app(ns, server),
        host=ns.host,
        port=ns.port,
        log_level="info",
        timeout_graceful_shutdown=5,
    )
    sockets = None
    if ns.socket_send_buffer_bytes is not None:
        sockets = [_listening_socket(ns.host, ns.port, ns.socket_send_buffer_bytes)]
    server.run(sockets=sockets)
    return 1 if server.scheduler_died else 0


def _listening_socket(host: str, port: int, send_buffer: int) -> socket.socket:
    """A listening socket whose accepted connections get a fixed kernel send buffer (Linux
    copies SO_SNDBUF to them), instead of autotuning's up to several MB each."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(addr)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    raise SystemExit(main())
