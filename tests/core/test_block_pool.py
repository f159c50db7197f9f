import pytest

from pagedllm.core.block_pool import BlockPool


def _hash(i: int) -> bytes:
    return bytes([i]) * 32


def test_allocate_in_order_and_fail_without_change():
    pool = BlockPool(5)
    assert pool.free_queue_order() == [0, 1, 2, 3, 4]
    assert pool.allocate(2) == [0, 1]
    assert [pool.ref_count(b) for b in range(5)] == [1, 1, 0, 0, 0]
    assert pool.allocate(4) is None
    assert pool.free_queue_order() == [2, 3, 4]
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def test_reverse_free_evicts_tail_before_head():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, _hash(i), [i, i])
    pool.decref(reversed(blocks))  # a finished request releases tail first
    assert pool.free_queue_order() == [3, 4, 2, 1, 0]
    assert pool.cached_free_order() == [2, 1, 0]
    assert pool.num_cached_free_blocks == 3
    # Plain free blocks go first, then the tail of the finished request.
    assert pool.allocate(3) == [3, 4, 2]
    assert pool.lookup(_hash(2), [2, 2]) is None  # evicted
    assert pool.lookup(_hash(1), [1, 1]) == 1  # still cached
    assert pool.free_queue_order() == [1, 0]
    pool.check_invariants(block_size=2)


def test_hit_revives_and_moves_to_lru_tail():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, _hash(i), [i])
    pool.decref([2, 1, 0])
    assert pool.cached_free_order() == [2, 1, 0]
    pool.incref([2])  # a prefix hit revives block 2
    assert pool.ref_count(2) == 1
    assert pool.cached_free_order() == [1, 0]
    pool.decref([2])  # released again: now the most recently used
    assert pool.cached_free_order() == [1, 0, 2]
    assert pool.allocate(1) == [1]
    pool.check_invariants()


def test_shared_block_frees_only_at_zero():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.decref([b])
    assert pool.ref_count(b) == 1
    assert pool.free_queue_order() == [1]
    pool.decref([b])
    assert pool.free_queue_order() == [1, 0]
    with pytest.raises(ValueError):
        pool.decref([b])


def test_lookup_rechecks_tokens_on_hash_hit():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    assert pool.register(b, _hash(7), [1, 2, 3])
    assert pool.lookup(_hash(7), [1, 2, 3]) == b
    assert pool.lookup(_hash(7), [9, 9, 9]) is None  # a fake collision
    assert pool.lookup(_hash(8), [1, 2, 3]) is None


def test_register_keeps_one_copy_per_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.register(a, _hash(1), [5])
    assert not pool.register(b, _hash(1), [5])
    assert pool.block_hash(b) is None
    pool.decref([b, a])
    assert pool.cached_free_order() == [a]
    assert pool.free_queue_order() == [2, b, a]
    with pytest.raises(ValueError):
        pool.register(2, _hash(2), [1])  # unreferenced


def test_evict_lru_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, _hash(i), [i])
    pool.decref([0, 2, 1])
    assert pool.evict(2) == [0, 2]
    assert pool.cached_free_order() == [1]
    assert pool.free_queue_order() == [0, 2, 1]
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool = BlockPool(2)
    pool.allocate(1)
    pool._ref_counts[1] = 1  # referenced but still on the free list
    with pytest.raises(AssertionError):
        pool.check_invariants()


def _first_blocks(pool: BlockPool, n: int, start: int = 0) -> list[int]:
    """``n`` allocated blocks, each registered as a first block (no parent)."""
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.register(b, _hash(start + i), [start + i])
    return blocks


def test_released_reports_unhashed_at_zero_and_hashed_when_evicted():
    pool = BlockPool(4, track_released=True)
    a, b = pool.allocate(2)
    pool.register(a, _hash(0), [0])
    pool.decref([b, a])
    assert pool.take_released() == (b,)  # a stays readable, cached-free
    assert pool.allocate(4) == [2, 3, 1, 0]  # the cached-free block goes last
    assert pool.take_released() == (a,)
    pool.check_invariants()


def test_cached_first_blocks_bounded_oldest_evicted():
    pool = BlockPool(6, track_released=True, max_cached_first_blocks=2)
    blocks = _first_blocks(pool, 3)  # 0, 1, 2
    (child,) = pool.allocate(1)  # 3: a second block, parent 0
    pool.register(child, _hash(9), [9], parent_hash=_hash(0))
    pool.decref([child, 0, 1])
    assert pool.cached_free_order() == [3, 0, 1]
    assert pool.num_cached_first_blocks == 2
    assert pool.take_released() == ()
    pool.decref([2])  # a third cached first block: the oldest (0) leaves the index
    assert pool.cached_free_order() == [3, 1, 2]
    assert pool.lookup(_hash(0), [0]) is None
    assert pool.free_queue_order() == [4, 5, 0, 3, 1, 2]
    assert pool.take_released() == (0,)
    assert pool.num_cached_first_blocks == 2
    pool.check_invariants(block_size=1)
    pool.incref([1])  # a hit revives 1: it no longer counts
    assert pool.num_cached_first_blocks == 1
    pool.check_invariants(block_size=1)
    assert blocks == [0, 1, 2]


def test_no_cached_first_blocks_when_bound_is_zero():
    pool = BlockPool(2, track_released=True, max_cached_first_blocks=0)
    _first_blocks(pool, 1)
    pool.decref([0])
    assert pool.cached_free_order() == []
    assert pool.take_released() == (0,)
    pool.check_invariants()


def test_relocate_moves_cached_first_block_and_releases_source():
    pool = BlockPool(4, track_released=True, max_cached_first_blocks=1)
    pool.allocate(2)  # 0, 1
    (first,) = _first_blocks(pool, 1)  # 2
    pool.decref([2])
    pool.decref([0, 1])
    assert pool.take_released() == (0, 1)
    pool.relocate([(2, 0)])
    assert pool.cached_free_order() == [0]
    assert pool.is_first_block(0) and not pool.is_first_block(2)
    assert pool.take_released() == (2,)
    pool.check_invariants(block_size=1)
    assert first == 2
