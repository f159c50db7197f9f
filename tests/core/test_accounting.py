import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.core.accounting import waste
from pagedllm.core.contiguous import ContiguousAllocator
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request

SYSTEM = list(range(100, 110))  # 10 shared tokens


def admit(kv: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    req = Request(request_id, tokens)
    hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return req


def test_paged_internal_waste_is_the_partial_blocks():
    kv = KVCacheManager(16, 4, watermark=0.0)
    a = admit(kv, "a", list(range(10)))  # 3 blocks, 2 slots unused
    b = admit(kv, "b", list(range(20, 25)))  # 2 blocks, 3 slots unused
    report = waste(kv, {"a": a.all_token_ids, "b": b.all_token_ids}, next_request_len=30)
    assert report.allocated_slots == 20
    assert report.internal_tokens == 5
    assert report.internal_fraction == pytest.approx(5 / 20)
    assert report.external_tokens == 0
    assert report.duplication_tokens == 0
    assert report.headroom_tokens == 11 * 4
    assert report.headroom_sequences(9) == 11 // 3
    assert report.internal_cache_fraction == pytest.approx(5 / 64)


def test_prefix_sharing_removes_duplication():
    for caching, expected_dup in ((False, 8), (True, 0)):
        kv = KVCacheManager(16, 4, enable_prefix_caching=caching, watermark=0.0)
        a = admit(kv, "a", [*SYSTEM, 1, 2])
        b = admit(kv, "b", [*SYSTEM, 3, 4, 5])
        report = waste(kv, {"a": a.all_token_ids, "b": b.all_token_ids})
        # 10 shared tokens, of which the first 8 fill two blocks that can be shared;
        # without caching those 8 tokens are stored twice. Tokens 8, 9 sit in
        # different (partial, unshared) blocks either way: duplicated too.
        assert report.duplication_tokens == expected_dup + 2
        assert report.allocated_slots == (5 if caching else 7) * 4


def test_forked_partial_block_is_not_duplication():
    kv = KVCacheManager(8, 4, watermark=0.0)
    parent = admit(kv, "p", list(range(6)))
    child = Request("c", list(range(6)))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    report = waste(kv, {"p": parent.all_token_ids, "c": child.all_token_ids})
    assert (report.allocated_slots, report.internal_tokens, report.duplication_tokens) == (8, 2, 0)


def test_contiguous_wastes():
    alloc = ContiguousAllocator(100, policy="max_len", max_model_len=40)
    alloc.allocate("a", 10, 5)
    alloc.allocate("b", 12, 5)
    alloc.grow("b", 15)
    tokens = {"a": [*SYSTEM], "b": [*SYSTEM, 1, 2, 3, 4, 5]}
    report = waste(alloc, tokens, next_request_len=5)
    assert report.allocated_slots == 80
    assert report.internal_tokens == 80 - 10 - 15
    assert report.duplication_tokens == 10  # the system prompt stored twice
    assert report.external_tokens == 20  # a 20-slot hole, 40 needed
    assert report.headroom_sequences(5) == 0
    exact = ContiguousAllocator(100, policy="exact", max_model_len=40)
    exact.allocate("a", 10, 5)
    report = waste(exact, {"a": SYSTEM}, next_request_len=5)
    assert (report.internal_tokens, report.external_tokens) == (5, 0)
    assert report.headroom_sequences(20) == 85 // 20


def test_external_waste_counts_small_holes():
    alloc = ContiguousAllocator(100, policy="exact", max_model_len=100)
    for rid in "abcde":
        alloc.allocate(rid, 10, 10)
    alloc.free("b")
    alloc.free("d")
    # Holes: 20 (b), 20 (d), 0..; the tail hole is 0 slots? 5*20 = 100 used.
    report = waste(alloc, None, next_request_len=30)
    assert report.free_extents == (20, 20)
    assert report.external_tokens == 40
    assert report.duplication_tokens is None
    assert waste(alloc, None, next_request_len=20).external_tokens == 0


@given(
    st.lists(
        st.tuples(
            st.sampled_from([(), (1, 2, 3), (1, 2, 4, 4)]), st.lists(st.integers(0, 2), max_size=5)
        ),
        min_size=1,
        max_size=8,
    )
)
def test_contiguous_duplication_matches_brute_force(specs):
    alloc = ContiguousAllocator(1000, policy="exact", max_model_len=20)
    tokens = {}
    for i, (prefix, suffix) in enumerate(specs):
        seq = [*prefix, *suffix] or [0]
        tokens[f"r{i}"] = seq
        assert alloc.allocate(f"r{i}", len(seq), 3) is not None
    prefixes = {tuple(seq[: p + 1]) for seq in tokens.values() for p in range(len(seq))}
    report = waste(alloc, tokens)
    assert report.filled_slots == sum(len(seq) for seq in tokens.values())
    assert report.duplication_tokens == report.filled_slots - len(prefixes)
    assert report.internal_tokens == 3 * len(specs)
