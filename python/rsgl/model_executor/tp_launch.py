"""Starting and stopping a tensor-parallel group: rank 0 in the engine, followers beside it.

Rank 0 runs where the engine runs (the `rsgl.Engine` process, or the server's scheduler
process), so neither needs to know about tensor parallelism beyond `build_stack`. It starts
the followers of its node as child processes, each with one `FollowerLaunch` on its command
line (`subprocess`, not `multiprocessing`: it works whatever started rank 0, a daemonic
multiprocessing child included, which may not have children, and a follower re-imports
nothing of its parent's `__main__`). A node with `node_rank > 0`
(`rsgl serve --nnodes N --node-rank K ...`) runs only its followers (`run_node`).

The ranks meet in a `TCPStore` that rank 0 serves at `--dist-init-addr` (one node: 127.0.0.1
and a free port). Through it the group's backends connect (`TPGroup.create`), and rank 0
publishes, as soon as it knows them, what every rank loads (`LoadSpec`: so all ranks load the
same dtype, the one rank 0 chose) and, once its core is sized, how every rank sizes its
runner (`RunnerSpec`) with the ZeroMQ endpoint rank 0 pushes its steps to; each follower
then reports ready. Objects travel through the store rather than a gloo broadcast so that
the NCCL group on CUDA needs no second, gloo, group.

Rank 0 stops the followers with a stop message (`Followers.close`, which `TPRunner.close`,
`Engine.shutdown` and, through atexit, the scheduler process's exit all reach); a follower
whose connection to rank 0 drops exits on its own, and one whose parent dies, at any moment
of its start-up too, dies with it (`rsgl.parent_death`), so a killed rank 0 leaves no orphans.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

# torch.distributed re-exports TCPStore without declaring it (mypy's strict re-export rule).
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from rsgl.distributed.group import TPGroup, TPRank
from rsgl.distributed.sharding import TPShard
from rsgl.model_executor.model_runner import ModelRunner
from rsgl.model_executor.tp_worker import STOP, RankZeroLost, TPGroupBroken, TPRunner, follow_steps
from rsgl.models.config import ModelConfig
from rsgl.models.loader import LoadedModel, load_model, resolve_model_dir
from rsgl.parent_death import ParentLink

if TYPE_CHECKING:
    from rsgl.args import EngineArgs

logger = logging.getLogger(__name__)

# Start-up may wait for a model to load on every rank, or for another node to be started.
START_TIMEOUT_S = 900.0
# A collective that does not complete in this time raises. A rank that died makes gloo raise
# at once; this bounds a rank that hangs. Generous: between two collectives a rank computes
# one layer, which on a CPU can take seconds for a long prefill.
COLLECTIVE_TIMEOUT_S = 300.0
# How long rank 0 lets followers finish after the stop message before killing them.
STOP_GRACE_S = 10.0
POLL_S = 0.1
_LOAD_KEY = "rsgl/load"
_RUNNER_KEY = "rsgl/runner"


class FollowerLaunch(msgspec.Struct, frozen=True):
    """What a follower process is started with: its rank and where the group meets."""

    rank: int
    tp_size: int
    host: str
    port: int
    device: str


class LoadSpec(msgspec.Struct, frozen=True):
    """What every rank loads: rank 0's model, dtype, seed and thread count."""

    model_path: str | None
    dtype: str
    load_format: str
    seed: int
    max_positions: int | None
    cpu_threads: int
    quantization: str | None = None
    quantization_group_size: int | None = None


class RunnerSpec(msgspec.Struct, frozen=True):
    """How every rank sizes its runner (the KV slots of rank 0's core), and the ZeroMQ
    endpoint each follower receives its steps on (keyed by rank, as a string)."""

    kv_buffer_size: int
    max_running_requests: int
    context_len: int
    attention_backend: str | None
    kv_cache_dtype: str
    endpoints: dict[str, str]
    # STANDALONE speculation: rank 0's draft model proposes every verify step's drafts, and
    # the followers take them from rank 0 (`ModelRunner.drafts_from_rank0`).
    drafts_from_rank0: bool = False


