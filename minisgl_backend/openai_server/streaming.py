"""Server-sent events of a streamed completion: each choice's role, text deltas (tool calls held
back until they are whole), its end, the usage when asked for, then exactly one `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from minisgl_backend.openai_server.engine import EngineChunk
from minisgl_backend.openai_server.errors import OpenAIError
from minisgl_backend.openai_server.responses import Formatter, Usage
from minisgl_backend.openai_server.tools import ToolStream

DONE = b"data: [DONE]\n\n"


def event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class ChoiceStreams:
    """What the stream has said of each choice so far."""

    def __init__(self, fmt: Formatter) -> None:
        self.fmt, self.gen = fmt, fmt.gen
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}  # completions: text sent per choice (text_offset)
        self.tools: dict[int, ToolStream] = {}

    def events(self, chunk: EngineChunk) -> list[bytes]:
        """The events one engine chunk makes."""
        fmt, i, out = self.fmt, chunk.index, []
        chat = self.gen.endpoint == "chat"
        if i not in self.started:
            self.started.add(i)
            if chat:
                out.append(event(fmt.chunk(i, {"role": "assistant", "content": ""})))
            elif self.gen.echo:
                out.append(event(fmt.chunk(i, self.gen.echo)))
                self.offsets[i] = len(self.gen.echo)
        text = chunk.text
        if self.gen.tools is not None:
            text = self.tools.setdefault(
                i, ToolStream(self.gen.tools, fmt.model.tool_format)).feed(text)
        logprobs = fmt.logprobs(chunk.token_ids, chunk.logprobs or [], chunk.top_logprobs or [],
                                self.offsets.get(i, 0))
        self.offsets[i] = self.offsets.get(i, 0) + len(chunk.text)
        if text or logprobs:
            out.append(event(fmt.chunk(i, {"content": text} if chat else text,
                                       logprobs=logprobs)))
        if chunk.finish_reason is not None:
            out += self._end(i, chunk.finish_reason)
        return out

    def _end(self, i: int, reason: str) -> list[bytes]:
        fmt, out = self.fmt, []
        stream = self.tools.get(i)
        if stream is not None:
            rest, calls = stream.finish()
            if rest:
                out.append(event(fmt.chunk(i, {"content": rest})))
            if calls:
                deltas = [{"index": k, **call} for k, call in enumerate(calls)]
                out.append(event(fmt.chunk(i, {"tool_calls": deltas})))
                reason = "tool_calls"
        empty: dict[str, Any] | str = {} if self.gen.endpoint == "chat" else ""
        out.append(event(fmt.chunk(i, empty, finish_reason=reason)))
        return out


async def sse_events(first: EngineChunk | None, chunks: AsyncGenerator[EngineChunk, None],
                     fmt: Formatter, on_end: Callable[[Usage, str], None]
                     ) -> AsyncIterator[bytes]:
    """The stream's events: `first` (already read, so that a refused request got its 400) then
    the rest of `chunks`. `on_end(usage, outcome)` runs once, whatever ends the stream."""
    usage, choices, outcome = Usage(), ChoiceStreams(fmt), "cancelled"
    try:
        if first is not None:
            usage.add(first)
            for data in choices.events(first):
                yield data
        async for chunk in chunks:
            usage.add(chunk)
            for data in choices.events(chunk):
                yield data
        if fmt.gen.include_usage:
            yield event(fmt.usage_chunk(usage))
        outcome = "ok"
    except OpenAIError as exc:  # the engine failed mid-stream: the error, then the end
        outcome = "error"
        yield event(exc.body())
    finally:
        on_end(usage, outcome)
        await chunks.aclose()  # a client gone: the engine's stream is cancelled now
    yield DONE
