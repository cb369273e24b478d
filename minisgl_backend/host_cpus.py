"""How many CPUs this process may use: in a container given a share of a larger host, the
host's count (what `os.cpu_count()` and C++'s `hardware_concurrency` report) would size thread
pools many times too large, and their threads then wait for each other."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max ..."


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs of this process's affinity mask, bounded by its cgroup's CPU quota (rounded
    up; at least 1)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            count = min(count, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 CPU controller here: the affinity mask is the bound
    return max(1, count)
