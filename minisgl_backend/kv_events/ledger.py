"""The events of the prefix cache's reports (`kvcache.CacheEvents`), and the hash of every page
the cache holds, which they need: a removed page is reported by its id, an event names it by
its hash."""

from __future__ import annotations

from collections.abc import Callable

from minisgl_backend.kv_events.hashing import chain_hashes, salt_of
from minisgl_backend.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from minisgl_backend.kvcache.keys import split_key


class BlockLedger:
    """Turns reports into events, in the order the cache made them."""

    def __init__(self, block_size: int, medium: str,
                 adapter_name: Callable[[int], str | None]) -> None:
        """`adapter_name(lora_id)`: the name of a LoRA adapter by the id its requests carry."""
        self.block_size = block_size
        self.medium = medium
        self.adapter_name = adapter_name
        self.hashes: dict[int, int] = {}  # page id -> its block's hash, for the cached pages

    def stored(self, parent_page: int | None, key: list[int], pages: list[int]) -> BlockStored:
        tokens, lora_id, long_rope = split_key(key)
        name = self.adapter_name(lora_id) if lora_id else None
        parent = None if parent_page is None else self.hashes[parent_page]
        hashes = chain_hashes(parent, tokens, self.block_size, salt_of(name, long_rope))
        self.hashes.update(zip(pages, hashes))
        return BlockStored(hashes, parent, tokens, self.block_size, lora_id or None,
                           self.medium, name)

    def removed(self, pages: list[int]) -> BlockRemoved:
        return BlockRemoved([self.hashes.pop(page) for page in pages], self.medium)

    def cleared(self) -> AllBlocksCleared:
        self.hashes.clear()
        return AllBlocksCleared()
