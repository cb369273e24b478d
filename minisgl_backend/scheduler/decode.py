"""The running requests that are past their prompt and decode one token per step."""

from __future__ import annotations

from minisgl_backend.core import Req


class DecodeManager:
    def __init__(self) -> None:
        self.running: dict[int, Req] = {}  # uid -> request, in admission order

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def add(self, req: Req) -> None:
        self.running[req.uid] = req

    def remove(self, req: Req) -> None:
        self.running.pop(req.uid, None)

    def schedule(self) -> list[Req]:
        batch = list(self.running.values())
        for req in batch:
            req.device_len = req.cached_len + 1
        return batch
