"""Prompt text to token ids, the same way for the offline API and the Triton preprocessing."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Plain text: the tokenizer's own special tokens (e.g. Llama 3's BOS) are added."""
    return list(tokenizer.encode(text, add_special_tokens=True))


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Chat messages (and the functions the model may call, for templates that render them)
    through the model's chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
