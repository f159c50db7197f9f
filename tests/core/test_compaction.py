"""Compaction plans with exact block ids, and a property test over random pools: after
the moves every table reads the same data, ref counts and the prefix index follow."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_pool import BLOCK_RETIRED, BlockPool
from pagedllm.core.compaction import CompactionPlan, packed_size, plan_compaction
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request


def _hash(i: int) -> bytes:
    return bytes([i]) * 32


def _pool_with(used: list[int], cached: list[int], num_blocks: int = 10) -> BlockPool:
    """A pool whose ``used`` blocks are referenced once and ``cached`` blocks are
    cached-free, released in the order given (the first is least recently used)."""
    pool = BlockPool(num_blocks)
    assert pool.allocate(num_blocks) == list(range(num_blocks))
    for block_id in cached:
        pool.register(block_id, _hash(block_id), [block_id])
    pool.decref([b for b in range(num_blocks) if b not in used and b not in cached])
    pool.decref(cached)
    pool.check_invariants()
    return pool


def test_plan_packs_live_then_cached_into_lowest_free_blocks():
    pool = _pool_with(used=[1, 7, 9], cached=[8, 2, 6])
    pool.set_limit(5)
    assert pool.free_block_ids() == [0, 3, 4]
    assert pool.block_states()[5] == BLOCK_RETIRED
    plan = plan_compaction(pool)
    # Live 7 and 9 first, then cached 6 and 8; room below 5: 0, 3, 4 (+ none dropped
    # yet) -> one short, so the least recently used cached block (8) is dropped.
    assert plan == CompactionPlan(moves=((7, 0), (9, 3), (6, 4)), drops=(8,))


def test_plan_drops_lru_cached_below_the_limit_to_make_room():
    pool = _pool_with(used=[0, 1, 8], cached=[2, 3, 9], num_blocks=10)
    pool.set_limit(4)
    # Nothing free below 4; the tail holds live 8 and cached 9: drop 2 and 3 (LRU).
    plan = plan_compaction(pool)
    assert plan == CompactionPlan(moves=((8, 2), (9, 3)), drops=(2, 3))
    # ... which drops the whole cached set in favour of the tail's; a bounded slice
    # moves the live block first.
    assert plan_compaction(pool, max_moves=1).moves == ((8, 2),)


def test_apply_moves_books_and_truncate_releases_the_tail():
    kv = KVCacheManager(8, 2)
    a = Request("a", [1, 2, 3, 4, 5])  # blocks 0, 1 (full) and 2
    assert kv.allocate_slots(a, 5, kv.get_computed_blocks(a)) is not None
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    b = Request("b", [9, 9, 9])  # blocks 3 (full) and 4
    assert kv.allocate_slots(b, 3, kv.get_computed_blocks(b)) is not None
    b.num_computed_tokens = 3
    kv.cache_full_blocks(b)
    kv.free(a)  # tail first: 2 is free, then 1 and 0 are cached-free (1 is older)
    assert kv.pool.cached_free_order() == [1, 0]
    kv.begin_shrink(3)  # 5, 6, 7 retire; only 2 is free below the limit
    assert kv.usable_blocks == 3 and kv.stats().blocks_retired == 3
    # b's 3 and 4 need two places: the least recently used cached block (1) makes room.
    plan = kv.plan_compaction()
    assert plan == CompactionPlan(moves=((3, 1), (4, 2)), drops=(1,))
    assert kv.plan_compaction(max_moves=1) == CompactionPlan(moves=((3, 1),), drops=(1,))
    kv.apply_compaction(plan)
    kv.check_invariants()
    assert kv.block_table("b") == [1, 2]
    assert not kv.shrink_pending
    assert kv.finish_shrink() == 3
    kv.check_invariants()
    stats = kv.stats()
    assert (stats.blocks_total, stats.blocks_used, stats.blocks_cached_free) == (3, 2, 1)
    assert kv.get_computed_blocks(Request("c", [1, 2, 7])).block_ids == (0,)  # survived
    assert kv.get_computed_blocks(Request("d", [9, 9, 1])).block_ids == (1,)  # moved


def test_settle_stops_past_the_highest_held_block_and_grow_adds_free_blocks():
    kv = KVCacheManager(8, 1)
    requests = [Request(f"r{i}", [i]) for i in range(6)]
    for r in requests:
        assert kv.allocate_slots(r, 1, kv.get_computed_blocks(r)) is not None
    kv.free(requests[1])
    kv.free(requests[2])
    kv.begin_shrink(2)  # four live blocks (0, 3, 4, 5) cannot fit in two
    plan = kv.plan_compaction()
    assert plan.moves == ((3, 1),)  # 1 is the only free block below the limit
    kv.apply_compaction(plan)
    assert kv.shrink_pending
    assert kv.plan_compaction().is_empty
    assert kv.finish_shrink(settle=True) == 6
    kv.check_invariants()
    assert kv.stats().blocks_free == 2  # 2 and 3 came back
    kv.grow(10)
    kv.check_invariants()
    assert kv.num_blocks == 10 and kv.num_free_blocks == 6
    assert kv.pool.free_queue_order() == [2, 3, 6, 7, 8, 9]


def test_shrink_in_progress_retires_freed_tail_blocks_and_grow_cancels_it():
    pool = _pool_with(used=[6], cached=[], num_blocks=8)
    pool.set_limit(4)
    assert pool.allocate(5) is None  # only 0..3 may be handed out
    pool.decref([6])
    assert pool.num_retired_blocks == 4 and pool.occupied_above(4) == []
    pool.grow(8)
    assert pool.num_retired_blocks == 0 and pool.num_free_blocks == 8
    pool.check_invariants()


def test_bad_moves_are_refused():
    pool = _pool_with(used=[0, 5], cached=[], num_blocks=6)
    with pytest.raises(ValueError):
        pool.relocate([(5, 0)])  # target held
    with pytest.raises(ValueError):
        pool.relocate([(3, 1)])  # source holds nothing
    with pytest.raises(ValueError):
        pool.set_limit(7)
    pool.set_limit(3)
    with pytest.raises(ValueError):
        pool.truncate()  # 5 is still held


# ---- property: random pools, random shrinks ----------------------------------------

BS = 2


def _fill(kv: KVCacheManager, ops: list[tuple[int, int, bool]]) -> tuple[dict, dict]:
    """Build a random state from ``ops`` (prefix choice, length, finish?): requests with
    shared prefixes, some finished (their full blocks stay cached). Returns the live
    requests and a fake store: (block, offset) -> token."""
    store: dict[tuple[int, int], int] = {}
    live: dict[str, Request] = {}
    prefixes = ([7, 7, 7, 7], [1, 2, 3, 4, 5, 6], [])
    for i, (p, length, finish) in enumerate(ops):
        tokens = [*prefixes[p % 3], *[(i + j) % 5 for j in range(length)]]
        request = Request(f"r{i}", tokens)
        hit = kv.get_computed_blocks(request)
        num_new = request.num_tokens - hit.num_tokens
        if kv.allocate_slots(request, num_new, hit) is None:
            kv.free(request)
            continue
        table = kv.block_table(request.request_id)
        for pos in range(hit.num_tokens, request.num_tokens):
            store[table[pos // BS], pos % BS] = tokens[pos]
        request.num_computed_tokens = request.num_tokens
        kv.cache_full_blocks(request)
        if finish:
            kv.free(request)
        else:
            live[request.request_id] = request
    return live, store


def _contents(kv: KVCacheManager, store: dict, live: dict) -> tuple:
    tables = {
        rid: [store.get((kv.block_table(rid)[p // BS], p % BS)) for p in range(r.num_tokens)]
        for rid, r in live.items()
    }
    cached = {
        kv.pool.block_hash(b): tuple(store.get((b, o)) for o in range(BS))
        for b in kv.pool.hashed_blocks()
    }
    shared = sorted(
        (kv.pool.ref_count(b), tuple(store.get((b, o), -1) for o in range(BS)))
        for b in range(kv.num_blocks)
        if kv.pool.ref_count(b)
    )
    return tables, cached, shared


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(4, 24),
    ops=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 7), st.booleans()), min_size=1, max_size=12
    ),
    target=st.floats(0.0, 1.0),
    max_moves=st.one_of(st.none(), st.integers(1, 4)),
)
def test_compaction_preserves_what_every_table_and_hash_reads(num_blocks, ops, target, max_moves):
    kv = KVCacheManager(num_blocks, BS)
    live, store = _fill(kv, ops)
    tables, cached, shared = _contents(kv, store, live)
    limit = max(1, round(target * num_blocks))
    kv.begin_shrink(limit)
    kv.check_invariants()
    used, num_cached = kv.pool.num_used_blocks, kv.pool.num_cached_free_blocks
    for _ in range(4 * num_blocks):
        plan = kv.plan_compaction(max_moves)
        if plan.is_empty:
            break
        for src, dst in plan.moves:  # the worker's copy: whole blocks, unwritten slots too
            for o in range(BS):
                store.pop((dst, o), None)
                if (src, o) in store:
                    store[dst, o] = store[src, o]
        kv.apply_compaction(plan)
        kv.check_invariants()
        assert all(d < limit <= s for s, d in plan.moves)
    after_tables, after_cached, after_shared = _contents(kv, store, live)
    assert after_tables == tables
    assert after_shared == shared  # every live block kept its ref count and data
    assert all(cached[h] == data for h, data in after_cached.items())  # survivors intact
    size = kv.finish_shrink(settle=True)
    kv.check_invariants()
    assert _contents(kv, store, live)[0] == tables
    if used <= limit:
        # Everything live fits: the target is reached and cached blocks survive as far
        # as they fit.
        assert size == limit
        assert kv.pool.num_cached_free_blocks == min(num_cached, limit - used)
    assert packed_size(kv.pool) <= size
