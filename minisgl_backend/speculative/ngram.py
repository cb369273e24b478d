"""`ngram` drafts (prompt lookup): the tokens that followed the latest earlier occurrence of the
request's last n tokens (the longest n that occurs) in its own prompt and output."""

from __future__ import annotations


class NgramIndex:
    """One token sequence's n-grams (n = min_n..max_n), each mapped to the start of its latest
    occurrence that has a continuation. Extended incrementally as the sequence grows."""

    def __init__(self, max_n: int, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.seen = 0  # tokens indexed so far

    def extend(self, tokens: list[int]) -> None:
        """Index what was appended to `tokens` since the last call."""
        for i in range(max(self.seen, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, i) + 1):  # n-grams ending before i
                self.latest[n][tuple(tokens[i - n : i])] = i - n
        self.seen = len(tokens)

    def continuation(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of `tokens` seen before."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.latest[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + limit]
        return []


class NgramProposer:
    """Drafts for each running request from its own tokens (`Req.input_ids`)."""

    def __init__(self, max_n: int, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, uid: int, tokens: list[int], limit: int) -> list[int]:
        index = self.indexes.get(uid)
        if index is None:
            index = self.indexes[uid] = NgramIndex(self.max_n, self.min_n)
        index.extend(tokens)
        return index.continuation(tokens, limit)

    def finish(self, uid: int, tokens: list[int]) -> None:
        """The request ended (or was aborted): forget its index."""
        self.indexes.pop(uid, None)
