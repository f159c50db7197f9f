"""In-flight prefix sharing: a request whose next block another request is computing
waits for it instead of computing it twice. Exact block ids, fabricated outputs."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import batch, make, req, run_model

PREFIX = list(range(100, 112))  # three full blocks of 4


def shared(request_id: str, suffix: list[int], *, salt: str | None = None) -> Request:
    return Request(
        request_id, PREFIX + suffix, SamplingParams(max_tokens=4), eos_token_id=None,
        cache_salt=salt,
    )  # fmt: skip


def step(s: Scheduler):
    output = s.schedule()
    s.update(output, run_model(output))
    s.kv.check_invariants()
    return output


def test_two_requests_in_one_step_compute_the_shared_blocks_once() -> None:
    s = make(num_blocks=16, budget=64)
    s.add_request(shared("A", [1, 2]))
    s.add_request(shared("B", [3, 4, 5]))
    first = step(s)
    assert batch(first) == [("A", 0, 14, 1)]  # B waits for A's three blocks
    assert s.kv.block_table("A") == [0, 1, 2, 3]
    second = step(s)
    assert batch(second) == [("A", 14, 1, 1), ("B", 12, 3, 1)]
    assert s.kv.block_table("B") == [0, 1, 2, 4]  # one physical copy of the prefix
    assert s.waiting == []
    requests = {r.request_id: r for r in s.running}
    assert requests["B"].num_cached_tokens == 12
    stats = s.stats()
    assert stats.num_inflight_shared_tokens == 12 and stats.num_inflight_waits == 1


def test_ten_requests_one_prefix_one_copy() -> None:
    s = make(num_blocks=64, budget=256, max_num_seqs=16)
    for i in range(10):
        s.add_request(shared(f"r{i}", [i, i + 1]))
    assert batch(step(s)) == [("r0", 0, 14, 1)]
    second = step(s)
    assert [b for b in batch(second) if b[0] != "r0"] == [(f"r{i}", 12, 2, 1) for i in range(1, 10)]
    tables = [s.kv.block_table(f"r{i}") for i in range(10)]
    assert all(t[:3] == [0, 1, 2] for t in tables)
    assert s.kv.block_ref_counts()[:3] == [10, 10, 10]
    assert sorted(t[3] for t in tables) == list(range(3, 13))
    assert s.stats().num_inflight_shared_tokens == 9 * 12


def test_partial_overlap_waits_only_for_the_blocks_it_shares() -> None:
    s = make(num_blocks=16, budget=64)
    s.add_request(shared("A", [1, 2]))
    # B shares the first block only, then differs.
    s.add_request(Request("B", PREFIX[:4] + [7, 7, 7, 7, 7], SamplingParams(max_tokens=4)))
    assert batch(step(s)) == [("A", 0, 14, 1)]
    assert batch(step(s)) == [("A", 14, 1, 1), ("B", 4, 5, 1)]
    assert s.kv.block_table("B")[0] == s.kv.block_table("A")[0] == 0
    assert s.stats().num_inflight_shared_tokens == 4


def test_different_cache_salt_never_waits_and_never_shares() -> None:
    s = make(num_blocks=16, budget=64)
    s.add_request(shared("A", [1, 2], salt="tenant-a"))
    s.add_request(shared("B", [1, 2], salt="tenant-b"))
    assert batch(step(s)) == [("A", 0, 14, 1), ("B", 0, 14, 1)]
    assert set(s.kv.block_table("A")).isdisjoint(s.kv.block_table("B"))
    assert s.stats().num_inflight_waits == 0


def test_a_waiting_request_does_not_hold_back_unrelated_ones() -> None:
    s = make(num_blocks=16, budget=64)
    s.add_request(shared("A", [1, 2]))
    s.add_request(shared("B", [3]))
    s.add_request(req("C", 5, first=500))
    assert batch(step(s)) == [("A", 0, 14, 1), ("C", 0, 5, 1)]


def test_owner_chunked_over_steps_is_followed_block_by_block() -> None:
    # Budget 10: A's prompt takes two steps; B waits while its next block is in flight.
    s = make(num_blocks=16, budget=10)
    s.add_request(shared("A", [1, 2]))
    s.add_request(shared("B", [3, 4, 5]))
    assert batch(step(s)) == [("A", 0, 10, 0)]  # the budget is spent: B is not considered
    assert batch(step(s)) == [("A", 10, 4, 1)]  # B finds blocks 0-1, waits for block 2
    assert batch(step(s)) == [("A", 14, 1, 1), ("B", 12, 3, 1)]
    assert s.kv.block_table("B")[:3] == s.kv.block_table("A")[:3] == [0, 1, 2]
    assert s.stats().num_inflight_shared_tokens == 4  # block 2: in flight when B waited


def test_abort_of_the_owner_mid_prefill_releases_the_waiter() -> None:
    s = make(num_blocks=16, budget=10)
    s.add_request(shared("A", [1, 2]))
    s.add_request(shared("B", [3, 4, 5]))
    assert batch(step(s)) == [("A", 0, 10, 0)]
    s.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    s.kv.check_invariants()
    # Blocks 0-1 stay cached (A registered them); B computes the rest itself.
    assert batch(step(s)) == [("B", 8, 7, 1)]
    assert s.kv.block_table("B")[:2] == [0, 1]
    assert s.stats().num_inflight_shared_tokens == 0


def test_abort_of_the_owner_after_the_shared_blocks_keeps_them_for_the_waiter() -> None:
    s = make(num_blocks=16, budget=10)
    s.add_request(shared("A", [1, 2]))
    s.add_request(shared("B", [3, 4, 5]))
    step(s)
    assert batch(step(s)) == [("A", 10, 4, 1)]  # B waits for block 2
    s.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    assert batch(step(s)) == [("B", 12, 3, 1)]
    assert s.kv.block_table("B")[:3] == [0, 1, 2]
    assert s.stats().num_inflight_shared_tokens == 4


def test_preempted_owner_no_longer_holds_the_waiter_back() -> None:
    s = make(num_blocks=16, budget=6)
    owner = shared("A", [1, 2])
    s.add_request(owner)
    s.add_request(shared("B", [3, 4, 5]))
    step(s)
    # The owner leaves the running queue (as a preemption by recompute would leave it).
    s.running.remove(owner)
    s.kv.free(owner)
    owner.num_computed_tokens = 0
    owner.status = RequestStatus.WAITING
    s.waiting.insert(0, owner)
    out = s.schedule()
    assert [b[0] for b in batch(out)] == ["A"]  # A is first again; B waits for it
    assert not s.kv.is_swapped("B")


def test_switched_off_both_compute_the_prefix() -> None:
    s = make(num_blocks=16, budget=64, inflight_sharing=False)
    s.add_request(shared("A", [1, 2]))
    s.add_request(shared("B", [3, 4, 5]))
    assert batch(step(s)) == [("A", 0, 14, 1), ("B", 0, 15, 1)]
    assert s.stats().num_inflight_waits == 0


def test_a_prompt_that_is_only_the_shared_prefix_does_not_wait_beyond_its_cap() -> None:
    # B's hit is capped at num_tokens - 1: its last block is computed anyway.
    s = make(num_blocks=16, budget=64)
    s.add_request(shared("A", [1, 2]))
    s.add_request(Request("B", PREFIX[:4], SamplingParams(max_tokens=4)))
    assert batch(step(s)) == [("A", 0, 14, 1), ("B", 0, 4, 1)]
