"""The scheduler side: admission, batching, prefix caching, page allocation, outputs."""

from minisgl_backend.scheduler.output import RequestOutput
from minisgl_backend.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["RequestOutput", "Scheduler", "SchedulerConfig"]
