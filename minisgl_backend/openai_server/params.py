"""An OpenAI request body as one generation of the `minisgl` model: the prompt's token ids and
`SamplingParams`. Every OpenAI parameter that is an engine control is mapped onto its
`SamplingParams` field and checked by that field's own declaration (`minisgl_backend.fields`),
with errors naming the OpenAI parameter; the rest (messages, tools, `response_format`,
`logprobs`, `echo`, `stream`) are read here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from minisgl_backend.core import SamplingParams
from minisgl_backend.openai_server.errors import OpenAIError
from minisgl_backend.openai_server.served_model import ServedModel
from minisgl_backend.openai_server.tools import ToolPlan, tool_plan, tool_system_prompt
from minisgl_backend.serving.request import name_inputs
from minisgl_backend.tokenizer import encode_chat, encode_prompt

Endpoint = Literal["chat", "completions"]

# OpenAI parameter -> the SamplingParams field it sets, as it is.
CONTROLS: dict[str, str] = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos", "min_tokens": "min_tokens", "n": "n", "stop": "stop",
    "logit_bias": "logit_bias",
}
# Read here, per endpoint; and accepted without effect (`user`: the caller's own label).
OWN: dict[Endpoint, frozenset[str]] = {
    "chat": frozenset({"model", "messages", "stream", "stream_options", "logprobs",
                       "top_logprobs", "response_format", "tools", "tool_choice",
                       "parallel_tool_calls", "user"}),
    "completions": frozenset({"model", "prompt", "stream", "stream_options", "logprobs", "echo",
                              "response_format", "user"}),
}
# OpenAI's defaults where they differ from the engine's (which samples greedily by default).
OPENAI_DEFAULTS: dict[str, Any] = {"temperature": 1.0}
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for completions; chat: the rest of the context
DEFAULT_NOTES = {"max_tokens": f"chat: the rest of the context; completions: "
                               f"`{COMPLETIONS_MAX_TOKENS}`"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


@dataclass
class Generation:
    """One request to the `minisgl` model, and how to answer the OpenAI client."""

    endpoint: Endpoint
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool  # report log-probabilities (chat: `logprobs`, completions: `logprobs` set)
    echo: str | None  # completions with `echo`: the prompt text put in front
    tools: ToolPlan | None
    given_as: dict[str, str]  # SamplingParams field -> the OpenAI parameter that set it


def check_known(body: dict[str, Any], endpoint: Endpoint) -> None:
    """Every parameter is one the endpoint reads: any other gets a 400 naming it."""
    unknown = sorted(set(body) - OWN[endpoint] - set(CONTROLS))
    if unknown:
        raise OpenAIError(f"Unrecognized or unsupported request argument(s): "
                          f"{', '.join(unknown)}", unknown[0], code="unsupported_parameter")


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be a boolean, got {value!r}", name)
    return value


def parse_request(body: Any, endpoint: Endpoint, model: ServedModel) -> Generation:
    """The body of `/v1/chat/completions` or `/v1/completions` as a `Generation`; OpenAIError
    (400, naming the parameter) when it is not one."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    check_known(body, endpoint)
    if body.get("model") != model.name:
        raise OpenAIError(f"The model {body.get('model')!r} does not exist: this server serves "
                          f"{model.name!r}", "model", code="model_not_found")
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise OpenAIError("stream_options must be an object, and only with stream",
                          "stream_options")
    include_usage = bool(options and flag(options, "include_usage"))
    values, given_as = _controls(body)
    plan = None
    if endpoint == "chat":
        plan = tool_plan(body.get("tools"), body.get("tool_choice"))
        prompt_ids = chat_prompt(body.get("messages"), plan, model)
        logprobs = flag(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None and not logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
        if logprobs:
            values["logprobs"], given_as["logprobs"] = (0 if top is None else top), "top_logprobs"
        echo = None
    else:
        prompt_ids, prompt_text = completion_prompt(body.get("prompt"), model)
        logprobs = body.get("logprobs") is not None
        if logprobs:
            values["logprobs"], given_as["logprobs"] = body["logprobs"], "logprobs"
        echo = prompt_text if flag(body, "echo") else None
        if echo is not None and logprobs:
            raise OpenAIError("echo with logprobs is not supported (no prompt log-probabilities)",
                              "echo")
    values.update(_guide(body.get("response_format"), plan, given_as))
    if "max_tokens" not in values:
        values["max_tokens"] = (COMPLETIONS_MAX_TOKENS if endpoint == "completions"
                                else max(1, model.max_seq_len - len(prompt_ids)))
    return Generation(endpoint, prompt_ids, sampling_params(values, given_as), stream,
                      include_usage, logprobs, echo, plan, given_as)


def _controls(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = dict(OPENAI_DEFAULTS)
    given_as: dict[str, str] = {}
    for name, field in CONTROLS.items():
        value = body.get(name)
        if value is None:
            continue
        if field in given_as and values[field] != value:
            raise OpenAIError(f"{given_as[field]} and {name} disagree: give one", name)
        if name == "logit_bias":
            value = _logit_bias(value)
        elif name == "stop" and value == []:
            continue
        values[field], given_as[field] = value, name
    return values, given_as


def _logit_bias(value: Any) -> Any:
    """OpenAI's `{"token id": bias}` (JSON keys are strings) as `{token id: bias}`."""
    if not isinstance(value, dict):
        return value  # the field's declaration refuses it, naming logit_bias
    try:
        return {int(key): bias for key, bias in value.items()}
    except ValueError:
        raise OpenAIError("logit_bias keys must be token ids", "logit_bias") from None


def sampling_params(values: dict[str, Any], given_as: dict[str, str]) -> SamplingParams:
    """`SamplingParams(**values)`; its declarations' errors name the OpenAI parameter."""
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        message = name_inputs(str(exc), given_as)
        raise OpenAIError(message, message.split(" ", 1)[0]) from None


def _guide(response_format: Any, plan: ToolPlan | None,
           given_as: dict[str, str]) -> dict[str, Any]:
    """Structured output: a forced tool choice's schema, else `response_format`'s."""
    if plan is not None and plan.guide is not None:
        given_as["json_schema"] = "tool_choice"
        return {"json_schema": plan.guide}
    if response_format is None:
        return {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError("response_format.json_schema.schema must be a JSON schema object",
                              "response_format.json_schema.schema")
        given_as["json_schema"] = "response_format.json_schema.schema"
        return {"json_schema": schema}
    raise OpenAIError("response_format.type must be 'text', 'json_object' or 'json_schema'",
                      "response_format")


def completion_prompt(prompt: Any, model: ServedModel) -> tuple[list[int], str]:
    """A completion's prompt (a string, a list of token ids, or a list of one of those) as
    token ids and text."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return encode_prompt(model.tokenizer, prompt), prompt
    vocab = len(model.tokenizer)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
        return list(prompt), model.tokenizer.decode(prompt)
    raise OpenAIError(f"prompt must be a non-empty string or a list of token ids below {vocab} "
                      f"(one prompt per request)", "prompt")


def chat_prompt(messages: Any, plan: ToolPlan | None, model: ServedModel) -> list[int]:
    """The messages (and the tools) through the model's chat template."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", "messages")
    rendered = [_message(m, i, model) for i, m in enumerate(messages)]
    tools = plan.tools if plan is not None else None
    if tools is not None and not model.renders_tools:
        prompt = tool_system_prompt(tools)
        if rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
        tools = None
    try:
        return encode_chat(model.tokenizer, rendered, tools)
    except Exception as exc:  # noqa: BLE001 - a model's template may raise anything
        raise OpenAIError(f"the model's chat template failed on these messages: {exc}",
                          "messages") from None


def _message(message: Any, i: int, model: ServedModel) -> dict[str, Any]:
    """One OpenAI message as the chat template takes it."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise OpenAIError(f"{where} must be an object with a role among "
                          f"{', '.join(ROLES)}", f"{where}.role")
    role = ROLES[message["role"]]
    content = _content(message.get("content"), f"{where}.content",
                       optional=role == "assistant" and bool(message.get("tool_calls")))
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise OpenAIError(f"{where}.tool_calls must be a list of function calls",
                              f"{where}.tool_calls")
        if model.renders_tools:
            out["tool_calls"] = [{**c, "function": _parsed_arguments(c["function"])}
                                 for c in calls]
        else:
            out["content"] = "\n".join(
                [content] * bool(content) + [_hermes_call(c["function"]) for c in calls])
    if role == "tool":
        if message.get("tool_call_id") is not None:
            out["tool_call_id"] = message["tool_call_id"]
        if not model.renders_tools:
            out["content"] = f"<tool_response>\n{content}\n</tool_response>"
    return out


def _content(content: Any, where: str, optional: bool) -> str:
    """Text content, or a list of text parts joined."""
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise OpenAIError(f"{where} must be a string or a list of text parts", where)


def _parsed_arguments(function: dict[str, Any]) -> dict[str, Any]:
    """Chat templates take a call's arguments as an object, OpenAI sends JSON text."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**function, "arguments": arguments}


def _hermes_call(function: dict[str, Any]) -> str:
    call = {"name": function.get("name"), "arguments": _parsed_arguments(function)["arguments"]}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
