"""Cache events from the block pool, the router's view of them, and the routing policies."""

from __future__ import annotations

import pytest

from pagedllm.core.cache_events import REMOVED, STORED, CacheEventLog
from pagedllm.core.hashing import hash_request_blocks
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.routing import (
    LeastLoaded,
    PrefixAware,
    ReplicaCacheView,
    ReplicaState,
    RoundRobin,
    make_policy,
    predicted_cached_tokens,
)


def _admit(kv: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, tokens)
    hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, len(tokens) - hit.num_tokens, hit) is not None
    request.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(request)
    return request


def test_pool_logs_registrations_and_evictions_in_order():
    kv = KVCacheManager(4, 2)
    a = _admit(kv, "a", [1, 2, 3, 4, 5])
    h = hash_request_blocks([1, 2, 3, 4, 5], 2)
    assert kv.events.since(0).events == ((STORED, h[0]), (STORED, h[1]))
    kv.free(a)
    _admit(kv, "b", [9, 9, 9, 9, 9, 9, 9])  # needs all 4 blocks: evicts a's two, tail first
    batch = kv.events.since(2)
    assert batch.events[:2] == ((REMOVED, h[1]), (REMOVED, h[0]))
    assert [kind for kind, _ in batch.events[2:]] == [STORED] * 3  # b's three full blocks
    assert batch.next_seq == kv.events.next_seq == 7


def test_view_follows_the_log_and_asks_for_a_snapshot_when_behind():
    log = CacheEventLog(max_events=2)
    view = ReplicaCacheView()
    view.reset(log.epoch, 0, ())
    log.stored(b"x")
    first = log.since(0)
    view.apply(first)
    log.stored(b"y")
    view.apply(log.since(0))  # overlaps the first read: only the new event counts
    view.apply(first)  # a stale read changes nothing
    assert view.hashes == {b"x", b"y"} and view.next_seq == 2
    log.removed(b"x")
    log.stored(b"z")
    log.stored(b"w")
    assert log.since(2) is None  # the log holds only the last two events
    with pytest.raises(ValueError, match="snapshot"):
        view.apply(log.since(3))  # a gap: event 2 was never seen
    view.reset(log.epoch, log.next_seq, [b"y", b"z", b"w"])
    assert view.matched_blocks([b"y", b"z", b"q"], with_pending=False) == 2


def test_view_replayed_to_a_lookup_finds_what_the_index_held_then():
    kv = KVCacheManager(4, 2)
    view = ReplicaCacheView()
    view.reset(kv.events.epoch, 0, ())
    a = _admit(kv, "a", [1, 2, 3, 4, 5])  # +h0 +h1 (seq 0, 1)
    h = hash_request_blocks([1, 2, 3, 4, 5], 2)
    kv.free(a)
    lookup = kv.events.next_seq  # b looks its prompt up here: both blocks cached
    assert kv.get_computed_blocks(Request("b", [1, 2, 3, 4, 6])).num_tokens == 4
    _admit(kv, "c", [9, 9, 9, 9, 9, 9, 9])  # -h1 -h0 (seq 2, 3), then c's blocks
    view.apply(kv.events.since(0))
    assert view.matched_blocks(h, with_pending=False) == 0  # gone by now
    assert view.matched_blocks_at(h, lookup) == 2  # held when b looked
    assert [view.matched_blocks_at(h, seq) for seq in range(5)] == [0, 1, 2, 1, 0]
    assert view.matched_blocks_at(h, kv.events.next_seq + 1) is None  # not read yet
    view.reset(kv.events.epoch, kv.events.next_seq, view.hashes)
    assert view.matched_blocks_at(h, lookup) is None  # a snapshot forgets the history


def test_pending_counts_for_routing_not_for_prediction():
    view = ReplicaCacheView()
    view.add_pending([b"a", b"b"], now=1.0)
    assert view.matched_blocks([b"a", b"b"], with_pending=True) == 2
    assert view.matched_blocks([b"a", b"b"], with_pending=False) == 0
    view.expire_pending(older_than=2.0)
    assert view.matched_blocks([b"a"], with_pending=True) == 0


def test_prediction_caps_like_the_engine():
    assert predicted_cached_tokens(3, 4, 12) == 8  # 12 tokens: at most 11 cached, 2 blocks
    assert predicted_cached_tokens(3, 4, 13) == 12
    assert predicted_cached_tokens(0, 4, 13) == 0


def _states(*rows: tuple[int, int]) -> list[ReplicaState]:
    return [ReplicaState(True, load, 0.0, matched) for load, matched in rows]


def test_policies():
    assert PrefixAware().choose(_states((3, 0), (1, 0))) == 1  # no hit: idlest
    assert PrefixAware().choose(_states((3, 2), (1, 0))) == 0  # hit wins within the bound
    assert PrefixAware(max_imbalance=1).choose(_states((3, 2), (1, 0))) == 1  # too busy
    assert LeastLoaded().choose(_states((3, 5), (1, 0))) == 1
    rr = RoundRobin()
    assert [rr.choose(_states((0, 0), (0, 0))) for _ in range(3)] == [0, 1, 0]
    sick = [ReplicaState(False, 0, 0.0, 9), ReplicaState(True, 5, 0.0, 0)]
    assert PrefixAware().choose(sick) == 1
    with pytest.raises(ValueError, match="no healthy"):
        LeastLoaded().choose([ReplicaState(False, 0, 0.0, 0)])
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
