"""N-gram prompt lookup: the tokens that followed the last time the sequence's own last n
tokens appeared (in its prompt or its output), the longest n first.

    tokens   ... a b c d x y ... a b c d |          last 4 tokens: a b c d
                         ^ latest earlier occurrence ends here
    drafts   x y ...                              what followed it

Each request keeps an index (``NgramIndex``) from every n-gram to where it last ended,
extended as tokens arrive, so a lookup costs a few dictionary reads, not a scan of the
context.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.request import Request


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n``) of one token sequence last ended."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # the longest first
        self._ends: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: Sequence[int], end: int) -> None:
        """Index the n-grams of ``tokens`` that end at positions ``num_indexed .. end - 1``."""
        ends, sizes = self._ends, self.sizes
        for last in range(self.num_indexed, end):
            for n in sizes:
                if last + 1 >= n:
                    ends[tuple(tokens[last + 1 - n : last + 1])] = last
        self.num_indexed = max(self.num_indexed, end)

    def find(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """``(end, n)``: the latest indexed end of the longest n-gram ending ``tokens``, or
        None when none of its sizes was seen before."""
        ends, length = self._ends, len(tokens)
        for n in self.sizes:
            if n <= length:
                end = ends.get(tuple(tokens[length - n :]))
                if end is not None:
                    return end, n
        return None


def continuation(tokens: Sequence[int], end: int, num_tokens: int) -> list[int]:
    """The ``num_tokens`` tokens after position ``end``; past the sequence's last token the
    text repeats with the period it showed (``len(tokens) - 1 - end``): a loop goes on."""
    drafts = list(tokens[end + 1 : end + 1 + num_tokens])
    period = len(tokens) - 1 - end
    while len(drafts) < num_tokens and period > 0:
        drafts.append(drafts[len(drafts) - period])
    return drafts


class NgramProposer:
    """``DraftProposer`` by prompt lookup over each request's own tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(r, k) for r, k in zip(requests, max_tokens, strict=True)]

    def propose_one(self, request: Request, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts for ``request``."""
        if num_tokens <= 0:
            return []
        tokens = request.all_token_ids
        index = self.index_of(request)
        found = index.find(tokens)
        return [] if found is None else continuation(tokens, found[0], num_tokens)

    def index_of(self, request: Request) -> NgramIndex:
        """The request's index, extended to every n-gram before its last token's."""
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = NgramIndex(self.min_n, self.max_n)
        tokens = request.all_token_ids
        index.extend(tokens, len(tokens) - 1)
        return index

    def request_finished(self, request: Request) -> None:
        self._indexes.pop(request.request_id, None)

    @property
    def num_tracked(self) -> int:
        """Requests whose index is kept (tests: none is left behind)."""
        return len(self._indexes)
