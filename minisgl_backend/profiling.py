"""Opt-in host profiles of the scheduler thread and the engine processes.

With `MINISGL_PROFILE_DIR` set, each profiled block (the scheduler thread's loop, each engine
rank's step loop) runs under cProfile and, when it ends, writes `<dir>/<name>-<pid>.prof` and a
text summary `<dir>/<name>-<pid>.txt` (own time and cumulative time, top 30 each; several
engines, e.g. a benchmark's offline runs and a server's, may share the folder). It tells where
host time goes per step (Python work, waits on pipes or on the device) on a real workload; off
(the default) it costs nothing.

    MINISGL_PROFILE_DIR=/tmp/prof python -m minisgl_backend.benchmark offline --shape qwen3-0.6b

With `MINISGL_TRACE_DIR` set, each engine rank records a torch.profiler trace (host ops and
device kernels) of a window of its steps, `MINISGL_TRACE_STEPS` ("first:count", default
"200:20": the 200th step message on, 20 of them), and writes `<dir>/<name>-<pid>-trace.json`
(chrome://tracing, Perfetto) and `<dir>/<name>-<pid>-trace.txt` (the top host ops and kernels):
a kernel-level timeline of the real system, scheduler and pipes included.

    MINISGL_TRACE_DIR=/tmp/trace python -m minisgl_backend.benchmark controls --configs logprobs
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROFILE_DIR_ENV = "MINISGL_PROFILE_DIR"
TRACE_DIR_ENV = "MINISGL_TRACE_DIR"
TRACE_STEPS_ENV = "MINISGL_TRACE_STEPS"
DEFAULT_TRACE_STEPS = "200:20"
logger = logging.getLogger(__name__)


@contextmanager
def profiled(name: str) -> Iterator[None]:
    """Profile the block (in the calling thread only) when `MINISGL_PROFILE_DIR` is set."""
    folder = os.environ.get(PROFILE_DIR_ENV)
    if not folder:
        yield
        return
    profile = cProfile.Profile()
    try:
        profile.enable()
    except ValueError:  # Python 3.12+: one cProfile per process; another thread holds it
        logger.warning("%s: not profiled (another block of this process is)", name)
        yield
        return
    try:
        yield
    finally:
        profile.disable()
        write_profile(profile, Path(folder), name)


def write_profile(profile: cProfile.Profile, folder: Path, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{name}-{os.getpid()}"
    profile.dump_stats(str(folder / f"{name}.prof"))
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    for order in ("tottime", "cumulative"):
        stats.sort_stats(order).print_stats(30)
    (folder / f"{name}.txt").write_text(text.getvalue())


class StepTrace:
    """A torch.profiler trace of steps `first` to `first + count - 1` (counted by `step()`, one
    call per step message), written when the window closes (or at `close()`)."""

    def __init__(self, folder: Path, name: str, first: int, count: int) -> None:
        self.folder, self.name = folder, f"{name}-{os.getpid()}"
        self.first, self.last = first, first + count
        self.steps = 0
        self._profiler: object = None
        self._marker: object = None  # an "engine step" range around each traced step

    @classmethod
    def from_env(cls, name: str) -> StepTrace | None:
        folder = os.environ.get(TRACE_DIR_ENV)
        if not folder:
            return None
        first, count = (int(v) for v in os.environ.get(TRACE_STEPS_ENV,
                                                       DEFAULT_TRACE_STEPS).split(":"))
        return cls(Path(folder), name, first, count)

    def step(self) -> None:
        self._end_marker()
        if self.steps == self.first:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()  # type: ignore[attr-defined]
        elif self.steps == self.last:
            self.close()
        self.steps += 1
        if self._profiler is not None:
            from torch.profiler import record_function

            self._marker = record_function("engine step")
            self._marker.__enter__()  # type: ignore[attr-defined]

    def _end_marker(self) -> None:
        marker, self._marker = self._marker, None
        if marker is not None:
            marker.__exit__(None, None, None)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._end_marker()
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        profiler.__exit__(None, None, None)  # type: ignore[attr-defined]
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = str(self.folder / f"{self.name}-trace.json")
        profiler.export_chrome_trace(trace)  # type: ignore[attr-defined]
        averages = profiler.key_averages()  # type: ignore[attr-defined]
        steps = min(self.steps, self.last) - self.first
        (self.folder / f"{self.name}-trace.txt").write_text(
            f"{steps} steps from step {self.first}: host ops by own CPU time\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=30)
            + f"\n{steps} steps from step {self.first}: device kernels\n"
            + averages.table(sort_by="self_device_time_total", row_limit=30) + "\n")
