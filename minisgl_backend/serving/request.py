"""Turn a Triton request's tensors into engine inputs, with errors that name the field.

Tensors follow the TensorRT-LLM ensemble convention (request shape [1, 1] with the batch
dimension, or [1] without); every scalar input is optional except `max_tokens` where noted.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from minisgl_backend.core import SamplingParams, bad_word_sequences, check_token_ids
from minisgl_backend.fields import spec_field, validate
from minisgl_backend.serving.interface import (TRITON_REQUEST_PARAMETERS, inputs_of, refused_inputs,
                                               sampling_inputs)
from minisgl_backend.tokenizer import encode_chat, encode_prompt

GetInput = Callable[[str], "np.ndarray | None"]


class RequestError(ValueError):
    """A bad request; the message names the offending field."""


@dataclass(frozen=True)
class RequestPolicy:
    """What one request may take, and the defaults of what it does not say: settings of the
    Triton model (config.pbtxt parameters of the same names)."""

    max_input_bytes: int = spec_field(1 << 20, "int", "bytes of `text_input` a request may "
                                      "send (before tokenization)", low=0, where="triton")
    max_prompt_tokens: int = spec_field(
        0, "int", "prompt tokens a request may send (0: the engine's context limit)", low=0,
        where="triton")
    max_output_tokens: int = spec_field(
        0, "int", "`max_tokens` a request may ask for (0: the engine's context limit)", low=0,
        where="triton")
    max_stop_words: int = spec_field(
        32, "int", "entries of `stop_words`, `bad_words` and `embedding_bias_words` each",
        low=0, where="triton")
    max_stop_word_length: int = spec_field(256, "int", "characters per such entry", low=0,
                                           where="triton")
    # Logits are [tokens, vocabulary] float32 tensors: a bound on the memory one request takes.
    max_logits_values: int = spec_field(
        1 << 26, "int", "values of `return_context_logits` (prompt tokens x vocabulary) and of "
        "`return_generation_logits` (max_tokens x vocabulary) per request", low=0,
        where="triton")
    exclude_input_in_output: bool = spec_field(
        False, "bool", "for requests that send no `exclude_input_in_output` (TensorRT-LLM's "
        "model parameter): non-streaming text without the prompt in front", where="triton",
        shipped=True)

    def __post_init__(self) -> None:
        validate(self)


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
    return_perf_metrics: bool = False
    lora: str | None = None  # the LoRA adapter's name (None: the base model)
    # TensorRT-LLM's LoRA task, and the adapter its first request brings.
    lora_task_id: int | None = None
    lora_weights: np.ndarray | None = None
    lora_config: np.ndarray | None = None
    # SamplingParams field -> the input that gave it, for errors found after parsing
    given_as: dict[str, str] = field(default_factory=dict)

    def name_inputs(self, message: str) -> str:
        """An error message about a SamplingParams field, naming the input instead."""
        return name_inputs(message, self.given_as)


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


def text_list(get: GetInput, name: str, max_entries: int, max_length: int,
              keep_empty: bool = False) -> list[str]:
    """All strings of an optional STRING input (any shape), empty strings dropped unless
    `keep_empty`; at most `max_entries` of at most `max_length` characters each."""
    array = get(name)
    if array is None:
        return []
    if array.dtype.kind not in "OSU":
        raise RequestError(f"{name} must be STRING, got dtype {array.dtype}")
    words = [decode_text(v, name) for v in array.reshape(-1)]
    words = words if keep_empty else [w for w in words if w]
    if len(words) > max_entries:
        raise RequestError(f"{name} has {len(words)} entries; the limit is {max_entries}")
    if any(len(word) > max_length for word in words):
        raise RequestError(f"{name} entries may have {max_length} characters at most")
    return words


_LIST_KIND = {"int": "integers", "float": "float"}


def value_list(get: GetInput, name: str, kind: str) -> list[Any]:
    """All values of an optional "int" or "float" input (any shape); floats each finite."""
    array = get(name)
    if array is None:
        return []
    if not _KIND_CHECK[kind](array):
        raise RequestError(f"{name} must be {_LIST_KIND[kind]}, got dtype {array.dtype}")
    values = [(int if kind == "int" else float)(v) for v in array.reshape(-1)]
    if kind == "float" and not all(math.isfinite(v) for v in values):
        raise RequestError(f"{name} must hold finite numbers")
    return values


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
                     limits: RequestPolicy = RequestPolicy()) -> list[int]:
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
        messages = chat_messages(text)
        try:
            return encode_chat(tokenizer, messages)
        except Exception as exc:  # noqa: BLE001 - a model's template may raise anything
            raise RequestError(f"text_input: the model's chat template failed on these "
                               f"messages: {exc}") from None
    return encode_prompt(tokenizer, text)


def _prompt(get: GetInput, tokenizer: Any, limits: RequestPolicy, vocab_size: int) -> list[int]:
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


def check_parameters(parameters: str) -> None:
    """A request's parameters (Triton's JSON of them) hold only Triton's own: over HTTP a key
    that is no input of the model arrives as a parameter."""
    try:
        names = set(json.loads(parameters or "{}"))
    except (json.JSONDecodeError, TypeError):
        return  # not ours to judge: Triton wrote it
    unknown = sorted(names - TRITON_REQUEST_PARAMETERS)
    if not unknown:
        return
    inputs = [i.name for i in inputs_of("ensemble")]
    hints = [f"{name} (did you mean {close[0]}?)" if close else name
             for name in unknown for close in [difflib.get_close_matches(name, inputs, 1)]]
    raise RequestError(f"unknown request field(s) {', '.join(hints)}: not an input of this "
                       f"model")


def parse_engine_request(get: GetInput, max_tokens_limit: int, tokenizer: Any = None,
                         limits: RequestPolicy = RequestPolicy(),
                         vocab_size: int = 0, parameters: str = "") -> EngineRequest:
    """Read the inputs of the `minisgl` model: the prompt (token ids from preprocessing, or
    text) and the generation settings; token ids must be below `vocab_size` when given.
    `parameters`: the request's parameters as Triton gives them (JSON)."""
    check_parameters(parameters)
    for spec in refused_inputs():
        if get(spec.name) is not None:
            raise RequestError(f"{spec.name}: {spec.refused}")
    prompt_ids = _prompt(get, tokenizer, limits, vocab_size)
    if limits.max_prompt_tokens and len(prompt_ids) > limits.max_prompt_tokens:
        raise RequestError(f"text_input has {len(prompt_ids)} tokens; the limit is "
                           f"{limits.max_prompt_tokens}")
    if limits.max_output_tokens:
        max_tokens_limit = min(max_tokens_limit, limits.max_output_tokens)
    values, given_as = _sampling_values(get)
    max_tokens = values.get("max_tokens")
    if max_tokens is None:
        raise RequestError("max_tokens is required")
    if max_tokens < 1 or max_tokens > max_tokens_limit:
        raise RequestError(f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}")
    end_id = scalar(get, "end_id", "int")
    if end_id is not None and vocab_size and end_id >= vocab_size:
        raise RequestError(f"end_id must be a token id below {vocab_size} (or -1), got {end_id}")
    if end_id is not None and end_id >= 0:  # TensorRT-LLM: end_id takes the place of EOS
        values["stop_token_ids"], values["ignore_eos"] = [end_id], True
        given_as["stop_token_ids"] = "end_id"
    beam_width = scalar(get, "beam_width", "int", 1)
    if beam_width != 1:
        raise RequestError(f"beam_width must be 1 (beam search is not supported), got "
                           f"{beam_width}")
    scalar(get, "pad_id", "int")  # accepted: responses carry no padding
    scalar(get, "length_penalty", "float")  # accepted: it only affects beam search
    return_log_probs = bool(scalar(get, "return_log_probs", "bool", False))
    top_log_probs = scalar(get, "num_top_log_probs", "int")
    if top_log_probs is not None and not return_log_probs:
        raise RequestError("num_top_log_probs needs return_log_probs")
    if return_log_probs:  # the sampled tokens' log-probabilities, and any alternatives
        values["logprobs"] = top_log_probs or 0
        if top_log_probs is not None:
            given_as["logprobs"] = "num_top_log_probs"
    values.update(_word_controls(get, tokenizer, limits, given_as))
    values.update(_guide(get, limits, given_as))
    flags = {name: bool(scalar(get, name, "bool", False)) for name in (
        "return_num_input_tokens", "return_num_output_tokens", "return_finish_reason",
        "return_cached_tokens", "return_perf_metrics")}
    vocab = vocab_size or (len(tokenizer) if tokenizer is not None else 0)
    for name, tokens in (("return_context_logits", len(prompt_ids)),
                         ("return_generation_logits", max_tokens)):
        if values.get(name) and tokens * vocab > limits.max_logits_values:
            raise RequestError(f"{name}: {tokens} tokens x {vocab} vocabulary entries exceed "
                               f"the limit of {limits.max_logits_values} values (parameter "
                               f"max_logits_values)")
    try:
        params = SamplingParams(**values)
    except ValueError as exc:
        raise RequestError(name_inputs(str(exc), given_as)) from None
    return EngineRequest(
        prompt_ids=prompt_ids,
        params=params,
        stream=bool(scalar(get, "stream", "bool", False)),
        exclude_input=bool(scalar(get, "exclude_input_in_output", "bool",
                                  limits.exclude_input_in_output)),
        return_log_probs=return_log_probs,
        given_as=given_as,
        **_lora_inputs(get),
        **flags,
    )


