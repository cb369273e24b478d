"""The serving package makes PYTHONPATH's entries importable inside Triton's Python-backend stub,
whose interpreter does not read the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl_backend.serving import honor_pythonpath


def test_missing_entries_go_first_in_order(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    present = sys.path[-1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([first, "", present, second, first]))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = list(sys.path)
    assert honor_pythonpath() == [first, second]
    assert sys.path == [first, second, *before]
    assert honor_pythonpath() == []  # idempotent


def test_an_interpreter_that_ignores_pythonpath_finds_its_packages(tmp_path: Path) -> None:
    """Like the stub: `python -E` ignores PYTHONPATH; importing the serving package (found here
    through sys.path, as the models' entry points find it) makes a module on PYTHONPATH
    importable."""
    site = tmp_path / "site"
    (site / "probe_module").mkdir(parents=True)
    (site / "probe_module" / "__init__.py").write_text("VALUE = 42\n")
    repo = Path(__file__).resolve().parents[1]
    code = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(repo)!r})\n"
        "assert importlib.util.find_spec('probe_module') is None\n"
        "import minisgl_backend.serving\n"
        "import probe_module\n"
        "print(probe_module.VALUE)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-E", "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "42"
