"""The `minisgl` model over tritonclient's asyncio gRPC streaming: a `Generation` as the model's
input tensors (each named and typed by its declaration in `serving/interface.py`), its responses
as `EngineChunk`s. Each request has its own gRPC stream, so that closing it (a client gone)
cancels the request in the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from minisgl_backend.core import SamplingParams
from minisgl_backend.openai_server.errors import OpenAIError, server_error
from minisgl_backend.openai_server.params import Generation
from minisgl_backend.serving.interface import inputs_of, sampling_inputs
from minisgl_backend.serving.request import GUIDE_TYPES

MODEL = "minisgl"
_DECLARED = {i.name: i for i in inputs_of(MODEL)}
# SamplingParams field -> the input that feeds it (the first declared: `seed`, not its alias).
_FEEDS: dict[str, str] = {}
for _input in sampling_inputs():
    _FEEDS.setdefault(_input.feeds or "", _input.name)
_GUIDES = {field: kind for kind, field in GUIDE_TYPES.items()}
_DEFAULTS = SamplingParams()
_NUMPY = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64,
          "TYPE_BOOL": np.bool_, "TYPE_STRING": np.object_}
# Asked of every request: the usage and the end of each sample come from the engine.
_ALWAYS = {"return_num_input_tokens": True, "return_num_output_tokens": True,
           "return_finish_reason": True, "return_cached_tokens": True,
           "exclude_input_in_output": True}


def tensor(name: str, value: Any) -> grpcclient.InferInput:
    """Input `name` holding `value` (a scalar or a list), typed as declared, with the batch
    dimension: [1, 1] or [1, n]."""
    data_type = _DECLARED[name].data_type
    values = value if isinstance(value, (list, tuple)) else [value]
    if data_type == "TYPE_STRING":
        array = np.array([[v.encode() for v in values]], dtype=np.object_)
    else:
        array = np.array([values], dtype=_NUMPY[data_type])
    triton_type = "BYTES" if data_type == "TYPE_STRING" else data_type[len("TYPE_"):]
    infer_input = grpcclient.InferInput(name, list(array.shape), triton_type)
    infer_input.set_data_from_numpy(array)
    return infer_input


def engine_values(gen: Generation) -> dict[str, Any]:
    """Input name -> value for a generation: each SamplingParams field that differs from its
    default through the input that feeds it, the rest through their own inputs."""
    params = gen.params
    values: dict[str, Any] = {"input_ids": gen.prompt_ids, "stream": gen.stream, **_ALWAYS}
    for field, name in _FEEDS.items():
        value = getattr(params, field)
        if value != getattr(_DEFAULTS, field) or field == "max_tokens":
            values[name] = value
    if params.stop:
        values["stop_words"] = list(params.stop)
    if params.logit_bias:
        values["logit_bias_token_ids"] = list(params.logit_bias)
        values["logit_bias_values"] = list(params.logit_bias.values())
    if params.logprobs is not None:
        values["return_log_probs"] = True
        if params.logprobs:
            values["num_top_log_probs"] = params.logprobs
    for field, kind in _GUIDES.items():
        guide = getattr(params, field)
        if guide:
            values["guided_decoding_guide_type"] = kind
            if guide is not True:
                values["guided_decoding_guide"] = guide
    return values


@dataclass
class EngineChunk:
    """One response of the model: a sample's new text and tokens (all of it when not
    streaming), with what the engine reports about it."""

    index: int
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def read_chunk(result: Any) -> EngineChunk | None:
    """A response's outputs (None for the empty final response)."""
    def scalar(name: str, default: Any = 0) -> Any:
        array = result.as_numpy(name)
        return default if array is None else array.reshape(-1)[0]

    text = result.as_numpy("text_output")
    if text is None:
        return None
    ids = result.as_numpy("output_ids")
    logprobs = result.as_numpy("output_log_probs")
    top_ids, top_values = (result.as_numpy("output_top_log_prob_ids"),
                           result.as_numpy("output_top_log_probs"))
    reason = scalar("finish_reason", None)
    return EngineChunk(
        index=int(scalar("sequence_index")),
        text=b"".join(text.reshape(-1).tolist()).decode("utf-8"),
        token_ids=[] if ids is None else ids.reshape(-1).tolist(),
        prompt_tokens=int(scalar("num_input_tokens")),
        cached_tokens=int(scalar("cached_tokens")),
        finish_reason=reason.decode() if reason is not None else None,
        logprobs=None if logprobs is None else logprobs.reshape(-1).tolist(),
        top_logprobs=None if top_ids is None else [
            list(zip(i, v)) for i, v in zip(top_ids[0].tolist(), top_values[0].tolist())],
    )


def engine_error(message: str, gen: Generation) -> OpenAIError:
    """The model's error as the client's: a refused request (its message starts with the input
    or field it names) is a 400 naming the OpenAI parameter, anything else a 500."""
    first = message.split(" ", 1)[0].rstrip(":")
    openai = _openai_name(first, gen)
    if openai is None:
        return server_error(message)
    return OpenAIError(message.replace(first, openai, 1) if first != openai else message,
                       openai)


def _openai_name(name: str, gen: Generation) -> str | None:
    """The OpenAI parameter behind a Triton input or SamplingParams field (None: neither)."""
    fields = {**{v: k for k, v in _FEEDS.items()}, "stop_words": "stop",
              "logit_bias_values": "logit_bias", "logit_bias_token_ids": "logit_bias",
              "num_top_log_probs": "logprobs", "return_log_probs": "logprobs",
              "guided_decoding_guide": "json_schema", "guided_decoding_guide_type": "json_schema",
              "input_ids": "prompt", "text_input": "prompt"}
    field = fields.get(name, name)
    if field in gen.given_as:
        return gen.given_as[field]
    if field == "prompt" or field == "max_tokens":
        return "messages" if gen.endpoint == "chat" else "prompt"
    return field if name in _DECLARED or field in _FEEDS else None


class EngineClient:
    """One gRPC channel to tritonserver; `generate` opens a stream per request."""

    def __init__(self, url: str) -> None:
        self.client = grpcaio.InferenceServerClient(url)

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(MODEL))
        except Exception:  # noqa: BLE001 - unreachable or starting: not ready
            return False

    async def parameters(self) -> dict[str, str]:
        """The model's `config.pbtxt` parameters."""
        config = await self.client.get_model_config(MODEL, as_json=True)
        raw = config.get("config", config).get("parameters") or {}
        return {key: str(value.get("string_value", "")) for key, value in raw.items()}

    async def generate(self, gen: Generation,
                       request_id: str) -> AsyncGenerator[EngineChunk, None]:
        """The model's responses to `gen`, until its final one. Leaving early (the caller's
        task cancelled, the generator closed) cancels the stream, and with it the request."""
        inputs = [tensor(name, value) for name, value in engine_values(gen).items()]
        ended = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": MODEL, "inputs": inputs, "request_id": request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}
            await ended.wait()  # the stream stays open until the final response

        call = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise engine_error(str(error.message()), gen)
                chunk = read_chunk(result)
                if chunk is not None:
                    yield chunk
                if result.get_response().parameters["triton_final_response"].bool_param:
                    finished = True
                    return
            finished = True
            raise server_error("the server closed the stream before the final response")
        finally:
            ended.set()
            if not finished:
                call.cancel()

    async def close(self) -> None:
        await self.client.close()
