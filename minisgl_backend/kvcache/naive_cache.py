"""A prefix cache that caches nothing (every request computes its whole prompt)."""

from __future__ import annotations

from collections.abc import Sequence

from minisgl_backend.kvcache.base import BasePrefixCache, CacheHandle, InsertResult, MatchResult


class NaiveCacheHandle(CacheHandle):
    """The only handle of a `NaivePrefixCache`; covers nothing."""

    __slots__ = ()


class NaivePrefixCache(BasePrefixCache):
    """No prefix sharing: never matches, takes no pages, has nothing to evict."""

    def __init__(self, page_size: int = 1) -> None:
        """Create an empty cache for pages of `page_size` tokens."""
        super().__init__(page_size)
        self._handle = NaiveCacheHandle(0)

    def match(self, token_ids: Sequence[int]) -> MatchResult:
        """Always a miss: cached_len 0, no pages."""
        return MatchResult(self._handle, 0, [])

    def lock(self, handle: CacheHandle) -> None:
        """No-op (nothing is cached)."""
        self._check_handle(handle)

    def unlock(self, handle: CacheHandle) -> None:
        """No-op (nothing is cached)."""
        self._check_handle(handle)

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Take nothing: `already_cached_len == len(token_ids)`, the caller keeps all its pages."""
        self._validate_insert(token_ids, pages)
        return InsertResult(self._handle, len(token_ids))

    def evict(self, num_pages: int) -> list[int]:
        """Return [] for 0 pages; any positive request cannot be met and raises RuntimeError."""
        self._validate_evict(num_pages)
        if num_pages == 0:
            return []
        raise RuntimeError(
            f"cannot evict {num_pages} pages: the naive cache holds none (short by {num_pages})"
        )

    def reset(self) -> list[int]:
        """Nothing to drop: []."""
        return []

    @property
    def evictable_pages(self) -> int:
        """Always 0."""
        return 0

    @property
    def protected_pages(self) -> int:
        """Always 0."""
        return 0

    def all_pages(self) -> list[int]:
        """Always []."""
        return []

    def check_invariants(self) -> None:
        """Nothing to check beyond the handle still covering nothing."""
        assert self._handle.cached_len == 0, "naive handle must cover nothing"

    def _check_handle(self, handle: CacheHandle) -> None:
        """Raise TypeError for handles from another cache type."""
        if not isinstance(handle, NaiveCacheHandle):
            raise TypeError(f"expected a NaiveCacheHandle, got {type(handle).__name__}")
