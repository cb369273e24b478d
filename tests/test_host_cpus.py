"""How many CPUs the process may use (`host_cpus.usable_cpus`) and the mask fill's thread
count that follows from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from minisgl_backend.grammar import guide
from minisgl_backend.host_cpus import usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("cpu_max", "expected"), [
    ("max 100000\n", AFFINITY),  # no quota
    ("150000 100000\n", min(AFFINITY, 2)),  # 1.5 CPUs of quota: 2 threads may run
    ("50000 100000\n", 1),
    (None, AFFINITY),  # no cgroup v2 CPU controller
    ("garbage\n", AFFINITY),
])
def test_usable_cpus_is_the_affinity_bounded_by_the_cgroup_quota(
        tmp_path: Path, cpu_max: str | None, expected: int) -> None:
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert usable_cpus(path) == expected


def test_mask_fill_threads_one_for_small_batches_then_half_the_cpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guide, "usable_cpus", lambda: 64)  # a share of a large host
    assert guide.fill_threads(guide.PARALLEL_FILL_ROWS - 1) == 1
    assert guide.fill_threads(guide.PARALLEL_FILL_ROWS) == guide.FILL_THREADS_MAX
    monkeypatch.setattr(guide, "usable_cpus", lambda: 2)
    assert guide.fill_threads(1024) == 1
    monkeypatch.setattr(guide, "usable_cpus", lambda: 6)
    assert guide.fill_threads(1024) == 3
