"""Turn a Triton request's tensors into engine inputs, with errors that name the field.

Tensors follow the TensorRT-LLM ensemble convention (request shape [1, 1] with the batch
dimension, or [1] without); every scalar input is optional except `max_tokens` where noted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from minisgl_backend.core import SamplingParams, check_token_ids
from minisgl_backend.serving.interface import sampling_inputs
from minisgl_backend.tokenizer import encode_chat, encode_prompt

GetInput = Callable[[str], "np.ndarray | None"]


class RequestError(ValueError):
    """A bad request; the message names the offending field."""


@dataclass(frozen=True)
class RequestLimits:
    """What one request may take (config.pbtxt parameters; 0 means the engine's own limit)."""

    max_input_bytes: int = 1 << 20  # text_input before tokenization
    max_prompt_tokens: int = 0
    max_output_tokens: int = 0
    max_stop_words: int = 32
    max_stop_word_length: int = 256  # characters


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    exclude_input: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    return_finish_reason: bool
    return_cached_tokens: bool
    return_log_probs: bool = False


_KIND_CHECK = {
    "int": lambda a: a.dtype.kind in "iu",
    "float": lambda a: a.dtype.kind in "fiu",
    "bool": lambda a: a.dtype.kind == "b",
}


def scalar(get: GetInput, name: str, kind: str, default: Any = None) -> Any:
    """The single value of an optional scalar input, type-checked."""
    array = get(name)
    if array is None:
        return default
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    if not _KIND_CHECK[kind](array):
        raise RequestError(f"{name} must be {kind}, got dtype {array.dtype}")
    value = array.reshape(-1)[0].item()
    if kind == "float" and not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value}")
    return value


def decode_text(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{name} is not valid UTF-8: {exc}") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"{name} must be a string")


def text_list(get: GetInput, name: str) -> list[str]:
    """All strings of an optional STRING input (any shape), empty strings dropped."""
    array = get(name)
    if array is None:
        return []
    if array.dtype.kind not in "OSU":
        raise RequestError(f"{name} must be STRING, got dtype {array.dtype}")
    return [s for s in (decode_text(v, name) for v in array.reshape(-1)) if s]


def chat_messages(text: str) -> list[dict[str, str]]:
    """`text` as chat messages: a JSON list of {role, content}, or else one user message."""
    stripped = text.lstrip()
    if not stripped.startswith("["):
        return [{"role": "user", "content": text}]
    try:
        messages = json.loads(stripped)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise RequestError(f"text_input is not a valid JSON list of chat messages: {exc}") from None
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages
    ):
        raise RequestError("text_input must be a JSON list of {\"role\", \"content\"} messages")
    return messages


def prompt_token_ids(get: GetInput, tokenizer: Any,
                     limits: RequestLimits = RequestLimits()) -> list[int]:
    """`text_input` (plain, or chat when `apply_chat_template`) as the prompt's token ids."""
    texts = get("text_input")
    if texts is None:
        raise RequestError("text_input is required")
    if texts.size != 1:
        raise RequestError("text_input must hold exactly one string")
    raw = texts.reshape(-1)[0]
    if isinstance(raw, (bytes, str)) and len(raw) > limits.max_input_bytes:
        raise RequestError(f"text_input has {len(raw)} bytes; the limit is "
                           f"{limits.max_input_bytes}")
    text = decode_text(raw, "text_input")
    if not text.strip():
        raise RequestError("text_input is empty")
    if scalar(get, "apply_chat_template", "bool", False):
        return encode_chat(tokenizer, chat_messages(text))
    return encode_prompt(tokenizer, text)


def _prompt(get: GetInput, tokenizer: Any, limits: RequestLimits, vocab_size: int) -> list[int]:
    """Token ids from preprocessing (`input_ids`), or `text_input` tokenized here."""
    ids = get("input_ids")
    if ids is None:
        if get("text_input") is None or tokenizer is None:
            raise RequestError("text_input is required")
        return prompt_token_ids(get, tokenizer, limits)
    if get("text_input") is not None:
        raise RequestError("give text_input or input_ids, not both")
    if ids.size == 0:
        raise RequestError("input_ids is empty (text_input must not be empty)")
    if ids.dtype.kind not in "iu":
        raise RequestError(f"input_ids must be integers, got dtype {ids.dtype}")
    prompt = [int(t) for t in ids.reshape(-1)]
    try:
        check_token_ids("input_ids", prompt, vocab_size or None)
    except ValueError as exc:
        raise RequestError(f"{exc}: got {min(prompt)}..{max(prompt)}") from None
    return prompt


