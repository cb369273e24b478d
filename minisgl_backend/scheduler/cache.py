"""Page allocation on top of a prefix cache (the scheduler's view of the KV pool).

Every page is in exactly one place: the free list, the prefix cache, or the `owned_pages` of one
running request. `check_accounting` verifies it (the scheduler calls it after every step in debug
mode).
"""

from __future__ import annotations

from typing import Iterable

from minisgl_backend.core import Req, wants_context_logits
from minisgl_backend.kvcache import BasePrefixCache, CacheHandle, MatchResult
from minisgl_backend.kvcache.keys import cache_key


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: BasePrefixCache,
                 long_rope_from: int = 0) -> None:
        """`long_rope_from`: the model's LongRoPE pretraining length (0: not LongRoPE)."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.long_rope_from = long_rope_from
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self.evicted_pages = 0  # pages taken back from the prefix cache so far

    @property
    def available_pages(self) -> int:
        """Pages that could be handed out now (free, or evictable from the prefix cache)."""
        return len(self.free_pages) + self.prefix_cache.evictable_pages

    def takes_long_rope(self, length: int) -> bool:
        """Whether a prefill of `length` tokens takes LongRoPE's long frequencies (HF's rule:
        the forward's sequence is past the pretraining length)."""
        return 0 < self.long_rope_from < length

    def short_rope_room(self, req: Req) -> int:
        """Positions `req` may still compute before it must be computed again (`restart_long`):
        KV in LongRoPE's short frequencies covers positions below the pretraining length only.
        Without LongRoPE, or once long, the request's whole reservation."""
        if self.long_rope_from == 0 or req.long_rope:
            return req.max_device_len - req.cached_len
        return self.long_rope_from - req.cached_len

    def _key(self, req: Req, length: int) -> list[int]:
        """The prefix cache's key of `req`'s first `length` tokens (`kvcache.keys`: a prefix
        hit never mixes KV of another adapter or frequency set)."""
        return cache_key(req.input_ids[:length], req.lora_id, req.long_rope)

    def match(self, req: Req) -> MatchResult:
        """Longest cached prefix of the prefill, leaving at least one token to compute; locked.
        Nothing for a request that returns its prompt's logits: it computes every token."""
        usable = 0 if wants_context_logits(req) else req.prefill_len - 1
        match = self.prefix_cache.match(self._key(req, usable))
        self.prefix_cache.lock(match.handle)
        return match

    def restart_long(self, req: Req) -> None:
        """A LongRoPE request crossed the pretraining length: HF computes it whole again with
        the long frequencies. Its short-frequency KV goes to the prefix cache (for requests
        that stay short) and it holds no pages until its restart starts
        (`PrefillManager.schedule`: from a long-frequency cached prefix, over every token so
        far). Holding none meanwhile, it can always start once the running requests end."""
        self.release(req, cache=True)
        req.long_rope = True
        req.prefill_len = len(req.input_ids)
        req.cached_len = req.device_len = 0
        req.pages = []
        req.pages_sent = 0

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_pages):
            evicted = self.prefix_cache.evict(count - len(self.free_pages))
            self.evicted_pages += len(evicted)
            self.free_pages.extend(evicted)
        pages = self.free_pages[-count:] if count else []
        del self.free_pages[len(self.free_pages) - count :]
        return pages

    def free(self, pages: Iterable[int]) -> None:
        self.free_pages.extend(pages)

    def grow(self, req: Req) -> None:
        """Allocate the pages `req` needs to hold `device_len` tokens."""
        missing = pages_for(req.device_len, self.page_size) - len(req.pages)
        if missing <= 0:  # the common decode case: the last page has room
            return
        pages = self.allocate(missing)
        req.pages.extend(pages)
        req.owned_pages.update(pages)

    def cache_prefix(self, req: Req) -> None:
        """Share the page-aligned computed prefix of a running request through the prefix cache.

        When another request cached part of the same tokens meanwhile (two prompts with one
        chat template admitted together, say), this request's row points at its own copies of
        that part, which it keeps until it ends (freeing them would let another request
        overwrite live KV); the rest is inserted after the cache's copies as long as those are
        locked already (by the request that cached them). Were they evictable, locking them
        would take pages that admitted requests were promised: then `release` caches the
        prefix instead.
        """
        length = req.cached_len - req.cached_len % self.page_size
        if length <= req.cache_handle.cached_len:
            return
        shared = self.prefix_cache.match(self._key(req, length))
        if shared.cached_len > req.cache_handle.cached_len and not self._locked(shared.handle):
            return
        handle = self._insert(req, length)
        self.prefix_cache.lock(handle)
        self.prefix_cache.unlock(req.cache_handle)
        req.cache_handle = handle

    def _locked(self, handle: CacheHandle) -> bool:
        """Whether every page on the path to `handle` is locked (locking it takes nothing)."""
        before = self.prefix_cache.evictable_pages
        self.prefix_cache.lock(handle)
        unchanged = self.prefix_cache.evictable_pages == before
        self.prefix_cache.unlock(handle)
        return unchanged

    def _insert(self, req: Req, length: int) -> CacheHandle:
        """Insert the first `length` tokens; the pages the cache takes leave `owned_pages`."""
        result = self.prefix_cache.insert(self._key(req, length),
                                          req.pages[: length // self.page_size])
        taken = req.pages[result.already_cached_len // self.page_size : length // self.page_size]
        req.owned_pages.difference_update(taken)
        return result.handle

    def release(self, req: Req, cache: bool) -> None:
        """A request ended: optionally cache its computed prefix, then free what it still owns."""
        if cache:
            self._insert(req, req.cached_len - req.cached_len % self.page_size)
        self.prefix_cache.unlock(req.cache_handle)
        self.free(req.owned_pages)
        req.owned_pages = set()
        req.cache_handle = None

    def check_accounting(self, running: Iterable[Req]) -> None:
        """free + cached + owned by running requests == total, with no page in two places."""
        self.prefix_cache.check_invariants()
        owned = [p for req in running for p in req.owned_pages]
        places = [*self.free_pages, *self.prefix_cache.all_pages(), *owned]
        assert len(places) == self.num_pages, (
            f"page accounting: free {len(self.free_pages)} + cached "
            f"{self.prefix_cache.cached_pages} + in use {len(owned)} != total {self.num_pages}"
        )
        assert len(set(places)) == self.num_pages, "page accounting: a page is in two places"
