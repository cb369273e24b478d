"""Overload: 64 requests at once for 4 table rows and a KV pool that holds about 3 of them.

Every request must complete (bounded wait: no deadlock) with exactly the output it gets when it
runs alone (greedy outputs and seeded samples do not depend on the batch), the scheduler's debug
checks verify page accounting after every step, and waiting is first come, first served: in
arrival order, the step that admitted a request never goes back (`RequestOutput.admitted_ns`,
stamped once per scheduling step), so no
request waits behind more than the requests that arrived before it plus one step's admissions.
A shutdown under load ends every request, also those submitted while or after it happens.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.scheduler import RequestOutput
from tests.test_overlap import idle_stats
from tests.conftest import CHECKED

NUM_REQUESTS = 64
MAX_RUNNING = 4
# The longest request holds 80 + 24 = 104 tokens: this pool holds about 3 requests at once.
POOL_TOKENS = 320
WAIT_S = 300  # every request must have ended by then (a deadlock fails instead of hanging)


def overload_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 5 to 80 tokens, half of them behind one of two shared prefixes; greedy and
    seeded sampling (temperature, top-p, top-k), with and without EOS, 1 to 24 new tokens."""
    gen = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 500, (n,), generator=gen).tolist()

    prefixes = [rand(40), rand(24)]
    lengths = [5, 80, 17, 33, 9, 61, 24, 47, 12, 70, 3, 28]
    prompts, params = [], []
    for i in range(NUM_REQUESTS):
        if i % 4 == 1:
            prompts.append(prefixes[0] + rand(3 + i % 9))
        elif i % 4 == 3:
            prompts.append(prefixes[1] + rand(1 + i % 13))
        else:
            prompts.append(rand(lengths[i % len(lengths)]))
        max_tokens = 1 + (7 * i) % 24
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9,
                                         seed=i, ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=20,
                                         seed=1000 + i))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=max_tokens))  # greedy, may stop at EOS
        else:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=1.2, seed=i,
                                         ignore_eos=True))
    return prompts, params


@dataclass
class Track:
    outputs: list[RequestOutput] = field(default_factory=list)
    admitted_ns: int = 0  # when the request was admitted (one stamp per scheduling step)
    late: int = 0  # outputs after the final one

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished

    def result(self) -> tuple:
        last = self.outputs[-1]
        tokens = [t for o in self.outputs for t in o.token_ids]
        return tokens, last.finish_reason, "".join(o.text for o in self.outputs)


@dataclass
class Figures:
    requests: int
    finished: int
    errors: int
    peak_running: int
    steps: int
    admission_steps: int  # distinct steps that admitted requests
    evicted_pages: int
    results: list[tuple]


def run_all(model: Path, prompts: list[list[int]], params: list[SamplingParams],
            **settings) -> Figures:
    """Submit every request at once, in index order (arrival order = uid order)."""
    with LLM(model, device="cpu", hooks=CHECKED, **settings) as llm:
        scheduler = llm.scheduler
        tracks: dict[int, Track] = {}
        lock = threading.Lock()
        all_done = threading.Event()

        def on_output(out: RequestOutput) -> None:  # on the scheduler thread
            with lock:
                track = tracks.setdefault(out.uid, Track())
                if track.finished:
                    track.late += 1
                    return
                if not track.outputs:
                    track.admitted_ns = out.admitted_ns
                track.outputs.append(out)
                if out.finished and sum(t.finished for t in tracks.values()) == len(prompts):
                    all_done.set()

        uids = [scheduler.submit(p, sp, on_output) for p, sp in zip(prompts, params)]
        completed = all_done.wait(WAIT_S)
        stats = idle_stats(scheduler)
        with lock:
            ended = sum(t.finished for t in tracks.values())
        assert completed, (f"deadlock: {ended} of {len(prompts)} requests ended in {WAIT_S} s; "
                           f"stats {scheduler.stats}")
        figures = Figures(
            requests=len(uids), finished=ended,
            errors=sum(tracks[u].outputs[-1].finish_reason == "error" for u in uids),
            peak_running=scheduler.peak_running, steps=scheduler.num_steps,
            admission_steps=len({tracks[u].admitted_ns for u in uids}),
            evicted_pages=scheduler.cache.evicted_pages,
            results=[tracks[u].result() for u in uids],
        )
        assert all(tracks[u].late == 0 for u in uids), "an output came after the final one"
        assert all(sum(o.finished for o in tracks[u].outputs) == 1 for u in uids)
        admitted = [tracks[u].admitted_ns for u in uids]
    assert stats.kv_pages_in_use == 0 and stats.running == 0 and stats.waiting == 0, stats
    assert all(ns > 0 for ns in admitted), "a request ran without being admitted"
    # First come, first served: in arrival order the admission step never decreases.
    for i in range(1, len(admitted)):
        assert admitted[i] >= admitted[i - 1], (
            f"request {i} was admitted at {admitted[i]} ns, before request {i - 1} "
            f"(admitted at {admitted[i - 1]} ns), which arrived earlier")
    return figures


