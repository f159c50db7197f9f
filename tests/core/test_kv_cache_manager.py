"""Hand-built token lists with exact block ids, ref counts and free-list order."""

import pytest

from pagedllm.core import block_pool, request_hashes
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_records import Allocation, ComputedBlocks
from pagedllm.core.request import Request


def make_request(request_id: str, tokens: list[int], **kwargs) -> Request:
    return Request(request_id, list(tokens), **kwargs)


def run_prompt(kv: KVCacheManager, req: Request) -> Allocation:
    """Admit a request: prefix hit, allocate, compute the whole prompt, register."""
    hit = kv.get_computed_blocks(req)
    alloc = kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit)
    assert alloc is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    kv.check_invariants()
    return alloc


def decode(kv: KVCacheManager, req: Request, token: int) -> Allocation | None:
    """Sample ``token``, then allocate and compute it."""
    req.append_output_token_ids(token)
    alloc = kv.allocate_slots(req, 1)
    if alloc is not None:
        req.num_computed_tokens += 1
        kv.cache_full_blocks(req)
    kv.check_invariants()
    return alloc


def fork_after_prompt(kv: KVCacheManager, num_tokens: int) -> tuple[Request, Request]:
    """Run parent "p"'s prompt of ``num_tokens``, then fork child "c1" sharing all of it."""
    parent = make_request("p", range(num_tokens))
    run_prompt(kv, parent)
    child = make_request("c1", range(num_tokens))
    child.num_computed_tokens = num_tokens
    kv.fork(parent, child)
    return parent, child


def snapshot(kv: KVCacheManager):
    return (
        kv.pool.free_queue_order(),
        kv.pool.cached_free_order(),
        [kv.pool.ref_count(b) for b in range(kv.num_blocks)],
        kv.live_block_tables(),
        {rid: kv.host_block_table(rid) for rid in ("a", "b", "c", "p", "c1")},
        kv.host_pool.free_queue_order(),
        kv.pool.hashed_blocks(),
    )


def test_prompt_decode_and_free_order():
    kv = KVCacheManager(10, 4, watermark=0.0)
    req = make_request("a", range(10))
    alloc = run_prompt(kv, req)
    assert alloc == Allocation((0, 1, 2), ())
    assert kv.block_table("a") == [0, 1, 2]
    assert set(kv.pool.hashed_blocks()) == {0, 1}  # the partial block 2 has no hash
    assert decode(kv, req, 10) == Allocation()
    assert decode(kv, req, 11) == Allocation()  # block 2 now full
    assert set(kv.pool.hashed_blocks()) == {0, 1, 2}
    assert decode(kv, req, 12) == Allocation((3,), ())
    assert kv.block_table("a") == [0, 1, 2, 3]
    kv.free(req)
    # Tail first: partial block 3 is plain free, full blocks cached-free tail to head.
    assert kv.pool.free_queue_order() == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    assert kv.pool.cached_free_order() == [2, 1, 0]
    assert kv.stats().blocks_cached_free == 3
    assert kv.usage == 0.0
    kv.check_invariants()


def test_cache_hit_after_request_finishes():
    kv = KVCacheManager(10, 4, watermark=0.0)
    first = make_request("a", range(10))
    run_prompt(kv, first)
    kv.free(first)
    second = make_request("b", [*range(8), 99, 98, 97])
    hit = kv.get_computed_blocks(second)
    assert hit == ComputedBlocks((0, 1), 8)
    alloc = kv.allocate_slots(second, 3, hit)
    # Block 2 (the first request's partial block) went back to the free list tail.
    assert alloc == Allocation((3,), ())
    assert kv.block_table("b") == [0, 1, 3]
    assert kv.pool.ref_count(0) == kv.pool.ref_count(1) == 1
    assert kv.stats().prefix_hits_tokens == 8
    assert kv.stats().prefix_queries_tokens == 10 + 11
    kv.check_invariants()