def check_tensor_parallel(args: EngineArgs, config: ModelConfig) -> list[TPShard]:
    """Every rank's slice, or ValueError naming what cannot work (before anything starts)."""
    if args.load_format == "null":
        raise ValueError("load_format null runs no model: tensor parallelism needs tp_size 1")
    if args.dp_size > 1 and args.nnodes > 1:
        raise ValueError("data parallelism over several nodes is not supported (nnodes > 1)")
    device = torch.device(args.device)
    per_node = args.tp_size // args.nnodes
    if device.type == "cuda" and (device.index or 0) + per_node > torch.cuda.device_count():
        raise ValueError(
            f"tp_size {args.tp_size} over {args.nnodes} node(s) needs {per_node} CUDA devices "
            f"from {device} on this node; torch sees {torch.cuda.device_count()}"
        )
    return TPShard.all_of(config, args.tp_size)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the node's `local_rank`-th rank: CUDA ranks take consecutive devices
    from `device`'s index; CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def rendezvous_address(args: EngineArgs) -> tuple[str, int]:
    """Where rank 0 serves the group's store: `dist_init_addr` (host:port) when given,
    otherwise (one node) a free port on loopback."""
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"dist_init_addr must be host:port, got {args.dist_init_addr!r}")
        return host.strip("[]"), int(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1", int(s.getsockname()[1])


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def spawn_follower(launch: FollowerLaunch) -> subprocess.Popen[bytes]:
    """A follower process for `launch.rank` (a fresh interpreter: it imports torch anew,
    once it is bound to die with this process and the calling thread, see `ParentLink`)."""
    code = (
        "import sys; from rsgl.parent_death import ParentLink, die_with_parent; "
        "die_with_parent(ParentLink.decode(sys.argv[1])); "
        "from rsgl.model_executor.tp_launch import follower_main; "
        "sys.exit(follower_main(sys.argv[2:]))"
    )
    payload = msgspec.json.encode(launch).decode()
    link = ParentLink.here().encode()
    return subprocess.Popen([sys.executable, "-c", code, link, payload])


def _first_dead(procs: dict[int, subprocess.Popen[bytes]]) -> str | None:
    for rank, proc in procs.items():
        code = proc.poll()
        if code is not None:
            return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
    return None


def _kill(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        proc.kill()
        proc.wait()


def _watching(procs: dict[int, subprocess.Popen[bytes]], what: str, fn: Callable[[], Any]) -> Any:
    """Runs the blocking `fn` while watching this node's followers: one that exits fails the
    start at once, naming its rank, instead of after the timeout."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            error.append(exc)

    thread = threading.Thread(target=run, name="rsgl-tp-start", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while thread.is_alive():
        thread.join(POLL_S)
        if (dead := _first_dead(procs)) is not None:
            raise RuntimeError(f"tensor parallelism did not start ({what}): {dead}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"tensor parallelism did not start ({what}) in {START_TIMEOUT_S:.0f} s"
            )
    if error:
        raise error[0]
    return result[0]


class Followers:
    """Rank 0's handle on the other ranks: the group, the store it was formed in, a step
    socket per rank, and this node's follower processes. Implements `tp_worker.StepSink`.

    A watcher thread polls the local processes; when one exits, it logs the rank at once
    and `failure()` reports it from then on, so the next step fails with that reason.
    Followers on other nodes are seen dead through the collectives' errors. `close` runs at
    interpreter exit too (atexit), so a process that exits without shutting its engine down
    still stops its followers.
    """

    def __init__(
        self,
        store: TCPStore,
        group: TPGroup,
        procs: dict[int, subprocess.Popen[bytes]],
        context: zmq.Context[zmq.Socket[bytes]],
        sockets: dict[int, zmq.Socket[bytes]],
        endpoints: dict[str, str],
    ) -> None:
        self.store = store
        self.group = group
        self.procs = procs
        self.context = context
        self.sockets = sockets
        self.endpoints = endpoints
        self._failure: str | None = None
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="rsgl-tp-watch", daemon=True)
        self._watcher.start()
        atexit.register(self.close)

    @property
    def pids(self) -> dict[int, int]:
        """The process ids of this node's followers, by rank."""
        return {rank: proc.pid for rank, proc in self.procs.items()}

    def _watch(self) -> None:
        while not self._closed.wait(0.5):
            dead = _first_dead(self.procs)
            # Followers exit after the stop message: only an exit before it is a failure.
            if dead is not None and self._failure is None and not self._closed.is_set():
                self._failure = dead
                logger.error("%s; the tensor-parallel group cannot run another step", dead)

    def failure(self, grace_s: float = 0.0) -> str | None:
        deadline = time.monotonic() + grace_s
        while self._failure is None:
            self._failure = _first_dead(self.procs)
            if self._failure is not None or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        return self._failure

    def send(self, payload: bytes) -> None:
        for rank, sock in self.sockets.items():
            waited = 0.0
            while True:
                try:
                    sock.send(payload, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    # No connection to take it, or a full queue: the rank is dead or stuck.
                    if (dead := self.failure()) is not None:
                        raise TPGroupBroken(dead) from None
                    if waited >= COLLECTIVE_TIMEOUT_S:
                        raise TPGroupBroken(
                            f"tensor-parallel rank {rank} took no step for {waited:.0f} s"
                        ) from None
                    time.sleep(POLL_S)
                    waited += POLL_S

    def close(self, kill: bool = False) -> None:
        """Sends the stop message and waits for this node's followers (up to STOP_GRACE_S,
        then kills them). With `kill` (a failed start), or once the group is broken, they
        are killed at once: a follower in a collective that never completes cannot read
        the stop message."""
        if self._closed.is_set():
            return
        self._closed.set()
        atexit.unregister(self.close)
        kill = kill or self.failure() is not None
        if not kill:
            for sock in self.sockets.values():
                with contextlib.suppress(zmq.Again):  # a rank no longer connected
                    sock.send(STOP, zmq.NOBLOCK)
        deadline = time.monotonic() + (0.0 if kill else STOP_GRACE_S)
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if not kill:
                    logger.warning("tensor-parallel rank %d did not stop; killing it", rank)
                proc.kill()
                proc.wait()
        for sock in self.sockets.values():
            sock.close(linger=0 if kill else 1000)
        self.context.term()
        self.group.close()


def start_followers(args: EngineArgs, device: torch.device, load: LoadSpec) -> Followers:
    """Rank 0's first half of the start: spawns this node's followers, serves the store,
    forms the group (blocks until every rank, other nodes' included, has joined), publishes
    `load` and binds a step socket per follower. The caller loads rank 0's shard next (the
    followers load theirs meanwhile), then calls `start_runner`."""
    host, port = rendezvous_address(args)
    per_node = args.tp_size // args.nnodes
    procs: dict[int, subprocess.Popen[bytes]] = {}
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets: dict[int, zmq.Socket[bytes]] = {}
    try:
        for rank in range(1, per_node):
            launch = FollowerLaunch(rank, args.tp_size, host, port, str(rank_device(device, rank)))
            procs[rank] = spawn_follower(launch)
        store = TCPStore(
            host,
            port,
            args.tp_size,
            is_master=True,
            timeout=_timeout(START_TIMEOUT_S),
            wait_for_workers=False,
        )
        group = _watching(
            procs,
            "every rank joining the group",
            lambda: TPGroup.create(store, 0, args.tp_size, device, _timeout(COLLECTIVE_TIMEOUT_S)),
        )
        store.set(_LOAD_KEY, msgspec.json.encode(load).decode())
        # Several nodes: listen on every interface, where peers reach rank 0 at the host of
        # --dist-init-addr. One node: loopback only.
        bind = "tcp://*" if args.nnodes > 1 else "tcp://127.0.0.1"
        endpoints: dict[str, str] = {}
        for rank in range(1, args.tp_size):
            sockets[rank] = context.socket(zmq.PUSH)
            endpoints[str(rank)] = f"tcp://{host}:{sockets[rank].bind_to_random_port(bind)}"
    except BaseException:
        _kill(procs)
        for sock in sockets.values():
            sock.close(linger=0)
        context.term()
        raise
    return Followers(store, group, procs, context, sockets, endpoints)


def start_runner(
    followers: Followers, loaded: LoadedModel, spec: RunnerSpec, **options: Any
) -> TPRunner:
    """Rank 0's second half: publishes `spec` (with the step endpoints), builds rank 0's
    runner (`options` are ModelRunner's) and waits until every follower is ready. On an
    error the caller closes `followers` with `kill=True`."""
    full = msgspec.structs.replace(spec, endpoints=followers.endpoints)
    followers.store.set(_RUNNER_KEY, msgspec.json.encode(full).decode())
    runner = TPRunner(loaded, followers=followers, **options)
    keys = [f"rsgl/ready/{rank}" for rank in range(1, followers.group.size)]
    _watching(
        followers.procs, "every follower loading its shard", lambda: followers.store.wait(keys)
    )
    logger.info(
        "tensor parallelism: %d ranks ready (followers on this node: %s)",
        followers.group.size,
        followers.pids or "none",
    )
    return runner


def follower_main(argv: list[str]) -> int:
    """A follower process's entry point (`spawn_follower`): exit status 0 after rank 0's
    stop message, 1 when it fails or rank 0 goes away."""
    launch = msgspec.json.decode(argv[0], type=FollowerLaunch)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [tp rank {launch.rank}] %(name)s %(message)s"
    )
    try:
        run_follower(launch)
    except RankZeroLost as exc:
        logger.error("%s; exiting", exc)
        return 1
    except Exception:
        logger.exception("tensor-parallel rank %d failed", launch.rank)
        return 1
    return 0


def run_follower(launch: FollowerLaunch) -> None:
    """Joins the group, loads this rank's shard, then runs rank 0's steps until stopped."""
    device = torch.device(launch.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = TCPStore(launch.host, launch.port, is_master=False, timeout=_timeout(START_TIMEOUT_S))
    group = TPGroup.create(
        store, launch.rank, launch.tp_size, device, _timeout(COLLECTIVE_TIMEOUT_S)
    )
    load = msgspec.json.decode(store.get(_LOAD_KEY), type=LoadSpec)
    torch.set_num_threads(load.cpu_threads)
    torch.manual_seed(load.seed)
    config = ModelConfig.from_model_dir(resolve_model_dir(load.model_path))
    shard = TPShard.of(config, launch.tp_size, launch.rank)
    loaded = load_model(
        load.model_path,
        device=device,
        dtype=getattr(torch, load.dtype),
        max_positions=load.max_positions,
        load_format=load.load_format,
        seed=load.seed,
        tp=TPRank(shard, group),
        quantization=load.quantization,
        quantization_group_size=load.quantization_group_size,
    )
    spec = msgspec.json.decode(store.get(_RUNNER_KEY), type=RunnerSpec)
    runner = ModelRunner(
        loaded,
        kv_buffer_size=spec.kv_buffer_size,
        max_running_requests=spec.max_running_requests,
        context_len=spec.context_len,
        attention_backend=spec.attention_backend,
        kv_cache_dtype=spec.kv_cache_dtype,
        seed=load.seed,
    )
    runner.drafts_from_rank0 = spec.drafts_from_rank0
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    steps = context.socket(zmq.PULL)
    steps.connect(spec.endpoints[str(launch.rank)])
    store.set(f"rsgl/ready/{launch.rank}", "1")
    logger.info("ready: %s", shard.to_dict())
    try:
        follow_steps(runner, steps)
    finally:
        steps.close(linger=0)
        context.term()
        runner.close()
        group.close()
    logger.info("stopped by rank 0")


def run_node(args: EngineArgs) -> int:
    """`rsgl serve --node-rank K` (K > 0): runs this node's tensor-parallel ranks (no HTTP,
    no core) until rank 0 stops them; the exit status is 0 when every rank stopped cleanly.
    The node's first rank runs in this process, the others as children; SIGTERM stops them
    all (the group then fails on rank 0, loudly)."""
    per_node = args.tp_size // args.nnodes
    first = args.node_rank * per_node
    host, port = rendezvous_address(args)
    device = torch.device(args.device)

    def launch(rank: int) -> FollowerLaunch:
        local_device = str(rank_device(device, rank - first))
        return FollowerLaunch(rank, args.tp_size, host, port, local_device)

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    last = first + per_node - 1
    logger.info("node %d: tensor-parallel ranks %d..%d", args.node_rank, first, last)
    children = [spawn_follower(launch(rank)) for rank in range(first + 1, first + per_node)]
    try:
        code = follower_main([msgspec.json.encode(launch(first)).decode()])
    except BaseException:
        for child in children:
            child.terminate()
        raise
    codes = [code] + [child.wait() for child in children]
    return 0 if all(c == 0 for c in codes) else 1


__all__ = [
    "FollowerLaunch",
    "Followers",
    "LoadSpec",
    "RunnerSpec",
    "check_tensor_parallel",
    "follower_main",
    "rank_device",
    "rendezvous_address",
    "run_follower",
    "run_node",
    "spawn_follower",
    "start_followers",
    "start_runner",
]
