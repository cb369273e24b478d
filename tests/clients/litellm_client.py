"""LiteLLM against this project's servers; run by the `litellm` client venv's python. Its
`triton/` provider (the default model) against a tritonserver:

    python tests/clients/litellm_client.py \
        '{"api_base": "http://localhost:8000/v2/models/ensemble/generate",
          "messages": [...], "max_tokens": 16}'

or its `openai/` provider against the OpenAI-compatible front door (`api_key` and
`temperature` are passed on only when given):

    python tests/clients/litellm_client.py '{"api_base": "http://localhost:9000/v1",
        "api_key": "...", "model": "openai/SmolLM2-135M-Instruct", "messages": [...],
        "max_tokens": 16, "temperature": 0}'

Prints one JSON object: `text`, `finish_reason` and `usage` of `litellm.completion(...)`,
`stream_deltas` and
`stream_usage` of the same call with `stream=True` (usage: the last chunk that carried one), and
`sent` (each HTTP request LiteLLM made: method, url, JSON body).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
os.environ.setdefault("LITELLM_TELEMETRY", "False")

import _record  # noqa: E402

_record.record_http()

import litellm  # noqa: E402

args = json.loads(sys.argv[1])
call = {"model": args.get("model", "triton/ensemble"), "api_base": args["api_base"],
        "messages": args["messages"], "max_tokens": args["max_tokens"],
        **{key: args[key] for key in ("api_key", "temperature") if key in args}}

response = litellm.completion(**call)
usage = response.usage.model_dump() if getattr(response, "usage", None) else None

deltas, stream_usage = [], None
for chunk in litellm.completion(**call, stream=True, stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].delta.content:
        deltas.append(chunk.choices[0].delta.content)
    if getattr(chunk, "usage", None):
        stream_usage = chunk.usage.model_dump()

print(json.dumps({"text": response.choices[0].message.content,
                  "finish_reason": response.choices[0].finish_reason, "usage": usage,
                  "stream_deltas": deltas, "stream_usage": stream_usage,
                  "sent": _record.SENT}))
