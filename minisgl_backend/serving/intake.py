"""A Triton request into the engine, on `execute`'s thread: read, checked and submitted to the
scheduler. A request refused here gets its one (error) response at once."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from minisgl_backend.llm import LLM
from minisgl_backend.lora.trtllm import TaskAdapters
from minisgl_backend.scheduler.output import RequestOutput
from minisgl_backend.serving.inflight import ActiveRequest
from minisgl_backend.serving.request import RequestError, RequestPolicy, parse_engine_request
from minisgl_backend.serving.responses import FINAL, error_response
from minisgl_backend.serving.tensors import input_getter

logger = logging.getLogger(__name__)


def submit(request: Any, llm: LLM, limits: RequestPolicy,
           on_output: Callable[[ActiveRequest, RequestOutput], None],
           tasks: TaskAdapters | None = None) -> ActiveRequest | None:
    """Submit a Triton request to `llm`'s scheduler, which hands each of its outputs to
    `on_output`; None when it was refused (and answered). `tasks`: TensorRT-LLM's LoRA tasks."""
    sender = request.get_response_sender()
    arrived, arrived_ns = time.monotonic(), time.time_ns()
    scheduler = llm.scheduler
    try:
        parsed = parse_engine_request(input_getter(request), scheduler.max_request_tokens,
                                      llm.tokenizer, limits, llm.vocab_size, request.parameters())
        try:  # a guide that does not compile, a prompt too long for the engine, ...
            checked = scheduler.check_request(parsed.prompt_ids, parsed.params)
        except ValueError as exc:
            raise RequestError(parsed.name_inputs(str(exc))) from None
        lora = parsed.lora
        try:
            if parsed.lora_task_id is not None:
                if tasks is None or not llm.lora_enabled:
                    raise ValueError("LoRA is off on this model (set its enable_lora or "
                                     "lora_adapters parameter)")
                lora = tasks.resolve(parsed.lora_task_id, parsed.lora_weights,
                                     parsed.lora_config)
            scheduler.loras.id_of(lora)
        except ValueError as exc:
            field = "lora_task_id" if parsed.lora_task_id is not None else "lora_name"
            message = str(exc)
            raise RequestError(message if message.startswith(field) else
                               f"{field}: {message}") from None
    except Exception as exc:  # noqa: BLE001 - whatever fails, the request gets its final
        message = str(exc)
        if not isinstance(exc, ValueError):  # not a bad request (a RequestError): a bug
            logger.exception("reading a request failed")
            message = f"the request could not be read: {type(exc).__name__}: {exc}"
        sender.send(error_response(message), flags=FINAL)
        return None
    state = ActiveRequest(request, sender, parsed, arrived, arrived_ns)
    state.uid = scheduler.submit(parsed.prompt_ids, parsed.params,
                                 lambda out: on_output(state, out), checked,
                                 stream=parsed.stream, lora=lora)
    return state
