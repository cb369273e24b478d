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
        """Every running request that may still sample a token. With overlap, a request whose
        last allowed token is being sampled by the step in flight is left out (not yet removed
        only because that step's tokens were not read)."""
        batch = [req for req in self.running.values()
                 if req.cached_len + 1 - req.prompt_len < req.sampling_params.max_tokens]
        for req in batch:
            req.device_len = req.cached_len + 1
        return batch
