"""Structured output: grammars compiled with xgrammar, and the per-request matcher that masks
each step's logits so that the output stays in the grammar's language."""

from minisgl_backend.grammar.compiler import GrammarCompilerCache, guide_of
from minisgl_backend.grammar.guide import (Guide, allowed_tokens, apply_token_masks, fill_masks,
                                           mask_words)

__all__ = [
    "GrammarCompilerCache",
    "Guide",
    "allowed_tokens",
    "apply_token_masks",
    "fill_masks",
    "guide_of",
    "mask_words",
]
