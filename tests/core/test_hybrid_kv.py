"""KV cache groups: the layout of layers into groups, and the grouped manager (one block
table per group over one pool, sliding groups releasing what their window passed, prefix
hits every group can serve); hand-built token lists and exact block ids."""

from __future__ import annotations

import pytest

from pagedllm.core.accounting import group_wastes, waste
from pagedllm.core.hybrid_kv import HybridKVCacheManager
from pagedllm.core.kv_groups import kv_cache_layout
from pagedllm.core.request import Request


def request(n: int, rid: str = "r", extra: tuple[int, ...] = ()) -> Request:
    return Request(rid, [*range(100, 100 + n), *extra])


def step(kv: HybridKVCacheManager, req: Request, n: int, hit=None) -> int:
    assert kv.allocate_slots(req, n, hit) is not None
    if hit is not None:
        req.num_computed_tokens = hit.num_tokens
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)
    released = kv.release_out_of_window(req)
    kv.check_invariants()
    return released


def tables(kv: HybridKVCacheManager, rid: str) -> list[list[int]]:
    return [kv.block_table(rid), *map(list, kv.group_block_tables(rid))]


# ---- the layout ---------------------------------------------------------------------


def test_one_kind_is_one_group_of_every_layer() -> None:
    layout = kv_cache_layout([None, None, None])
    assert [(g.sliding_window, g.layers) for g in layout.groups] == [(None, (0, 1, 2))]
    assert layout.layers_per_block == 3
    assert kv_cache_layout([8, 8]).windows == (8,)


def test_gemma3_270m_is_one_full_group_and_five_sliding_groups_of_three() -> None:
    windows = [None if (layer + 1) % 6 == 0 else 512 for layer in range(18)]
    layout = kv_cache_layout(windows)
    assert layout.layers_per_block == 3
    assert [(g.sliding_window, g.layers) for g in layout.groups] == [
        (None, (5, 11, 17)),
        (512, (0, 1, 2)),
        (512, (3, 4, 6)),
        (512, (7, 8, 9)),
        (512, (10, 12, 13)),
        (512, (14, 15, 16)),
    ]
    assert layout.layer_groups[5] == 0 and layout.layer_slots[17] == 2
    assert layout.layer_groups[6] == 2 and layout.layer_slots[6] == 2


def test_groups_are_as_large_as_the_kinds_divide_evenly() -> None:
    layout = kv_cache_layout([None] * 4 + [16] * 14)  # gcd(4, 14) = 2
    assert layout.layers_per_block == 2 and len(layout.groups) == 9
    layout = kv_cache_layout([None, 4, 4, 4])  # 1 full, 3 sliding: groups of one layer
    assert layout.layers_per_block == 1 and layout.windows == (None, 4, 4, 4)
    layout = kv_cache_layout([8, None, 4, 4, 8, 4])  # two windows: each its own kind
    assert layout.windows == (None, 4, 4, 4, 8, 8)
    assert layout.layer_groups == (4, 0, 1, 2, 5, 3)
    with pytest.raises(ValueError, match="positive"):
        kv_cache_layout([None, 0])
    with pytest.raises(ValueError, match="at least one layer"):
        kv_cache_layout([])


# ---- the grouped manager -----------------------------------------------------------


def test_sliding_group_releases_while_the_full_group_keeps_every_block() -> None:
    kv = HybridKVCacheManager(16, 4, [None, 6])
    assert kv.null_block == 0
    req = request(10)
    # Group 0 takes its blocks first, then group 1; positions 0..9 computed, the next
    # query (10) sees 5..10 in the sliding group: its block 0 is dead.
    assert step(kv, req, 10) == 1
    assert tables(kv, "r") == [[1, 2, 3], [0, 5, 6]]
    assert kv.pool.ref_count(4) == 0 and kv.pool.is_cached_free(4)  # hashed: findable
    req.append_output_token_ids([7, 8, 9])
    assert step(kv, req, 1) == 0
    assert step(kv, req, 1) == 0
    assert step(kv, req, 1) == 1  # next query 13 sees 8..13: block 1 (4..7) is dead
    assert tables(kv, "r") == [[1, 2, 3, 7], [0, 0, 6, 8]]
    stats = kv.stats()
    assert [(g.sliding_window, g.blocks_used, g.window_freed_blocks) for g in stats.groups] == [
        (None, 4, 0),
        (6, 2, 2),
    ]
    assert stats.blocks_used == 1 + 4 + 2  # the placeholder, then each group's
    assert stats.sliding_window == 6 and stats.window_freed_blocks == 2
    kv.free(req)
    kv.check_invariants()
    assert kv.stats().blocks_used == 1


