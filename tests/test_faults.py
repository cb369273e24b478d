"""Faults: an engine process killed mid-stream, and tritonserver stopped with streams in flight.

Each test starts its own tritonserver (the first in explicit model-control mode, so that the
model can be reloaded); figures are printed with `-s`.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.triton_fixtures import (
    GrpcStream,
    TritonServer,
    _alive,
    _cmdline,
    descendants,
    engine_pids,
    ensemble_inputs,
    http_generate,
    http_status,
    start_server,
)

PROMPT = "The capital of France is"
LONG_PROMPT = "Tell me a very long story about a dragon."
EXIT_TIMEOUT_S = 10


def good_text(server: TritonServer, model: str = "ensemble") -> str:
    result = http_generate(server, {"text_input": PROMPT, "max_tokens": 8,
                                    "exclude_input_in_output": True}, model=model)
    assert result.status == 200, result.body
    return result.text


def start_long_stream(server: TritonServer, model: str) -> GrpcStream:
    stream = GrpcStream(server)
    stream.send(ensemble_inputs(LONG_PROMPT, 400, stream=True, ignore_eos=True), "long",
                model=model)
    _, response, error = stream.next_event(timeout=120)
    assert error is None and response is not None and not response.final
    return stream


def wait_for_error(stream: GrpcStream, timeout: float) -> tuple[str, float]:
    """Read the stream until its error; (message, seconds it took)."""
    start = time.monotonic()
    while True:
        remaining = timeout - (time.monotonic() - start)
        _, response, error = stream.next_event(timeout=max(0.1, remaining))
        if error is not None:
            return str(error), time.monotonic() - start
        assert not response.final, "the stream finished normally although its engine died"


@pytest.fixture
def explicit_server(tmp_path: Path):  # noqa: ANN201
    server = start_server(tmp_path / "server.log",
                          ("--model-control-mode=explicit", "--load-model=*"))
    yield server
    leftovers = server.stop()
    assert not leftovers, f"processes outlived the server: {leftovers}"


def test_killed_engine_fails_requests_and_the_model_reloads(explicit_server: TritonServer) -> None:
    server = explicit_server
    before = good_text(server)
    streams = {model: start_long_stream(server, model) for model in ("minisgl", "ensemble")}
    pids = engine_pids(server.process.pid)
    assert pids, "no engine process found below the minisgl stub"
    killed_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    try:
        for model, stream in streams.items():
            message, took = wait_for_error(stream, timeout=30)
            print(f"\n{model} stream failed {took:.2f} s after the kill: {message[:160]}")
            assert took < 10, f"{model}: no error within 10 s"
            assert "engine" in message, message
    finally:
        for stream in streams.values():
            stream.close()
    later = http_generate(server, {"text_input": PROMPT, "max_tokens": 4}, timeout=30)
    print(f"request after the kill: HTTP {later.status}: {str(later.body)[:160]}")
    assert later.status != 200
    ready_url = f"{server.http_url}/v2/models/minisgl/ready"
    deadline = time.monotonic() + 30
    while http_status(ready_url) == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    status = http_status(ready_url)
    print(f"minisgl ready endpoint {time.monotonic() - killed_at:.1f} s after the kill: {status}")
    assert status != 200, "the model still reports ready with a dead engine"

    load = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                           f"{server.http_url}/v2/repository/models/minisgl/load"],
                          capture_output=True, text=True, timeout=300)
    assert load.stdout == "200", load
    assert http_status(ready_url) == 200
    assert good_text(server) == before  # the ensemble serves again, the same greedy answer
    assert engine_pids(server.process.pid) and not set(engine_pids(server.process.pid)) & set(pids)


def stub_shm_regions(server: TritonServer) -> set[str]:
    """The shared-memory files of the server's Python backend stubs (named on their command
    line: `stub model.py <region> ...`)."""
    regions = set()
    for pid in descendants(server.process.pid):
        cmd = _cmdline(pid)
        if cmd and Path(cmd[0]).name == "triton_python_backend_stub" and len(cmd) > 2:
            regions.add(f"/dev/shm/{cmd[2]}")
    return regions


def private_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "minisgl-*")))


def start_and_stream(tmp_path: Path, models: tuple[str, ...]
                     ) -> tuple[TritonServer, list[GrpcStream], set[str], set[str]]:
    """A server with a long stream in flight on each of `models`; its shm regions and
    private directories."""
    dirs_before = private_dirs()
    server = start_server(tmp_path / "server.log", (f"--exit-timeout-secs={EXIT_TIMEOUT_S}",))
    assert engine_pids(server.process.pid)
    streams = [start_long_stream(server, model) for model in models]
    return server, streams, stub_shm_regions(server), private_dirs() - dirs_before


def report_leftovers(what: str, took: float, server: TritonServer, leftovers: dict,
                     regions: set[str], dirs: set[str]) -> tuple[list[str], list[str]]:
    # Stubs watch their server twice a second; on a loaded 2-core machine their cleanup may
    # take a few seconds more: wait up to 10 s for it.
    deadline = time.monotonic() + 10.0
    while True:
        time.sleep(0.5)
        shm_left = sorted(r for r in regions if os.path.exists(r))
        dirs_left = sorted(d for d in dirs if os.path.exists(d))
        if not (shm_left or dirs_left) or time.monotonic() > deadline:
            break
    print(f"\n{what}: tritonserver gone {took:.1f} s later (exit code "
          f"{server.process.returncode}); left behind: processes {leftovers}, shared memory "
          f"{shm_left}, private dirs {dirs_left}")
    return shm_left, dirs_left


def test_sigterm_with_streams_in_flight_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM with streams in flight on the engine model: the model sees the server stopping
    and ends each stream with a final CANCELLED error; clients that close their stream on it
    let tritonserver exit cleanly within its exit timeout, and nothing is left behind."""
    server, streams, regions, dirs = start_and_stream(tmp_path, ("minisgl",) * 4)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    ended = []
    try:
        for stream in streams:
            message, _ = wait_for_error(stream, timeout=30)
            ended.append((message, time.monotonic() - started))
            stream.close()  # what a client does once its request has ended
        exit_code = server.process.wait(timeout=EXIT_TIMEOUT_S + 10)
    finally:
        for stream in streams:  # (on a failure: a plain close would wait for the server)
            stream.close(cancel_requests=True)
        leftovers = server.stop()
    took = time.monotonic() - started
    print(f"\nstreams ended {[round(t, 2) for _, t in ended]} s after SIGTERM: "
          f"{sorted({m for m, _ in ended})}")
    shm_left, dirs_left = report_leftovers(f"SIGTERM with {len(streams)} streams in flight",
                                           took, server, leftovers, regions, dirs)
    assert all("cancel" in message.lower() for message, _ in ended), ended
    assert exit_code == 0 and took < EXIT_TIMEOUT_S + 5
    assert regions and dirs
    assert not leftovers and not shm_left and not dirs_left


