"""The prefix-cache interface shared by every cache implementation.

A prefix cache maps token-id sequences to the ids of the KV-pool pages that hold their keys and
values. The pool is split into pages of `page_size` tokens; a cached sequence of `n` tokens (a
multiple of `page_size`) owns `n // page_size` page ids, and matching only ever covers whole pages.

Ownership contract between a cache and its caller (the scheduler):

* `match` finds the longest cached page-aligned prefix; the returned pages still belong to the
  cache and may be evicted unless the caller `lock`s the handle.
* `insert` takes ownership of the caller's pages for the part of the sequence that was not cached
  yet and reports `already_cached_len`: the caller's pages for tokens `[0, already_cached_len)`
  are duplicates the cache did NOT take, and the caller must free them itself when safe.
* `evict` removes unlocked entries and hands their page ids back to the caller to free.
* `reset` drops every entry (none may be locked) and hands all their page ids back.

A cache given `events` (a `CacheEvents`) tells it about every page that enters or leaves it.

Everything here is pure Python: token ids and page ids are plain ints.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol


class CacheHandle:
    """An opaque reference to a cached prefix; only the cache that issued it may interpret it.

    `cached_len` is the number of tokens the handle covers (a multiple of the page size).
    """

    __slots__ = ("cached_len",)

    def __init__(self, cached_len: int) -> None:
        self.cached_len = cached_len

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cached_len={self.cached_len})"


class MatchResult(NamedTuple):
    """The result of `BasePrefixCache.match`."""

    handle: CacheHandle
    cached_len: int
    """Matched tokens, a multiple of the page size."""
    pages: list[int]
    """Page ids of the matched tokens, `len(pages) == cached_len // page_size`."""


class InsertResult(NamedTuple):
    """The result of `BasePrefixCache.insert`."""

    handle: CacheHandle
    """Covers the whole inserted sequence (for caches that store it)."""
    already_cached_len: int
    """Tokens `[0, already_cached_len)` were cached before the insert: the caller's pages for them
    were not taken and the caller still owns (and must free) them; its pages for the rest now
    belong to the cache."""


def as_token_list(token_ids: Sequence[int] | Any) -> list[int]:
    """Return `token_ids` as a plain list of ints (accepts lists, tuples, arrays, tensors)."""
    if isinstance(token_ids, list):
        return token_ids
    tolist = getattr(token_ids, "tolist", None)
    if tolist is not None:
        converted: list[int] = tolist()
        return converted
    return list(token_ids)


class CacheEvents(Protocol):
    """What a prefix cache reports of its pages, in the order it happens (the KV-cache events
    follow it: `minisgl_backend.kv_events`). Called on the cache's thread: keep it cheap."""

    def stored(self, parent_page: int | None, key: list[int], pages: list[int]) -> None:
        """`pages` now hold `key` (one page per `page_size` of it), following `parent_page`
        (the page before them in the cached sequence; None: they start it)."""

    def removed(self, pages: list[int]) -> None:
        """`pages` left the cache (evicted)."""

    def cleared(self) -> None:
        """Every page left the cache (a reset)."""


class BasePrefixCache(ABC):
    """Abstract page-aligned prefix cache over a paged KV pool."""

    page_size: int

    def __init__(self, page_size: int = 1) -> None:
        """Validate and store the page size (tokens per KV page)."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.events: CacheEvents | None = None  # None: nobody listens, no event work at all

    # ----------------------------------------------------------------------------- operations
    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> MatchResult:
        """The longest cached page-aligned prefix of `token_ids` (its path's LRU times refreshed;
        not locked)."""

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's prefix from eviction (nestable; undo with `unlock`)."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Release one `lock` of the handle's prefix."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Cache `token_ids` stored in `pages` (one page id per `page_size` tokens).

        Raises ValueError if `len(token_ids)` is not a multiple of the page size or
        `len(pages) != len(token_ids) // page_size`. Never frees or returns the caller's
        duplicate pages; see `InsertResult.already_cached_len`.
        """

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Evict unlocked entries, least recently used first, until >= `num_pages` pages are freed;
        return their ids. RuntimeError (evicting nothing) when fewer are evictable."""

    @abstractmethod
    def reset(self) -> list[int]:
        """Drop every entry and return their page ids. RuntimeError (dropping nothing) while
        any entry is locked."""

    # ---------------------------------------------------------------------------- accounting
    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages held in unlocked entries."""

    @property
    @abstractmethod
    def protected_pages(self) -> int:
        """Pages held in locked entries."""

    @property
    def cached_pages(self) -> int:
        """All pages the cache holds (evictable + protected)."""
        return self.evictable_pages + self.protected_pages

    @abstractmethod
    def all_pages(self) -> list[int]:
        """Every page id held by the cache (for accounting checks)."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if any internal accounting is inconsistent."""

    # ------------------------------------------------------------------------------- helpers
    def _validate_insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> None:
        """Raise ValueError unless `token_ids`/`pages` describe whole pages consistently."""
        num_tokens, num_pages = len(token_ids), len(pages)
        if num_tokens % self.page_size != 0:
            raise ValueError(
                f"len(token_ids)={num_tokens} is not a multiple of page_size={self.page_size}"
            )
        if num_pages != num_tokens // self.page_size:
            raise ValueError(
                f"len(pages)={num_pages} must equal len(token_ids) // page_size "
                f"= {num_tokens // self.page_size}"
            )

    @staticmethod
    def _validate_evict(num_pages: int) -> None:
        """Raise ValueError for a negative eviction request."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
