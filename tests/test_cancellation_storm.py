"""A storm of cancelled gRPC streams against the running server (tests/triton_fixtures.py).

More than 200 streams, 12 in flight at once, each carrying one streaming request and closed
with `cancel_requests=True` at a random point: before its first token, mid-stream (after 1-4
responses) or after its final response. Most go to `minisgl` (called with the ensemble's inputs),
which aborts a cancelled request within a step; some go to the `ensemble`, where Triton 2.51
cancels only between steps, so the engine runs them to their (small) max_tokens. Afterwards the
engine must be idle (no KV page in use, nothing running or waiting), no response may have come
after a final one, every stream must have ended with its final response or a CANCELLED error,
the server must not have failed a send, and a good request must give the same answer as before.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.triton_fixtures import (  # noqa: F401 - triton_server is a fixture
    GrpcStream,
    StreamResponse,
    TritonServer,
    ensemble_inputs,
    grpc_generate,
    http_status,
    metrics,
    tensor,
    triton_server,
    wait_engine_idle,
)

SEED = 4242
NUM_STREAMS = 216
CONCURRENCY = 12
ENSEMBLE_SHARE = 0.2
READ_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0  # ensemble streams run to their max_tokens after their client left
PROMPTS = [
    "Tell me a long story about a dragon.", "The capital of France is",
    "Write a poem about the sea.", "List the planets of the solar system:",
    "Once upon a time, in a small village,", "Explain how a bicycle works.",
    "The best way to cook rice is", "My favourite programming language is",
]
GOOD_PROMPT = "The capital of France is"
GOOD_MAX_TOKENS = 8


@dataclass
class Plan:
    index: int
    model: str
    when: str  # planned cancellation point: "before", "mid" or "after"
    prompt: str
    max_tokens: int
    wait_responses: int = 0  # mid: responses read before closing
    delay: float = 0.0  # before: seconds after sending; after: seconds after the final one
    seed: int | None = None  # sampled when set, greedy otherwise


@dataclass
class StreamLog:
    plan: Plan
    responses: list[tuple[float, StreamResponse]] = field(default_factory=list)
    errors: list[tuple[float, str, str]] = field(default_factory=list)  # (time, status, message)
    closed_at: float = 0.0
    problem: str = ""

    @property
    def observed(self) -> str:
        """Where the stream really was when it was closed."""
        seen = [r for t, r in self.responses if t <= self.closed_at]
        if any(r.final for r in seen):
            return "after"
        return "mid" if seen else "before"

    @property
    def finals(self) -> int:
        return sum(r.final for _, r in self.responses)

    @property
    def responses_after_final(self) -> int:
        """Responses that arrived after the first final one (events are in arrival order)."""
        for i, (_, response) in enumerate(self.responses):
            if response.final:
                return len(self.responses) - i - 1
        return 0

    @property
    def num_ids(self) -> int:
        return sum(len(r.ids) for _, r in self.responses)

    @property
    def ended_with(self) -> str:
        if self.finals:
            return "final"
        if self.errors and self.errors[-1][1] == "StatusCode.CANCELLED":
            return "cancelled"
        return "error: " + "; ".join(f"{s} {m[:120]}" for _, s, m in self.errors) \
            if self.errors else "nothing"


def make_plans(seed: int, count: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for index in range(count):
        model = "ensemble" if rng.random() < ENSEMBLE_SHARE else "minisgl"
        when = rng.choice(["before", "mid", "after"])
        plan = Plan(index, model, when, rng.choice(PROMPTS) + f" (#{index})", max_tokens=0,
                    seed=rng.getrandbits(64) if rng.random() < 0.5 else None)
        if when == "before":
            plan.max_tokens = rng.randint(3, 6) if model == "ensemble" else rng.randint(32, 96)
            plan.delay = rng.choice([0.0, 0.0, 0.001, 0.005, 0.02, 0.05, 0.1])
        elif when == "mid":
            plan.max_tokens = rng.randint(4, 6) if model == "ensemble" else rng.randint(16, 96)
            plan.wait_responses = rng.randint(1, 3 if model == "ensemble" else 4)
        else:
            plan.max_tokens = rng.randint(2, 5)
            plan.delay = rng.choice([0.0, 0.0, 0.02, 0.1, 0.3])
        plans.append(plan)
    return plans


def _inputs(plan: Plan) -> list:
    if plan.seed is None:
        return ensemble_inputs(plan.prompt, plan.max_tokens, stream=True, ignore_eos=True)
    return ensemble_inputs(plan.prompt, plan.max_tokens, stream=True, ignore_eos=True,
                           temperature=0.8, top_p=0.95, seed=tensor("seed", plan.seed, "UINT64"))


def _decode(result: Any) -> StreamResponse:
    """A streamed response (as GrpcStream.next_event reads it); raises UnicodeDecodeError."""
    response = result.get_response()
    names = {out.name for out in response.outputs}
    text = ids = None
    if "text_output" in names:
        text = b"".join(result.as_numpy("text_output").reshape(-1).tolist()).decode("utf-8")
    if "output_ids" in names:
        ids = [int(v) for v in result.as_numpy("output_ids").reshape(-1)]
    return StreamResponse(text or "", ids or [],
                          response.parameters["triton_final_response"].bool_param, {})


def run_stream(server: TritonServer, plan: Plan) -> StreamLog:
    log = StreamLog(plan)
    stream = GrpcStream(server)

    def take(timeout: float) -> bool:
        """Record the next event; False when none came within `timeout`."""
        try:
            arrived, result, error = stream.events.get(timeout=timeout)
        except queue.Empty:
            return False
        if error is not None:
            log.errors.append((arrived, str(error.status()), error.message() or ""))
            return True
        try:
            response = _decode(result)
        except UnicodeDecodeError as exc:
            log.problem = f"text_output is not UTF-8: {exc}"
            return True
        log.responses.append((arrived, response))
        return True

    try:
        stream.send(_inputs(plan), f"s{plan.index}", model=plan.model)
        deadline = time.monotonic() + READ_TIMEOUT_S
        if plan.when == "before":
            time.sleep(plan.delay)
        else:
            while not (log.errors or log.finals) and (
                    plan.when == "after" or len(log.responses) < plan.wait_responses):
                if not take(max(0.0, deadline - time.monotonic())):
                    log.problem = f"no response within {READ_TIMEOUT_S} s"
                    break
            if plan.when == "after":
                time.sleep(plan.delay)  # anything after the final response would show up here
    finally:
        log.closed_at = time.monotonic()
        stream.close(cancel_requests=True)  # joins the stream's thread: every event is queued
    while take(0.05):
        pass
    return log


def good_answer(server: TritonServer) -> tuple[str, list[int]]:
    result = grpc_generate(server, ensemble_inputs(GOOD_PROMPT, GOOD_MAX_TOKENS, stream=True),
                           model="minisgl")
    assert not result.errors and result.finals == 1 and result.last.final, result
    assert len(result.ids) == GOOD_MAX_TOKENS, result.ids
    return result.text, result.ids


@pytest.fixture(scope="module")
def server(triton_server: TritonServer, default_model: Path) -> TritonServer:  # noqa: F811
    return triton_server


def _log_failures(server: TritonServer, start: int) -> list[str]:
    """Lines of the server log (from byte `start`) where the engine model failed a send."""
    try:
        with open(server.log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines()
            if "sending a response failed" in line or "Response sender has been closed" in line]


def test_cancellation_storm(server: TritonServer) -> None:
    before_text = good_answer(server)
    log_start = server.log_path.stat().st_size
    plans = make_plans(SEED, NUM_STREAMS)
    todo: queue.Queue[Plan] = queue.Queue()
    for plan in plans:
        todo.put(plan)
    logs: list[StreamLog] = []
    lock = threading.Lock()
    crashed: list[BaseException] = []

    def worker() -> None:
        while True:
            try:
                plan = todo.get_nowait()
            except queue.Empty:
                return
            try:
                log = run_stream(server, plan)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                crashed.append(exc)
                return
            with lock:
                logs.append(log)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(CONCURRENCY)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    storm_s = time.monotonic() - started
    assert not crashed, crashed[:3]
    assert not any(t.is_alive() for t in threads), "a stream worker did not finish"

    idle = wait_engine_idle(server, IDLE_TIMEOUT_S)
    idle_s = time.monotonic() - started - storm_s
    ready = http_status(f"{server.http_url}/v2/health/ready")
    after_text = good_answer(server)
    send_failures = _log_failures(server, log_start)

    logs.sort(key=lambda log: log.plan.index)
    observed = Counter((log.plan.model, log.observed) for log in logs)
    ended = Counter(log.ended_with if log.ended_with in ("final", "cancelled") else "other"
                    for log in logs)
    after_final = sum(log.responses_after_final for log in logs)
    problems = [(log.plan.index, log.plan.model, log.problem) for log in logs if log.problem]
    bad_ends = [(log.plan.index, log.plan.model, log.ended_with) for log in logs
                if log.ended_with not in ("final", "cancelled")]
    multi_final = [log.plan.index for log in logs if log.finals > 1]
    # a stream that got its final response got all of its max_tokens (ignore_eos)
    short = [(log.plan.index, log.num_ids, log.plan.max_tokens) for log in logs
             if log.finals and log.num_ids != log.plan.max_tokens]

    def count(when: str, model: str | None = None) -> int:
        return sum(n for (m, w), n in observed.items() if w == when and model in (None, m))

    print(f"\ncancellation storm (seed {SEED}, {CONCURRENCY} streams in flight): "
          f"{storm_s:.1f} s, engine idle {idle_s:.1f} s later")
    print(f"  streams:                         {len(logs)} "
          f"(minisgl {sum(1 for g in logs if g.plan.model == 'minisgl')}, "
          f"ensemble {sum(1 for g in logs if g.plan.model == 'ensemble')})")
    for when, label in (("before", "before the first token"), ("mid", "mid-stream"),
                        ("after", "after the last token")):
        print(f"  cancelled {label + ':':<24} {count(when):>3} "
              f"(minisgl {count(when, 'minisgl')}, ensemble {count(when, 'ensemble')})")
    print(f"  ended with the final response:   {ended['final']}, with CANCELLED: "
          f"{ended['cancelled']}, otherwise: {ended['other']}")
    print(f"  responses after a final one:     {after_final}")
    print(f"  failed sends in the server log:  {len(send_failures)}")
    print(f"  pages leaked (in use once idle): {idle['minisgl_kv_pages_in_use']}, running "
          f"{idle['minisgl_requests_running']}, waiting {idle['minisgl_requests_waiting']}")
    print(f"  good request after: same answer as before: {after_text == before_text}")

    assert len(logs) == NUM_STREAMS >= 200
    assert not problems, problems[:10]
    assert after_final == 0
    assert not multi_final, multi_final[:10]
    assert not bad_ends, bad_ends[:10]
    assert not short, short[:10]
    assert not send_failures, send_failures[:5]
    for when in ("before", "mid", "after"):
        assert count(when, "minisgl") >= 15, observed
        assert count(when, "ensemble") >= 3, observed
    assert all(v == 0 for v in idle.values()), f"engine not idle {IDLE_TIMEOUT_S} s after: {idle}"
    assert ready == 200
    assert after_text == before_text
