"""Which blocks each logged request finds cached: the engine's own hashing and manager.

Two answers per request, both in prompt tokens served from the cache:

- unbounded: every full block ever computed stays cached (a set of the engine's block
  hashes, ``core.hashing.hash_request_blocks``, salt included);
- configured: the requests replayed one after the other through a real
  ``KVCacheManager`` of the configured size (LRU eviction of cached-free blocks, tail
  blocks first), as ``pagedllm serve`` admits them when they do not overlap in time.

Both follow the engine's rules: full blocks only, and at most ``num_tokens - 1`` tokens
(one token is always computed for its logits). A request's generated tokens are cached
too, all but the last (whose K/V is never written), when the log carries them::

    |<------ prompt ------>|<-- output -->|
    |  blocks registered up to here   |x|    x: the last sampled token, never computed

A block-hash trace (Mooncake format) has one chained id per 512 tokens; unbounded, a
request hits the longest prefix of its ids already seen, capped at ``input_length``.
Replayed, each id is one block of a manager with ``block_size`` 1 (one slot standing for
512 tokens) and an unshared sentinel token last, so every id may hit, as in the trace's
own rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.hashing import hash_request_blocks
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.planner.cachelog import MOONCAKE_BLOCK_SIZE, HashTraceRequest, LoggedRequest


def computed_token_ids(request: LoggedRequest) -> tuple[int, ...]:
    """The tokens whose K/V the engine writes: the prompt and all outputs but the last."""
    if len(request.output_token_ids) < 2:
        return request.token_ids
    return request.token_ids + request.output_token_ids[:-1]


def block_hash_chains(requests: Sequence[LoggedRequest], block_size: int) -> list[list[bytes]]:
    """The engine's hashes of every full block each request computes (prompt + outputs);
    a prompt's own full blocks are the first ``len(prompt) // block_size``."""
    return [hash_request_blocks(computed_token_ids(r), block_size, r.extra_keys) for r in requests]


def unbounded_hits(
    requests: Sequence[LoggedRequest],
    block_size: int,
    chains: Sequence[Sequence[bytes]] | None = None,
) -> list[int]:
    """Cached prompt tokens of each request if no block were ever evicted (``chains``:
    ``block_hash_chains``, computed here if not given)."""
    if chains is None:
        chains = block_hash_chains(requests, block_size)
    seen: set[bytes] = set()
    hits = []
    for request, hashes in zip(requests, chains, strict=True):
        limit = (len(request.token_ids) - 1) // block_size
        n = 0
        while n < limit and hashes[n] in seen:
            n += 1
        hits.append(n * block_size)
        seen.update(hashes)
    return hits


def replayed_hits(
    requests: Sequence[LoggedRequest], block_size: int, num_blocks: int
) -> list[int | None]:
    """Cached prompt tokens of each request replayed through a ``KVCacheManager`` of
    ``num_blocks`` blocks; ``None`` for a request the cache cannot hold at all."""
    kv = KVCacheManager(num_blocks, block_size)
    return [_replay_one(kv, request) for request in requests]


def _replay_one(kv: KVCacheManager, logged: LoggedRequest) -> int | None:
    request = Request(f"r{logged.index}", list(logged.token_ids), cache_salt=logged.cache_salt)
    computed = kv.get_computed_blocks(request)
    num_new = request.num_tokens - computed.num_tokens
    if kv.allocate_slots(request, num_new, computed) is None:
        return None  # larger than the whole cache: the engine refuses it
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    more = len(logged.output_token_ids) - 1
    if more > 0:
        request.append_output_token_ids(list(logged.output_token_ids))
        if kv.allocate_slots(request, more) is not None:
            request.num_computed_tokens += more
            kv.cache_full_blocks(request)
    kv.free(request)
    return computed.num_tokens


def unbounded_hash_hits(requests: Sequence[HashTraceRequest]) -> list[int]:
    """Mooncake's rule: the longest prefix of ``hash_ids`` seen before, capped at the input."""
    seen: set[int] = set()
    hits = []
    for request in requests:
        n = 0
        for hash_id in request.hash_ids:
            if hash_id not in seen:
                break
            n += 1
        hits.append(min(n * MOONCAKE_BLOCK_SIZE, request.input_length))
        seen.update(request.hash_ids)
    return hits


def replayed_hash_hits(requests: Sequence[HashTraceRequest], num_blocks: int) -> list[int | None]:
    """The trace replayed through a ``KVCacheManager`` of ``num_blocks`` 512-token blocks."""
    # One spare block holds the sentinel, which is never registered, so it never
    # displaces a cached block.
    kv = KVCacheManager(num_blocks + 1, 1)
    hits: list[int | None] = []
    for request in requests:
        tokens = [*request.hash_ids, -1 - request.index]
        req = Request(f"r{request.index}", tokens)
        computed = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - computed.num_tokens, computed) is None:
            hits.append(None)
            continue
        req.num_computed_tokens = len(request.hash_ids)
        kv.cache_full_blocks(req)
        kv.free(req)
        hits.append(min(computed.num_tokens * MOONCAKE_BLOCK_SIZE, request.input_length))
    return hits
