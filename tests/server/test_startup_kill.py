"""A launcher killed at any moment of its start-up leaves no process behind.

`rsgl serve` gets SIGTERM, SIGINT or SIGKILL as from a supervisor (the launcher alone, not
its process group; SIGKILL follows SIGTERM or SIGINT after a grace period) at once, as its
scheduler process appears, while the scheduler imports torch and loads the model, and once
the server is ready; with `--dp-size 2` and with `--tp-size 2` (a follower under the
scheduler) too. Every process it started, however deep, must then be gone. They are found
by a marker in their environment, which every descendant inherits, wherever an orphan was
reparented. Its socket directory goes too: with it, or, after a SIGKILL, at the next start.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from rsgl.bench.serve_process import free_port
from rsgl.server.ranks import (
    IPC_DIR_PREFIX,
    make_ipc_dir,
    remove_stale_ipc_dirs,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MARK = "RSGL_STARTUP_KILL_TEST"
# Generous: each case waits only as long as it takes.
MOMENT_TIMEOUT_S = 120.0
GONE_TIMEOUT_S = 30.0
# A supervisor's grace period between SIGTERM (or SIGINT) and SIGKILL.
GRACE_S = 2.0
POLL_S = 0.05

NULL = ("--load-format", "null")
# A small pool, so that sizing it is quick.
SMALL = ("--max-total-tokens", "4096", "--max-running-requests", "8")
# A line logged by another process than the frontend: the scheduler has imported torch and
# is building its model.
SCHEDULER_LOGGED = re.compile(r"^\S+ \S+ rsgl\.(?!server )", re.MULTILINE)


def marked_processes(mark: str) -> dict[int, str]:
    """pid -> command line of every live process (zombies aside) whose environment carries
    the marker: the launcher and all its descendants."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours
            continue
        if state != "Z":
            found[int(entry)] = cmdline
    return found


@dataclasses.dataclass
class Launch:
    """One `rsgl serve` under a fresh marker."""

    proc: subprocess.Popen[bytes]
    mark: str
    log_path: Path
    url: str

    def children(self, needle: str) -> list[int]:
        found = marked_processes(self.mark).items()
        return [pid for pid, cmdline in found if pid != self.proc.pid and needle in cmdline]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


# Each moment waits until the launch reaches it.
MOMENTS: dict[str, Callable[[Launch], bool]] = {
    "at-once": lambda launch: True,
    "scheduler-spawned": lambda launch: bool(launch.children("spawn_main")),
    "scheduler-loading": lambda launch: SCHEDULER_LOGGED.search(launch.log()) is not None,
    "follower-spawned": lambda launch: bool(launch.children("follower_main")),
    "ready": Launch.healthy,
}


@dataclasses.dataclass(frozen=True)
class Case:
    sig: signal.Signals
    moment: str
    flags: tuple[str, ...] = NULL

    def __str__(self) -> str:
        flags = " ".join(f for f in self.flags if f.startswith("--")).replace("--", "")
        return f"{self.sig.name}-{self.moment}-{flags.replace(' ', '-') or 'model'}"


CASES = [
    Case(signal.SIGINT, "at-once"),
    # A scheduler that has not yet run a line of its own: the race that left orphans.
    Case(signal.SIGKILL, "scheduler-spawned"),
    Case(signal.SIGTERM, "scheduler-spawned", ("--dp-size", "2", *NULL)),
    # The embedded model, loading.
    Case(signal.SIGTERM, "scheduler-loading", ()),
    Case(signal.SIGKILL, "scheduler-loading", ()),
    Case(signal.SIGINT, "scheduler-loading", ("--dp-size", "2", *NULL)),
    Case(signal.SIGKILL, "ready"),
    # A grandchild: the follower under rank 0's scheduler process, as it starts.
    Case(signal.SIGKILL, "follower-spawned", ("--tp-size", "2")),
]


def test_the_sweep_removes_only_the_socket_directories_of_gone_processes() -> None:
    root = tempfile.gettempdir()
    # A maker that is gone: its lock file is there, and nobody holds the lock.
    make = "from rsgl.server.ranks import make_ipc_dir; print(make_ipc_dir()[0])"
    made = subprocess.run([sys.executable, "-c", make], check=True, capture_output=True, text=True)
    gone = made.stdout.strip()
    Path(gone, "events").touch()
    os.utime(Path(gone, "lock"), (0, 0))  # past the grace a maker has to lock it
    live, lock = make_ipc_dir()  # this process holds its lock
    # Without a lock file: one being made (kept) and an old one (an earlier version's).
    fresh = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX, dir=root)
    old = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX, dir=root)
    os.utime(old, (0, 0))  # made in 1970: far older than UNLOCKED_STALE_S
    try:
        removed = remove_stale_ipc_dirs()
        assert gone in removed and old in removed
        assert not os.path.exists(gone) and not os.path.exists(old)
        assert os.path.isdir(live) and os.path.isdir(fresh)
    finally:
        lock.close()
        shutil.rmtree(live)
        os.rmdir(fresh)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_launcher_killed_during_start_up_leaves_no_process(case: Case, tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "rsgl", "serve", "--port", str(port), *SMALL, *case.flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, MARK: mark},
            start_new_session=True,
        )
    launch = Launch(proc, mark, log_path, f"http://127.0.0.1:{port}")
    try:
        reach(launch, case.moment)
        proc.send_signal(case.sig)
        try:
            proc.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
        left = wait_gone(launch)
        assert not left, (
            f"left after {GONE_TIMEOUT_S:.0f} s: "
            + "; ".join(f"pid {pid}: {cmdline}" for pid, cmdline in left.items())
            + f"\n{launch.log()}"
        )
        # Its socket directory: removed by the launcher, or, when it could not (SIGKILL),
        # by the next start's sweep of the directories whose maker is gone.
        proc.wait(GONE_TIMEOUT_S)
        mine = glob.glob(os.path.join(tempfile.gettempdir(), f"{IPC_DIR_PREFIX}{proc.pid}-*"))
        if mine:
            assert case.sig == signal.SIGKILL or launch.proc.returncode == -signal.SIGKILL, mine
            for path in mine:  # as a start a minute later finds it
                os.utime(os.path.join(path, "lock"), (0, 0))
            assert set(mine) <= set(remove_stale_ipc_dirs())
    finally:
        for pid in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def reach(launch: Launch, moment: str) -> None:
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    while not MOMENTS[moment](launch):
        if launch.proc.poll() is not None:
            pytest.fail(f"rsgl serve exited ({launch.proc.returncode}):\n{launch.log()}")
        if time.monotonic() > deadline:
            pytest.fail(f"start-up never reached {moment}:\n{launch.log()}")
        time.sleep(POLL_S)


def wait_gone(launch: Launch) -> dict[int, str]:
    """Polls until no marked process is left (reaping the launcher); what is left then."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        launch.proc.poll()
        left = marked_processes(launch.mark)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
