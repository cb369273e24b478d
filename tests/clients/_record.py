"""What a client sends, recorded inside its own process (imported by the helper scripts here).

`record_grpc()` wraps tritonclient's gRPC `async_stream_infer` and `infer`; `record_http()` wraps
httpx's `Client.send` / `AsyncClient.send`. Each call lands in SENT as a JSON-ready dict (and, with
`log`, as one JSON line appended to that file).

`record_http()` also refuses requests to any host but this machine's loopback (they fail with
httpx.ConnectError, as they would offline, and are recorded with "blocked": true): LiteLLM looks
the model name up on the Hugging Face Hub for a chat template, and a test must not depend on, or
send traffic to, anything outside this machine.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

SENT: list[dict[str, Any]] = []
LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def _tensor(inp: Any) -> dict[str, Any]:
    """name, datatype, shape and values (a flat list; BYTES decoded as UTF-8) of an InferInput."""
    import numpy as np
    from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

    raw = inp._get_content()  # noqa: SLF001 - the serialized bytes the request carries
    datatype = inp.datatype()
    if raw is None:
        values: list[Any] = []
    elif datatype == "BYTES":
        values = [v.decode("utf-8", "replace") for v in deserialize_bytes_tensor(raw).tolist()]
    else:
        values = np.frombuffer(raw, dtype=triton_to_np_dtype(datatype)).tolist()
    return {"name": inp.name(), "datatype": datatype, "shape": list(inp.shape()),
            "values": values}


def record_grpc() -> None:
    import tritonclient.grpc as grpcclient

    cls = grpcclient.InferenceServerClient
    original_stream, original_infer = cls.async_stream_infer, cls.infer

    def async_stream_infer(self, model_name, inputs, *args, **kwargs):  # noqa: ANN001, ANN202
        SENT.append({"call": "async_stream_infer", "model": model_name,
                     "parameters": {k: v for k, v in (kwargs.get("parameters") or {}).items()},
                     "inputs": [_tensor(i) for i in inputs]})
        return original_stream(self, model_name, inputs, *args, **kwargs)

    def infer(self, model_name, inputs, *args, **kwargs):  # noqa: ANN001, ANN202
        SENT.append({"call": "infer", "model": model_name, "inputs": [_tensor(i) for i in inputs]})
        return original_infer(self, model_name, inputs, *args, **kwargs)

    cls.async_stream_infer, cls.infer = async_stream_infer, infer


def _http(request: Any) -> dict[str, Any]:
    try:
        content = request.content
    except Exception:  # noqa: BLE001 - a streamed body that has not been read
        return {"method": request.method, "url": str(request.url), "body": None}
    try:
        body: Any = json.loads(content) if content else None
    except ValueError:
        body = content.decode("utf-8", "replace")
    return {"method": request.method, "url": str(request.url), "body": body}


def record_http(log: str | None = None) -> None:
    import httpx

    original_send, original_asend = httpx.Client.send, httpx.AsyncClient.send

    def note(request: Any) -> None:
        entry = _http(request)
        host = urlsplit(entry["url"]).hostname or ""
        if host not in LOOPBACK and not host.startswith("127."):
            entry["blocked"] = True
        SENT.append(entry)
        if log:
            with open(log, "a") as f:
                f.write(json.dumps(entry) + "\n")
        if entry.get("blocked"):
            raise httpx.ConnectError(f"blocked by the test: {entry['url']}", request=request)

    def send(self, request, *args, **kwargs):  # noqa: ANN001, ANN202
        note(request)
        return original_send(self, request, *args, **kwargs)

    async def asend(self, request, *args, **kwargs):  # noqa: ANN001, ANN202
        note(request)
        return await original_asend(self, request, *args, **kwargs)

    httpx.Client.send, httpx.AsyncClient.send = send, asend
