"""The step executor interface on CPU: launch order, prepare before execute, errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rsgl.layers.sampler import SampleOutput
from rsgl.model_executor.executor import StepExecutor, ThreadExecutor
from rsgl.model_executor.model_runner import StepOutput


def _output(value: int) -> StepOutput:
    return StepOutput(SampleOutput(torch.tensor([value], dtype=torch.int64)))


def test_steps_run_in_launch_order_off_the_calling_thread() -> None:
    executor = StepExecutor.for_device("cpu")
    assert isinstance(executor, ThreadExecutor)
    events: list[str] = []
    callers: set[str] = set()
    release = threading.Event()

    def prepare(i: int) -> int:
        callers.add(threading.current_thread().name)
        events.append(f"prepare {i}")
        return i

    def execute(i: int) -> StepOutput:
        if i == 0:
            release.wait(5)  # step 0 is slow: step 1 must still wait for it
        events.append(f"execute {i}")
        return _output(10 + i)

    try:
        launched = [
            executor.launch(lambda i=i: prepare(i), execute)  # type: ignore[misc]
            for i in range(3)
        ]
        time.sleep(0.05)
        assert events == ["prepare 0"], "launch returns before the step runs"
        release.set()
        tokens = [int(step.result().next_token_ids[0]) for step in launched]
    finally:
        executor.shutdown()
    assert tokens == [10, 11, 12]
    assert events == [f"{what} {i}" for i in range(3) for what in ("prepare", "execute")]
    assert threading.current_thread().name not in callers


def test_a_failed_step_raises_from_result_and_later_steps_still_run() -> None:
    executor = ThreadExecutor()

    def execute(i: int) -> StepOutput:
        if i == 1:
            raise RuntimeError("step 1 broke")
        return _output(i)

    try:
        steps = [executor.launch(lambda i=i: i, execute) for i in range(3)]  # type: ignore[misc]
        assert int(steps[0].result().next_token_ids[0]) == 0
        with pytest.raises(RuntimeError, match="step 1 broke"):
            steps[1].result()
        assert int(steps[2].result().next_token_ids[0]) == 2
    finally:
        executor.shutdown()


def test_cpu_outputs_are_already_on_the_host() -> None:
    out = _output(3)
    assert out.to_host() is out