def test_a_long_generation_holds_a_window_of_blocks_per_sliding_group() -> None:
    block_size, window = 4, 8
    kv = HybridKVCacheManager(128, block_size, [None, window, window])
    req = request(3)
    step(kv, req, 3)
    most = [0, 0, 0]
    for i in range(300):
        req.append_output_token_ids([i % 50])
        step(kv, req, 1)
        for g, table in enumerate(tables(kv, "r")):
            most[g] = max(most[g], sum(b != kv.null_block for b in table))
    bound = window // block_size + 1
    assert most == [-(-303 // block_size), bound, bound]


def test_prefix_hit_is_a_length_every_group_serves() -> None:
    kv = HybridKVCacheManager(32, 4, [None, 6])
    first = request(17)
    step(kv, first, 17)
    # Group 1 released blocks 0..2 (the next query, 17, sees 12..17): cached-free.
    assert tables(kv, "r") == [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]]
    kv.free(first)
    again = request(17, "s", extra=(1,))
    hit = kv.get_computed_blocks(again)
    # 4 full blocks; computing from 16 the window reaches 11..16: group 1 needs its
    # blocks 2 and 3 only, the earlier entries are the placeholder.
    assert hit.num_tokens == 16
    assert hit.block_ids == (1, 2, 3, 4)
    assert hit.group_block_ids == ((0, 0, 8, 9),)
    assert kv.blocks_to_allocate(again, 2, hit) == 4 + 2 + 1 + 1  # revived, and one new each
    step(kv, again, 2, hit)
    assert tables(kv, "s") == [[1, 2, 3, 4, 11], [0, 0, 0, 9, 12]]


def test_a_hit_stops_where_the_sliding_group_lost_a_block_its_window_needs() -> None:
    kv = HybridKVCacheManager(32, 4, [None, 6])
    first = request(17)
    step(kv, first, 17)
    kv.free(first)
    # Evict cached-free blocks least recently used first until group 1's block 8 (its
    # table index 2) is gone: 6, 7, 8 go (freed on release, before the rest).
    assert kv.pool.cached_free_order()[:3] == [6, 7, 8]
    kv.evict_cached_blocks(3)
    hit = kv.get_computed_blocks(request(17, "s", extra=(1,)))
    # 16 tokens would need group 1's index 2; 12 would need index 1 (evicted) and 2;
    # 8 needs indices 0..1 (both evicted); 4: index 0 (evicted): no hit.
    assert hit.num_tokens == 0
    kv.check_invariants()


def test_window_hit_keeps_earlier_blocks_out_when_they_are_not_needed() -> None:
    kv = HybridKVCacheManager(32, 4, [None, 6])
    first = request(25)
    step(kv, first, 25)
    kv.free(first)
    # Group 1's block for positions 0..3 (id 8) is evicted: a hit of 24 tokens (window
    # from 24 reaches 19..24, table indices 4 and 5) does not need it.
    group1_first = 8
    assert kv.pool.is_cached_free(group1_first)
    kv.pool.discard(group1_first)
    hit = kv.get_computed_blocks(request(25, "s", extra=(1,)))
    assert hit.num_tokens == 24
    assert hit.group_block_ids[0][:4] == (0, 0, 0, 0)


def test_allocation_is_all_or_nothing_across_groups() -> None:
    kv = HybridKVCacheManager(6, 4, [None, 8])
    a = request(8, "a")
    step(kv, a, 8)  # two blocks in each group + the placeholder: 5 of 6
    b = request(8, "b", extra=(3,))
    before = (kv.pool.ref_counts(), tables(kv, "a"), kv.stats())
    assert kv.allocate_slots(b, 4) is None  # group 0 could, group 1 could not
    assert (kv.pool.ref_counts(), tables(kv, "a"), kv.stats()) == before
    assert tables(kv, "b") == [[], []]
    kv.free(b)
    kv.check_invariants()


def test_hits_are_pinned_while_other_groups_allocate() -> None:
    # Every block cached-free after the first request: the second one's allocation in
    # group 0 would evict group 1's hit blocks if they were not pinned first.
    kv = HybridKVCacheManager(5, 2, [None, 3])
    first = request(4)
    step(kv, first, 4)
    kv.free(first)
    assert kv.pool.num_cached_free_blocks == 4 and kv.pool.num_free_blocks == 4
    again = request(4, "s", extra=(5,))
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 4
    assert kv.allocate_slots(again, 1, hit) is None  # 4 revived + 2 new > 4 free
    kv.check_invariants()
    small = Request("t", [100, 101, 102])
    hit = kv.get_computed_blocks(small)
    assert hit.num_tokens == 2 and hit.block_ids == (1,) and hit.group_block_ids == ((3,),)
    step(kv, small, 1, hit)  # revives 1 and 3, the new blocks come from 2 and 4
    assert tables(kv, "t") == [[1, 2], [3, 4]]


def test_fork_copy_on_write_per_group() -> None:
    kv = HybridKVCacheManager(16, 4, [None, 6])
    parent = request(6)
    step(kv, parent, 6)
    assert tables(kv, "r") == [[1, 2], [3, 4]]
    child = request(6, "c")
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    for req, token in ((parent, 1), (child, 2)):
        req.append_output_token_ids([token])
    allocation = kv.allocate_slots(child, 1)
    assert allocation is not None
    # The shared partial block (index 1) of each group is copied for the child.
    assert allocation.block_copies == ((2, 5), (4, 6))
    assert tables(kv, "c") == [[1, 5], [3, 6]]
    kv.check_invariants()


def test_waste_and_group_reports_add_up() -> None:
    kv = HybridKVCacheManager(16, 4, [None, 6])
    req = request(10)
    step(kv, req, 10)
    tokens = {"r": req.all_token_ids}
    per_group = group_wastes(kv, tokens, next_request_len=4)
    assert [r.allocated_slots for r in per_group] == [12, 8]
    assert [r.filled_slots for r in per_group] == [10, 6]  # group 1 holds 4..9
    total = waste(kv, tokens, next_request_len=4)
    assert (total.allocated_slots, total.filled_slots, total.internal_tokens) == (20, 16, 4)
    assert total.duplication_tokens == 0
    assert total.headroom_tokens == kv.num_free_blocks * 4


def test_blocks_needed_counts_each_group_and_one_placeholder() -> None:
    kv = HybridKVCacheManager(64, 4, [None, 8, 8])
    # 100 tokens, steps of 4: full 25; each sliding group sees 7 + 4 = 11 positions: 3 + 1.
    assert kv.blocks_needed(100, 4) == 25 + 4 + 4 + 1
    assert kv.blocks_needed(6, 4) == 2 + 2 + 2 + 1


def test_grouped_requests_are_never_swapped() -> None:
    kv = HybridKVCacheManager(16, 4, [None, 6])
    req = request(5)
    step(kv, req, 5)
    assert not kv.can_swap_out(req) and kv.swap_out(req) is None
    assert kv.take_disk_ops().loads == ()
    with pytest.raises(ValueError, match="at least two groups"):
        HybridKVCacheManager(16, 4, [None])


def test_compaction_renames_every_group_table() -> None:
    kv = HybridKVCacheManager(16, 4, [None, 6])
    filler = request(24, "f")
    for _ in range(3):
        step(kv, filler, 8)
    req = request(6, "r", extra=(9,))
    step(kv, req, 6)
    kv.free(filler)
    kv.evict_cached_blocks()
    kv.begin_shrink(8)
    plan = kv.plan_compaction()
    kv.apply_compaction(plan)
    assert not kv.shrink_pending
    assert kv.finish_shrink() == 8
    assert all(b < 8 for table in tables(kv, "r") for b in table)
    kv.check_invariants()
