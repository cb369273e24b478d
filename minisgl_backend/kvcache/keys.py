"""The prefix cache's keys: a request's token ids, moved apart where its KV differs.

KV computed under a LoRA adapter, or with LongRoPE's long frequencies, differs from the base
model's for the same tokens, so it is keyed apart: ids are moved past every vocabulary by the
adapter's id, and long-frequency ids are mapped below zero. `split_key` undoes both (the KV-cache
events report real token ids and name the adapter).
"""

from __future__ import annotations

from typing import NamedTuple

ADAPTER_KEY_SHIFT = 32  # token ids stay below 2**32
_TOKEN_MASK = (1 << ADAPTER_KEY_SHIFT) - 1


class KeyParts(NamedTuple):
    """What a cache key is made of."""

    tokens: list[int]
    lora_id: int  # 0: the base model
    long_rope: bool  # KV in LongRoPE's long frequencies


def cache_key(tokens: list[int], lora_id: int, long_rope: bool) -> list[int]:
    """The prefix cache's key of `tokens` computed under adapter `lora_id` (0: none), with
    LongRoPE's long frequencies or not."""
    if lora_id:
        tokens = [t + (lora_id << ADAPTER_KEY_SHIFT) for t in tokens]
    return [-1 - t for t in tokens] if long_rope else tokens


def split_key(key: list[int]) -> KeyParts:
    """The tokens, adapter and frequency set of a (non-empty) key made by `cache_key`; a key's
    tokens all share the adapter and frequency set, so its first one tells them."""
    long_rope = key[0] < 0
    if long_rope:
        key = [-1 - k for k in key]
    lora_id = key[0] >> ADAPTER_KEY_SHIFT
    if lora_id:
        key = [k & _TOKEN_MASK for k in key]
    return KeyParts(key, lora_id, long_rope)
