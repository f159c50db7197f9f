"""Read-only per-block views for the dashboard: ``block_states`` and ref counts."""

from pagedllm.core.block_pool import (
    BLOCK_CACHED_FREE,
    BLOCK_FREE,
    BLOCK_STATE_NAMES,
    BLOCK_USED,
    BlockPool,
)
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request

F, C, U = BLOCK_FREE, BLOCK_CACHED_FREE, BLOCK_USED


def _hash(i: int) -> bytes:
    return bytes([i]) * 32


def _admit(kv: KVCacheManager, req: Request) -> None:
    """Prefix hit, allocate, compute the whole prompt, register its full blocks."""
    hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_state_codes_are_distinct_and_named():
    assert sorted((F, C, U)) == [0, 1, 2]
    assert BLOCK_STATE_NAMES[F] == "free"
    assert BLOCK_STATE_NAMES[C] == "cached_free"
    assert BLOCK_STATE_NAMES[U] == "used"


def test_pool_states_follow_ref_counts_and_the_cached_free_list():
    pool = BlockPool(5)
    assert pool.block_states() == [F] * 5
    assert pool.ref_counts() == [0] * 5
    blocks = pool.allocate(3)  # [0, 1, 2]
    pool.register(0, _hash(0), [0])
    pool.register(1, _hash(1), [1])
    pool.incref([1])
    assert pool.block_states() == [U, U, U, F, F]
    assert pool.ref_counts() == [1, 2, 1, 0, 0]
    pool.decref(reversed(blocks))
    # 0 is hashed and unreferenced: cached-free; 1 is still held once; 2 had no hash.
    assert pool.block_states() == [C, U, F, F, F]
    assert pool.ref_counts() == [0, 1, 0, 0, 0]
    pool.evict()
    assert pool.block_states() == [F, U, F, F, F]


def test_pool_views_are_copies():
    pool = BlockPool(3)
    pool.allocate(1)
    states, counts = pool.block_states(), pool.ref_counts()
    states[0] = F
    counts[0] = 7
    assert pool.block_states() == [U, F, F]
    assert pool.ref_count(0) == 1
    pool.check_invariants()


def test_manager_shows_a_shared_prefix_and_the_host_tier():
    kv = KVCacheManager(8, 4, num_host_blocks=4, watermark=0.0)
    a = Request("a", list(range(10)))  # blocks 0, 1 full; 2 partial
    _admit(kv, a)
    b = Request("b", list(range(8)) + [50, 51, 52])  # shares blocks 0, 1 with a
    _admit(kv, b)
    assert kv.block_table("b") == [0, 1, 3]
    assert kv.block_states() == [U, U, U, U, F, F, F, F]
    assert kv.block_ref_counts() == [2, 2, 1, 1, 0, 0, 0, 0]
    assert kv.block_states(host=True) == [F] * 4

    kv.free(b)
    assert kv.block_ref_counts() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert kv.block_states() == [U, U, U, F, F, F, F, F]  # 3 was partial: no hash

    assert kv.swap_out(a) == [(0, 0), (1, 1), (2, 2)]
    assert kv.block_states() == [C, C, F, F, F, F, F, F]
    assert kv.block_ref_counts() == [0] * 8
    assert kv.block_states(host=True) == [U, U, U, F]
    assert kv.block_ref_counts(host=True) == [1, 1, 1, 0]
    assert kv.live_host_block_tables() == {"a": [0, 1, 2]}
    assert kv.live_block_tables() == {}
    kv.check_invariants()
