"""`suffix` drafts (suffix decoding): the most frequent continuation of the request's latest
tokens among its own tokens and recent requests' tokens, extended token by token.

The structure is a table of contexts (the last 1..depth tokens) -> counts of the token that
followed, over the stored sequences: one per running request (its prompt and output, grown as it
decodes) and the finished requests' sequences, oldest dropped first beyond `max_tokens`. Each
stored token adds at most `depth` context entries, so memory is bounded by about
`depth x 150` bytes per stored token (Python dicts and tuples).
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class ContextCounts:
    """contexts of 1..depth tokens -> Counter of the next token, over added sequences."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.table: dict[tuple[int, ...], Counter[int]] = {}

    def add(self, tokens: list[int], start: int = 1, sign: int = 1) -> None:
        """Count (or, with sign -1, uncount) the continuations of tokens[start:]."""
        for i in range(max(start, 1), len(tokens)):
            for n in range(1, min(self.depth, i) + 1):
                key = tuple(tokens[i - n : i])
                counter = self.table.get(key)
                if counter is None:
                    counter = self.table[key] = Counter()
                counter[tokens[i]] += sign
                if counter[tokens[i]] <= 0:
                    del counter[tokens[i]]
                    if not counter:
                        del self.table[key]

    def next_counts(self, context: list[int]) -> tuple[int, Counter[int]]:
        """(n, counts) for the longest suffix of `context` (n tokens) with a continuation."""
        for n in range(min(self.depth, len(context)), 0, -1):
            counter = self.table.get(tuple(context[-n:]))
            if counter:
                return n, counter
        return 0, Counter()


class SuffixProposer:
    """Drafts from running and recent requests' tokens (see the module docstring)."""

    DEPTH = 8

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.history = ContextCounts(self.DEPTH)  # finished requests' sequences
        self.stored: OrderedDict[int, list[int]] = OrderedDict()  # uid -> sequence, oldest first
        self.stored_tokens = 0
        self.running: dict[int, tuple[ContextCounts, int]] = {}  # uid -> (own counts, seen)

    def propose(self, uid: int, tokens: list[int], limit: int) -> list[int]:
        own, seen = self.running.get(uid) or (ContextCounts(self.DEPTH), 0)
        own.add(tokens, start=seen)
        self.running[uid] = (own, len(tokens))
        context, drafts = list(tokens[-self.DEPTH :]), []
        while len(drafts) < limit:
            token = self._most_frequent_next(own, context)
            if token is None:
                break
            drafts.append(token)
            context = context[1:] + [token] if len(context) >= self.DEPTH else context + [token]
        return drafts

    def _most_frequent_next(self, own: ContextCounts, context: list[int]) -> int | None:
        n_own, own_counts = own.next_counts(context)
        n_hist, hist_counts = self.history.next_counts(context)
        if n_own == 0 and n_hist == 0:
            return None
        # The longer matched context is the better evidence; equal lengths pool their counts.
        if n_own > n_hist:
            counts = own_counts
        elif n_hist > n_own:
            counts = hist_counts
        else:
            counts = own_counts + hist_counts
        return max(counts.items(), key=lambda item: (item[1], -item[0]))[0]

    def finish(self, uid: int, tokens: list[int]) -> None:
        """The request ended: its sequence joins the history (bounded by `max_tokens`)."""
        self.running.pop(uid, None)
        if self.max_tokens <= 0 or len(tokens) < 2:
            return
        tokens = list(tokens[-self.max_tokens :])
        self.history.add(tokens)
        self.stored[uid] = tokens
        self.stored_tokens += len(tokens)
        while self.stored_tokens > self.max_tokens:
            _, old = self.stored.popitem(last=False)
            self.history.add(old, sign=-1)
            self.stored_tokens -= len(old)
