"""The scheduler processes behind one frontend: one per data-parallel rank.

`SchedulerRanks` binds the frontend's ZeroMQ sockets (a PUSH command socket per rank, one
PULL event socket every rank sends to), spawns the processes, waits for each one's `Ready`,
watches them while they serve, and stops them. The server's lifespan and
`rsgl.Engine(dp_size > 1)` both use it, so both start, watch and stop ranks the same way.
Nothing here imports torch: the processes load it themselves, after `die_with_parent`, so
that a rank never outlives the process that started it, whatever the moment that dies.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import fcntl
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import IO, Any

import zmq
import zmq.asyncio

from rsgl.args import EngineArgs
from rsgl.cpu_features import default_cpu_threads
from rsgl.parent_death import ParentLink, die_with_parent
from rsgl.server import ipc
from rsgl.server.frontend import Frontend

logger = logging.getLogger("rsgl.server")

READY_TIMEOUT_S = 900.0
WATCHDOG_INTERVAL_S = 0.5
SHUTDOWN_TIMEOUT_S = 30.0


# The socket directory's name starts so; its maker holds an exclusive `flock` on LOCK_FILE
# in it for as long as it lives (the kernel drops the lock with the process, however it
# ends), so a directory whose lock can be taken is stale.
IPC_DIR_PREFIX = "rsgl-ipc-"
LOCK_FILE = "lock"
# A directory without a lock file (one being made, or an older version's) is left alone
# until it is this old.
UNLOCKED_STALE_S = 3600.0
# A lock file younger than this may not be locked yet (its maker is between creating and
# locking it): it counts as live.
LOCK_GRACE_S = 60.0


def make_ipc_dir() -> tuple[str, IO[bytes]]:
    """A socket directory of this process, and the open lock file that marks it live."""
    path = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
    lock = open(os.path.join(path, LOCK_FILE), "wb")  # noqa: SIM115 - held for the life
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return path, lock


def remove_stale_ipc_dirs() -> list[str]:
    """Removes the socket directories of this user, in the temporary directory, whose maker
    is gone (a server killed by SIGKILL cannot remove its own); returns their paths."""
    root = tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(IPC_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or not _is_stale(path):
                continue
            shutil.rmtree(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def _is_stale(path: str) -> bool:
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        lock = open(lock_path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return time.time() - os.stat(path).st_mtime > UNLOCKED_STALE_S
    with lock:
        if time.time() - os.fstat(lock.fileno()).st_mtime < LOCK_GRACE_S:
            return False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its maker holds it
        return True


def rank_args(args: EngineArgs, dp_rank: int) -> EngineArgs:
    """One data-parallel rank's options.

    Without `--cpu-threads`, the ranks split the cores, and each rank's tensor-parallel
    ranks split its share: every process would otherwise take them all, and N processes on
    the same cores spend their time contending. On CUDA each rank gets its own devices, as
    SGLang places them: rank r's first device is `base + r * tp_size` (`--device cuda:base`,
    0 for plain `cuda`). The KV pool is sized by each rank as if it were alone: on CPU, where
    the ranks share the machine's memory, give each its size with --max-total-tokens.
    """
    if args.dp_size == 1:
        return args
    changes: dict[str, Any] = {}
    if args.cpu_threads is None:
        changes["cpu_threads"] = max(1, default_cpu_threads() // (args.dp_size * args.tp_size))
    kind, _, index = args.device.partition(":")
    if kind == "cuda":
        changes["device"] = f"cuda:{int(index or 0) + dp_rank * args.tp_size}"
    return dataclasses.replace(args, **changes)


def check_data_parallel(args: EngineArgs) -> None:
    """ValueError for the data-parallel setups rsgl does not run."""
    if args.dp_size > 1 and args.nnodes > 1:
        raise ValueError(
            "dp_size > 1 with nnodes > 1 is not supported: nodes spread the tensor-parallel "
            "ranks of one replica; for replicas on several machines run one server per "
            "machine behind sglang-router (see the README)"
        )


class SchedulerRanks:
    """`args.dp_size` scheduler processes and the frontend's sockets to them."""

    def __init__(self, args: EngineArgs) -> None:
        check_data_parallel(args)
        self.args = args
        self.dp_size = args.dp_size
        remove_stale_ipc_dirs()
        self.ipc_dir, self._ipc_lock = make_ipc_dir()
        self.ctx = zmq.asyncio.Context()
        self.event_addr = f"ipc://{self.ipc_dir}/events"
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(self.event_addr)
        self.command_addrs = [f"ipc://{self.ipc_dir}/commands-{r}" for r in range(self.dp_size)]
        self.commands: list[zmq.asyncio.Socket] = []
        for addr in self.command_addrs:
            socket = self.ctx.socket(zmq.PUSH)
            socket.bind(addr)
            self.commands.append(socket)
        # The started processes, by rank.
        self.procs: list[BaseProcess] = []
        self._ready: set[int] = set()
        self._reported: set[int] = set()
        self._stopped = False
        atexit.register(self._kill_leftovers)

    def start(self) -> None:
        """Spawns the processes. They die with this process, and with the calling thread
        when it is the main thread (`ParentLink`)."""
        link = ParentLink.here()
        spawn = mp.get_context("spawn")
        for rank, command_addr in enumerate(self.command_addrs):
            # Not a daemon: a rank may start tensor-parallel workers of its own, which a
            # daemon may not. `stop` (or, at the latest, interpreter exit) ends it here.
            proc = spawn.Process(
                target=_scheduler_main,
                args=(link, rank_args(self.args, rank), command_addr, self.event_addr, rank),
                name=f"rsgl-scheduler-{rank}" if self.dp_size > 1 else "rsgl-scheduler",
            )
            proc.start()
            self.procs.append(proc)
            who = f"data-parallel rank {rank}: " if self.dp_size > 1 else ""
            logger.info("%sscheduler process %d started; loading the model", who, proc.pid)

    def is_alive(self) -> bool:
        """Whether any rank still runs."""
        return any(p.is_alive() for p in self.procs)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    async def wait_ready(self) -> list[dict[str, Any]]:
        """Every rank's `Ready` info, by rank; RuntimeError naming the rank that died or
        the ranks that were not ready in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        infos: dict[int, dict[str, Any]] = {}
        while loop.time() < deadline:
            for rank, proc in enumerate(self.procs):
                if not proc.is_alive():
                    who = f"data-parallel rank {rank}" if self.dp_size > 1 else "the scheduler"
                    raise RuntimeError(
                        f"{who} process exited with code {proc.exitcode} during start-up"
                    )
            if await self.events.poll(500):
                event = ipc.event_decoder.decode(await self.events.recv())
                if isinstance(event, ipc.Ready):
                    infos[event.dp_rank] = event.info
                    self._ready.add(event.dp_rank)
                    if len(infos) == self.dp_size:
                        return [infos[r] for r in range(self.dp_size)]
        missing = sorted(set(range(self.dp_size)) - set(infos))
        raise RuntimeError(
            f"scheduler process(es) of rank(s) {missing} not ready after {READY_TIMEOUT_S:.0f} s"
        )

    async def watch(self, frontend: Frontend, on_all_dead: Callable[[], None]) -> None:
        """Reports each rank that dies to the frontend (its requests fail, the others keep
        serving); once none is left, calls `on_all_dead` and returns."""
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            for rank, proc in enumerate(self.procs):
                if rank in self._reported or proc.is_alive():
                    continue
                self._reported.add(rank)
                failed = frontend.rank_died(rank, proc.exitcode)
                left = self.dp_size - len(self._reported)
                where = "" if self.dp_size == 1 else f": data-parallel rank {rank} (pid {proc.pid})"
                logger.error(
                    "rsgl: the scheduler process exited unexpectedly (exit code %s)%s; "
                    "%d request(s) on it failed; %d of %d rank(s) left%s",
                    proc.exitcode,
                    where,
                    failed,
                    left,
                    self.dp_size,
                    "; shutting down" if left == 0 else "",
                )
            if len(self._reported) == self.dp_size:
                on_all_dead()
                return

    async def stop(self) -> None:
        """Asks every live rank to shut down and waits for them (terminating stragglers).
        A rank still starting reads no command before its `Ready`: it is terminated."""
        if self._stopped:
            return
        self._stopped = True
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                continue
            if rank in self._ready:
                await self.commands[rank].send(ipc.encoder.encode(ipc.Shutdown()))
            else:
                proc.terminate()
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(loop.run_in_executor(None, p.join, SHUTDOWN_TIMEOUT_S) for p in self.procs)
        )
        self._kill_leftovers()
        atexit.unregister(self._kill_leftovers)

    def close(self) -> None:
        """Releases the sockets and the socket directory (after `stop`, once nothing reads
        the event socket any more)."""
        for socket in self.commands:
            socket.close(linger=0)
        self.events.close(linger=0)
        self.ctx.term()
        for name in ("events", LOCK_FILE, *(f"commands-{r}" for r in range(self.dp_size))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.ipc_dir, name))
        self._ipc_lock.close()
        with contextlib.suppress(OSError):
            os.rmdir(self.ipc_dir)

    def abandon(self) -> None:
        """Terminates every rank without waiting for it and removes the socket directory:
        for a process about to die of a signal, which can neither wait in its handler nor
        close sockets its event loop is polling."""
        for proc in self.procs:
            proc.terminate()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        self._ipc_lock.close()

    def _kill_leftovers(self) -> None:
        """Terminates (then kills) the ranks still running; reaps them all."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _scheduler_main(
    link: ParentLink, args: EngineArgs, command_addr: str, event_addr: str, dp_rank: int
) -> None:
    """A scheduler process's entry point. Its module (torch, the model) is imported here,
    in the child (the frontend process never loads torch), once the child is bound to die
    with its parent."""
    die_with_parent(link)
    from rsgl.server.scheduler_process import run_scheduler_process

    run_scheduler_process(args, command_addr, event_addr, dp_rank)