@pytest.fixture(scope="module")
def workload(tiny_models: dict[str, Path]) -> tuple[list, list, list[tuple]]:
    """The workload and each request's output when it runs alone: one table row (so every
    batch holds one request), no prefix sharing, no overlap, a large pool."""
    prompts, params = overload_workload()
    alone = run_all(tiny_models["llama"], prompts, params, max_running_requests=1,
                    cache="naive", overlap=False)
    assert alone.peak_running == 1 and alone.errors == 0
    return prompts, params, alone.results


@pytest.mark.parametrize("settings", [
    pytest.param({"overlap": False}, id="overlap-off"),
    pytest.param({"overlap": True}, id="overlap-on"),
    pytest.param({"overlap": False, "page_size": 4, "chunked_prefill_size": 48},
                 id="overlap-off-page4-chunk48"),
    pytest.param({"overlap": True, "page_size": 16, "chunked_prefill_size": 32},
                 id="overlap-on-page16-chunk32"),
])
def test_overload_completes_fcfs_with_outputs_as_alone(tiny_models: dict[str, Path], workload,
                                                       settings: dict) -> None:  # noqa: ANN001
    prompts, params, alone = workload
    figures = run_all(tiny_models["llama"], prompts, params, max_running_requests=MAX_RUNNING,
                      max_total_tokens=POOL_TOKENS, **settings)
    print(f"\noverload {settings}: requests {figures.requests}, finished {figures.finished}, "
          f"errors {figures.errors}, max running {figures.peak_running} "
          f"(limit {MAX_RUNNING}), steps {figures.steps}, admission steps "
          f"{figures.admission_steps}, evicted pages {figures.evicted_pages}")
    assert figures.finished == figures.requests == NUM_REQUESTS
    assert figures.errors == 0
    assert 2 <= figures.peak_running <= MAX_RUNNING
    assert figures.admission_steps >= NUM_REQUESTS // MAX_RUNNING  # requests did wait
    assert figures.evicted_pages > 0  # the pool was too small to keep every prefix
    mismatched = [i for i, (got, want) in enumerate(zip(figures.results, alone)) if got != want]
    assert not mismatched, (f"{len(mismatched)} outputs differ from the request run alone, "
                            f"first: request {mismatched[0]}")
    reasons = {reason for _, reason, _ in alone}
    assert "length" in reasons