def test_hit_capped_at_num_tokens_minus_one():
    kv = KVCacheManager(10, 4, watermark=0.0)
    run_prompt(kv, make_request("a", range(12)))
    same = make_request("b", range(8))
    assert kv.get_computed_blocks(same) == ComputedBlocks((0,), 4)
    assert kv.get_computed_blocks(make_request("c", range(9))) == ComputedBlocks((0, 1), 8)


def test_hit_shared_by_live_requests():
    kv = KVCacheManager(10, 4, watermark=0.0)
    run_prompt(kv, make_request("a", range(9)))
    b = make_request("b", [*range(8), 50])
    assert run_prompt(kv, b) == Allocation((3,), ())
    assert kv.block_table("b") == [0, 1, 3]
    assert [kv.pool.ref_count(x) for x in (0, 1, 2, 3)] == [2, 2, 1, 1]


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(10, 4, watermark=0.0)
    run_prompt(kv, make_request("a", range(9), cache_salt="t1"))
    assert kv.get_computed_blocks(make_request("b", range(9), cache_salt="t2")) == ComputedBlocks()
    assert kv.get_computed_blocks(make_request("c", range(9))) == ComputedBlocks()
    assert kv.get_computed_blocks(make_request("d", range(9), cache_salt="t1")).num_tokens == 8


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(6, 4, watermark=0.0)
    a = make_request("a", range(12))
    run_prompt(kv, a)
    kv.free(a)  # blocks 2, 1, 0 cached-free
    run_prompt(kv, make_request("p", [100, 101, 102, 103, 104]))  # takes blocks 3, 4
    b = make_request("b", [*range(8), *range(200, 215)])  # needs 2 hit + 4 new blocks
    hit = kv.get_computed_blocks(b)
    assert hit == ComputedBlocks((0, 1), 8)
    before = snapshot(kv)
    assert kv.allocate_slots(b, b.num_tokens - 8, hit) is None
    assert snapshot(kv) == before
    assert kv.allocate_slots(make_request("c", range(300, 330)), 30) is None
    assert snapshot(kv) == before
    kv.check_invariants()


def test_watermark_applies_to_admission_only():
    kv = KVCacheManager(10, 4, watermark=0.2)  # keep 2 blocks free at admission
    big = make_request("a", range(33))  # 9 blocks
    assert kv.allocate_slots(big, 33, admission=True) is None
    assert kv.allocate_slots(make_request("b", range(32)), 32, admission=True) is not None
    kv.free(make_request("b", []))
    assert kv.allocate_slots(big, 33) is not None


def test_fork_then_copy_on_write_of_partial_block():
    kv = KVCacheManager(10, 4, watermark=0.0)
    parent, child = fork_after_prompt(kv, 6)
    assert kv.block_table("c1") == [0, 1]
    assert [kv.pool.ref_count(b) for b in (0, 1)] == [2, 2]
    kv.check_invariants()
    # The child writes into shared partial block 1: it gets a copy first.
    assert decode(kv, child, 7) == Allocation((2,), ((1, 2),))
    assert kv.block_table("c1") == [0, 2]
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    # The parent is now block 1's only holder and writes in place.
    assert decode(kv, parent, 8) == Allocation()
    assert kv.block_table("p") == [0, 1]


def test_fork_at_block_boundary_copies_nothing():
    kv = KVCacheManager(10, 4, watermark=0.0)
    parent, child = fork_after_prompt(kv, 8)
    assert decode(kv, child, 1) == Allocation((2,), ())
    assert decode(kv, parent, 2) == Allocation((3,), ())
    assert kv.block_table("p") == [0, 1, 3]
    assert kv.block_table("c1") == [0, 1, 2]


def test_fork_then_free_keeps_shared_blocks():
    kv = KVCacheManager(10, 4, watermark=0.0)
    parent, child = fork_after_prompt(kv, 6)
    kv.free(parent)
    assert [kv.pool.ref_count(b) for b in (0, 1)] == [1, 1]
    kv.free(child)
    assert kv.pool.cached_free_order() == [0]
    assert kv.pool.free_queue_order()[-2:] == [1, 0]
    kv.check_invariants()