def _lora_inputs(get: GetInput) -> dict[str, Any]:
    """The adapter a request names: `lora_name`, or TensorRT-LLM's `lora_task_id` (with
    `lora_weights` and `lora_config` on the task's first request)."""
    name = next(iter(text_list(get, "lora_name", 1, 256)), None)
    task_id = scalar(get, "lora_task_id", "int")
    weights, config = get("lora_weights"), get("lora_config")
    if name is not None and task_id is not None:
        raise RequestError("lora_name and lora_task_id: give one adapter, not both")
    if task_id is None and (weights is not None or config is not None):
        raise RequestError("lora_weights and lora_config need a lora_task_id")
    if (weights is None) != (config is None):
        raise RequestError("lora_weights and lora_config come together")
    return {"lora": name, "lora_task_id": task_id, "lora_weights": weights,
            "lora_config": config}


def name_inputs(message: str, given_as: dict[str, str]) -> str:
    """`message` (a ValueError's, starting with a SamplingParams field) naming the input."""
    field_name = message.split(" ", 1)[0]
    return message.replace(field_name, given_as.get(field_name, field_name), 1)


# guided_decoding_guide_type -> the SamplingParams field its guide feeds (TensorRT-LLM's names)
GUIDE_TYPES = {"json": "json_object", "json_schema": "json_schema", "regex": "regex",
               "ebnf_grammar": "grammar"}


