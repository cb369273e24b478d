"""Soak: a mixed workload submitted continuously for MINISGL_SOAK_SECONDS (default 300) seconds.

A few client threads submit to one scheduler (tiny model, CPU, overlap on, pages of 4 tokens, a
KV pool too small for every request, page accounting checked after every step): greedy and
sampled requests, shared prefixes, stop strings, stop ids, min_tokens, small and larger
max_tokens, some aborted at random points (at once, after a delay, or from the output callback
after a few tokens). Every request must end with exactly one final output and nothing after it;
aborted ones end with "abort" (unless they finished first), no request ends with an error or is
lost; repeats of reference prompts give prefixes of their reference output (no cross-request KV
corruption under load); admissions are first come, first served; resident memory (this process
plus the engine processes) is flat after a warm-up; once idle no page, row or request is held.

Skip it locally with `-m "not soak"`; `scripts/test.sh` runs it.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.core import Req
from minisgl_backend.scheduler import RequestOutput
from tests.test_overlap import idle_stats
from tests.conftest import CHECKED

SOAK_SECONDS = float(os.environ.get("MINISGL_SOAK_SECONDS", "300"))
WARMUP_SECONDS = min(60.0, SOAK_SECONDS / 5)  # RSS is measured from here on
NUM_CLIENTS = 3
OUTSTANDING_PER_CLIENT = 12  # requests a client has submitted and not seen end, at most
MAX_RUNNING = 8
POOL_TOKENS = 768  # about 4 of the largest requests (120 prompt + 128 new tokens)
SETTINGS = dict(device="cpu", hooks=CHECKED, overlap=True, page_size=4,
                chunked_prefill_size=64)
DRAIN_S = 180  # every request must have ended this long after the last submission
# Resident memory of this process + the engine process is about 680 MB (torch twice) and grows
# by under 1 MB from the end of the warm-up to the end of the load (the test forgets each request
# once checked). 25 MB (under 4 %) is far above that noise, yet a leak of 1 KB per step or 5 KB
# per request (a Req with its tokens, a tracker with its detokenizer) over the ~25k steps and ~5k
# requests of a default run exceeds it; leaked Req objects are also counted directly.
RSS_GROWTH_LIMIT_MB = 25.0

pytestmark = pytest.mark.soak

NUM_REFERENCE_PROMPTS = 12
REFERENCE_TOKENS = 64
STOP_STRINGS = ["e", "a", "in", " t", "s", "on", "x"]


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def total_rss_mb(engine_pids: list[int]) -> float:
    return sum(_rss_kb(pid) for pid in [os.getpid(), *engine_pids]) / 1024


@dataclass(eq=False)
class Track:
    """One request until it ends (then it is checked, counted and dropped, so that the test's
    own bookkeeping does not grow with the number of requests and inflate the RSS figures)."""

    client: int
    params: SamplingParams
    reference: tuple[int, str] | None = None  # (reference prompt, "greedy" or "seeded")
    abort_after: int | None = None  # abort from the callback once this many outputs came
    uid: int = -1
    abort_requested: bool = False
    outputs: int = 0
    tokens: list[int] = field(default_factory=list)
    ended: bool = False


@dataclass
class Counts:
    submitted: int = 0
    finished: int = 0
    reasons: Counter = field(default_factory=Counter)
    abort_requested: int = 0
    tokens: int = 0
    checked: int = 0  # outputs of reference prompts compared with their reference
    wrong: int = 0
    late: int = 0  # outputs after a request's final one


class Soak:
    def __init__(self, llm: LLM, references: dict[tuple[int, str], list[int]],
                 reference_prompts: list[list[int]], prefixes: list[list[int]]) -> None:
        self.llm = llm
        self.scheduler = llm.scheduler
        self.references = references
        self.reference_prompts = reference_prompts
        self.prefixes = prefixes
        self.lock = threading.Lock()
        self.open: set[Track] = set()  # submitted, not ended yet
        self.counts = Counts()
        self.admissions = array("q")  # (uid, admitting step) pairs, flat
        self.errors: list[str] = []
        self.recent_tokens: list[int] = [5, 7, 11]  # stop-id candidates (tokens that occur)
        self.stop = threading.Event()
        self.slots = [threading.Semaphore(OUTSTANDING_PER_CLIENT) for _ in range(NUM_CLIENTS)]

    # ----- the callback (scheduler thread) --------------------------------------------------

    def on_output(self, track: Track, out: RequestOutput) -> None:
        abort = False
        try:
            with self.lock:
                if track.ended:
                    self.counts.late += 1
                    return
                if track.outputs == 0:
                    tracker = self.scheduler.trackers.get(out.uid)
                    if tracker is not None and tracker.req.admitted_step >= 0:
                        self.admissions.extend((out.uid, tracker.req.admitted_step))
                track.outputs += 1
                track.tokens.extend(out.token_ids)
                if out.token_ids and len(self.recent_tokens) < 64:
                    self.recent_tokens.append(out.token_ids[-1])
                elif out.token_ids:
                    self.recent_tokens[random.randrange(64)] = out.token_ids[-1]
                if out.finished:
                    self._end(track, out)
                    return
                abort = track.abort_after is not None and track.outputs >= track.abort_after
                if abort:
                    track.abort_requested = True
            if abort:
                self.scheduler.abort(out.uid)
        except Exception as exc:  # never let a test bug kill the scheduler thread
            self.errors.append(f"callback: {exc!r}")

    def _end(self, track: Track, out: RequestOutput) -> None:
        """Check a request's end (under the lock), count it and forget it."""
        reason, tokens, limit = out.finish_reason, track.tokens, track.params.max_tokens
        problem = None
        if reason == "error":
            problem = f"failed: {out.error}"
        elif reason == "abort" and not track.abort_requested:
            problem = "ended with abort, but nobody aborted it"
        elif reason not in ("stop", "length", "abort"):
            problem = f"unknown finish reason {reason!r}"
        elif reason == "length" and len(tokens) != limit:
            problem = f"length with {len(tokens)} tokens, max_tokens {limit}"
        elif reason == "stop" and not tokens:
            problem = "stopped without a token"
        elif len(tokens) > limit:
            problem = f"{len(tokens)} tokens > max_tokens {limit}"
        if problem is not None:
            self.errors.append(f"request {out.uid}: {problem}")
        if track.reference is not None:
            self.counts.checked += 1
            if tokens != self.references[track.reference][: len(tokens)]:
                self.counts.wrong += 1
                self.errors.append(f"request {out.uid}: output differs from the reference "
                                   f"{track.reference}")
        counts = self.counts
        counts.finished += 1
        counts.reasons[reason] += 1
        counts.tokens += len(tokens)
        counts.abort_requested += track.abort_requested
        track.ended = True
        track.tokens = []
        self.open.discard(track)
        self.slots[track.client].release()

    # ----- clients ---------------------------------------------------------------------------

    def make_request(self, rng: random.Random, client: int) -> tuple[list[int], Track]:
        choice = rng.random()
        reference = None
        if choice < 0.25:  # a reference prompt: its output must be a prefix of the reference
            index = rng.randrange(len(self.reference_prompts))
            kind = rng.choice(["greedy", "seeded"])
            prompt = list(self.reference_prompts[index])
            max_tokens = rng.choice([rng.randint(1, 8), rng.randint(16, REFERENCE_TOKENS)])
            if kind == "greedy":
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            else:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95,
                                        seed=1000 + index, ignore_eos=True)
            reference = (index, kind)
        else:
            if choice < 0.6:  # a shared prefix and a fresh tail
                prompt = rng.choice(self.prefixes) + _tokens(rng, rng.randint(1, 24))
            else:
                prompt = _tokens(rng, rng.randint(3, 120))
            max_tokens = rng.choice([rng.randint(1, 8), rng.randint(9, 128)])
            sampled = rng.random() < 0.5
            with self.lock:
                stop_ids = rng.sample(self.recent_tokens, k=min(2, len(self.recent_tokens)))
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=rng.uniform(0.5, 1.3) if sampled else 0.0,
                top_k=rng.choice([-1, 5, 50]) if sampled else -1,
                top_p=rng.choice([1.0, 0.9]) if sampled else 1.0,
                seed=rng.getrandbits(64) if sampled and rng.random() < 0.5 else None,
                ignore_eos=rng.random() < 0.7,
                stop=rng.sample(STOP_STRINGS, k=2) if rng.random() < 0.3 else None,
                stop_token_ids=stop_ids if rng.random() < 0.3 else None,
                min_tokens=min(max_tokens, rng.randint(1, 4)) if rng.random() < 0.2 else 0,
            )
        track = Track(client=client, params=params, reference=reference)
        return prompt, track

    def client(self, client: int) -> None:
        rng = random.Random(1000 + client)
        delayed: list[tuple[float, Track]] = []  # (when, request) aborts from this thread
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                for item in [d for d in delayed if d[0] <= now]:
                    delayed.remove(item)
                    self._abort(item[1])
                if not self.slots[client].acquire(timeout=0.2):
                    continue
                prompt, track = self.make_request(rng, client)
                mode = rng.random()
                if mode < 0.05:
                    track.abort_after = rng.randint(1, 12)  # from the callback
                with self.lock:
                    self.open.add(track)
                    self.counts.submitted += 1
                track.uid = self.scheduler.submit(
                    prompt, track.params, lambda out, t=track: self.on_output(t, out))
                if mode >= 0.95:
                    self._abort(track)  # at once: usually still waiting
                elif mode >= 0.85:
                    delayed.append((now + rng.uniform(0.0, 0.3), track))
                if rng.random() < 0.005:
                    time.sleep(rng.uniform(0.5, 1.5))  # a lull
                else:
                    time.sleep(rng.uniform(0.0, 0.004))
            for _, track in delayed:
                self._abort(track)
        except Exception as exc:
            with self.lock:
                self.errors.append(f"client {client}: {exc!r}")

    def _abort(self, track: Track) -> None:
        with self.lock:
            track.abort_requested = True
        self.scheduler.abort(track.uid)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def soak_model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def test_soak(soak_model: Path) -> None:
    rng = random.Random(7)
    reference_prompts = [_tokens(rng, rng.randint(4, 90)) for _ in range(NUM_REFERENCE_PROMPTS)]
    prefixes = [_tokens(rng, n) for n in (8, 16, 33, 64)]
    started = time.monotonic()
    with LLM(soak_model, max_running_requests=MAX_RUNNING, max_total_tokens=POOL_TOKENS,
             **SETTINGS) as llm:
        scheduler = llm.scheduler
        greedy = SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True)
        seeded = [SamplingParams(max_tokens=REFERENCE_TOKENS, temperature=0.9, top_p=0.95,
                                 seed=1000 + i, ignore_eos=True)
                  for i in range(NUM_REFERENCE_PROMPTS)]
        references = {}
        for i, out in enumerate(llm.generate(reference_prompts, greedy)):
            references[(i, "greedy")] = out.token_ids
        for i, out in enumerate(llm.generate(reference_prompts, seeded)):
            references[(i, "seeded")] = out.token_ids
        soak = Soak(llm, references, reference_prompts, prefixes)
        pids = scheduler.engine.pids
        clients = [threading.Thread(target=soak.client, args=(c,), name=f"soak-client-{c}")
                   for c in range(NUM_CLIENTS)]
        load_start = time.monotonic()
        for thread in clients:
            thread.start()
        rss_start = rss_peak = None
        while (elapsed := time.monotonic() - load_start) < SOAK_SECONDS:
            time.sleep(min(1.0, SOAK_SECONDS - elapsed))
            if not scheduler.alive:
                break
            if time.monotonic() - load_start >= WARMUP_SECONDS:
                rss = total_rss_mb(pids)
                rss_start = rss if rss_start is None else rss_start
                rss_peak = rss if rss_peak is None else max(rss_peak, rss)
        rss_end = total_rss_mb(pids)
        if rss_start is None:  # the scheduler died during the warm-up (asserted below)
            rss_start = rss_peak = rss_end
        soak.stop.set()
        for thread in clients:
            thread.join(30)
        drain_start = time.monotonic()
        while time.monotonic() - drain_start < DRAIN_S and scheduler.alive:
            with soak.lock:
                if not soak.open:
                    break
            time.sleep(0.1)
        with soak.lock:
            lost = len(soak.open)  # (the shutdown below ends them with "abort")
        stats = idle_stats(scheduler)
        time.sleep(0.2)  # the scheduler thread is idle now: its state can be read safely
        rss_idle = total_rss_mb(pids)
        leaked_pages = stats.kv_pages_in_use
        scheduler.cache.check_accounting([])
        held = (len(scheduler.trackers), len(scheduler.prefill.waiting),
                scheduler.prefill.chunked is not None, len(scheduler.decode.running),
                scheduler.rows.num_rows - scheduler.rows.num_free,
                scheduler.in_flight is not None)
        gc.collect()
        live_reqs = sum(type(o) is Req for o in gc.get_objects())
        steps, peak_running = scheduler.num_steps, scheduler.peak_running
        evicted, failure = scheduler.cache.evicted_pages, scheduler.failure
    load_s = drain_start - load_start

    counts, errors = soak.counts, list(soak.errors)
    # First come, first served: in arrival (uid) order admissions never go back in steps.
    admitted = sorted(zip(soak.admissions[::2], soak.admissions[1::2]))
    out_of_order = sum(b[1] < a[1] for a, b in zip(admitted, admitted[1:]))
    aborted = counts.reasons["abort"]
    print(f"\nsoak {load_s:.0f} s of load (warm-up {WARMUP_SECONDS:.0f} s), "
          f"{time.monotonic() - started:.0f} s in all: submitted {counts.submitted}, "
          f"finished {counts.finished} {dict(counts.reasons)}, abort requested "
          f"{counts.abort_requested}, aborted {aborted}, errors {len(errors)}, lost {lost}, "
          f"outputs after the final one {counts.late}")
    print(f"  {counts.tokens} tokens generated, {steps} steps, max running {peak_running} "
          f"(limit {MAX_RUNNING}), evicted pages {evicted}, {counts.checked} outputs checked "
          f"against their reference ({counts.wrong} wrong), {len(admitted)} admissions "
          f"({out_of_order} out of arrival order)")
    print(f"  pages leaked {leaked_pages} (of {stats.kv_pages_total}), held at idle "
          f"(trackers, waiting, chunked, decoding, rows, in flight) {held}, "
          f"live Req objects {live_reqs}")
    growth = rss_end - rss_start
    print(f"  RSS (this process + {len(pids)} engine process) after warm-up {rss_start:.1f} MB, "
          f"peak {rss_peak:.1f} MB, end {rss_end:.1f} MB (growth {growth:+.1f} MB, limit "
          f"{RSS_GROWTH_LIMIT_MB:.0f} MB), idle {rss_idle:.1f} MB")

    assert failure is None, failure
    assert not errors, errors[:10]
    assert lost == 0
    assert counts.late == 0
    assert counts.wrong == 0
    assert out_of_order == 0
    assert leaked_pages == 0 and stats.running == 0 and stats.waiting == 0, stats
    assert held == (0, 0, False, 0, 0, False)
    assert live_reqs == 0
    assert growth < RSS_GROWTH_LIMIT_MB
    # The workload did what it is meant to: plenty of requests, every ending, real pressure.
    assert counts.submitted >= 10 * SOAK_SECONDS / 60
    assert aborted > 0 and counts.reasons["stop"] > 0 and counts.reasons["length"] > 0
    assert counts.checked > 0 and peak_running == MAX_RUNNING and evicted > 0