def test_hash_recheck_on_fake_collision(monkeypatch):
    # Every block of the same position collides: only the token re-check saves us.
    def colliding(parent, token_ids, extra_keys=()):
        return b"x" * 32 if parent is None else b"y" * 32

    monkeypatch.setattr(request_hashes, "hash_block_tokens", colliding)
    monkeypatch.setattr(block_pool, "hash_block_tokens", colliding)
    kv = KVCacheManager(10, 4, watermark=0.0)
    run_prompt(kv, make_request("a", range(9)))
    other = make_request("b", range(100, 109))
    assert kv.get_computed_blocks(other) == ComputedBlocks()
    assert run_prompt(kv, other) == Allocation((3, 4, 5), ())
    # The duplicate hash is not registered twice: one block per hash.
    assert set(kv.pool.hashed_blocks()) == {0, 1}


def test_stale_computed_blocks_rejected():
    kv = KVCacheManager(4, 4, watermark=0.0)
    a = make_request("a", range(9))
    run_prompt(kv, a)
    kv.free(a)
    b = make_request("b", range(9))
    hit = kv.get_computed_blocks(b)
    kv.evict_cached_blocks()
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, hit)


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(8, 4, num_host_blocks=4, watermark=0.0)
    a = make_request("a", range(10))
    run_prompt(kv, a)
    assert kv.swap_out(a) == [(0, 0), (1, 1), (2, 2)]
    assert kv.is_swapped("a") and kv.block_table("a") == []
    assert kv.host_block_table("a") == [0, 1, 2]
    assert kv.stats().host_blocks_used == 3
    kv.check_invariants()
    kv.evict_cached_blocks()  # so swap-in cannot reuse device blocks 0 and 1
    moves = kv.swap_in(a)
    assert moves == [(0, 3), (1, 4), (2, 5)]
    assert kv.block_table("a") == [3, 4, 5]
    assert kv.stats().host_blocks_used == 0
    assert set(kv.pool.hashed_blocks()) == {3, 4}
    kv.check_invariants()


def test_swap_in_reuses_cached_full_blocks():
    kv = KVCacheManager(8, 4, num_host_blocks=4, watermark=0.0)
    a = make_request("a", range(10))
    run_prompt(kv, a)
    kv.swap_out(a)
    assert kv.pool.cached_free_order() == [1, 0]
    assert kv.swap_in(a) == [(2, 3)]  # full blocks 0, 1 were still cached on device
    assert kv.block_table("a") == [0, 1, 3]
    kv.check_invariants()


def test_shared_block_moves_once_each_way():
    kv = KVCacheManager(8, 4, num_host_blocks=4, enable_prefix_caching=False, watermark=0.0)
    parent, child = fork_after_prompt(kv, 6)
    assert kv.swap_out(parent) == [(0, 0), (1, 1)]
    assert kv.swap_out(child) == []  # same physical blocks, already on the host
    assert kv.host_block_table("c1") == [0, 1]
    assert [kv.host_pool.ref_count(b) for b in (0, 1)] == [2, 2]
    assert kv.pool.num_free_blocks == 8
    kv.check_invariants()
    # Released device blocks went to the free list's tail: 2 and 3 come first.
    assert kv.swap_in(child) == [(0, 2), (1, 3)]
    assert kv.swap_in(parent) == []
    assert kv.block_table("p") == kv.block_table("c1") == [2, 3]
    assert [kv.pool.ref_count(b) for b in (2, 3)] == [2, 2]
    kv.check_invariants()
    # Still shared and partial: the next write copies.
    assert decode(kv, child, 6) == Allocation((4,), ((3, 4),))


def test_shared_partial_block_written_in_place_is_moved_again():
    kv = KVCacheManager(8, 4, num_host_blocks=4, enable_prefix_caching=False, watermark=0.0)
    parent, child = fork_after_prompt(kv, 6)
    assert kv.swap_out(parent) == [(0, 0), (1, 1)]
    decode(kv, child, 42)  # sole holder now: writes block 1 in place
    # Block 1 changed since its host copy, so it needs a fresh host block.
    assert kv.swap_out(child) == [(1, 2)]
    assert kv.host_block_table("c1") == [0, 2]


