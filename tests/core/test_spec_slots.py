"""Draft slots and their rollback in the KV core, with exact block ids: drafts take slots
with the step, a rejected draft's block goes back to the pool by the computed length
alone, and no block holding an unverified token is ever published (prefix index, disk
tier, cache events)."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.tiers import DiskTier

BS = 4


def prompt(kv: KVCacheManager, request: Request) -> None:
    """Admit and compute the whole prompt, then sample one token (a decode is due)."""
    assert kv.allocate_slots(request, request.num_tokens, kv.get_computed_blocks(request))
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    request.append_output_token_ids(90)


def verify(kv: KVCacheManager, request: Request, drafts: list[int], accepted: int) -> int:
    """A verified step: the first ``accepted`` drafts and a token after them are kept."""
    request.append_output_token_ids([*drafts[:accepted], 91])
    request.num_computed_tokens += 1 + accepted
    kv.cache_full_blocks(request)
    released = kv.release_unverified(request)
    kv.check_invariants()
    return released


def test_draft_slots_come_with_the_step_and_an_empty_block_returns() -> None:
    kv = KVCacheManager(8, BS, watermark=0.0)
    request = Request("r", list(range(6)))
    prompt(kv, request)  # 6 computed in blocks 0, 1; token 90 at position 6
    assert kv.block_table("r") == [0, 1]
    # Position 6 and five drafts (7 .. 11): block 1's last two slots and a new block 2.
    allocation = kv.allocate_slots(request, 6)
    assert allocation is not None and allocation.new_block_ids == (2,)
    assert kv.block_table("r") == [0, 1, 2] and kv.num_slots("r") == 12
    # One draft accepted: 8 tokens computed, block 2 holds none of them.
    assert verify(kv, request, [1, 2, 3, 4, 5], accepted=1) == 1
    assert kv.block_table("r") == [0, 1] and kv.num_slots("r") == 8
    assert kv.pool.free_queue_order()[-1] == 2  # back at the most recently freed end
    assert kv.take_released_block_ids() == (2,)


def test_every_draft_accepted_keeps_the_blocks_it_filled() -> None:
    kv = KVCacheManager(8, BS, watermark=0.0)
    request = Request("r", list(range(6)))
    prompt(kv, request)
    assert kv.allocate_slots(request, 4) is not None  # positions 6 .. 9
    assert verify(kv, request, [1, 2, 3], accepted=3) == 0
    assert kv.block_table("r") == [0, 1, 2] and request.num_computed_tokens == 10


def test_a_block_filled_by_drafts_is_published_only_once_verified() -> None:
    disk = DiskTier(16)
    kv = KVCacheManager(8, BS, watermark=0.0, disk=disk)
    request = Request("r", list(range(6)))
    prompt(kv, request)
    kv.take_disk_ops()
    published = set(kv.pool.hashed_blocks())
    assert published == {0}
    first_event = kv.events.next_seq
    # Drafts fill block 1 (positions 6, 7) and spill into block 2; none is accepted.
    assert kv.allocate_slots(request, 4) is not None
    assert verify(kv, request, [7, 8, 9], accepted=0) == 1
    assert set(kv.pool.hashed_blocks()) == published  # block 1 holds position 7 unverified
    assert kv.take_disk_ops().stores == ()
    assert kv.events.next_seq == first_event  # nothing for a router either
    # The next step computes 91 at position 7: block 1 is full and verified.
    request.append_output_token_ids(92)
    assert kv.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
    kv.cache_full_blocks(request)
    assert set(kv.pool.hashed_blocks()) == {0, 1}
    assert kv.pool.block_token_ids(1) == (4, 5, 90, 91)
    assert [block for block, _, _ in kv.take_disk_ops().stores] == [1]


def test_drafts_after_a_fork_copy_the_shared_block_and_roll_back_alone() -> None:
    kv = KVCacheManager(8, BS, watermark=0.0)
    parent = Request("p", list(range(6)))
    prompt(kv, parent)
    parent.output_token_ids.pop()  # fork after the prompt, before the first sample
    parent.all_token_ids.pop()
    child = Request("c", list(range(6)))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    child.append_output_token_ids(90)
    # The child writes into the shared partial block 1: copy-on-write, then block 3.
    allocation = kv.allocate_slots(child, 4)
    assert allocation is not None
    assert allocation.block_copies == ((1, 2),) and allocation.new_block_ids == (2, 3)
    assert kv.block_table("c") == [0, 2, 3]
    assert verify(kv, child, [5, 6, 7], accepted=0) == 1
    assert kv.block_table("c") == [0, 2] and kv.block_table("p") == [0, 1]
    assert [kv.pool.ref_count(b) for b in range(4)] == [2, 1, 1, 0]


def test_a_rollback_with_nothing_past_the_computed_tokens_changes_nothing() -> None:
    kv = KVCacheManager(8, BS, watermark=0.0)
    request = Request("r", list(range(6)))
    prompt(kv, request)
    before = (kv.block_table("r"), kv.pool.free_queue_order(), kv.num_slots("r"))
    assert kv.release_unverified(request) == 0
    assert (kv.block_table("r"), kv.pool.free_queue_order(), kv.num_slots("r")) == before
    assert kv.release_unverified(Request("unknown", [1])) == 0
