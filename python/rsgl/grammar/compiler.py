"""Compiles constraints off the scheduling loop: a bounded thread pool over a backend, a
cache of compiled grammars (LRU under a byte cap, keyed by the normalised constraint, failures
included), and one compile per constraint however many requests wait for it."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rsgl.grammar.backend import GrammarBackend, GrammarError
from rsgl.grammar.constraint import Constraint

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 << 20
# The compile threads' nice value (with Linux's SCHED_IDLE policy): the steps' threads keep
# the cores while a grammar compiles for seconds, and a compile runs whenever a core would
# be idle (an xgrammar schema compiling for 6 s beside 16 decoding requests: step p99 2.46x
# at nice 19 alone, 1.08x with SCHED_IDLE; `rsgl bench grammar --parts interference`).
COMPILE_NICE = 19


@dataclass(slots=True)
class CompilerStats:
    """Counters for /metrics and get_server_info."""

    hits: int = 0
    misses: int = 0
    failures: int = 0
    compile_seconds: float = 0.0  # summed over compiles
    cached_bytes: int = 0
    cached_grammars: int = 0


class GrammarCompiler:
    """`submit(constraint)` returns a Future of the compiled grammar (or of its GrammarError).

    Thread-safe. A hit resolves at once; a miss joins the compile already running for the
    same constraint, or starts one on the pool. Successes are cached up to `cache_bytes`
    (least recently used first out); failures are cached too (a bad schema sent again fails
    at once), counted as small entries.
    """

    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        threads: int = 2,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        # Built on the pool (reading the tokenizer's vocabulary takes ~0.3 s for xgrammar,
        # ~1 s for llguidance): by `prewarm` while the server starts, else on first use.
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.cache_bytes = cache_bytes
        self._pool = ThreadPoolExecutor(
            max(1, threads), thread_name_prefix="rsgl-grammar", initializer=_yield_the_cores
        )
        self._lock = threading.Lock()
        # constraint -> (compiled or GrammarError, bytes)
        self._cache: OrderedDict[Constraint, tuple[Any, int]] = OrderedDict()
        self._running: dict[Constraint, Future[Any]] = {}
        self.stats = CompilerStats()

    @property
    def backend(self) -> GrammarBackend:
        """The backend (built by the first call)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def prewarm(self) -> Future[GrammarBackend]:
        """Builds the backend on the pool now, at the compile threads' idle priority, so the
        first constrained request does not wait for it (its build is the first compile's
        cost: 1-4 s for llguidance). A backend that fails to build fails this future, and is
        tried again by the first compile, which then reports it."""
        return self._pool.submit(lambda: self.backend)

    def submit(self, constraint: Constraint) -> Future[Any]:
        with self._lock:
            entry = self._cache.get(constraint)
            if entry is not None:
                self._cache.move_to_end(constraint)
                self.stats.hits += 1
                done: Future[Any] = Future()
                if isinstance(entry[0], GrammarError):
                    done.set_exception(entry[0])
                else:
                    done.set_result(entry[0])
                return done
            running = self._running.get(constraint)
            if running is not None:
                self.stats.hits += 1
                return running
            self.stats.misses += 1
            future = self._pool.submit(self._compile, constraint)
            self._running[constraint] = future
        return future

    def _compile(self, constraint: Constraint) -> Any:
        """On the pool. A GrammarError (the constraint's fault) is cached; anything else (a
        backend that fails to start) is not, and fails only the requests waiting now."""
        start = time.perf_counter()
        try:
            backend = self.backend
            try:
                compiled = backend.compile(constraint)
            except GrammarError as exc:
                with self._lock:
                    self.stats.failures += 1
                    self._store(constraint, exc, 1024)
                raise
            with self._lock:
                self._store(constraint, compiled, backend.size_bytes(compiled))
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._running.pop(constraint, None)
                self.stats.compile_seconds += elapsed
        logger.debug("compiled %s in %.1f ms", constraint.describe(), elapsed * 1e3)
        return compiled

    def _store(self, constraint: Constraint, result: Any, size: int) -> None:
        if size > self.cache_bytes:
            return
        self._cache[constraint] = (result, size)
        self.stats.cached_bytes += size
        while self.stats.cached_bytes > self.cache_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self.stats.cached_bytes -= evicted
        self.stats.cached_grammars = len(self._cache)

    def shutdown(self) -> None:
        """Stops the pool (a compile under way finishes; nobody waits for it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["DEFAULT_CACHE_BYTES", "CompilerStats", "GrammarCompiler"]


def _yield_the_cores() -> None:
    """Lowers the calling thread's scheduling priority to the lowest there is (on Linux a
    thread's nice value and policy are its own, and the threads it starts inherit them: the
    backend's compile workers too)."""
    if not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, COMPILE_NICE)
        if hasattr(os, "SCHED_IDLE"):  # Linux: runs only when a core has nothing else
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # a sandbox may refuse it: compiles then compete as before
        logger.warning("could not lower the grammar compile threads' priority: %s", exc)
