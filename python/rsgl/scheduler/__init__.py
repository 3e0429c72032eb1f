"""The scheduling loop around rsgl._core (normal and overlap modes)."""

from rsgl.scheduler.loop import SchedulerLoop

__all__ = ["SchedulerLoop"]
