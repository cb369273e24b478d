"""MINISGL_PROFILE_DIR: host profiles of the scheduler thread and every engine rank;
MINISGL_STEP_TIMES_DIR: the device timeline of each engine rank; MINISGL_TRACE_DIR: a
torch.profiler trace of a window of each rank's steps."""

from __future__ import annotations

import pstats
from pathlib import Path

import pytest

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.engine import step_times
from minisgl_backend.engine.step_times import STEP_TIMES_DIR_ENV, StepTimeline
from minisgl_backend.profiling import PROFILE_DIR_ENV, TRACE_DIR_ENV, TRACE_STEPS_ENV
from tests.conftest import mixed_prompts


def test_profiles_of_scheduler_and_engine_are_written(tiny_models: dict[str, Path],
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "prof"
    monkeypatch.setenv(PROFILE_DIR_ENV, str(folder))  # inherited by the spawned engines
    with LLM(tiny_models["qwen3"], device="cpu") as llm:
        llm.generate(mixed_prompts(2), SamplingParams(max_tokens=4, ignore_eos=True))
    names = sorted(p.name.rsplit("-", 1)[0] + p.suffix for p in folder.iterdir())
    assert names == ["engine-rank0.prof", "engine-rank0.txt", "scheduler.prof", "scheduler.txt"]
    (scheduler,) = folder.glob("scheduler-*.txt")
    (engine,) = folder.glob("engine-rank0-*.txt")
    assert "_send_next_step" in scheduler.read_text()
    assert engine.read_text().strip()
    (engine_prof,) = folder.glob("engine-rank0-*.prof")  # every function, not just the top
    assert {"start", "finish"} <= {name for _, _, name in pstats.Stats(str(engine_prof)).stats}


def test_trace_covers_the_window_of_steps(tiny_models: dict[str, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """MINISGL_TRACE_STEPS=2:3: the steps from the third on, three of them, in the chrome trace
    and the tables; a window past the run's end is closed when the engine stops."""
    import json

    for steps, expected in (("2:3", 3), ("4:100", None)):
        folder = tmp_path / steps.replace(":", "-")
        monkeypatch.setenv(TRACE_DIR_ENV, str(folder))
        monkeypatch.setenv(TRACE_STEPS_ENV, steps)
        monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
        with LLM(tiny_models["qwen3"], device="cpu") as llm:
            llm.generate(mixed_prompts(2), SamplingParams(max_tokens=6, ignore_eos=True))
            total = llm.scheduler.num_steps
        (trace,) = folder.glob("engine-rank0-*-trace.json")
        (text,) = folder.glob("engine-rank0-*-trace.txt")
        count = expected if expected is not None else total - 4
        assert text.read_text().startswith(f"{count} steps from step {steps.split(':')[0]}: ")
        events = json.loads(trace.read_text())["traceEvents"]
        assert sum(e.get("name") == "engine step" for e in events) == count


def test_no_profiles_without_the_variable(tiny_models: dict[str, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with LLM(tiny_models["qwen3"], device="cpu") as llm:
        llm.generate(mixed_prompts(1), SamplingParams(max_tokens=2, ignore_eos=True))
    assert list(tmp_path.iterdir()) == []


def test_step_timeline_accounts_for_every_step(tiny_models: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """MINISGL_STEP_TIMES_DIR: the engine rank reports every step the scheduler sent, per
    phase and per decode batch size, with busy and idle times."""
    folder = tmp_path / "steps"
    monkeypatch.setenv(STEP_TIMES_DIR_ENV, str(folder))
    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    with LLM(tiny_models["qwen3"], device="cpu") as llm:
        llm.generate(mixed_prompts(3), SamplingParams(max_tokens=5, ignore_eos=True))
        steps = llm.scheduler.num_steps
    (report,) = folder.glob("engine-rank0-*-steps.txt")
    title, text = report.read_text().split("\n", 1)
    assert "max_running_requests 256" in title
    assert text.startswith(f"steps: {steps}, device busy ")
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[2].strip().isdigit()}
    assert int(rows["prefill"][0]) + int(rows["decode"][0]) == steps
    assert int(rows["decode"][0]) >= 4 and float(rows["decode"][1]) > 0
    assert int(rows["8"][0]) == int(rows["decode"][0])  # every decode batch held 3 requests


def test_step_timeline_resolves_steps_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy time runs from each forward's start to the step's end, sampling from the sampling's
    start; waits are the gap after the previous step plus the time before the forward, long
    waits for work left out."""
    import torch

    timeline = StepTimeline(torch.device("cpu"))
    # (launch start, forward start, sampling start, end) per step
    marks = iter([0.0, 0.001, 0.0015, 0.002, 0.003, 0.0035, 0.0038, 0.004,
                  0.5, 0.5002, 0.5009, 0.501])
    timeline._mark = lambda: next(marks)  # type: ignore[method-assign]
    # The host's clock at begin, forward, sampling and end of each step
    clock = iter([0.0, 0.1, 0.4, 0.5, 1.0, 1.1, 1.2, 1.3, 2.0, 2.1, 2.3, 2.4])
    monkeypatch.setattr(step_times.time, "perf_counter", lambda: next(clock))
    for phase, bs in (("prefill", 2), ("decode", 2), ("decode", 2)):
        timeline.begin()
        timeline.forward()
        timeline.sampling()
        timeline.end(phase, bs)
    timeline.summary()
    assert timeline.phases["prefill"].busy == pytest.approx(0.001)
    assert timeline.phases["prefill"].sampling == pytest.approx(0.0005)
    assert timeline.phases["prefill"].waits == pytest.approx(0.001)  # launch -> forward
    assert timeline.phases["decode"].busy == pytest.approx(0.0005 + 0.0008)
    assert timeline.phases["decode"].sampling == pytest.approx(0.0002 + 0.0001)
    # 0.002 -> 0.003 between steps, then 0.0005 and 0.0002 before the forwards
    assert timeline.phases["decode"].waits == pytest.approx(0.001 + 0.0005 + 0.0002)
    assert timeline.waits_for_work == 1  # 0.004 -> 0.5
    assert timeline.phases["prefill"].held == pytest.approx(0.3)  # forward -> sampling launch
    assert timeline.phases["decode"].held == pytest.approx(0.1 + 0.2)
    assert timeline.phases["decode"].launch == pytest.approx(0.3 + 0.4)
    assert timeline.phases["prefill"].apply == pytest.approx(0.1)  # begin -> forward launch
    assert timeline.phases["decode"].apply == pytest.approx(0.1 + 0.1)


def test_two_engines_of_one_process_both_serve_with_profiling_on(
        tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two scheduler threads profiled at once (Python 3.12 allows one cProfile per process:
    the second block runs unprofiled) both serve; at least one scheduler profile is written."""
    folder = tmp_path / "prof"
    monkeypatch.setenv(PROFILE_DIR_ENV, str(folder))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with LLM(tiny_models["qwen3"], device="cpu") as first, \
            LLM(tiny_models["qwen3"], device="cpu") as second:
        outputs = [llm.generate(mixed_prompts(2), params) for llm in (first, second)]
    assert [[len(o.token_ids) for o in out] for out in outputs] == [[3, 3], [3, 3]]
    assert list(folder.glob("scheduler-*.prof"))
