#!/usr/bin/env python3
"""Stream one generation from the Triton `ensemble` model over gRPC and print the text deltas.

    python scripts/grpc_stream_client.py --url localhost:8001 --chat \
        --prompt "What is the capital of France?" --max-tokens 64

Needs `tritonclient[grpc]`. Exits 1 on any error (connection, bad request, engine failure).
"""

from __future__ import annotations

import argparse
import queue
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype


def make_input(name: str, value: Any, dtype: type) -> grpcclient.InferInput:
    """A [1, 1] input tensor (batch dimension included), as the ensemble expects."""
    array = np.array([[value]], dtype=dtype)
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def stream(url: str, prompt: str, max_tokens: int, chat: bool, temperature: float) -> None:
    """Send one streaming request and print each text delta as it arrives."""
    inputs = [
        make_input("text_input", prompt.encode(), np.object_),
        make_input("max_tokens", max_tokens, np.int32),
        make_input("stream", True, bool),
        make_input("apply_chat_template", chat, bool),
        make_input("temperature", temperature, np.float32),
    ]
    responses: queue.SimpleQueue[tuple[Any, InferenceServerException | None]] = \
        queue.SimpleQueue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            client.async_stream_infer("ensemble", inputs, request_id="1",
                                      enable_empty_final_response=True)
            while True:
                result, error = responses.get()
                if error is not None:
                    raise error
                text = result.as_numpy("text_output")
                if text is not None:
                    print("".join(t.decode() for t in text.reshape(-1)), end="", flush=True)
                params = result.get_response().parameters
                if params["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream()
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC host:port")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = parser.parse_args()
    try:
        stream(args.url, args.prompt, args.max_tokens, args.chat, args.temperature)
    except InferenceServerException as exc:
        print(f"\nerror: {exc.message() or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
