"""OpenAI response objects from the engine's chunks: whole completions, streamed chunks, usage
and log-probabilities in each endpoint's format."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minisgl_backend.openai_server.engine import EngineChunk
from minisgl_backend.openai_server.params import Generation
from minisgl_backend.openai_server.served_model import ServedModel
from minisgl_backend.openai_server.tools import parse_tool_calls

OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk"),
           "completions": ("text_completion", "text_completion")}


@dataclass
class Usage:
    """The engine's counts: prompt tokens (once, whatever `n`), tokens generated over every
    sample, prompt tokens served from the prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, chunk: EngineChunk) -> None:
        self.prompt_tokens, self.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
        self.completion_tokens += len(chunk.token_ids)

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Sample:
    """One choice's chunks joined."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, chunk: EngineChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or []
        self.top_logprobs += chunk.top_logprobs or []
        self.finish_reason = chunk.finish_reason or self.finish_reason


class Formatter:
    """Bodies for one request: its id, creation time and the model served."""

    def __init__(self, gen: Generation, request_id: str, model: ServedModel) -> None:
        self.gen, self.request_id, self.model = gen, request_id, model
        self.tokenizer = model.tokenizer
        self.created = int(time.time())

    def envelope(self, streamed: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": OBJECTS[self.gen.endpoint][streamed],
                "created": self.created, "model": self.model.name, "choices": choices}

    def logprobs(self, token_ids: list[int], logprobs: list[float],
                 top: list[list[tuple[int, float]]], offset: int = 0) -> dict[str, Any] | None:
        """The tokens' log-probabilities in the endpoint's format (`offset`: where their text
        starts, for completions' `text_offset`)."""
        if not self.gen.logprobs:
            return None
        texts = [self.tokenizer.decode([t]) for t in token_ids]
        tops = top or [[] for _ in token_ids]
        if self.gen.endpoint == "chat":
            return {"content": [
                {**_token(text, lp), "top_logprobs": [
                    _token(self.tokenizer.decode([i]), v) for i, v in alternatives]}
                for text, lp, alternatives in zip(texts, logprobs, tops)]}
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": logprobs, "text_offset": offsets,
                "top_logprobs": [{self.tokenizer.decode([i]): v for i, v in alternatives}
                                 for alternatives in tops] if top else None}

    def completion(self, samples: dict[int, Sample], usage: Usage) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choices = []
        for index in range(self.gen.params.n):
            sample = samples.get(index, Sample())
            logprobs = self.logprobs(sample.token_ids, sample.logprobs, sample.top_logprobs,
                                     len(self.gen.echo or ""))
            if self.gen.endpoint == "completions":
                choices.append({"index": index, "text": (self.gen.echo or "") + sample.text,
                                "logprobs": logprobs, "finish_reason": sample.finish_reason})
                continue
            message: dict[str, Any] = {"role": "assistant", "content": sample.text}
            reason = sample.finish_reason
            if self.gen.tools is not None:
                content, calls = parse_tool_calls(sample.text, self.gen.tools,
                                                  self.model.tool_format)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls"
            choices.append({"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": reason})
        return {**self.envelope(False, choices), "usage": usage.body()}

    def chunk(self, index: int, delta: dict[str, Any] | str, finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A streamed chunk of one choice: chat's `delta` object, or completions' text."""
        choice: dict[str, Any] = {"index": index}
        if self.gen.endpoint == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        body = self.envelope(True, [choice])
        if self.gen.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self.envelope(True, []), "usage": usage.body()}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
