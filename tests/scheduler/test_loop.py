"""The scheduling loop's own decisions, without a model: which step errors stop it."""

from __future__ import annotations

import pytest
import torch

from rsgl.scheduler.fault_injection import InjectedFault
from rsgl.scheduler.loop import SchedulerLoop


def raised_from(cause: BaseException) -> RuntimeError:
    """A RuntimeError raised while handling `cause` (`raise ... from cause`)."""
    try:
        try:
            raise cause
        except BaseException as exc:
            raise RuntimeError("the step could not read its tokens") from exc
    except RuntimeError as wrapped:
        return wrapped


@pytest.mark.parametrize(
    "exc",
    [
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("Triton Error [CUDA]: device-side assert triggered"),
        RuntimeError("CUDA error: misaligned address\nCompile with TORCH_USE_CUDA_DSA"),
        raised_from(RuntimeError("CUDA error: device-side assert triggered")),
    ],
)
def test_cuda_errors_leave_the_process_unusable(exc: BaseException) -> None:
    assert SchedulerLoop.is_fatal_step_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        InjectedFault("injected fault for request poison-1"),
        IndexError("index out of range in self"),
        ValueError("the CUDA device is fine"),  # not a RuntimeError
        RuntimeError("shape mismatch"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        raised_from(KeyError("placeholder")),
    ],
)
def test_other_errors_fail_only_their_step(exc: BaseException) -> None:
    assert not SchedulerLoop.is_fatal_step_error(exc)
