"""Function calling: the tools a request offers, the structured output that enforces a named or
required `tool_choice`, and tool calls parsed from the model's text in its chat template's
format (Hermes' `<tool_call>` JSON, Llama 3's bare JSON)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from minisgl_backend.openai_server.errors import OpenAIError
from minisgl_backend.openai_server.served_model import ToolFormat

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the generation. `forced`: None (the model decides, `auto`),
    a function's name (its arguments are generated under its parameters' schema) or
    "required" (a JSON list of calls to the offered functions)."""

    tools: list[dict[str, Any]]
    forced: str | None

    @property
    def guide(self) -> dict[str, Any] | None:
        """The JSON schema of a forced choice's output."""
        if self.forced is None:
            return None
        if self.forced != "required":
            return parameters_of(self.function(self.forced))
        calls = [{"type": "object", "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "arguments": parameters_of(t["function"])}}
                 for t in self.tools]
        return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}

    def function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def parameters_of(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_plan(tools: Any, tool_choice: Any) -> ToolPlan | None:
    """The request's `tools` and `tool_choice` checked; None when no tool may be called."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice names a tool but the request offers no tools",
                              "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise OpenAIError("tools must be a non-empty list of functions", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not function["name"]):
            raise OpenAIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              f"{{\"name\": ..., \"parameters\": ...}}}}", f"tools[{i}]")
        if not isinstance(function.get("parameters", {}), dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools[{i}].function.parameters")
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(tools, None)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolPlan(tools, "required")
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) \
        else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" \
            or not isinstance(name, str):
        raise OpenAIError("tool_choice must be 'none', 'auto', 'required' or {\"type\": "
                          "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise OpenAIError(f"tool_choice names the function {name!r}, which is not among the "
                          f"tools ({', '.join(names)})", "tool_choice")
    return ToolPlan(tools, name)


def tool_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes' description of the tools, for chat templates that do not render `tools`."""
    signatures = "\n".join(json.dumps(t) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
            "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One `tool_calls` entry (arguments as JSON text)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": text}}


def _call_of(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return tool_call(obj["name"], arguments)


def parse_tool_calls(text: str, plan: ToolPlan, fmt: ToolFormat
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished output: the calls of the function offered, the text
    around them as content (None when empty). Text that holds no valid call is all content."""
    names = {t["function"]["name"] for t in plan.tools}
    if plan.forced is not None:
        return _forced_calls(text, plan)
    if fmt == "hermes":
        calls = []
        for match in _HERMES_CALL.finditer(text):
            try:
                call = _call_of(json.loads(match.group(1)), names)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = _HERMES_CALL.sub("", text).strip() if calls else text
        return content or None, calls
    return _llama3_calls(text, names)


def _forced_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:  # cut short (max_tokens): the text as it is
        return text, []
    if plan.forced != "required":
        return None, [tool_call(plan.forced or "", value)]
    names = {t["function"]["name"] for t in plan.tools}
    calls = [_call_of(item, names) for item in value] if isinstance(value, list) else []
    if not calls or None in calls:
        return text, []
    return None, calls  # type: ignore[return-value]


def _llama3_calls(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3's calls: JSON objects `{"name", "parameters"}`, after `<|python_tag|>` or alone,
    separated by `;` or whitespace."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call_of(obj, names)
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return (None, calls) if calls else (text, [])


class ToolStream:
    """A streamed output's text with tool calls held back: text that cannot start a call goes
    out as content at once (`feed`); a call is parsed when the output ends (`finish`)."""

    def __init__(self, plan: ToolPlan, fmt: ToolFormat) -> None:
        self.plan, self.fmt = plan, fmt
        self.text, self.sent = "", 0
        self.holding = plan.forced is not None  # a forced choice's whole output is the call

    def feed(self, delta: str) -> str:
        """The content that may go out now."""
        self.text += delta
        if self.holding:
            return ""
        if self.fmt == "llama3":
            start = self.text.lstrip()
            if not start:
                return ""
            if start.startswith("{") or PYTHON_TAG.startswith(start[:len(PYTHON_TAG)]):
                self.holding = True
                return ""
            return self._send(len(self.text))
        found = self.text.find(HERMES_OPEN, self.sent)
        if found >= 0:
            self.holding = True
            return self._send(found)
        return self._send(len(self.text) - _partial_suffix(self.text, HERMES_OPEN))

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not sent yet, the tool calls) at the output's end."""
        content, calls = parse_tool_calls(self.text, self.plan, self.fmt)
        if not calls:
            return self.text[self.sent:], []
        rest = self.text[self.sent:]
        if self.fmt == "hermes" and self.plan.forced is None:
            rest = _HERMES_CALL.sub("", rest).strip()
        else:
            rest = ""
        return rest, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
