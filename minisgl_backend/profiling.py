"""Opt-in host profiles of the scheduler thread and the engine processes.

With `MINISGL_PROFILE_DIR` set, each profiled block (the scheduler thread's loop, each engine
rank's step loop) runs under cProfile and, when it ends, writes `<dir>/<name>-<pid>.prof` and a
text summary `<dir>/<name>-<pid>.txt` (own time and cumulative time, top 30 each; several
engines, e.g. a benchmark's offline runs and a server's, may share the folder). It tells where
host time goes per step (Python work, waits on pipes or on the device) on a real workload; off
(the default) it costs nothing.

    MINISGL_PROFILE_DIR=/tmp/prof python scripts/bench_offline.py --shape qwen3-0.6b
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
