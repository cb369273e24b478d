"""The FastAPI app: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health` and
`/metrics`, with the optional API key, a request id per request (in the logs, the response and
the engine's request) and the front door's counters."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from minisgl_backend.openai_server.engine import EngineChunk, EngineClient
from minisgl_backend.openai_server.errors import OpenAIError, server_error
from minisgl_backend.openai_server.metrics import FrontDoorMetrics, server_metrics
from minisgl_backend.openai_server.params import Endpoint, Generation, parse_request
from minisgl_backend.openai_server.responses import Formatter, Sample, Usage
from minisgl_backend.openai_server.served_model import (ServedModel, ToolFormat,
                                                        load_served_model, model_folder)
from minisgl_backend.openai_server.streaming import sse_events

logger = logging.getLogger("minisgl_backend.openai_server")
CONNECT_POLL_SECONDS = 1.0
_KV_TOKENS = re.compile(r"^minisgl_kv_tokens_total\{[^}]*model=\"minisgl\"[^}]*\} (\S+)$", re.M)
ID_PREFIX: dict[Endpoint, str] = {"chat": "chatcmpl-", "completions": "cmpl-"}


@dataclass(frozen=True)
class FrontDoorSettings:
    """`model`: the checkpoint folder (None: the one the `minisgl` model serves);
    `served_model_name`: the name clients ask for (None: that folder's name); `api_key`: when
    set, requests must carry it as a bearer token."""

    triton_url: str
    metrics_url: str | None = None
    served_model_name: str | None = None
    model: Path | None = None
    api_key: str | None = None
    tool_format: ToolFormat | None = None


class FrontDoor:
    """The app's state: the engine client, the model once tritonserver serves it, counters."""

    def __init__(self, settings: FrontDoorSettings) -> None:
        self.settings = settings
        self.engine: EngineClient | None = None
        self.model: ServedModel | None = None
        self.metrics = FrontDoorMetrics()

    async def connect(self) -> None:
        """Wait for the `minisgl` model, then load its tokenizer."""
        self.engine = EngineClient(self.settings.triton_url)
        while not await self.engine.ready():
            await asyncio.sleep(CONNECT_POLL_SECONDS)
        folder = self.settings.model or model_folder(await self.engine.parameters())
        metrics_text = await asyncio.to_thread(server_metrics, self.settings.metrics_url)
        kv = _KV_TOKENS.search(metrics_text)
        self.model = await asyncio.to_thread(
            load_served_model, folder, self.settings.served_model_name,
            int(float(kv.group(1))) if kv else None, self.settings.tool_format)
        logger.info("serving %s as %r (context %d tokens, %s tool calls)", folder,
                    self.model.name, self.model.max_seq_len, self.model.tool_format)

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise OpenAIError("Incorrect API key provided", status=401,
                              code="invalid_api_key")

    def served(self) -> tuple[ServedModel, EngineClient]:
        if self.model is None or self.engine is None:
            raise OpenAIError("the model is not loaded yet", status=503, kind="server_error")
        return self.model, self.engine


def _report_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("could not load the served model: the API answers 503",
                     exc_info=task.exception())


def error_response(exc: OpenAIError, request_id: str) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers={"x-request-id": request_id})


def outcome_of(exc: OpenAIError) -> str:
    return {400: "bad_request", 401: "unauthorized"}.get(exc.status, "error")


async def collect(gen: Generation, chunks: AsyncGenerator[EngineChunk, None], fmt: Formatter
                  ) -> tuple[dict[str, Any], Usage]:
    """A non-streamed response: every chunk joined."""
    samples: dict[int, Sample] = {}
    usage = Usage()
    async for chunk in chunks:
        usage.add(chunk)
        samples.setdefault(chunk.index, Sample()).add(chunk)
    return fmt.completion(samples, usage), usage


async def until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(settings: FrontDoorSettings) -> FastAPI:
    door = FrontDoor(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        connecting = asyncio.create_task(door.connect())
        connecting.add_done_callback(_report_failure)
        yield
        connecting.cancel()
        if door.engine is not None:
            await door.engine.close()

    app = FastAPI(title="minisgl OpenAI-compatible API", lifespan=lifespan)
    app.state.door = door

    @app.get("/health")
    async def health() -> Response:
        ready = door.model is not None and door.engine is not None and await door.engine.ready()
        return JSONResponse({"status": "ok" if ready else "loading"},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        engine = await asyncio.to_thread(server_metrics, settings.metrics_url)
        return PlainTextResponse(door.metrics.text() + engine)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            door.authorize(request)
            model, _ = door.served()
        except OpenAIError as exc:
            return error_response(exc, "")
        return JSONResponse({"object": "list", "data": [{
            "id": model.name, "object": "model", "created": 0, "owned_by": "minisgl",
            "max_model_len": model.max_seq_len}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(door, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(door, request, "completions")

    return app


async def answer(door: FrontDoor, request: Request, endpoint: Endpoint) -> Response:
    """One completion request, streamed or not."""
    request_id = request.headers.get("x-request-id") or ID_PREFIX[endpoint] + uuid.uuid4().hex
    started = time.monotonic()
    try:
        door.authorize(request)
        model, engine = door.served()
        try:
            body = await request.json()
        except ValueError:
            raise OpenAIError("the request body is not valid JSON") from None
        gen = parse_request(body, endpoint, model)
    except OpenAIError as exc:
        door.metrics.ended(endpoint, outcome_of(exc))
        logger.info("%s %s: %d %s", request_id, endpoint, exc.status, exc.message)
        return error_response(exc, request_id)
    fmt = Formatter(gen, request_id, model)
    chunks = engine.generate(gen, request_id)
    door.metrics.running += 1

    def ended(usage: Usage, outcome: str) -> None:
        door.metrics.running -= 1
        door.metrics.ended(endpoint, outcome, usage.prompt_tokens, usage.completion_tokens)
        logger.info("%s %s: %s, %d prompt (%d cached) + %d completion tokens, %.2f s",
                    request_id, endpoint, outcome, usage.prompt_tokens, usage.cached_tokens,
                    usage.completion_tokens, time.monotonic() - started)

    try:
        if gen.stream:
            first = await anext(chunks, None)  # a refused request still gets its status
            return StreamingResponse(sse_events(first, chunks, fmt, ended),
                                     media_type="text/event-stream",
                                     headers={"x-request-id": request_id})
        return await _whole(gen, chunks, fmt, request, ended, request_id)
    except OpenAIError as exc:
        ended(Usage(), outcome_of(exc))
        logger.info("%s %s: %d %s", request_id, endpoint, exc.status, exc.message)
        return error_response(exc, request_id)


async def _whole(gen: Generation, chunks: AsyncGenerator[EngineChunk, None], fmt: Formatter,
                 request: Request, ended: Any, request_id: str) -> Response:
    """A non-streamed answer; a client that leaves first cancels its request."""
    work = asyncio.create_task(collect(gen, chunks, fmt))
    gone = asyncio.create_task(until_disconnect(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        await chunks.aclose()
        ended(Usage(), "cancelled")
        return Response(status_code=499)
    try:
        body, usage = work.result()
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine or the connection failed
        logger.exception("%s failed", request_id)
        raise server_error(f"the request failed: {exc}") from None
    ended(usage, "ok")
    return JSONResponse(body, headers={"x-request-id": request_id})
