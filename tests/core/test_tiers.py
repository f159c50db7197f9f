"""The tiers below the block tables, by hand with exact block ids."""

from __future__ import annotations

import pytest

from pagedllm.core.tiers import CopyMap, HostSwapTier


def test_copy_map_keeps_one_copy_per_source() -> None:
    copies = CopyMap()
    copies.record(3, 0, 4)
    assert copies.target(3, 4) == 0
    assert copies.target(3, 2) is None  # another fill is another content
    copies.record(3, 1, 2)  # a newer copy replaces the older one
    assert copies.target(3, 4) is None and copies.target(3, 2) == 1
    copies.forget_target(0)  # the stale target no longer points back
    assert copies.target(3, 2) == 1
    copies.forget_target(1)
    assert not copies
    copies.check_invariants()


def test_host_tier_moves_a_shared_block_once() -> None:
    tier = HostSwapTier(4)
    plan, num_new = tier.plan_out([5, 6], [4, 2])
    assert num_new == 2
    assert tier.move_out("a", plan) == [(5, 0), (6, 1)]
    # A second holder of device block 5 with the same fill reuses host block 0.
    plan, num_new = tier.plan_out([5, 7], [4, 1])
    assert plan == [(5, 0, 4), (7, None, 1)] and num_new == 1
    assert tier.move_out("b", plan) == [(7, 2)]
    assert tier.table("a") == [0, 1] and tier.table("b") == [0, 2]
    assert tier.pool.ref_counts() == [2, 1, 1, 0]
    tier.check_invariants(lambda _: 0, 4)


def test_host_tier_copy_back_is_reused_while_held() -> None:
    tier = HostSwapTier(2)
    tier.move_out("a", tier.plan_out([5], [4])[0])
    tier.moved_in("a", [(0, 9, 4)])
    assert not tier.holds("a") and tier.pool.num_free_blocks == 2
    assert tier.reusable_device_copy(0, 4, lambda b: b == 9) == 9
    assert tier.reusable_device_copy(0, 4, lambda b: False) is None
    tier.device_blocks_allocated([9])  # device block 9 handed out again: copy gone
    assert tier.reusable_device_copy(0, 4, lambda b: True) is None
    tier.check_invariants(lambda _: 0, 4)


def test_host_tier_refuses_without_room_and_changes_nothing() -> None:
    tier = HostSwapTier(1)
    assert tier.move_out("a", tier.plan_out([1, 2], [4, 4])[0]) is None
    assert not tier.holds("a") and tier.pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostSwapTier(-1)
