"""Where launched steps run: one small interface, a worker thread on CPU, streams on CUDA.

The loop launches step N+1 before it reads step N's tokens (overlap). A launch is two
callables: `prepare` copies the step's inputs to the device and `execute` runs the forward
and sampling; `result()` later hands back the step's output on the host. Steps execute in
launch order on both implementations, so state the forward mutates (the KV cache,
req_to_token, the FutureMap, per-slot sampling state) sees them one after another, and the
loop never branches on the device.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from rsgl.model_executor.model_runner import StepOutput

P = TypeVar("P")
R = TypeVar("R")

logger = logging.getLogger(__name__)


class LaunchedStep(ABC):
    """A step in flight."""

    @abstractmethod
    def result(self) -> StepOutput:
        """Waits for the step; its output with every tensor on the host. Re-raises what the
        step raised (on CUDA, also an error of its kernels)."""


class StepExecutor(ABC):
    """Runs launched steps in order, off the loop's critical path."""

    @abstractmethod
    def launch(self, prepare: Callable[[], P], execute: Callable[[P], StepOutput]) -> LaunchedStep:
        """Starts `execute(prepare())`; returns at once (CPU) or once it is queued (CUDA)."""

    def shutdown(self) -> None:
        """Waits for launched steps and releases the executor's resources."""
        return None

    @staticmethod
    def for_device(device: torch.device | str) -> StepExecutor:
        """The executor for a runner on `device`."""
        device = torch.device(device)
        if device.type == "cuda":
            return CudaStreamExecutor(device)
        return ThreadExecutor()


class _FutureStep(LaunchedStep):
    def __init__(self, future: Future[StepOutput]) -> None:
        self._future = future

    def result(self) -> StepOutput:
        return self._future.result()


# The process's CPU compute thread (see `run_on_compute_thread`).
_compute: ThreadPoolExecutor | None = None
_compute_ident: int | None = None
_compute_lock = threading.Lock()


def _compute_thread() -> ThreadPoolExecutor:
    global _compute
    with _compute_lock:
        if _compute is None:
            _compute = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="rsgl-compute",
                initializer=_remember_compute_thread,
            )
        return _compute


def _remember_compute_thread() -> None:
    global _compute_ident
    _compute_ident = threading.get_ident()


def on_compute_thread() -> bool:
    """Whether the caller is the process's CPU compute thread."""
    return threading.get_ident() == _compute_ident


def run_on_compute_thread(fn: Callable[[], R]) -> R:
    """Runs `fn` on the process's one CPU compute thread and returns what it returns.

    Every parallel torch op (and our OpenMP kernels) on CPU should start from this thread:
    model loading, calibration and every step. GNU OpenMP keeps one thread team per thread
    that starts parallel regions, and once a process has more OpenMP threads than CPUs it
    stops letting idle team members spin between regions, so each of a decode step's ~300
    small parallel regions then pays a futex wake-up per thread. With the model loaded on
    the main thread and stepped on a worker thread (two teams on 2 cores), a SmolLM2 bf16
    decode step at batch 64 took 68 ms; loaded and stepped on one thread, 48 ms.
    """
    if on_compute_thread():
        return fn()
    return _compute_thread().submit(fn).result()


class ThreadExecutor(StepExecutor):
    """The CPU "stream": the process's compute thread (`run_on_compute_thread`) runs steps
    in launch order. torch releases the GIL inside its ops, so the loop thread schedules
    step N+1 while step N computes."""

    def __init__(self) -> None:
        self._worker = _compute_thread()
        self._last: Future[StepOutput] | None = None

    def launch(self, prepare: Callable[[], P], execute: Callable[[P], StepOutput]) -> LaunchedStep:
        self._last = self._worker.submit(lambda: execute(prepare()).to_host())
        return _FutureStep(self._last)

    def shutdown(self) -> None:
        """Waits for this executor's steps (they run in order: the last one is enough); the
        compute thread stays for the rest of the process."""
        if self._last is not None:
            concurrent.futures.wait([self._last])
            self._last = None


class _CudaStep(LaunchedStep):
    def __init__(self, host: StepOutput, done: torch.cuda.Event) -> None:
        self._host = host
        self._done = done

    def result(self) -> StepOutput:
        self._done.synchronize()
        return self._host


class _FailedStep(LaunchedStep):
    def __init__(self, error: Exception) -> None:
        self._error = error

    def result(self) -> StepOutput:
        raise self._error


class CudaStreamExecutor(StepExecutor):
    """Steps are queued on the loop thread onto CUDA streams and run while the loop goes on.

    `prepare` runs on the schedule stream (the device's current stream: pinned host-to-device
    copies of the plan's arrays), `execute` on the forward stream after it waits for the
    schedule stream. The sampled ids are copied to pinned host memory without blocking and
    an event marks when they have landed; `result()` waits on that event only. The last two
    launched steps stay referenced: tensors made on the schedule stream and read on the
    forward stream must not return to the caching allocator while a queued kernel may still
    read them (a step is two launches old only once the loop has read its result).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.schedule_stream = torch.cuda.current_stream(device)
        self.forward_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._in_flight: collections.deque[tuple[Any, StepOutput | None]]
        self._in_flight = collections.deque(maxlen=2)

    def launch(self, prepare: Callable[[], P], execute: Callable[[P], StepOutput]) -> LaunchedStep:
        inputs: P | None = None
        try:
            with torch.cuda.stream(self.schedule_stream):
                inputs = prepare()
            self.forward_stream.wait_stream(self.schedule_stream)
            with torch.cuda.stream(self.forward_stream):
                out = execute(inputs)
                host = out.to_host()
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(self.forward_stream)
        except Exception as exc:  # noqa: BLE001 - reported by result(), as on the CPU path
            # Kernels queued before the error may still read the inputs: keep them too.
            self._in_flight.append((inputs, None))
            return _FailedStep(exc)
        self._in_flight.append((inputs, out))
        return _CudaStep(host, done)

    def shutdown(self) -> None:
        try:
            self.forward_stream.synchronize()
        except RuntimeError:  # a sticky CUDA error, which the loop has reported already
            logger.exception("waiting for the forward stream at shutdown failed")
        self._in_flight.clear()


__all__ = [
    "CudaStreamExecutor",
    "on_compute_thread",
    "run_on_compute_thread",
    "LaunchedStep",
    "StepExecutor",
    "ThreadExecutor",
]
