"""Tokenizer-side helpers: streaming detokenization and stop-string matching."""

from __future__ import annotations

from .detokenizer import IncrementalDetokenizer, StopStringMatcher

__all__ = ["IncrementalDetokenizer", "StopStringMatcher"]
