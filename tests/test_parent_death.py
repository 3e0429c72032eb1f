"""A child bound with `die_with_parent` does not outlive its parent: killed with it through
the parent-death signal (started from the parent's main thread) or the parent watch (from
another thread), and gone at once when its parent died before it got there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from rsgl.parent_death import ParentLink

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

GONE_TIMEOUT_S = 30.0

# The parent: starts a child bound to it (from its main thread, or from a thread that then
# ends), prints the child's pid, and sleeps until killed.
PARENT = """
import subprocess, sys, threading, time
from rsgl.parent_death import ParentLink

CHILD = (
    "import sys, time; from rsgl.parent_death import ParentLink, die_with_parent; "
    "die_with_parent(ParentLink.decode(sys.argv[1])); time.sleep(600)"
)

def start():
    link = ParentLink.here().encode()
    child = subprocess.Popen([sys.executable, "-c", CHILD, link])
    print(child.pid, flush=True)

if sys.argv[1] == "main":
    start()
else:
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, reparented to an init that may not reap it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def gone(pid: int) -> bool:
    """Whether `pid` has ended, waiting up to GONE_TIMEOUT_S for it to."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_link_reads_back_from_its_argument() -> None:
    link = ParentLink(1234, main_thread=False)
    assert ParentLink.decode(link.encode()) == link
    assert ParentLink.here() == ParentLink(os.getpid(), main_thread=True)


@contextmanager
def parent_and_child(code: str, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Runs `code`, which prints a child's pid; yields it and that pid, and kills both after."""
    parent = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        yield parent, child
    finally:
        parent.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("thread", ["main", "other"])
def test_a_child_dies_with_its_killed_parent(thread: str) -> None:
    with parent_and_child(PARENT, thread) as (parent, child):
        # The child survives a thread of its parent that ends (the parent-death signal
        # follows the thread that forked it: it is not armed then).
        time.sleep(1.0)
        assert alive(child)
        parent.kill()
        parent.wait()
        assert gone(child)


def test_a_child_whose_parent_is_already_gone_exits_at_once() -> None:
    # A link to another pid than the child's parent (this process): what a child sees whose
    # parent died before it was bound, and which was reparented.
    code = (
        "from rsgl.parent_death import ParentLink, die_with_parent; "
        "die_with_parent(ParentLink(1, main_thread=True)); print('still here')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "still here" not in out.stdout
    assert "is gone" in out.stderr


# A benchmark that starts `rsgl serve` (`rsgl.bench.serve_process.start_server`), prints
# the server's pid once it answers, and sleeps until killed.
BENCH = """
import sys, tempfile, time
from pathlib import Path
from rsgl.bench.serve_process import start_server

log = Path(tempfile.mkdtemp()) / "serve.log"
proc, _ = start_server(log, "--load-format", "null", "--max-total-tokens", "4096")
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_benchmark_takes_its_server_down() -> None:
    with parent_and_child(BENCH) as (bench, server):
        assert alive(server)
        bench.send_signal(signal.SIGTERM)  # what `pkill` sends: no finally runs in it
        bench.wait()
        assert gone(server)
