"""Overlap scheduling: step N+1 is sent before step N's tokens are read.

Outputs must be identical with overlap on and off, also when requests end early (stop ids, stop
strings), wait for KV pages, are aborted while a step for them is in flight, or share prefixes;
the scheduler's debug checks verify page accounting after every step.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.scheduler import RequestOutput
from minisgl_backend.scheduler.scheduler import SchedulerStats
from tests.conftest import CHECKED, mixed_prompts


def mixed_workload(prompts: list[list[int]], greedy_outputs: list[list[int]]
                   ) -> list[SamplingParams]:
    """Greedy and seeded sampling, early stops (on a token each greedy request does produce),
    max_tokens from 1 up, min_tokens."""
    params = []
    for i in range(len(prompts)):
        stop_id = greedy_outputs[i][5]
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(max_tokens=1 + i, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=i,
                                         ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=16, stop_token_ids=[stop_id],
                                         ignore_eos=True))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=7 * i,
                                         stop_token_ids=[stop_id], min_tokens=3,
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=10))
    return params


def idle_stats(scheduler) -> SchedulerStats:  # noqa: ANN001
    """The stats once the scheduler has taken its snapshot after the last request ended."""
    for _ in range(500):
        stats = scheduler.stats
        if stats.running == 0:
            break
        time.sleep(0.01)
    return stats


def run(model: Path, prompts: list[list[int]], params: list[SamplingParams],
        **settings) -> list[tuple]:
    with LLM(model, device="cpu", hooks=CHECKED, **settings) as llm:
        outputs = llm.generate(prompts, params)
        stats = idle_stats(llm.scheduler)
    assert stats.kv_pages_in_use == 0 and stats.running == 0 and stats.waiting == 0
    return [(o.token_ids, o.finish_reason, o.text, o.prompt_tokens) for o in outputs]


@pytest.fixture(scope="module")
def workload(tiny_models: dict[str, Path]) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = mixed_prompts(10)
    prompts += [prompts[1][:60] + p[:8] for p in prompts[:4]]  # shared prefixes
    probe = run(tiny_models["llama"], prompts,
                [SamplingParams(max_tokens=8, ignore_eos=True)] * len(prompts), overlap=False)
    return prompts, mixed_workload(prompts, [tokens for tokens, _, _, _ in probe])


@pytest.mark.parametrize("settings", [
    {},
    {"page_size": 16, "chunked_prefill_size": 24},
    {"max_total_tokens": 192, "max_running_requests": 4},  # requests wait; pages are evicted
    # Chunked prefill steps between decode steps, with requests admitted over time.
    {"max_running_requests": 4, "chunked_prefill_size": 24, "page_size": 4},
])
def test_overlap_on_and_off_give_identical_outputs(tiny_models: dict[str, Path], workload,
                                                   settings: dict) -> None:  # noqa: ANN001
    model = tiny_models["llama"]
    prompts, params = workload
    off = run(model, prompts, params, overlap=False, **settings)
    on = run(model, prompts, params, overlap=True, **settings)
    assert on == off
    assert any(reason == "stop" for _, reason, _, _ in off)


def test_abort_with_a_step_in_flight_frees_everything(tiny_models: dict[str, Path]) -> None:
    """Abort requests while steps run (overlap on): no leak, the others finish normally."""
    model = tiny_models["qwen3"]
    prompts = mixed_prompts(8)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(model, device="cpu", hooks=CHECKED, overlap=True) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, greedy)]
        scheduler = llm.scheduler
        done = threading.Event()
        results: dict[int, list[RequestOutput]] = {}
        lock = threading.Lock()

        def collect(out: RequestOutput) -> None:
            with lock:
                results.setdefault(out.uid, []).append(out)
                if sum(o.finished for outs in results.values() for o in outs) == len(prompts):
                    done.set()

        uids = [scheduler.submit(p, greedy, collect) for p in prompts]
        for uid in uids[::2]:  # abort every other request once it has produced some tokens
            while True:
                with lock:
                    produced = sum(len(o.token_ids) for o in results.get(uid, []))
                if produced >= 3:
                    break
                time.sleep(0.005)
            scheduler.abort(uid)
        assert done.wait(120), "not every request ended"
        stats = idle_stats(scheduler)
    aborted = 0
    for i, uid in enumerate(uids):
        outs = results[uid]
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        tokens = [t for o in outs for t in o.token_ids]
        if outs[-1].finish_reason == "abort":
            assert i % 2 == 0 and tokens == expected[i][: len(tokens)]
            aborted += 1
        else:
            assert outs[-1].finish_reason == "length" and tokens == expected[i]
    assert aborted >= 2
    assert stats.kv_pages_in_use == 0 and stats.running == 0