def test_swap_fails_cleanly_when_a_tier_is_full():
    kv = KVCacheManager(4, 4, num_host_blocks=2, watermark=0.0)
    a = make_request("a", range(10))  # 3 blocks
    run_prompt(kv, a)
    before = snapshot(kv)
    assert not kv.can_swap_out(a)
    assert kv.swap_out(a) is None
    assert snapshot(kv) == before
    small = make_request("b", range(100, 106))
    kv.free(a)
    kv.evict_cached_blocks()
    run_prompt(kv, small)
    assert kv.swap_out(small) is not None
    run_prompt(kv, make_request("c", range(200, 212)))  # fills the device
    before = snapshot(kv)
    assert not kv.can_swap_in(small)
    assert kv.swap_in(small) is None
    assert snapshot(kv) == before
    kv.check_invariants()


def test_free_releases_swapped_request():
    kv = KVCacheManager(4, 4, num_host_blocks=4, watermark=0.0)
    a = make_request("a", range(6))
    run_prompt(kv, a)
    kv.swap_out(a)
    kv.free(a)
    assert kv.stats().host_blocks_used == 0
    assert not kv.is_swapped("a")
    kv.check_invariants()


def test_invalid_arguments():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(4, 4, watermark=1.5)
    kv = KVCacheManager(4, 4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(make_request("a", [1]), -1)


def test_stats_partition_blocks():
    kv = KVCacheManager(10, 4, watermark=0.0)
    a = make_request("a", range(10))
    run_prompt(kv, a)
    run_prompt(kv, make_request("b", range(50, 55)))
    kv.free(a)
    s = kv.stats()
    assert (s.blocks_used, s.blocks_cached_free, s.blocks_free) == (2, 2, 6)
    assert s.blocks_used + s.blocks_cached_free + s.blocks_free == s.blocks_total
    assert kv.usage == pytest.approx(0.2)


def test_waiting_request_dropped_without_free_leaves_nothing():
    kv = KVCacheManager(4, 4, watermark=0.0)
    run_prompt(kv, make_request("a", range(16)))  # fills the cache
    for i in range(5):  # waiting requests asked about, never admitted, never freed
        waiting = make_request(f"w{i}", range(100 * i, 100 * i + 9))
        kv.get_computed_blocks(waiting)
        assert kv.allocate_slots(waiting, 9, kv.get_computed_blocks(waiting)) is None
    assert set(kv._block_hashes) == {"a"}
    # The hashes computed while waiting are kept once the request is admitted.
    b = make_request("b", range(12))
    hit = kv.get_computed_blocks(b)
    kv.free(make_request("a", []))
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 4, hit) is not None
    assert len(kv._block_hashes["b"]) == 3
    kv.check_invariants()


def test_chunked_prefill_registers_blocks_as_they_fill():
    kv = KVCacheManager(10, 4, watermark=0.0)
    req = make_request("a", range(14))
    hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, 6, hit) == Allocation((0, 1), ())
    req.num_computed_tokens = 6
    kv.cache_full_blocks(req)
    assert set(kv.pool.hashed_blocks()) == {0}  # block 1 holds 2 of 4 tokens
    assert kv.allocate_slots(req, 6) == Allocation((2,), ())
    req.num_computed_tokens = 12
    kv.cache_full_blocks(req)
    assert set(kv.pool.hashed_blocks()) == {0, 1, 2}
    assert kv.allocate_slots(req, 2) == Allocation((3,), ())
    assert kv.num_slots("a") == 14
    kv.check_invariants()


