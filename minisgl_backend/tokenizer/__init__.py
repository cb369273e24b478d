"""Tokenizer-side helpers: streaming detokenization and stop-string matching."""

from __future__ import annotations

from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .prompt import encode_chat, encode_prompt

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "encode_chat", "encode_prompt"]
