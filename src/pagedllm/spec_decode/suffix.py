"""Suffix decoding: drafts from the request's own tokens and from a bounded pool of the
recent requests of the same tenant, the continuation most of their matches share.

Each finished request's prompt and output join its tenant's pool (``cache_salt``; no salt
is a tenant of its own), the oldest leaving past ``max_cached_requests``: one tenant's
text never drafts for another's request. A lookup finds the longest n-gram ending the
request (``min_n <= n <= max_n``) in its own tokens and in the pool, then walks the
matches forward one token at a time, keeping the token most of the surviving matches
continue with, and stops where that token's share falls below ``min_token_prob``::

    matches   ... a b c | x y z          the request ends "a b c"
              ... a b c | x y w
              ... a b c | q
    drafts    x y (z or w: a share of 1/2 each, drafted while >= min_token_prob)
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pagedllm.core.request import Request
from pagedllm.spec_decode.ngram import NgramProposer, continuation

# Pool matches walked per lookup: the most recent ones (a common n-gram may have many).
MAX_MATCHES = 32


@dataclass(slots=True)
class _Pool:
    """One tenant's recent requests and where each of their n-grams ends."""

    docs: dict[int, tuple[int, ...]] = field(default_factory=dict)
    order: deque[int] = field(default_factory=deque)  # doc ids, oldest first
    # n-gram -> (doc id, end position) of each occurrence, oldest first.
    ends: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)


class SuffixProposer:
    """``DraftProposer`` over each request's own tokens and its tenant's recent requests."""

    def __init__(
        self, min_n: int, max_n: int, max_cached_requests: int, min_token_prob: float
    ) -> None:
        # Each request's own text is looked up exactly as prompt lookup does it.
        self._own = NgramProposer(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self._pools: dict[str | None, _Pool] = {}
        self._next_doc = 0

    # ---- DraftProposer ----------------------------------------------------------------

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(r, k) for r, k in zip(requests, max_tokens, strict=True)]

    def propose_one(self, request: Request, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts for ``request``."""
        if num_tokens <= 0:
            return []
        tokens = request.all_token_ids
        own = self._own.index_of(request).find(tokens)
        pool = self._pools.get(request.cache_salt)
        pooled = self._pool_matches(pool, tokens, min_n=own[1] if own else self.min_n)
        if not pooled:
            return [] if own is None else continuation(tokens, own[0], num_tokens)
        assert pool is not None
        texts = [pool.docs[doc][end + 1 :] for doc, end in pooled]
        if own is not None:
            texts.append(tuple(continuation(tokens, own[0], num_tokens)))
        return self._walk(texts, num_tokens)

    def request_finished(self, request: Request) -> None:
        self._own.request_finished(request)
        if self.max_cached_requests:
            self.add_text(request.cache_salt, request.all_token_ids)

    # ---- the pool ---------------------------------------------------------------------

    def add_text(self, cache_salt: str | None, tokens: Sequence[int]) -> None:
        """Add a finished request's tokens to its tenant's pool (the oldest may leave)."""
        pool = self._pools.setdefault(cache_salt, _Pool())
        doc = self._next_doc
        self._next_doc += 1
        text = tuple(tokens)
        pool.docs[doc] = text
        pool.order.append(doc)
        for key, last in self._ngram_ends(text):
            pool.ends.setdefault(key, []).append((doc, last))
        while len(pool.order) > self.max_cached_requests:
            self._evict(pool)

    def num_cached_requests(self, cache_salt: str | None) -> int:
        pool = self._pools.get(cache_salt)
        return 0 if pool is None else len(pool.order)

    @property
    def num_tracked(self) -> int:
        """Running requests whose own index is kept (tests: none is left behind)."""
        return self._own.num_tracked

    # ---- internal ---------------------------------------------------------------------

    def _ngram_ends(self, text: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], int]]:
        """Each n-gram of ``text`` (``min_n`` to ``max_n`` long) with the position it ends
        at; an n-gram ending the text has no continuation and is left out."""
        for last in range(len(text) - 1):
            for n in range(self.min_n, min(self.max_n, last + 1) + 1):
                yield text[last + 1 - n : last + 1], last

    def _pool_matches(
        self, pool: _Pool | None, tokens: Sequence[int], min_n: int
    ) -> list[tuple[int, int]]:
        """The pool's most recent occurrences of the longest n-gram (at least ``min_n``)
        ending ``tokens``."""
        if pool is None:
            return []
        length = len(tokens)
        for n in range(self.max_n, max(min_n, self.min_n) - 1, -1):
            if n <= length:
                found = pool.ends.get(tuple(tokens[length - n :]))
                if found:
                    return found[-MAX_MATCHES:]
        return []

    def _walk(self, texts: list[Sequence[int]], num_tokens: int) -> list[int]:
        """The continuation most ``texts`` share, token by token, while the chosen token's
        share of the texts still in agreement is at least ``min_token_prob``."""
        drafts: list[int] = []
        alive = texts
        total = len(texts)
        for depth in range(num_tokens):
            counts = Counter(t[depth] for t in alive if len(t) > depth)
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            if count < self.min_token_prob * total:
                break
            drafts.append(token)
            alive = [t for t in alive if len(t) > depth and t[depth] == token]
            total = len(alive)
        return drafts

    def _evict(self, pool: _Pool) -> None:
        doc = pool.order.popleft()
        text = pool.docs.pop(doc)
        ends = pool.ends
        for key, _ in self._ngram_ends(text):
            found = ends.get(key)
            if found is None:
                continue
            # Oldest first: this document's entries lead the list.
            cut = 0
            while cut < len(found) and found[cut][0] == doc:
                cut += 1
            if cut == len(found):
                del ends[key]
            elif cut:
                del found[:cut]
