"""python -m minisgl_backend.openai_server: serve the OpenAI-compatible API until stopped."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import uvicorn

from minisgl_backend.openai_server.app import FrontDoorSettings, create_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minisgl_backend.openai_server",
                                     description=__doc__)
    parser.add_argument("--triton-url", default="localhost:8001",
                        help="tritonserver's gRPC address (default localhost:8001)")
    parser.add_argument("--metrics-url", default=None,
                        help="tritonserver's metrics URL: its metrics follow the front door's "
                        "on /metrics, and its KV pool size caps the context")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients ask for (default: the checkpoint "
                        "folder's name)")
    parser.add_argument("--model", type=Path, default=None,
                        help="the checkpoint folder (default: the one the minisgl model serves)")
    parser.add_argument("--tool-call-parser", choices=("hermes", "llama3"), default=None,
                        help="how tool calls are read from the model's text (default: from "
                        "the chat template)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = FrontDoorSettings(
        triton_url=args.triton_url, metrics_url=args.metrics_url,
        served_model_name=args.served_model_name, model=args.model,
        # The server's key, as the `openai` SDK's clients name theirs.
        api_key=os.environ.get("OPENAI_API_KEY") or None, tool_format=args.tool_call_parser)
    uvicorn.run(create_app(settings), host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
