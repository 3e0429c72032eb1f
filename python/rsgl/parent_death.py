"""Child processes that die with the process that started them.

rsgl's children (the scheduler processes, tensor-parallel followers) each hold a model: one
that outlives a killed launcher keeps it in memory for good. A child calls `die_with_parent`
first thing, before it imports torch or loads anything, with the `ParentLink` its parent made
when it started it:

- On Linux, prctl(PR_SET_PDEATHSIG, SIGKILL) has the kernel kill the child when its parent
  goes, however it goes (SIGKILL included). The kernel sends it when the parent *thread* that
  forked the child exits, not the process, so it is armed only for a child started from its
  parent's main thread, which lives as long as the process.
- The parent may have died before the prctl (a launcher killed while its child was still
  importing): the child then sees a parent pid other than the link's and exits at once.
- Elsewhere, or for a child started from another thread (the Engine's frontend thread), a
  daemon thread polls the parent pid, which changes when the parent dies (the child is
  reparented to init or a subreaper).

Nothing here imports more than the standard library: it runs before the child's slow imports.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

# <linux/prctl.h>
_PR_SET_PDEATHSIG = 1
# `rsgl serve` started by rsgl itself (a benchmark's server, `rsgl.bench.serve_process`)
# finds its parent's link here and dies with it (`die_with_environment_parent`).
PARENT_LINK_ENV = "RSGL_PARENT_LINK"
WATCH_INTERVAL_S = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class ParentLink:
    """Who a child dies with: its parent's pid, and whether the parent started it from its
    main thread (see the module's docstring)."""

    pid: int
    main_thread: bool

    @classmethod
    def here(cls) -> ParentLink:
        """The link of a child that the calling thread of this process starts."""
        return cls(os.getpid(), threading.current_thread() is threading.main_thread())

    def encode(self) -> str:
        """The link as one command-line argument (`decode` reads it back)."""
        return f"{self.pid}:{int(self.main_thread)}"

    @classmethod
    def decode(cls, text: str) -> ParentLink:
        pid, _, main_thread = text.partition(":")
        return cls(int(pid), main_thread == "1")


def die_with_parent(link: ParentLink) -> None:
    """Makes this process die when its parent does; exits at once (SystemExit, status 1) if
    the parent is already gone. Call it first in a child's entry point."""
    armed = link.main_thread and _set_parent_death_signal(signal.SIGKILL)
    # After the prctl: a parent that dies from now on kills us, one that died before has
    # already had us reparented.
    if os.getppid() != link.pid:
        raise SystemExit(f"rsgl: the parent process {link.pid} is gone; exiting")
    if not armed:
        threading.Thread(
            target=_watch_parent, args=(link.pid,), name="rsgl-parent-watch", daemon=True
        ).start()


def die_with_environment_parent() -> None:
    """`die_with_parent` for the link in PARENT_LINK_ENV, if any; the variable is removed
    first, so that this process's own children do not inherit it."""
    link = os.environ.pop(PARENT_LINK_ENV, None)
    if link:
        die_with_parent(ParentLink.decode(link))


def _set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig); False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _watch_parent(pid: int) -> None:
    while os.getppid() == pid:
        time.sleep(WATCH_INTERVAL_S)
    logger.error("the parent process %d is gone; exiting", pid)
    # From a thread: SystemExit would end only the thread. Nothing is left to clean up for a
    # parent that is gone.
    os._exit(1)


__all__ = ["PARENT_LINK_ENV", "ParentLink", "die_with_environment_parent", "die_with_parent"]
