"""LlamaIndex's NvidiaTriton against a tritonserver; run by the `llamaindex` client venv's python.

    python tests/clients/llamaindex_client.py '{"server_url": "localhost:8001", "prompt": "...",
                                                "tokens": 16}'

Prints one JSON object: `complete` (the text of `.complete(prompt)`), `stream_deltas` (the
`delta`s of `.stream_complete(prompt)`, in order), `sent` (every gRPC request either made,
tensors decoded), and what reached the client's stream callback of each call: `received` (per
call, the `text_output` of each response; read flattened, whatever its shape) and
`stream_errors` (errors the server sent back). Exits with 3 at once when the client's own
stream callback raises (it would otherwise wait for ever).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import _record
from llama_index.llms.nvidia_triton import NvidiaTriton
from llama_index.llms.nvidia_triton.utils import GrpcTritonClient

args = json.loads(sys.argv[1])
_record.record_grpc()

# The client stops reading its queue once it has what it wants: record what the server sent.
received: list[list[str]] = []
stream_errors: list[str] = []
_callback = GrpcTritonClient._stream_callback
_start = GrpcTritonClient._send_prompt_streaming


def _send_prompt_streaming(self, *args, **kwargs):  # noqa: ANN001, ANN202
    received.append([])
    return _start(self, *args, **kwargs)


def _stream_callback(self, result_queue, force_batch, result, error):  # noqa: ANN001, ANN202
    if error:
        stream_errors.append(str(error))
    else:
        text = result.as_numpy("text_output")
        if text is not None:
            received[-1].append(b"".join(text.reshape(-1).tolist()).decode("utf-8"))
    try:
        return _callback(self, result_queue, force_batch, result, error)
    except Exception:  # noqa: BLE001
        # The client's callback thread dies and its generator waits for ever: end now.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)


GrpcTritonClient._send_prompt_streaming = _send_prompt_streaming


GrpcTritonClient._stream_callback = _stream_callback

llm = NvidiaTriton(server_url=args["server_url"], model_name=args.get("model", "ensemble"),
                   tokens=args["tokens"])
complete = llm.complete(args["prompt"]).text
deltas = [r.delta for r in llm.stream_complete(args["prompt"])]
print(json.dumps({"complete": complete, "stream_deltas": deltas, "sent": _record.SENT,
                  "received": received, "stream_errors": stream_errors}))