def test_shutdown_under_load_ends_every_request(tiny_models: dict[str, Path]) -> None:
    """Clients keep submitting while the scheduler shuts down: requests queued before it end
    ("abort" if they had not finished), later ones end at once with an error; none is lost
    (a request queued behind the shutdown used to never end: `LLM.generate` hung)."""
    prompts, params = overload_workload()
    llm = LLM(tiny_models["llama"], device="cpu", hooks=CHECKED,
              max_running_requests=MAX_RUNNING, max_total_tokens=POOL_TOKENS)
    lock = threading.Lock()
    finals: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    errors: set[str] = set()
    late: list[int] = []
    uids: list[int] = []
    shut_down = threading.Event()

    def on_output(out: RequestOutput) -> None:
        with lock:
            if finals[out.uid]:
                late.append(out.uid)
            if out.finished:
                finals[out.uid] += 1
                reasons[out.finish_reason] += 1
                if out.finish_reason == "error":
                    errors.add(out.error)

    def client(offset: int) -> None:
        after = 0
        for i in range(offset, 10**6, 3):
            uid = llm.scheduler.submit(prompts[i % NUM_REQUESTS], params[i % NUM_REQUESTS],
                                       on_output)
            with lock:
                uids.append(uid)
            if shut_down.is_set():
                after += 1
                if after == 20:
                    return
            time.sleep(0.002)

    clients = [threading.Thread(target=client, args=(c,)) for c in range(3)]
    for thread in clients:
        thread.start()
    time.sleep(2.0)
    llm.shutdown()
    shut_down.set()
    for thread in clients:
        thread.join(60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum(finals.values()) < len(uids):
        time.sleep(0.05)
    with lock:
        lost = [uid for uid in uids if finals[uid] == 0]
        print(f"\nshutdown under load: requests {len(uids)}, ended {sum(finals.values())} "
              f"{dict(reasons)}, lost {len(lost)}, outputs after the final one {len(late)}")
        assert not lost, f"{len(lost)} requests never ended, first uid {lost[0]}"
        assert all(finals[uid] == 1 for uid in uids) and not late
        assert reasons["abort"] > 0 and reasons["error"] >= 60
        assert errors == {"the engine was shut down"}


def test_invalid_token_ids_amid_load_fail_alone(tiny_models: dict[str, Path], workload) -> None:  # noqa: ANN001
    """Requests with prompt ids outside the vocabulary (negative ones killed the scheduler
    thread: every request hung; too large ones failed the engine for every request) or stop
    ids outside it with min_tokens (an IndexError in the engine) end with an error at once;
    the overload workload around them still gets its outputs."""
    prompts, params, alone = workload
    bad = [([5, -1, 7], SamplingParams(max_tokens=4)),
           ([5, 512, 7], SamplingParams(max_tokens=4)),
           ([5, 6, 7], SamplingParams(max_tokens=4, stop_token_ids=[600], min_tokens=2))]
    with LLM(tiny_models["llama"], device="cpu", hooks=CHECKED,
             max_running_requests=MAX_RUNNING, max_total_tokens=POOL_TOKENS) as llm:
        results: dict[int, Track] = {}
        lock = threading.Lock()
        done = threading.Event()
        total = len(prompts) + 2 * len(bad)

        def on_output(out: RequestOutput) -> None:
            with lock:
                track = results.setdefault(out.uid, Track())
                track.outputs.append(out)
                if sum(t.finished for t in results.values()) == total:
                    done.set()

        good_uids, bad_uids = [], []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if i in (0, 20):  # one wave of invalid requests first, one among waiting requests
                bad_uids += [llm.scheduler.submit(bp, bsp, on_output) for bp, bsp in bad]
            good_uids.append(llm.scheduler.submit(p, sp, on_output))
        assert done.wait(WAIT_S), "not every request ended"
        stats = idle_stats(llm.scheduler)
        failure = llm.scheduler.failure
    errors = [results[u].outputs[-1].error for u in bad_uids]
    print(f"\ninvalid ids amid load: {len(bad_uids)} invalid requests, errors {set(errors)}")
    assert failure is None
    assert all(results[u].outputs[-1].finish_reason == "error" for u in bad_uids)
    assert all(len(results[u].outputs) == 1 for u in bad_uids)
    assert set(errors) == {"prompt has token ids outside [0, 512)",
                           "stop_token_ids has token ids outside [0, 512)"}
    assert [results[u].result() for u in good_uids] == alone
    assert stats.kv_pages_in_use == 0 and stats.running == 0 and stats.waiting == 0, stats
