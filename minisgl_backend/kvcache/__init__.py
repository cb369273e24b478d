"""Prefix caches over the paged KV pool, behind the `BasePrefixCache` interface."""

from __future__ import annotations

from minisgl_backend.kvcache.base import (BasePrefixCache, CacheEvents, CacheHandle, InsertResult,
                                          MatchResult)
from minisgl_backend.kvcache.naive_cache import NaivePrefixCache
from minisgl_backend.kvcache.radix_cache import RadixPrefixCache

_CACHE_KINDS: dict[str, type[BasePrefixCache]] = {
    "radix": RadixPrefixCache,
    "naive": NaivePrefixCache,
}


def create_prefix_cache(kind: str, page_size: int = 1) -> BasePrefixCache:
    """Build the prefix cache named `kind` ("radix" or "naive") for pages of `page_size` tokens."""
    cls = _CACHE_KINDS.get(kind)
    if cls is None:
        allowed = ", ".join(repr(k) for k in _CACHE_KINDS)
        raise ValueError(f"unknown prefix cache kind {kind!r}; allowed: {allowed}")
    return cls(page_size)


__all__ = [
    "BasePrefixCache",
    "CacheEvents",
    "CacheHandle",
    "InsertResult",
    "MatchResult",
    "NaivePrefixCache",
    "RadixPrefixCache",
    "create_prefix_cache",
]