def _guide(get: GetInput, limits: RequestPolicy, given_as: dict[str, str]) -> dict[str, Any]:
    """Structured output from `guided_decoding_guide_type` and `guided_decoding_guide` (a
    guide may be as long as a prompt)."""
    kinds = text_list(get, "guided_decoding_guide_type", 1, 64, keep_empty=True)
    guides = text_list(get, "guided_decoding_guide", 1, limits.max_input_bytes, keep_empty=True)
    if not kinds:
        if guides:
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type")
        return {}
    if kinds[0] not in GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type must be one of "
                           f"{', '.join(GUIDE_TYPES)}, got {kinds[0]!r}")
    target = GUIDE_TYPES[kinds[0]]
    if target == "json_object":
        given_as[target] = "guided_decoding_guide_type"
        return {target: True}
    if not guides or not guides[0]:
        raise RequestError(f"guided_decoding_guide must hold the {kinds[0]} (one string)")
    given_as[target] = "guided_decoding_guide"
    return {target: guides[0]}


def _word_controls(get: GetInput, tokenizer: Any, limits: RequestPolicy,
                   given_as: dict[str, str]) -> dict[str, Any]:
    """`stop`, `bad_token_ids` and `logit_bias` from the word inputs, tokenized as
    TensorRT-LLM's preprocessing does: bad words as written without special tokens, embedding
    bias words with them (each of a word's tokens gets the word's weight; weights add up)."""
    values: dict[str, Any] = {}
    stop, bad, bias_words = (text_list(get, name, limits.max_stop_words,
                                       limits.max_stop_word_length, keep_empty=keep)
                             for name, keep in (("stop_words", False), ("bad_words", False),
                                                ("embedding_bias_words", True)))
    if stop:
        values["stop"] = stop
    bias_weights = value_list(get, "embedding_bias_weights", "float")
    if len(bias_words) != len(bias_weights):
        raise RequestError(f"embedding_bias_weights must have one weight per "
                           f"embedding_bias_words entry: {len(bias_weights)} weights for "
                           f"{len(bias_words)} words")
    if (bad or bias_words) and tokenizer is None:
        raise RequestError("bad_words and embedding_bias_words need the model's tokenizer")
    sequences = bad_word_sequences(tokenizer, bad, spaced=False)
    if sequences:
        values["bad_token_ids"] = sequences
        given_as["bad_token_ids"] = "bad_words"
    bias: dict[int, float] = {}
    for word, weight in zip(bias_words, bias_weights):
        for token in tokenizer.encode(word):
            bias[token] = bias.get(token, 0.0) + weight
    bias_ids = value_list(get, "logit_bias_token_ids", "int")
    bias_values = value_list(get, "logit_bias_values", "float")
    if len(bias_ids) != len(bias_values):
        raise RequestError(f"logit_bias_values must have one value per logit_bias_token_ids "
                           f"entry: {len(bias_values)} values for {len(bias_ids)} ids")
    for token, value in zip(bias_ids, bias_values):
        bias[token] = bias.get(token, 0.0) + value
    if bias:
        values["logit_bias"] = bias
        given_as["logit_bias"] = "logit_bias_values" if bias_ids else "embedding_bias_weights"
    return values


def _sampling_values(get: GetInput) -> tuple[dict[str, Any], dict[str, str]]:
    """The `SamplingParams` fields the request's sampling inputs set, and for each the input
    that gave it (two inputs for one field, `seed` and `random_seed`, must agree)."""
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
