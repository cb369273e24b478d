"""Opt-in device timeline of an engine rank: is the device busy, or waiting for the host?

With `MINISGL_STEP_TIMES_DIR` set, every step marks four points on the device's stream (CUDA
events on a GPU, wall time on CPU): its launch's start, its forward's start, its sampling's start
and its end; the rank writes `<dir>/engine-rank<N>-<pid>-steps.txt` when its step loop ends,
per phase and per decode batch size (the report's legend names each column). Unlike the
cProfile of `MINISGL_PROFILE_DIR`, it adds no host work beyond four events and a few clock reads
per step, so the waits it reports are real.

    MINISGL_STEP_TIMES_DIR=/tmp/steps python -m minisgl_backend.benchmark offline --shape qwen3-0.6b
    cat /tmp/steps/engine-rank0-*-steps.txt
"""

from __future__ import annotations

import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

STEP_TIMES_DIR_ENV = "MINISGL_STEP_TIMES_DIR"
# A gap longer than this is the engine waiting for work (no requests), not a slow host turn.
WAIT_FOR_WORK_S = 0.1
BATCH_BUCKETS = (1, 8, 32, 64, 128, 256, 512)


@dataclass
class _Totals:
    steps: int = 0
    busy: float = 0.0  # forward start -> step end
    waits: float = 0.0  # previous step end -> forward start, gaps up to WAIT_FOR_WORK_S
    launch: float = 0.0  # host: applying the message and launching the step
    wait: float = 0.0  # host: waiting for this step's message (up to WAIT_FOR_WORK_S)
    sampling: float = 0.0  # device: sampling start -> step end
    held: float = 0.0  # host: forward launch -> sampling launch
    apply: float = 0.0  # host: launch start -> forward launch (the message applied)


@dataclass
class _Pending:
    start: object
    forward: object
    sample: object
    end: object
    phase: str
    batch_size: int
    launch: float
    wait: float
    held: float
    apply: float


@dataclass
class StepTimeline:
    """Records steps with `begin()`, `forward()` and `end(phase, batch_size)`; `summary()` is
    the report."""

    device: torch.device
    phases: dict[str, _Totals] = field(default_factory=lambda: defaultdict(_Totals))
    decode_buckets: dict[int, _Totals] = field(default_factory=lambda: defaultdict(_Totals))
    waits_for_work: int = 0
    largest_gap: float = 0.0
    _pending: deque = field(default_factory=deque)
    _start: object = None
    _forward: object = None
    _sample: object = None
    _begun: float = 0.0
    _forward_launched: float = 0.0
    _held: float = 0.0
    _apply: float = 0.0
    _waited: float = 0.0
    _previous_end: object = None

    @classmethod
    def from_env(cls, device: torch.device) -> StepTimeline | None:
        return cls(device) if os.environ.get(STEP_TIMES_DIR_ENV) else None

    def _mark(self) -> object:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, first: object, second: object) -> float:
        if self.device.type != "cuda":
            return second - first  # type: ignore[operator]
        return first.elapsed_time(second) / 1e3  # type: ignore[union-attr]

    def begin(self, waited: float = 0.0) -> None:
        """A step's launch starts; `waited`: seconds the rank waited for its message."""
        self._begun = time.perf_counter()
        self._waited = waited if waited <= WAIT_FOR_WORK_S else 0.0
        self._resolve(wait=False)
        self._start = self._forward = self._sample = self._mark()
        self._held = 0.0

    def forward(self) -> None:
        """The step's inputs are in place; its forward is launched next."""
        self._forward = self._mark()
        self._forward_launched = time.perf_counter()
        self._apply = self._forward_launched - self._begun

    def sampling(self) -> None:
        """The step's forward is launched and its masks (if any) are in: sampling is next."""
        self._sample = self._mark()
        self._held = time.perf_counter() - self._forward_launched

    def end(self, phase: str, batch_size: int) -> None:
        end = self._mark()
        self._pending.append(_Pending(self._start, self._forward, self._sample, end, phase,
                                      batch_size, time.perf_counter() - self._begun,
                                      self._waited, self._held, self._apply))

    def _resolve(self, wait: bool) -> None:
        """Account every recorded step whose end the device has passed (all of them if wait)."""
        while self._pending:
            step = self._pending[0]
            if self.device.type == "cuda":
                if wait:
                    step.end.synchronize()
                elif not step.end.query():
                    return
            self._pending.popleft()
            busy = self._seconds(step.forward, step.end)
            sampling = self._seconds(step.sample, step.end)
            gap = 0.0 if self._previous_end is None else max(
                0.0, self._seconds(self._previous_end, step.start))
            self._previous_end = step.end
            if gap > WAIT_FOR_WORK_S:
                self.waits_for_work += 1
                gap = 0.0
            gap += self._seconds(step.start, step.forward)
            self.largest_gap = max(self.largest_gap, gap)
            totals = [self.phases[step.phase]]
            if step.phase == "decode":
                bucket = next((b for b in BATCH_BUCKETS if step.batch_size <= b), step.batch_size)
                totals.append(self.decode_buckets[bucket])
            values = {"busy": busy, "waits": gap, "launch": step.launch, "wait": step.wait,
                      "sampling": sampling, "held": step.held, "apply": step.apply}
            for t in totals:
                t.steps += 1
                for name, value in values.items():
                    setattr(t, name, getattr(t, name) + value)

    def summary(self, title: str = "") -> str:
        self._resolve(wait=True)
        steps = sum(t.steps for t in self.phases.values())
        busy = sum(t.busy for t in self.phases.values())
        waits = sum(t.waits for t in self.phases.values())
        lines = [title] if title else []
        lines += [
            (f"steps: {steps}, device busy {busy:.3f} s, waiting for the host {waits:.3f} s "
            f"({waits / max(busy + waits, 1e-12):.1%}; largest gap "
            f"{self.largest_gap * 1e3:.2f} ms; {self.waits_for_work} waits for work over "
            f"{WAIT_FOR_WORK_S} s not counted)"),
            "",
            ("device: busy in the step (of it, sampling) / waiting for the host before it; "
            "host: the engine launching the step / waiting for its message / of the launch, "
            "applying the message (to the forward's launch) / from the forward's launch to "
            "the sampling's; the launch's rest is the sampling's launch"),
            "",
            *_table("phase", sorted(self.phases.items())),
            "",
            *_table("decode batch up to", sorted(self.decode_buckets.items())),
        ]
        return "\n".join(lines) + "\n"

    def write(self, name: str, title: str) -> Path:
        """`<dir>/<name>-<pid>-steps.txt` (several engines may share the folder)."""
        folder = Path(os.environ[STEP_TIMES_DIR_ENV])
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}-{os.getpid()}-steps.txt"
        path.write_text(self.summary(title))
        return path


def _table(first_column: str, totals: list[tuple[object, _Totals]]) -> list[str]:
    lines = [(f"| {first_column} | steps | busy s | waits s | busy ms/step | sampling ms/step | "
             "waits ms/step | launch ms/step | wait ms/step | apply ms/step | held ms/step |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in totals:
        per_step = " | ".join(f"{getattr(t, k) / max(t.steps, 1) * 1e3:.3f}" for k in (
            "busy", "sampling", "waits", "launch", "wait", "apply", "held"))
        lines.append(f"| {name} | {t.steps} | {t.busy:.3f} | {t.waits:.3f} | {per_step} |")
    return lines