def test_admission_watermark_counts_revived_cached_blocks():
    kv = KVCacheManager(10, 4, watermark=0.2)  # keep 2 blocks free at admission
    a = make_request("a", range(16))
    run_prompt(kv, a)
    kv.free(a)  # 4 cached-free blocks; all 10 count as free
    b = make_request("b", [*range(16), *range(50, 70)])  # 4 hit blocks + 5 new
    hit = kv.get_computed_blocks(b)
    assert hit == ComputedBlocks((0, 1, 2, 3), 16)
    # Reviving 4 + allocating 5 leaves 1 free block: below the watermark.
    assert kv.allocate_slots(b, b.num_tokens - 16, hit, admission=True) is None
    assert kv.pool.cached_free_order() == [3, 2, 1, 0]
    assert kv.allocate_slots(b, b.num_tokens - 16, hit) == Allocation((4, 5, 6, 7, 8), ())
    assert kv.pool.num_free_blocks == 1
    kv.check_invariants()


def test_block_table_tuple_is_the_same_object_until_the_table_changes():
    """The worker skips rewriting an unchanged row by identity: the tuple view must be
    reused while the table is unchanged and replaced whenever it changes."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=8)
    req = make_request("a", range(6))
    assert kv.block_table_tuple("a") == ()  # holds nothing yet
    run_prompt(kv, req)
    view = kv.block_table_tuple("a")
    assert view == tuple(kv.block_table("a")) and len(view) == 2
    assert decode(kv, req, 6) is not None  # token 7 fits in block 1
    assert kv.block_table_tuple("a") is view
    decode(kv, req, 7)
    assert decode(kv, req, 8) is not None  # token 9 needs a third block
    grown = kv.block_table_tuple("a")
    assert grown is not view and grown == tuple(kv.block_table("a")) and len(grown) == 3
    kv.check_invariants()  # also checks that no cached view is stale

    child = make_request("c", range(6))
    child.append_output_token_ids([6, 7, 8])
    child.num_computed_tokens = req.num_computed_tokens
    kv.fork(req, child)
    assert kv.block_table_tuple("c") == grown
    assert kv.allocate_slots(child, 1) is not None  # copy-on-write of the shared last block
    assert kv.block_table_tuple("c") != grown
    assert kv.block_table_tuple("a") is grown  # the parent's table did not change
    kv.check_invariants()

    assert kv.swap_out(req) is not None
    assert kv.block_table_tuple("a") == ()
    assert kv.swap_in(req) is not None
    assert kv.block_table_tuple("a") == tuple(kv.block_table("a"))
    kv.free(req)
    kv.free(child)
    assert kv.block_table_tuple("a") == () and kv.block_table_tuple("c") == ()
    kv.check_invariants()


def test_released_block_ids_in_release_order():
    """The worker learns which device blocks nobody reads any more (a quantized cache drops
    their staging slots), in order, once: an unhashed block when its ref count reaches zero,
    a hashed one when it leaves the prefix index."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.take_released_block_ids() == ()
    a = make_request("a", range(100, 110))  # blocks 0, 1, 2 (2 partial)
    run_prompt(kv, a)
    parent, child = fork_after_prompt(kv, 6)  # blocks 3, 4 shared by p and c1
    kv.free(parent)
    assert kv.take_released_block_ids() == ()  # c1 still holds them
    kv.free(a)
    assert kv.take_released_block_ids() == (2,)  # 1 and 0 stay cached-free
    assert kv.take_released_block_ids() == ()
    kv.free(child)
    assert kv.take_released_block_ids() == (4,)  # 3 (full, hashed) stays cached-free
    assert kv.evict_cached_blocks() == 3
    assert kv.take_released_block_ids() == (1, 0, 3)  # least recently released first


def test_prompt_logprob_requests_take_no_prefix_hit():
    from pagedllm.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=8, block_size=4)
    run_prompt(kv, make_request("a", range(9)))
    plain = make_request("b", range(9))
    wants = make_request("c", range(9), sampling_params=SamplingParams(prompt_logprobs=0))
    assert kv.get_computed_blocks(plain).num_tokens == 8
    assert kv.get_computed_blocks(wants) == ComputedBlocks()
