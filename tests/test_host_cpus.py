"""How many CPUs the process may use (`host_cpus.usable_cpus`) and the mask fill's thread
count that follows from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from minisgl_backend.grammar import guide
from minisgl_backend.host_cpus import usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("files", "expected"), [
    ({"cpu.max": "max 100000\n"}, AFFINITY),  # cgroup v2, no quota
    ({"cpu.max": "150000 100000\n"}, min(AFFINITY, 2)),  # 1.5 CPUs: 2 threads may run
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, AFFINITY),
    ({}, AFFINITY),  # no CPU controller
    ({"cpu.max": "garbage\n"}, AFFINITY),
])
def test_usable_cpus_is_the_affinity_bounded_by_the_cgroup_quota(
        tmp_path: Path, files: dict[str, str], expected: int) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert usable_cpus(tmp_path) == expected


def test_mask_fill_threads_one_for_small_batches_then_half_the_cpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guide, "usable_cpus", lambda: 64)  # a share of a large host
    assert guide.fill_threads(guide.PARALLEL_FILL_ROWS - 1) == 1
    assert guide.fill_threads(guide.PARALLEL_FILL_ROWS) == guide.FILL_THREADS_MAX
    monkeypatch.setattr(guide, "usable_cpus", lambda: 2)
    assert guide.fill_threads(1024) == 1
    monkeypatch.setattr(guide, "usable_cpus", lambda: 6)
    assert guide.fill_threads(1024) == 3
