"""Per-request timings (time to first token, finish) of a workload submitted all at once.

`LLM.generate` returns only the final outputs, so this goes one level down: every request is
handed to the scheduler at the same instant and its callback records when the first generated
token and the end arrive.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

from minisgl_backend.benchmark.workloads import Workload
from minisgl_backend.llm import LLM
from minisgl_backend.scheduler.output import OutputCallback, RequestOutput


@dataclass
class RequestTiming:
    first_token_s: float | None = None  # since submission
    finish_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class RunTiming:
    wall_s: float  # from submitting the first request to the last one finishing
    requests: list[RequestTiming] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(r.first_token_s for r in self.requests
                               if r.first_token_s is not None)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)


def run_timed(llm: LLM, workload: Workload) -> RunTiming:
    """Submit every request of `workload` at once; wait for all; return their timings."""
    timings = [RequestTiming() for _ in range(len(workload))]
    remaining = [len(workload)]
    done = threading.Event()
    lock = threading.Lock()

    def callback_for(timing: RequestTiming) -> OutputCallback:
        def on_output(out: RequestOutput) -> None:  # runs on the scheduler thread
            now = time.perf_counter() - start
            if out.token_ids and timing.first_token_s is None:
                timing.first_token_s = now
            timing.output_tokens += len(out.token_ids)
            timing.cached_tokens = out.cached_tokens
            if out.finished:
                timing.finish_s, timing.error = now, out.error
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

        return on_output

    if not timings:
        return RunTiming(0.0)
    start = time.perf_counter()
    for prompt, params, timing in zip(workload.prompts, workload.params, timings):
        llm.scheduler.submit(prompt, params, callback_for(timing))
    done.wait()
    wall = time.perf_counter() - start
    errors = [f"request {i}: {t.error}" for i, t in enumerate(timings) if t.error]
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    return RunTiming(wall, timings)
