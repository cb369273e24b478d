"""How the engine model learns that tritonserver is stopping: the server's HTTP endpoint, found
from the server's command line (`minisgl_backend.serving.server_health`)."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from minisgl_backend.serving.server_health import (
    Readiness,
    model_ready,
    model_ready_url,
    server_options,
)


def _process_with_args(*args: str) -> subprocess.Popen:
    """A process whose command line ends with `args` (waited for: right after the fork,
    /proc shows the parent's command line until the exec)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    expected = "\0".join(args).encode()
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{process.pid}/cmdline").read_bytes().rstrip(b"\0").endswith(
            expected) and time.monotonic() < deadline:
        time.sleep(0.01)
    return process


@pytest.mark.parametrize(("args", "expected"), [
    (("--model-repository=/m", "--http-port=8123"), "http://127.0.0.1:8123/v2/models/m%201/ready"),
    (("--http-port", "9000", "--http-address", "10.1.2.3"),
     "http://10.1.2.3:9000/v2/models/m%201/ready"),
    (("--http-address=::",), "http://[::1]:8000/v2/models/m%201/ready"),
    (("--allow-http=false", "--http-port=8123"), None),
    (("--allow-http", "0"), None),
])
def test_ready_url_from_the_server_command_line(args: tuple[str, ...],
                                                expected: str | None) -> None:
    process = _process_with_args(*args)
    try:
        assert model_ready_url(process.pid, "m 1") == expected
    finally:
        process.kill()
        process.wait()


def test_options_of_a_missing_process_are_empty() -> None:
    assert server_options(2**22 + 12345) == {}


@pytest.fixture
def http_server() -> Iterator[tuple[str, dict[str, int]]]:
    """A loopback HTTP server answering each path with the status set in the dict."""
    statuses: dict[str, int] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self.send_response(statuses.get(self.path, 404))
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", statuses
    finally:
        server.shutdown()
        server.server_close()


def test_model_ready_reads_the_status(http_server: tuple[str, dict[str, int]]) -> None:
    base, statuses = http_server
    statuses["/v2/models/a/ready"] = 200
    statuses["/v2/models/b/ready"] = 400
    statuses["/v2/models/c/ready"] = 503
    assert model_ready(f"{base}/v2/models/a/ready") == Readiness.READY
    assert model_ready(f"{base}/v2/models/b/ready") == Readiness.NOT_READY
    assert model_ready(f"{base}/v2/models/c/ready") == Readiness.NOT_READY
    # a restricted or authenticated endpoint, or a wrong URL, says nothing about the model: the
    # engine model must not end its requests over it (it asks the stub instead)
    for status, name in ((401, "d"), (403, "e"), (404, "f")):
        statuses[f"/v2/models/{name}/ready"] = status
        assert model_ready(f"{base}/v2/models/{name}/ready") == Readiness.NO_ANSWER, status


def test_a_closed_endpoint_is_refused_and_silence_is_no_answer() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert model_ready(f"http://127.0.0.1:{port}/v2/models/a/ready") == Readiness.REFUSED
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v2/models/a/ready"
        assert model_ready(url, timeout=0.3) == Readiness.NO_ANSWER
