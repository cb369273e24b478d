"""Draft-free speculative decoding: settings and the draft proposers the scheduler uses."""

from __future__ import annotations

from typing import Protocol

from minisgl_backend.speculative.config import METHODS, SpeculativeConfig


class Proposer(Protocol):
    def propose(self, uid: int, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow `tokens` (request `uid`'s prompt and output)."""

    def finish(self, uid: int, tokens: list[int]) -> None:
        """Request `uid` ended with `tokens`."""


def create_proposer(config: SpeculativeConfig) -> Proposer | None:
    if config.speculative == "ngram":
        from minisgl_backend.speculative.ngram import NgramProposer

        return NgramProposer(config.speculative_ngram_max, config.speculative_ngram_min)
    if config.speculative == "suffix":
        from minisgl_backend.speculative.suffix import SuffixProposer

        return SuffixProposer(config.speculative_suffix_tokens)
    return None


def accepted_drafts(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts a verify step accepts: the longest prefix equal to the tokens the target
    sampled at those positions (`sampled` has one token more: the one after the last draft).
    Sampling each position with its own seed keeps the output exactly the non-speculative one:
    a draft is kept when the target would have sampled it anyway."""
    count = 0
    while count < len(drafts) and drafts[count] == sampled[count]:
        count += 1
    return count


__all__ = ["METHODS", "Proposer", "SpeculativeConfig", "accepted_drafts", "create_proposer"]
