import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.contiguous import ContiguousAllocator


def test_first_fit_and_merge_on_free():
    alloc = ContiguousAllocator(100, policy="exact", max_model_len=50)
    assert alloc.allocate("a", 10, 10) == 0  # reserves 20
    assert alloc.allocate("b", 5, 25) == 20  # 30
    assert alloc.allocate("c", 10, 0) == 50  # 10
    assert alloc.free_holes() == [(60, 40)]
    alloc.free("b")
    assert alloc.free_holes() == [(20, 30), (60, 40)]
    # First fit: a 25-slot run goes into the first hole that is large enough.
    assert alloc.allocate("d", 20, 5) == 20
    assert alloc.free_holes() == [(45, 5), (60, 40)]
    alloc.free("c")  # merges with both neighbours
    assert alloc.free_holes() == [(45, 55)]
    alloc.check_invariants()


def test_failed_allocation_changes_nothing():
    alloc = ContiguousAllocator(120, policy="max_len", max_model_len=40)
    assert [alloc.allocate(r, 1, 1) for r in "abc"] == [0, 40, 80]
    alloc.free("a")
    alloc.free("c")
    assert alloc.allocate("d", 1, 1) == 0
    alloc.free("b")
    alloc.allocate("e", 1, 1)  # 40..79
    alloc.allocate("f", 30, 0)  # policy max_len: 40 slots, 80..119
    assert alloc.num_free_slots == 0
    alloc.free("e")
    alloc.grow("d", 2)
    holes, runs = alloc.free_holes(), alloc.runs()
    assert alloc.allocate("x", 1, 1) == 40
    alloc.free("x")
    alloc.allocate("y", 1, 1)
    assert alloc.allocate("z", 1, 1) is None
    assert alloc.free_holes() == []
    alloc.free("y")
    assert (alloc.free_holes(), alloc.runs()) == (holes, runs)
    small = ContiguousAllocator(100, policy="max_len", max_model_len=40)
    small.allocate("a", 1, 1)
    small.allocate("b", 1, 1)
    before = (small.free_holes(), small.runs())
    assert small.allocate("c", 1, 1) is None  # 20 slots free, no 40-slot hole
    assert (small.free_holes(), small.runs()) == before
    small.check_invariants()


def test_grow_within_reservation_only():
    alloc = ContiguousAllocator(64, policy="exact", max_model_len=64)
    alloc.allocate("a", 4, 4)
    assert alloc.grow("a", 8)
    assert not alloc.grow("a", 9)
    assert alloc.num_tokens("a") == 8


def test_invalid_arguments():
    with pytest.raises(ValueError, match="policy"):
        ContiguousAllocator(10, policy="pow2")
    alloc = ContiguousAllocator(10, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        alloc.allocate("a", 9, 0)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 30), st.integers(0, 30)), max_size=60))
def test_random_alloc_free_tiles_the_slots(ops):
    alloc = ContiguousAllocator(200, policy="exact", max_model_len=60)
    live = []
    for i, (is_free, prompt, max_tokens) in enumerate(ops):
        if is_free and live:
            alloc.free(live.pop(prompt % len(live)))
        else:
            holes = alloc.free_holes()
            size = alloc.reservation_size(prompt, max_tokens)
            start = alloc.allocate(f"r{i}", prompt, max_tokens)
            fitting = [s for s, length in holes if length >= size]
            assert start == (fitting[0] if fitting else None)
            if start is not None:
                live.append(f"r{i}")
        alloc.check_invariants()
