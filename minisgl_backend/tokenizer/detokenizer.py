"""Streaming detokenization and stop-string matching, with per-request state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# How many prompt tokens give context to the first generated tokens (as in vLLM / TGI).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def ids_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """`tokenizer.decode` with these settings, as a function of the ids. For a transformers
    fast tokenizer that changes nothing after its Rust tokenizer (no clean-up of spaces, no
    decode of its own class), that Rust tokenizer's decode: the same text without the Python
    wrapper's cost per call, which counts since every generated token is decoded twice."""
    from transformers import PreTrainedTokenizerFast as Fast

    if (isinstance(tokenizer, Fast) and type(tokenizer).decode is Fast.decode
            and type(tokenizer)._decode is Fast._decode
            and not tokenizer.clean_up_tokenization_spaces):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of printable text deltas.

    Uses the prefix_offset / read_offset method of vLLM and TGI: decode the window
    ids[prefix_offset:read_offset] (text already emitted) and ids[prefix_offset:], and emit the
    difference unless it ends in U+FFFD (an incomplete UTF-8 character, held back until the
    next tokens complete it). Decoding a window that starts a few tokens back, instead of the
    new tokens alone, keeps the leading spaces of SentencePiece-style tokens right.

    The concatenation of all `push()` results and the final `flush()` equals
    `tokenizer.decode(generated_ids, skip_special_tokens=...)` for byte-level BPE tokenizers.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode_ids = ids_decoder(tokenizer, skip_special_tokens)
        # Only ids from prefix_offset on are kept, so offsets are relative to self._ids.
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes would merge with ours, drop it.
            self._ids = []
            self._prefix_text = ""
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids)

    def _emit(self, new_text: str) -> str:
        """Return the text after the emitted prefix and move the window past it."""
        delta = new_text[len(self._prefix_text) :]
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated token ids; return the text that became printable."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids)
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            return self._emit(new_text)
        return ""

    def flush(self) -> str:
        """Return all text still held back (call once the request has ended)."""
        new_text = self._decode(self._ids)
        if len(new_text) > len(self._prefix_text):
            return self._emit(new_text)
        return ""


class StopStringMatcher:
    """Cuts a stream of text deltas before the earliest occurrence of any stop string.

    `feed()` holds back a trailing piece of text that could still grow into a stop string and
    returns the text that is safe to emit. Once a stop string is complete and no earlier one can
    still complete, it returns the text up to the earliest stop string and `stopped=True`.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._buffer = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been matched (or the matcher flushed)."""
        return self._stopped

    def _earliest_stop(self) -> int:
        """Start of the earliest complete stop string in the buffer, or -1."""
        starts = [i for i in (self._buffer.find(stop) for stop in self._stops) if i >= 0]
        return min(starts, default=-1)

    def _earliest_partial(self) -> int:
        """Start of the longest buffer suffix that is a proper prefix of a stop string."""
        n = len(self._buffer)
        longest = max(len(stop) for stop in self._stops)
        for start in range(max(0, n - longest + 1), n):
            tail = self._buffer[start:]
            if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self._stops):
                return start
        return n

    def _take(self, end: int) -> str:
        out, self._buffer = self._buffer[:end], self._buffer[end:]
        return out

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; return (text safe to emit now, whether a stop string matched)."""
        if self._stopped:
            raise RuntimeError("feed() called after a stop string matched or flush()")
        if not self._stops:
            return delta, False
        self._buffer += delta
        complete = self._earliest_stop()
        partial = self._earliest_partial()
        if complete >= 0 and complete <= partial:
            self._stopped = True
            out = self._buffer[:complete]
            self._buffer = ""
            return out, True
        # Either no stop yet, or a longer stop starting earlier may still complete.
        return self._take(partial), False

    def flush(self) -> str:
        """Release the held-back text (cut before any complete stop string); ends the stream."""
        if self._stopped:
            return ""
        self._stopped = True
        complete = self._earliest_stop()
        out = self._buffer if complete < 0 else self._buffer[:complete]
        self._buffer = ""
        return out
