"""How many CPUs this process may use: in a container given a share of a larger host, the
host's count (what `os.cpu_count()` and C++'s `hardware_concurrency` report) would size thread
pools many times too large, and their threads then wait for each other."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _quota(root: Path) -> float | None:
    """CPUs of the cgroup's CFS quota (v2 `cpu.max`, else v1 `cpu/cpu.cfs_*`); None if none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The CPUs of this process's affinity mask, bounded by its cgroup's CPU quota (rounded
    up; at least 1)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    quota = _quota(cgroup_root)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)
