"""Sliding windows in the KV manager: blocks that no later query can read are released
(hashed ones stay findable as cached-free), their table entries point at the manager's
placeholder block, and every invariant holds; exact block ids."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request


def request(n: int, rid: str = "r") -> Request:
    return Request(rid, list(range(100, 100 + n)))


def step(kv: KVCacheManager, req: Request, n: int) -> int:
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)
    released = kv.release_out_of_window(req)
    kv.check_invariants()
    return released


def test_placeholder_is_held_and_counted_as_used() -> None:
    kv = KVCacheManager(8, 4, sliding_window=6)
    assert kv.null_block == 0
    assert kv.stats().blocks_used == 1 and kv.stats().sliding_window == 6
    kv.check_invariants()
    assert KVCacheManager(8, 4).null_block is None


def test_blocks_before_the_window_are_released_exactly() -> None:
    kv = KVCacheManager(16, 4, sliding_window=6)
    req = request(10)
    # Positions 0..9 computed: the next query (10) sees 5..10; block 0 (0..3) is dead,
    # block 1 (4..7) still holds 5..7.
    assert step(kv, req, 10) == 1
    assert kv.block_table("r") == [kv.null_block, 2, 3]
    assert kv.pool.ref_count(1) == 0 and kv.pool.num_cached_free_blocks == 1
    req.append_output_token_ids([7, 8, 9])
    assert step(kv, req, 1) == 0  # next query 11 sees 6..11: block 1 still needed
    assert step(kv, req, 1) == 0  # next query 12 sees 7..12: block 1 still holds 7
    assert step(kv, req, 1) == 1  # next query 13 sees 8..13: block 1 is dead
    assert kv.block_table("r") == [kv.null_block, kv.null_block, 3, 4]
    assert kv.pool.ref_count(kv.null_block) == 3  # the manager's and two entries


def test_window_keeps_at_most_window_blocks_plus_one_over_a_long_run() -> None:
    block_size, window = 4, 10
    kv = KVCacheManager(32, block_size, sliding_window=window, enable_prefix_caching=False)
    req = request(3)
    step(kv, req, 3)
    most = 0
    for i in range(500):
        req.append_output_token_ids([i % 50])
        step(kv, req, 1)
        live = [b for b in kv.block_table("r") if b != kv.null_block]
        most = max(most, len(live))
    assert most <= -(-window // block_size) + 1
    assert kv.stats().window_freed_blocks > 100
    kv.free(req)
    kv.check_invariants()
    assert kv.stats().blocks_used == 1  # the placeholder only


def test_fork_and_free_share_the_placeholder() -> None:
    kv = KVCacheManager(16, 4, sliding_window=5)
    parent = request(13, "p")
    step(kv, parent, 13)
    assert kv.block_table("p")[:2] == [kv.null_block] * 2
    child = request(13, "c")
    child.num_computed_tokens = 13
    kv.fork(parent, child)
    kv.check_invariants()
    assert not kv.can_swap_out(parent)  # placeholders are never swapped: recompute
    kv.free(parent)
    kv.free(child)
    kv.check_invariants()
    assert kv.stats().blocks_used == 1


def test_released_full_blocks_are_prefix_hits_for_a_new_request() -> None:
    kv = KVCacheManager(16, 4, sliding_window=5)
    first = request(13, "a")
    step(kv, first, 13)
    second = request(13, "b")
    hit = kv.get_computed_blocks(second)
    assert hit.num_tokens == 12  # the released blocks 1, 2 are cached-free, still found
    assert kv.allocate_slots(second, 1, hit) is not None
    second.num_computed_tokens = 13
    kv.cache_full_blocks(second)
    kv.release_out_of_window(second)
    kv.check_invariants()


@pytest.mark.parametrize("window", [0, -3])
def test_window_must_be_positive(window: int) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, 4, sliding_window=window)
