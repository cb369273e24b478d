"""MINISGL_PROFILE_DIR: host profiles of the scheduler thread and every engine rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.profiling import PROFILE_DIR_ENV
from tests.conftest import mixed_prompts


def test_profiles_of_scheduler_and_engine_are_written(tiny_models: dict[str, Path],
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "prof"
    monkeypatch.setenv(PROFILE_DIR_ENV, str(folder))  # inherited by the spawned engines
    with LLM(tiny_models["qwen3"], device="cpu") as llm:
        llm.generate(mixed_prompts(2), SamplingParams(max_tokens=4, ignore_eos=True))
    assert sorted(p.name for p in folder.iterdir()) == [
        "engine-rank0.prof", "engine-rank0.txt", "scheduler.prof", "scheduler.txt"]
    assert "_send_next_step" in (folder / "scheduler.txt").read_text()
    assert "launch" in (folder / "engine-rank0.txt").read_text()


def test_no_profiles_without_the_variable(tiny_models: dict[str, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with LLM(tiny_models["qwen3"], device="cpu") as llm:
        llm.generate(mixed_prompts(1), SamplingParams(max_tokens=2, ignore_eos=True))
    assert list(tmp_path.iterdir()) == []
