"""A tritonserver serving `model_repository/` (session fixture) and small client helpers.

The server is started the way a user would start it (`scripts/triton_env.sh`, then
`run_tritonserver`), on free ports, in the background. Teardown stops it with SIGTERM and checks
that none of its Python backend stubs or engine processes outlived it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from minisgl_backend.benchmark.tritonserver import Tritonserver, free_ports, http_status
from minisgl_backend.serving.interface import PERF_METRICS

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0  # tritonserver itself waits up to 30 s (--exit-timeout-secs) for requests
MODEL = "ensemble"


# ----- processes ------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a live process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[1] != "Z"


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> set[int]:
    """Every live process below `root` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def server_leftovers(server_pid: int, known: set[int]) -> dict[int, str]:
    """Live processes that belong to the server `server_pid` once it has exited: the Python
    backend stubs (their command line carries the server's pid), the engine processes and
    multiprocessing helpers below them, and any process seen below the server before it stopped.
    """
    stubs = {pid for pid in _all_pids()
             if (cmd := _cmdline(pid)) and Path(cmd[0]).name == "triton_python_backend_stub"
             and str(server_pid) in cmd[1:]}
    suspects = set(known) | stubs
    for stub in stubs:
        suspects |= descendants(stub)
    return {pid: " ".join(_cmdline(pid))[:200] for pid in sorted(suspects) if _alive(pid)}


def engine_pids(server_pid: int, model: str = "minisgl") -> list[int]:
    """The engine processes spawned by `model`'s Python backend stub."""
    stubs = [pid for pid in descendants(server_pid)
             if (cmd := _cmdline(pid)) and Path(cmd[0]).name == "triton_python_backend_stub"
             and f"/{model}/" in " ".join(cmd)]
    return [pid for stub in stubs for pid in descendants(stub)
            if "spawn_main" in " ".join(_cmdline(pid))]


