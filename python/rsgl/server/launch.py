"""`rsgl serve` / `python -m rsgl.launch_server`: start the scheduler processes, then HTTP.

Start-up is ordered: the frontend binds its ZeroMQ sockets, spawns one scheduler process per
data-parallel rank (`--dp-size`, default 1) and waits for every `Ready` (model loaded, pool
sized) before it accepts connections. SIGINT or SIGTERM aborts in-flight requests, then
stops uvicorn and the schedulers; during start-up, it stops the schedulers and exits at once.
However this process ends (SIGKILL included), its schedulers die with it
(`rsgl.parent_death`). A watchdog watches every scheduler process: when one dies, it logs
the rank and its exit code, that rank's requests fail and the others keep serving; when
none is left, it takes the server down (exit code 1) instead of leaving it hanging.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from rsgl.args import EngineArgs, ServerArgs, add_cli_args, from_cli
from rsgl.gc_tuning import freeze_startup_objects
from rsgl.reasoning import reasoning_end_ids
from rsgl.server.app import ServerState, StateHolder, create_app
from rsgl.server.frontend import Frontend
from rsgl.server.metrics import ServerMetrics
from rsgl.server.ranks import SchedulerRanks, check_data_parallel
from rsgl.tokenizer.loader import load_tokenizer

logger = logging.getLogger("rsgl.server")

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
    second SIGTERM, or SIGINT, aborts in-flight requests at once. Before the server is
    ready, either signal stops the scheduler processes and the server at once."""

    # The scheduler processes, from before they start; the frontend, once they are ready.
    ranks: SchedulerRanks | None = None
    frontend: Frontend | None = None
    loop: asyncio.AbstractEventLoop | None = None
    drain_timeout_s: float = 30.0
    # Set when every scheduler process died: the server then exits non-zero.
    scheduler_died = False
    _draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.frontend is None:
            self._exit_while_starting(sig)
        if sig == signal.SIGTERM and not self._draining and self.loop and self.frontend:
            self._draining = True
            logger.info("SIGTERM: draining in-flight requests, then shutting down")
            self.loop.call_soon_threadsafe(asyncio.ensure_future, self._drain_then_exit())
            return
        if self.frontend is not None:
            self.frontend.abort_all("the server is shutting down")
        super().handle_exit(sig, frame)

    def _exit_while_starting(self, sig: int) -> None:
        """No request to drain, and uvicorn would act on the signal only once every rank is
        ready (minutes, for a large model): a supervisor's SIGKILL would come first. Dies of
        the signal now, as uvicorn would have after its shutdown."""
        logger.info(
            "%s during start-up: stopping the scheduler processes", signal.Signals(sig).name
        )
        if self.ranks is not None:
            self.ranks.abandon()
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)

    async def _drain_then_exit(self) -> None:
        assert self.frontend is not None
        await self.frontend.drain(self.drain_timeout_s)
        # Not through handle_exit: uvicorn would re-raise the signal after shutting down,
        # and a drained server exits 0.
        self.should_exit = True


def make_app(ns: argparse.Namespace, server: _Server | None = None) -> FastAPI:
    """The app with a lifespan that owns the scheduler processes."""
    args = engine_args(ns)
    try:
        check_data_parallel(args)
    except ValueError as exc:
        raise SystemExit(f"rsgl serve: {exc}") from None
    model_name = ns.served_model_name or (
        Path(ns.model_path).stem if ns.model_path else DEFAULT_MODEL_NAME
    )
    holder = StateHolder()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ranks = SchedulerRanks(args)
        if server is not None:
            server.ranks = ranks
        tasks: list[asyncio.Future[Any]] = []
        frontend: Frontend | None = None
        try:
            ranks.start()
            infos = await ranks.wait_ready()
            info = infos[0]
            tokenizer = load_tokenizer(ns.tokenizer_path or info["model_dir"])
            metrics = ServerMetrics(model_name, ns.enable_metrics_compat, args.dp_size)
            frontend = Frontend(
                tokenizer,
                infos,
                metrics,
                ranks.commands,
                ranks.events,
                load_balance_method=args.load_balance_method,
                max_queued_requests=ns.max_queued_requests,
                log_requests=ns.log_requests,
                request_timeout_s=ns.request_timeout_s,
                stream_stall_timeout_s=ns.stream_stall_timeout_s,
                stream_interval=ns.stream_interval,
                reasoning_end_ids=reasoning_end_ids(tokenizer, args.reasoning_parser),
            )
            state = ServerState(
                frontend=frontend,
                tokenizer=tokenizer,
                model_name=model_name,
                limits=args.request_limits(
                    int(info["vocab_size"]),
                    int(info["context_length"]),
                    int(info["max_prompt_len"]),
                ),
                args=server_args(ns),
                api_key=ns.api_key,
                is_alive=ranks.is_alive,
            )
            holder.state = state
            freeze_startup_objects()
            if server is not None:
                server.frontend = frontend
                server.loop = asyncio.get_running_loop()
                server.drain_timeout_s = ns.graceful_shutdown_timeout
            tasks.append(asyncio.ensure_future(frontend.run_events()))
            tasks.append(asyncio.ensure_future(frontend.run_timers()))
            tasks.append(asyncio.ensure_future(ranks.watch(frontend, _all_dead(frontend, server))))
            logger.info(
                "rsgl is ready on http://%s:%d (model %s%s)",
                ns.host,
                ns.port,
                model_name,
                f", {args.dp_size} data-parallel ranks, {args.load_balance_method}"
                if args.dp_size > 1
                else "",
            )
            yield
        finally:
            if frontend is not None:
                frontend.abort_all("the server is shutting down")
            # The event reader stays up while the ranks stop, and goes before their sockets.
            for task in tasks[1:]:
                task.cancel()
            await ranks.stop()
            for task in tasks[:1]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ranks.close()

    return create_app(holder, lifespan, max_request_bytes=ns.max_request_bytes)


def _all_dead(frontend: Frontend, server: _Server | None) -> Callable[[], None]:
    """What the watchdog does once no rank is left: fail what is pending, exit non-zero."""

    def stop() -> None:
        frontend.abort_all("the scheduler process died")
        if server is not None:
            server.scheduler_died = True
            server.should_exit = True

    return stop


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rsgl serve`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ns = build_parser().parse_args(argv)
    if ns.node_rank > 0:
        # Another node of a multi-node tensor-parallel group: only its model ranks run here
        # (no HTTP, no frontend, no core) until rank 0 stops them.
        from rsgl.model_executor.tp_launch import run_node

        return run_node(engine_args(ns))
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
