"""The OpenAI-compatible front door: an HTTP server (FastAPI + uvicorn, its own process) in front
of tritonserver, for the `openai` SDK and everything built on it.

    python -m minisgl_backend.openai_server --triton-url localhost:8001 --port 9000

Process map: clients speak HTTP to this process; it renders chat messages with the model's chat
template and tokenizes them itself (`params`), and sends each request to the `minisgl` model as
token ids over its own gRPC stream (`engine`, tritonclient's asyncio client), so that a client
that leaves cancels its request in the engine. The model's responses come back as tensors and
go out as OpenAI objects (`responses`) or server-sent events (`streaming`); tool calls are
parsed from the text (`tools`). `scripts/serve.sh` starts it next to tritonserver.
"""

from __future__ import annotations

from minisgl_backend.openai_server.app import FrontDoorSettings, create_app

__all__ = ["FrontDoorSettings", "create_app"]
