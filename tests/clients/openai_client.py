"""The `openai` Python client against an OpenAI-compatible server (the LiteLLM proxy here).

    python tests/clients/openai_client.py '{"base_url": "http://localhost:4000/v1",
        "model": "triton/ensemble", "messages": [...], "prompt": "...", "max_tokens": 16}'

Prints one JSON object with, for `chat` (chat.completions) and `completion` (completions): the
non-streaming `text`, `finish_reason` and `usage`, and the streaming `stream_deltas` and
`stream_usage` (with stream_options={"include_usage": True}).
"""

from __future__ import annotations

import json
import sys

from openai import OpenAI

args = json.loads(sys.argv[1])
client = OpenAI(base_url=args["base_url"], api_key=args.get("api_key", "unused"),
                max_retries=0, timeout=300)
model, max_tokens = args["model"], args["max_tokens"]


def usage(obj) -> dict | None:  # noqa: ANN001
    return obj.usage.model_dump() if getattr(obj, "usage", None) else None


out: dict = {}

chat = client.chat.completions.create(model=model, messages=args["messages"],
                                      max_tokens=max_tokens)
deltas, stream_usage = [], None
for chunk in client.chat.completions.create(model=model, messages=args["messages"],
                                            max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].delta.content:
        deltas.append(chunk.choices[0].delta.content)
    stream_usage = usage(chunk) or stream_usage
out["chat"] = {"text": chat.choices[0].message.content, "finish_reason":
               chat.choices[0].finish_reason, "usage": usage(chat), "stream_deltas": deltas,
               "stream_usage": stream_usage}

completion = client.completions.create(model=model, prompt=args["prompt"], max_tokens=max_tokens)
deltas, stream_usage = [], None
for chunk in client.completions.create(model=model, prompt=args["prompt"], max_tokens=max_tokens,
                                       stream=True, stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].text:
        deltas.append(chunk.choices[0].text)
    stream_usage = usage(chunk) or stream_usage
out["completion"] = {"text": completion.choices[0].text, "finish_reason":
                     completion.choices[0].finish_reason, "usage": usage(completion),
                     "stream_deltas": deltas, "stream_usage": stream_usage}

print(json.dumps(out))
