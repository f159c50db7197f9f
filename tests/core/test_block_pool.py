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