def parse_engine_request(get: GetInput, max_tokens_limit: int, tokenizer: Any = None,
                         limits: RequestLimits = RequestLimits(),
                         vocab_size: int = 0) -> EngineRequest:
    """Read the inputs of the `minisgl` model: the prompt (token ids from preprocessing, or
    text when called directly) and the generation settings. Token ids (`input_ids`, `end_id`)
    must be below `vocab_size` when it is given: the engine indexes its embedding and logits
    with them."""
    prompt_ids = _prompt(get, tokenizer, limits, vocab_size)
    if limits.max_prompt_tokens and len(prompt_ids) > limits.max_prompt_tokens:
        raise RequestError(f"text_input has {len(prompt_ids)} tokens; the limit is "
                           f"{limits.max_prompt_tokens}")
    if limits.max_output_tokens:
        max_tokens_limit = min(max_tokens_limit, limits.max_output_tokens)
    stop = text_list(get, "stop_words")
    if len(stop) > limits.max_stop_words:
        raise RequestError(f"stop_words has {len(stop)} entries; the limit is "
                           f"{limits.max_stop_words}")
    if any(len(word) > limits.max_stop_word_length for word in stop):
        raise RequestError(f"stop_words entries may have {limits.max_stop_word_length} "
                           f"characters at most")
    values, given_as = _sampling_values(get)
    max_tokens = values.get("max_tokens")
    if max_tokens is None:
        raise RequestError("max_tokens is required")
    if max_tokens < 1 or max_tokens > max_tokens_limit:
        raise RequestError(f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}")
    end_id = scalar(get, "end_id", "int")
    if end_id is not None and vocab_size and end_id >= vocab_size:
        raise RequestError(f"end_id must be a token id below {vocab_size} (or -1), got {end_id}")
    beam_width = scalar(get, "beam_width", "int", 1)
    if beam_width != 1:
        raise RequestError(f"beam_width must be 1 (beam search is not supported), got "
                           f"{beam_width}")
    scalar(get, "pad_id", "int")  # accepted: responses carry no padding
    scalar(get, "length_penalty", "float")  # accepted: it only affects beam search
    return_log_probs = bool(scalar(get, "return_log_probs", "bool", False))
    if return_log_probs:
        values["logprobs"] = 0  # the sampled tokens' log-probabilities, no alternatives
    try:
        params = SamplingParams(
            **values,
            stop=stop or None,
            stop_token_ids=[end_id] if end_id is not None and end_id >= 0 else None,
        )
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise RequestError(str(exc).replace(field, given_as.get(field, field), 1)) from None
    return EngineRequest(
        prompt_ids=prompt_ids,
        params=params,
        stream=bool(scalar(get, "stream", "bool", False)),
        exclude_input=bool(scalar(get, "exclude_input_in_output", "bool", False)),
        return_num_input_tokens=bool(scalar(get, "return_num_input_tokens", "bool", False)),
        return_num_output_tokens=bool(scalar(get, "return_num_output_tokens", "bool", False)),
        return_finish_reason=bool(scalar(get, "return_finish_reason", "bool", False)),
        return_cached_tokens=bool(scalar(get, "return_cached_tokens", "bool", False)),
        return_log_probs=return_log_probs,
    )


def _sampling_values(get: GetInput) -> tuple[dict[str, Any], dict[str, str]]:
    """The `SamplingParams` fields the request's sampling inputs set (as declared in
    `serving/interface.py`), and for each field the input that gave it. Two inputs for one
    field (`seed` and `random_seed`, say) must agree."""
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for spec in sampling_inputs():
        value = scalar(get, spec.name, spec.kind)
        if value is None:
            continue
        if spec.kind == "float":
            value = float(value)  # an integer tensor may feed a float input
        if spec.convert is not None:
            try:
                value = spec.convert(value)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        field = spec.feeds
        assert field is not None
        if field in values and values[field] != value:
            raise RequestError(f"{given_as[field]} and {spec.name} disagree ({values[field]} vs "
                               f"{value}): give one")
        values[field], given_as[field] = value, spec.name
    return values, given_as