@pytest.mark.xfail(strict=True, reason=(
    "Triton 2.51: a gRPC stream that stays open keeps the model it last used (any model, also "
    "the plain `preprocessing`) from unloading; tritonserver then waits past its exit "
    "timeout, logs 'Exiting immediately' and still does not exit until the client closes "
    "the stream. The engine model has ended its requests by then (previous test)."))
def test_sigterm_exits_while_clients_keep_idle_streams_open(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.log", (f"--exit-timeout-secs={EXIT_TIMEOUT_S}",))
    stream = GrpcStream(server)
    try:
        stream.send(ensemble_inputs(PROMPT, 4, stream=True), "short", model="minisgl")
        assert not stream.collect(["short"])["short"].errors
        server.process.send_signal(signal.SIGTERM)
        try:
            exit_code = server.process.wait(timeout=EXIT_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            exit_code = None
    finally:
        stream.close()  # the server exits once the stream is gone
        leftovers = server.stop()
    assert not leftovers
    assert exit_code == 0, "tritonserver did not exit while a client kept its stream open"


def test_killed_server_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGKILL (or a crash, or a hang past the exit timeout that an orchestrator ends with
    SIGKILL): the stubs notice, stop their engines, remove their shared memory and exit."""
    server, streams, regions, dirs = start_and_stream(tmp_path, ("minisgl", "ensemble") * 2)
    started = time.monotonic()
    known = descendants(server.process.pid)
    try:
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in known) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = {pid: " ".join(_cmdline(pid))[:120] for pid in known if _alive(pid)}
        for pid in leftovers:  # do not let them outlive the test
            os.kill(pid, signal.SIGKILL)
    finally:
        for stream in streams:
            stream.close()
    took = time.monotonic() - started
    shm_left, dirs_left = report_leftovers("SIGKILL with 4 streams in flight", took, server,
                                           leftovers, regions, dirs)
    assert regions and dirs
    assert not leftovers and not shm_left and not dirs_left
