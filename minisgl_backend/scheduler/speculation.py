"""Which decode rows verify draft tokens in a step, and what a verify step's samples mean.

A row with k drafts computes its last sampled token and the k drafts in one extend against
its paged KV and samples a token at each of those k + 1 positions (its "slots"), each with
the seed of its position, as the non-speculative steps would. The drafts equal to what was
sampled before them are kept, plus the token sampled after the last kept one: the output is
exactly the non-speculative output (greedy or seeded). The KV of rejected drafts lies past
the row's new length: never cached, overwritten by the next tokens.

Drafts come from the proposer (`speculative`), and for guided rows from the grammar when it
forces a continuation (jump-forward, `jump_forward`), cut at the first token the grammar
rejects. Steps with more rows than `speculative_max_batch_size` do not speculate; a request
gets only the drafts likely enough to be kept (`draft_length`), so that a verify step computes
few tokens in vain; after a step in which no row had a draft (and none is guided), the next
tries wait a few steps (doubling), with overlap meanwhile.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from minisgl_backend.core import Req
from minisgl_backend.speculative import SpeculativeConfig, accepted_drafts, create_proposer

# A request's acceptance rate is estimated as if its drafts had been kept this many times more
# than they were: a new request drafts in full, one whose drafts are all rejected stops after
# a few verify steps, and one whose drafts are kept at 0.6 is rarely stopped by bad luck.
PRIOR_KEPT = 2
MAX_BACKOFF = 64  # decode steps at most between two tries when nothing could be drafted


class Speculator:
    def __init__(self, config: SpeculativeConfig, jump_forward: bool, max_drafts: int,
                 room: Callable[[Req], int] | None = None, device_type: str = "cpu",
                 synthetic_acceptance: float | None = None) -> None:
        """`max_drafts`: what the engine was sized for (`EngineConfig.samples_per_row` - 1).
        `room(req)`: the positions a request may compute before its KV restarts (LongRoPE's
        crossing, `CacheManager.short_rope_room`); a verify row stays within them.
        `device_type`: the engine's ("cpu", "cuda"), for `speculative_min_acceptance`.
        `synthetic_acceptance`: benchmarks of random weights (`EngineHooks`)."""
        self.config = config
        self.min_acceptance = config.min_acceptance(device_type)
        self.room = room
        self.jump_forward = jump_forward and max_drafts > 0
        self.max_drafts = min(max_drafts, config.num_speculative_tokens)
        self.proposer = create_proposer(config)
        self._synthetic = (None if synthetic_acceptance is None
                           else (synthetic_acceptance, random.Random(0)))
        # Steps whose rows got no drafts back off (doubling, up to MAX_BACKOFF steps) before
        # drafting is tried again, so that a batch with nothing to draft keeps overlap.
        self._misses = 0
        self._resume_step = 0
        self.verified_rows = 0  # rows that verified drafts, summed over steps
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of those, kept

    def may_draft(self, running: int, guided: bool, step: int) -> bool:
        """Whether decode step number `step`, of `running` rows, may verify drafts (the
        tokens of the step before are then needed before it is built: no overlap)."""
        return ((self.proposer is not None or (self.jump_forward and guided))
                and self.max_drafts > 0 and running <= self.config.speculative_max_batch_size
                and step >= self._resume_step)

    def draft(self, batch: list[Req], no_drafts: set[int], step: int) -> None:
        """Give each row of decode step `step` its drafts (`Req.drafts`; rows in `no_drafts`,
        uids, get none) and extend its `device_len` by them."""
        for req in batch:
            req.drafts = [] if req.uid in no_drafts else self._drafts(req)
            req.device_len += len(req.drafts)
        # Guided rows keep trying: their grammar forces tokens now and then (jump-forward).
        if any(req.drafts for req in batch) or (
                self.jump_forward and any(req.guide is not None for req in batch)):
            self._misses = 0
        else:
            self._misses += 1
            self._resume_step = step + min(1 << self._misses, MAX_BACKOFF)

    def new_requests(self) -> None:
        """Requests were admitted: drafting is worth trying again at once."""
        self._misses = self._resume_step = 0

    def _drafts(self, req: Req) -> list[int]:
        # The row's tokens after the drafts stay within max_tokens (what admission reserved).
        limit = min(self.max_drafts, req.sampling_params.max_tokens - len(req.output_ids) - 1)
        if self.room is not None:  # the last sampled token takes a position too
            limit = min(limit, self.room(req) - 1)
        if limit <= 0:
            return []
        drafts: list[int] = []
        if req.guide is not None and self.jump_forward:
            drafts = req.guide.forced_tokens()[:limit]
        if not drafts and self.proposer is not None:
            limit = min(limit, self.draft_length(req))
            drafts = self.proposer.propose(req.uid, req.input_ids, limit) if limit else []
            if not drafts and self._synthetic is not None:  # benchmarks: always draft
                drafts = [req.input_ids[-1]] * limit
        if req.guide is not None and drafts:
            drafts = drafts[: req.guide.valid_prefix(drafts)]
        return drafts

    def draft_length(self, req: Req) -> int:
        """How many proposed drafts `req` is sent: each draft token only while its chance of
        being kept, the request's acceptance rate (`acceptance_rate`) to the power of its
        place, reaches `speculative_min_acceptance` (`min_acceptance`). A rate below it sends
        none: the request stops speculating."""
        floor = self.min_acceptance
        rate = acceptance_rate(req)
        length, chance = 0, rate
        while length < self.max_drafts and chance >= floor:
            length, chance = length + 1, chance * rate
        return length

    def settle(self, req: Req, sampled: list[int]) -> list[int]:
        """The tokens a verify row keeps from its slots' samples (at least one); its lengths
        roll back past the rejected drafts."""
        drafts = req.drafts
        if self._synthetic is not None and drafts:
            rate, rng = self._synthetic
            kept = next((i for i in range(len(drafts)) if rng.random() >= rate), len(drafts))
            tokens = drafts[:kept] + [sampled[kept]]
        else:
            kept = accepted_drafts(drafts, sampled)
            tokens = sampled[: kept + 1]
        rejected = len(drafts) - kept
        req.cached_len -= rejected
        req.device_len = req.cached_len
        req.explicit = rejected > 0
        req.drafted += len(drafts)
        req.accepted += kept
        # The acceptance rate is judged on the drafts that met a verdict: the kept ones and
        # the first rejected one. The drafts after it were never compared, so counting them
        # would take a proposer whose every draft has a 0.6 chance for one of about 0.33.
        req.judged += kept + (rejected > 0)
        if drafts:
            self.verified_rows += 1
            self.drafted += len(drafts)
            self.accepted += kept
        req.drafts = []
        return tokens

    def finish(self, req: Req) -> None:
        if self.proposer is not None:
            self.proposer.finish(req.uid, req.input_ids)


def acceptance_rate(req: Req) -> float:
    """The chance that one of `req`'s drafts is kept, given those before it were: kept drafts
    over drafts that met a verdict (`Req.judged`), with `PRIOR_KEPT` kept ones added."""
    return (req.accepted + PRIOR_KEPT) / (req.judged + PRIOR_KEPT)
