"""Compiling a request's guide (JSON schema, regex, EBNF grammar or any JSON object) with
xgrammar, once per distinct guide: xgrammar's compiler keeps compiled grammars in a cache
bounded in bytes. Compiling happens where a request is submitted (the caller's thread, never
the scheduler's), so an invalid guide is a ValueError naming its field before the request
is queued."""

from __future__ import annotations

import re
import threading
from typing import Any

from minisgl_backend.core import SamplingParams

CACHE_LIMIT_BYTES = 256 << 20  # compiled grammars kept (xgrammar evicts past it)
_LOCATION = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


def guide_of(params: SamplingParams) -> tuple[str, str] | None:
    """(field, text) of the request's guide, or None when it has none."""
    for field in ("json_schema", "regex", "grammar"):
        value = getattr(params, field)
        if value is not None:
            return field, value
    return ("json_object", "") if params.json_object else None


class GrammarCompilerCache:
    """One xgrammar compiler for a tokenizer and the model's vocabulary (the logits' width,
    which may exceed the tokenizer's), created on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def compile(self, params: SamplingParams) -> Any:
        """The compiled grammar of the request's guide (None without one); ValueError naming
        the field when it does not compile."""
        guide = guide_of(params)
        if guide is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{guide[0]} needs a tokenizer in the model folder")
        field, text = guide
        compiler = self._get()
        try:
            if field == "json_schema":
                return compiler.compile_json_schema(text)
            if field == "regex":
                return compiler.compile_regex(text)
            if field == "grammar":
                return compiler.compile_grammar(text)
            return compiler.compile_json_schema('{"type": "object"}')  # any JSON object
        except (RuntimeError, ValueError) as exc:
            message = _LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip()
                                    else type(exc).__name__)
            raise ValueError(f"{field} does not compile: {message}") from None
