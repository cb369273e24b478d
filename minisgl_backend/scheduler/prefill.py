"""Admission and chunked prefill.

Requests wait in arrival order. A request is admitted only when a table row is free and the KV
it could ever need (whole prompt + max_tokens, minus its cached prefix) fits beside what the
running requests have reserved, so admitted requests can always finish. The later samples of a
request with n > 1 are held back (others pass them) until the first sample's prompt is computed
and in the prefix cache, so that they share its KV instead of computing the prompt again.
Each step computes at most `chunk_size` prompt tokens; a request cut by the budget continues
first in the next step.
"""

from __future__ import annotations

from collections import deque

from minisgl_backend.core import Req
from minisgl_backend.scheduler.cache import CacheManager, pages_for
from minisgl_backend.scheduler.lora import AdapterSlots
from minisgl_backend.scheduler.table import RowAllocator


class PrefillManager:
    def __init__(self, cache: CacheManager, rows: RowAllocator, chunk_size: int,
                 max_running: int, loras: AdapterSlots | None = None) -> None:
        self.cache = cache
        self.loras = loras
        self.rows = rows
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # admitted, prompt partly computed
        # Running requests computed whole again (a LongRoPE crossing), first served. One
        # holds no pages (`cache_handle` None) until its KV fits and its restart starts.
        self.restarting: deque[Req] = deque()

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def schedule(self, decoding: list[Req]) -> tuple[list[Req], list[Req]]:
        """(requests of this prefill step with `device_len` set, the newly admitted ones)."""
        if self.chunked is None and not self.waiting and not self.restarting:
            return [], []
        budget = self.chunk_size
        batch: list[Req] = []
        restarts = list(self.restarting)
        running = [*decoding, *(r for r in restarts if r.cache_handle is not None)]
        if self.chunked is not None:
            running.append(self.chunked)
            budget -= self._take_chunk(self.chunked, budget)
            batch.append(self.chunked)
        reserved = sum(self._future_pages(r) for r in running)
        for req in restarts:
            if budget <= 0:
                break
            if req.cache_handle is None:  # its restart starts if its KV fits (else it waits)
                need = self._take_cached_prefix(req, reserved)
                if need is None:
                    break
                reserved += need
            budget -= self._take_chunk(req, budget)
            batch.append(req)
            if req.prompt_done:
                self.restarting.remove(req)
        # Restarts still waiting hold rows, and admissions leave room for their KV.
        reserved += sum(self._future_pages(r) for r in self.restarting
                        if r.cache_handle is None)
        admitted: list[Req] = []
        num_running = len(decoding) + len(restarts) + (self.chunked is not None)
        held: list[Req] = []
        while budget > 0 and self.waiting and num_running < self.max_running:
            req = self.waiting[0]
            if not _first_sample_cached(req):
                held.append(self.waiting.popleft())
                continue
            need = self._admit(req, reserved)
            if need is None:
                break  # first come, first served: later requests wait behind this one
            self.waiting.popleft()
            reserved += need
            num_running += 1
            admitted.append(req)
            budget -= self._take_chunk(req, budget)
            batch.append(req)
        self.waiting.extendleft(reversed(held))
        self.chunked = next((r for r in batch if not r.prompt_done
                             and r not in self.restarting), None)
        return batch, admitted

    def _future_pages(self, req: Req) -> int:
        return pages_for(req.max_device_len, self.cache.page_size) - len(req.pages)

    def _admit(self, req: Req, reserved: int) -> int | None:
        """Give `req` a row and its cached prefix if its KV fits; return its future pages."""
        if self.rows.num_free == 0:
            return None
        if req.lora_id and not (self.loras is not None and self.loras.can_acquire(req.lora_id)):
            return None  # every adapter slot is held by running requests of other adapters
        req.long_rope = self.cache.takes_long_rope(req.prompt_len)
        need = self._take_cached_prefix(req, reserved)
        if need is None:
            return None
        if req.lora_id and self.loras is not None:
            req.lora_slot, req.lora_load = self.loras.acquire(req.lora_id)
        req.table_idx = self.rows.allocate()
        req.prefix_hit_len = req.cached_len
        req.reused_pages = len(req.pages)
        return need

    def _take_cached_prefix(self, req: Req, reserved: int) -> int | None:
        """If the KV `req` could ever need fits beside `reserved` pages, start its prefill
        after its cached prefix (locked) and return its future pages; else None."""
        match = self.cache.match(req)
        need = pages_for(req.max_device_len, self.cache.page_size) - len(match.pages)
        if need > self.cache.available_pages - reserved:
            self.cache.prefix_cache.unlock(match.handle)
            return None
        req.cache_handle = match.handle
        req.cached_len = req.device_len = match.cached_len
        req.pages = list(match.pages)
        req.pages_sent = 0
        return need

    def _take_chunk(self, req: Req, budget: int) -> int:
        size = min(budget, req.prefill_len - req.cached_len)
        req.device_len = req.cached_len + size
        return size

    @property
    def has_work(self) -> bool:
        return self.chunked is not None or bool(self.restarting) or any(
            _first_sample_cached(r) for r in self.waiting)

    def restart(self, req: Req) -> None:
        """Compute a running request whole again (its KV restarted: `CacheManager.restart_long`)."""
        self.restarting.append(req)

    def remove(self, req: Req) -> bool:
        """Drop a request that has not finished its prompt (aborted); True if it was here."""
        if self.chunked is req:
            self.chunked = None
            return True
        if req in self.restarting:
            self.restarting.remove(req)
            return True
        try:
            self.waiting.remove(req)
        except ValueError:
            return False
        return True


def _first_sample_cached(req: Req) -> bool:
    """False while `req` is a later sample whose first sample has not finished its prompt."""
    first = req.wait_for
    return first is None or first.cached_len >= first.prompt_len
