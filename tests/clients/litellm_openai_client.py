"""LiteLLM's `openai/` provider against an OpenAI-compatible server (the project's front door);
run by the `litellm` client venv's python.

    python tests/clients/litellm_openai_client.py '{"api_base": "http://localhost:9000/v1",
        "api_key": "...", "model": "SmolLM2-135M-Instruct", "messages": [...], "max_tokens": 16}'

Prints one JSON object: `text`, `finish_reason` and `usage` of `litellm.completion(...)`
(greedy), and `stream_deltas` and `stream_usage` of the same call with `stream=True`.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
os.environ.setdefault("LITELLM_TELEMETRY", "False")

import litellm  # noqa: E402

args = json.loads(sys.argv[1])
call = {"model": "openai/" + args["model"], "api_base": args["api_base"],
        "api_key": args["api_key"], "messages": args["messages"],
        "max_tokens": args["max_tokens"], "temperature": 0}

response = litellm.completion(**call)
deltas, stream_usage = [], None
for chunk in litellm.completion(**call, stream=True, stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].delta.content:
        deltas.append(chunk.choices[0].delta.content)
    if getattr(chunk, "usage", None):
        stream_usage = chunk.usage.model_dump()
print(json.dumps({"text": response.choices[0].message.content,
                  "finish_reason": response.choices[0].finish_reason,
                  "usage": response.usage.model_dump(), "stream_deltas": deltas,
                  "stream_usage": stream_usage}))