class TritonServer(Tritonserver):
    """The package's server handle; `stop` here also reports what outlived the server."""

    def stop(self) -> dict[int, str]:
        """SIGTERM, wait (SIGKILL after STOP_TIMEOUT_S); return the processes left behind
        (already killed here so that they do not outlive the test session)."""
        pid = self.process.pid
        known = descendants(pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        deadline = time.monotonic() + 10.0  # stubs notice their parent's exit within seconds
        leftovers = server_leftovers(pid, known)
        while leftovers and time.monotonic() < deadline:
            time.sleep(0.5)
            leftovers = server_leftovers(pid, known)
        for left in leftovers:
            try:
                os.kill(left, signal.SIGKILL)
            except OSError:
                pass
        return leftovers


def start_server(log_path: Path, extra_args: tuple[str, ...] = (),
                 repository: Path = REPO_ROOT / "model_repository") -> TritonServer:
    http_port, grpc_port, metrics_port = free_ports(3)
    command = (
        ". scripts/triton_env.sh && run_tritonserver "
        f"--model-repository={repository} "
        f"--http-port={http_port} --grpc-port={grpc_port} --metrics-port={metrics_port} "
        "--disable-auto-complete-config " + " ".join(extra_args)
    )
    log = open(log_path, "wb")  # noqa: SIM115 - the server writes to it until it exits
    process = subprocess.Popen(["bash", "-c", command], cwd=REPO_ROOT, stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    log.close()
    server = TritonServer(process, http_port, grpc_port, metrics_port, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode} before it was "
                               f"ready; log tail:\n{server.log_tail()}")
        if http_status(f"{server.http_url}/v2/health/ready") == 200:
            return server
        if time.monotonic() > deadline:
            leftovers = server.stop()
            raise RuntimeError(f"tritonserver was not ready within {READY_TIMEOUT_S:.0f} s "
                               f"(left behind: {leftovers}); log tail:\n{server.log_tail()}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    log_path = tmp_path_factory.mktemp("tritonserver") / "server.log"
    try:
        server = start_server(log_path)
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield server
    leftovers = server.stop()
    assert not leftovers, (
        f"processes of the server outlived it (killed now): {leftovers}\n"
        f"log tail:\n{server.log_tail(3000)}"
    )


# ----- HTTP -----------------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any], timeout: float):  # noqa: ANN202
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def _as_ids(value: Any) -> list[int]:
    """`output_ids` of a JSON response: a list, or a bare number when it holds one id."""
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


@dataclass
class HttpResult:
    status: int
    body: dict[str, Any]

    @property
    def error(self) -> str | None:
        return self.body.get("error")

    @property
    def text(self) -> str:
        return self.body["text_output"]

    @property
    def ids(self) -> list[int]:
        return _as_ids(self.body.get("output_ids"))


def http_generate(server: TritonServer, body: dict[str, Any], timeout: float = 120,
                  model: str = MODEL) -> HttpResult:
    """POST /v2/models/{model}/generate; errors come back as a result, not an exception."""
    url = f"{server.http_url}/v2/models/{model}/generate"
    try:
        with _post(url, body, timeout) as resp:
            return HttpResult(resp.status, json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"error": raw.decode(errors="replace")}
        return HttpResult(exc.code, parsed)


def http_generate_stream(server: TritonServer, body: dict[str, Any],
                         timeout: float = 120) -> list[dict[str, Any]]:
    """POST /v2/models/ensemble/generate_stream; the decoded `data:` events, in order."""
    url = f"{server.http_url}/v2/models/{MODEL}/generate_stream"
    events = []
    with _post(url, {**body, "stream": True}, timeout) as resp:
        assert resp.status == 200, resp.status
        for raw_line in resp:
            line = raw_line.decode("utf-8").rstrip("\r\n")
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    return events


def metrics(server: TritonServer, model: str = "minisgl") -> dict[str, float]:
    return server.model_metrics(model)


def wait_engine_idle(server: TritonServer, timeout: float = 5.0) -> dict[str, float | None]:
    """Poll the metrics until no KV page, running or waiting request is left (or `timeout`);
    the last values seen."""
    deadline = time.monotonic() + timeout
    while True:
        sample = metrics(server)
        idle = {k: sample.get(k) for k in ("minisgl_kv_pages_in_use", "minisgl_requests_running",
                                           "minisgl_requests_waiting")}
        if all(v == 0 for v in idle.values()) or time.monotonic() > deadline:
            return idle
        time.sleep(0.1)


# ----- gRPC -----------------------------------------------------------------------------------


def tensor(name: str, value: Any, datatype: str | None = None) -> grpcclient.InferInput:
    """An input of shape [1, 1] (batch dimension included), or [1, n] for a list."""
    if isinstance(value, (list, tuple)):
        array = np.array([value])
    elif isinstance(value, np.ndarray):
        array = value
    else:
        array = np.array([[value]])
    if datatype is None:
        if isinstance(value, (str, bytes)) or array.dtype.kind in "OSU":
            datatype = "BYTES"
        elif array.dtype.kind == "b":
            datatype = "BOOL"
        elif array.dtype.kind == "f":
            datatype = "FP32"
        else:
            datatype = "INT32"
    numpy_type = {"BYTES": np.object_, "BOOL": np.bool_, "FP32": np.float32, "FP16": np.float16,
                  "INT32": np.int32, "UINT64": np.uint64}[datatype]
    if datatype == "BYTES":
        array = np.array([[v.encode() if isinstance(v, str) else v for v in row]
                          for row in array.tolist()], dtype=np.object_)
    else:
        array = array.astype(numpy_type)
    inp = grpcclient.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    return inp


def ensemble_inputs(prompt: str | bytes, max_tokens: int, **options: Any) -> list:
    """Inputs of the ensemble: text_input, max_tokens and any optional scalar by name (bool,
    int -> INT32, float -> FP32; pass an InferInput to control the type)."""
    inputs = [tensor("text_input", prompt, "BYTES"), tensor("max_tokens", max_tokens, "INT32")]
    for name, value in options.items():
        inputs.append(value if isinstance(value, grpcclient.InferInput) else tensor(name, value))
    return inputs


@dataclass
class StreamResponse:
    text: str
    ids: list[int]
    final: bool
    outputs: dict[str, Any]


@dataclass
class StreamResult:
    responses: list[StreamResponse] = field(default_factory=list)
    errors: list[InferenceServerException] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(r.text for r in self.responses)

    @property
    def ids(self) -> list[int]:
        return [i for r in self.responses for i in r.ids]

    @property
    def finals(self) -> int:
        return sum(r.final for r in self.responses)

    @property
    def last(self) -> StreamResponse:
        return self.responses[-1]


class GrpcStream:
    """One bidirectional gRPC stream; responses of each request id collected in order."""

    OPTIONAL_OUTPUTS = ("num_input_tokens", "num_output_tokens", "cached_tokens", "finish_reason",
                        "sequence_index", "batch_index",
                        *(name for name, data_type, _ in PERF_METRICS if "INT" in data_type))
    FLOAT_OUTPUTS = ("output_log_probs", "cum_log_probs", "acceptance_rate")  # lists of floats
    ARRAY_OUTPUTS = ("context_logits", "generation_logits")  # numpy arrays as sent

    def __init__(self, server: TritonServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=self._callback)
        self.closed = False

    def _callback(self, result: Any, error: Any) -> None:
        self.events.put((time.monotonic(), result, error))

    def send(self, inputs: list, request_id: str, model: str = MODEL) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id,
                                       enable_empty_final_response=True)

    def next_event(self, timeout: float) -> tuple[str | None, StreamResponse | None,
                                                  InferenceServerException | None]:
        """(request id, response, error) of the next callback; raises queue.Empty."""
        _, result, error = self.events.get(timeout=timeout)
        if error is not None:
            return None, None, error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        names = {out.name for out in response.outputs}
        text = ""
        ids: list[int] = []
        if "text_output" in names:
            text = b"".join(result.as_numpy("text_output").reshape(-1).tolist()).decode("utf-8")
        if "output_ids" in names:
            ids = [int(v) for v in result.as_numpy("output_ids").reshape(-1)]
        outputs = {}
        for name in self.OPTIONAL_OUTPUTS:
            if name in names:
                value = result.as_numpy(name).reshape(-1)[0]
                outputs[name] = value.decode() if isinstance(value, bytes) else int(value)
        for name in self.FLOAT_OUTPUTS:
            if name in names:
                outputs[name] = [float(v) for v in result.as_numpy(name).reshape(-1)]
        for name in self.ARRAY_OUTPUTS:
            if name in names:
                outputs[name] = result.as_numpy(name)
        return response.id, StreamResponse(text, ids, final, outputs), None

    def collect(self, request_ids: list[str], timeout: float = 120) -> dict[str, StreamResult]:
        """Read until every request has its final response or an error (errors carry no id:
        they are accepted only while a single request is outstanding)."""
        results = {rid: StreamResult() for rid in request_ids}
        pending = set(request_ids)
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no final response for {sorted(pending)} within {timeout} s")
            try:
                rid, response, error = self.next_event(remaining)
            except queue.Empty:
                continue
            if error is not None:
                assert len(pending) == 1, f"an error with several requests pending: {error}"
                rid = next(iter(pending))
                results[rid].errors.append(error)
                pending.discard(rid)
                continue
            assert rid in results, f"a response for an unknown request id {rid!r}"
            assert rid in pending, f"a response for {rid} after its final response"
            results[rid].responses.append(response)
            if response.final:
                pending.discard(rid)
        return results

    def close(self, cancel_requests: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.client.stop_stream(cancel_requests=cancel_requests)
            self.client.close()

    def __enter__(self) -> GrpcStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def grpc_generate(server: TritonServer, inputs: list, timeout: float = 120,
                  model: str = MODEL) -> StreamResult:
    """One request on its own gRPC stream, read to its final response (or error)."""
    with GrpcStream(server) as stream:
        stream.send(inputs, "r0", model=model)
        return stream.collect(["r0"], timeout)["r0"]
