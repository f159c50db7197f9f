"""Pins: a waiting request holds its cached prefix while it waits (exact block ids).

Every scenario builds its cache by hand: a finished request leaves its full blocks
cached-free (tail first in the LRU order), a long running request then takes blocks,
and a waiting request arrives behind it (``max_num_seqs=1`` keeps it waiting).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.sampling_params import SamplingParams

from .test_scheduler import make, run_model, run_to_end, step


def request(request_id: str, tokens: Iterable[int], max_tokens: int = 1, **kw) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), **kw)


def cache_prefixes(s: Scheduler, *prompts: Iterable[int]) -> None:
    """Run one request per prompt to its end: their full blocks stay cached-free."""
    for i, tokens in enumerate(prompts):
        s.add_request(request(f"P{i}", tokens))
        run_to_end(s)


def scheduled_tables(s: Scheduler) -> dict[str, tuple[int, ...]]:
    output = s.schedule()
    return {seq.request_id: seq.block_table for seq in output.scheduled}


def test_a_waiting_requests_prefix_survives_eviction_that_took_it_before() -> None:
    def run(pin: bool) -> tuple[Request, dict, Scheduler]:
        s = make(num_blocks=6, budget=64, max_num_seqs=1)
        s.config = replace(s.config, pin_waiting_prefixes=pin)
        cache_prefixes(s, range(9), range(100, 109))  # P0: blocks 0, 1; P1: 3, 4
        assert s.kv.pool.cached_free_order() == [1, 0, 4, 3]
        assert s.kv.pool.free_block_ids() == [2, 5]
        s.add_request(request("R", range(200, 203), max_tokens=12))  # 15 tokens: 4 blocks
        step(s)
        waiting = request("W", [*range(8), 50])  # P0's two blocks + one token
        s.add_request(waiting)
        assert s.kv.pinned_block_ids("W") == ([0, 1] if pin else [])
        while "R" in s.requests:
            step(s)  # R grows past the free blocks: eviction, LRU first
        return waiting, scheduled_tables(s), s

    waiting, tables, s = run(pin=False)
    assert waiting.num_cached_tokens == 0  # R's growth evicted 1 and 0
    assert tables == {"W": (0, 4, 3)}

    waiting, tables, s = run(pin=True)
    # R evicted P1's blocks instead (4, 3): W finds its 8 tokens and takes its own
    # references; the pin's are gone, so no block is counted twice.
    assert waiting.num_cached_tokens == 8
    assert tables == {"W": (0, 1, 3)}
    assert s.kv.pinned_block_ids("W") == []
    assert [s.kv.pool.ref_count(b) for b in (0, 1, 3)] == [1, 1, 1]
    assert s.kv.stats().blocks_pinned == 0
    s.kv.check_invariants()


def test_arrival_event_seq_tells_a_queued_miss_from_one_before_arrival() -> None:
    """The log's position at ``add_request`` (arrival) and at the prefix lookup
    (admission): a view replayed to each finds what the index held then. Unpinned, W's
    prefix is there at arrival and gone at lookup (a miss in the queue); pinned, both agree."""
    from pagedllm.core.hashing import hash_request_blocks
    from pagedllm.core.routing import ReplicaCacheView

    def run(pin: bool) -> tuple[int | None, int | None, Request]:
        s = make(num_blocks=6, budget=64, max_num_seqs=1)
        s.config = replace(s.config, pin_waiting_prefixes=pin)
        cache_prefixes(s, range(9), range(100, 109))
        s.add_request(request("R", range(200, 203), max_tokens=12))
        step(s)
        waiting = request("W", [*range(8), 50])
        s.add_request(waiting)
        assert waiting.arrival_event_seq == s.kv.events.next_seq
        run_to_end(s)
        view = ReplicaCacheView()
        view.reset(s.kv.events.epoch, 0, ())
        view.apply(s.kv.events.since(0))
        hashes = hash_request_blocks(waiting.prompt_token_ids, s.kv.block_size, ())
        at_arrival = view.matched_blocks_at(hashes, waiting.arrival_event_seq)
        at_lookup = view.matched_blocks_at(hashes, waiting.cache_event_seq)
        return at_arrival, at_lookup, waiting

    at_arrival, at_lookup, waiting = run(pin=False)
    assert (at_arrival, at_lookup) == (2, 0) and waiting.num_cached_tokens == 0
    assert waiting.arrival_event_seq < waiting.cache_event_seq
    at_arrival, at_lookup, waiting = run(pin=True)
    assert (at_arrival, at_lookup) == (2, 2) and waiting.num_cached_tokens == 8


def test_b_the_head_gets_the_room_pins_behind_it_hold_newest_first() -> None:
    s = make(num_blocks=8, budget=64, max_num_seqs=1)
    cache_prefixes(s, range(9), range(100, 109))  # P0: blocks 0, 1; P1: 3, 4
    s.add_request(request("R", range(200, 203), max_tokens=12))
    step(s)  # R holds block 6
    s.add_request(request("W1", [*range(8), 50]))
    s.add_request(request("W2", [*range(100, 108), 51]))
    assert (s.kv.pinned_block_ids("W1"), s.kv.pinned_block_ids("W2")) == ([0, 1], [3, 4])
    assert s.kv.stats().blocks_pinned == 4
    assert s.kv.stats().blocks_used == 5  # R's block and the four pinned
    s.kv.check_invariants()
    head = request("H", range(300, 324), priority=-1)  # 24 tokens: 6 blocks
    s.add_request(head)
    s.finish_requests(["R"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.free_block_ids() == [7, 2, 5, 6] and s.kv.pool.num_free_blocks == 4
    # H needs 6: W2's pin (the last to be admitted) gives way, W1 keeps its prefix.
    assert scheduled_tables(s) == {"H": (7, 2, 5, 6, 4, 3)}
    assert s.kv.pinned_block_ids("W1") == [0, 1] and s.kv.pinned_block_ids("W2") == []
    s.kv.check_invariants()


def test_pins_hold_when_giving_them_up_would_not_make_the_room() -> None:
    s = make(num_blocks=8, budget=64, max_num_seqs=2)
    cache_prefixes(s, range(9), range(100, 109))
    s.add_request(request("R", range(200, 205), max_tokens=4))  # holds 2 blocks
    step(s)
    s.add_request(request("W1", [*range(8), 50]))
    s.add_request(request("W2", [*range(100, 108), 51]))
    step(s)  # W1 is admitted beside R (two sequences); W2 waits, pinned
    assert s.kv.pinned_block_ids("W2") == [3, 4]
    head = request("H", range(300, 328), priority=-1)  # 28 tokens: 7 blocks
    s.add_request(head)
    # W1 finished; R holds 2 blocks, W2's pin 2: 4 free, 6 with the pin, 7 needed.
    assert s.kv.pool.num_free_blocks == 4 and s.kv.num_pinned_only_blocks == 2
    assert scheduled_tables(s).keys() == {"R"}  # H waits, and nobody overtakes it
    assert s.kv.pinned_block_ids("W2") == [3, 4]
    s.kv.check_invariants()


def test_a_running_request_takes_pinned_room_instead_of_being_preempted() -> None:
    s = make(num_blocks=6, budget=64, max_num_seqs=1)
    cache_prefixes(s, range(9))  # blocks 0, 1 cached-free
    s.add_request(request("R", range(200, 203), max_tokens=20))  # 22 tokens: 6 blocks
    step(s)
    s.add_request(request("W", [*range(8), 50]))
    assert s.kv.pinned_block_ids("W") == [0, 1]
    while len(s.kv.block_table("R")) < 6:
        step(s)
    # The free blocks first, then W's pin gives way: 1 before 0 (tail first).
    assert s.kv.block_table("R") == [3, 4, 5, 2, 1, 0]
    assert s.kv.pinned_block_ids("W") == []
    assert s.stats().num_preemptions == 0
    s.kv.check_invariants()


def test_c_an_aborted_waiting_request_releases_its_pin() -> None:
    s = make(num_blocks=8, budget=64, max_num_seqs=1)
    cache_prefixes(s, range(9))
    s.add_request(request("R", range(200, 203), max_tokens=12))
    step(s)
    s.add_request(request("W", [*range(8), 50]))
    s.add_request(request("V", [*range(8), 51]))  # the same prefix: two pins on 0, 1
    assert [s.kv.pool.ref_count(b) for b in (0, 1)] == [2, 2]
    assert s.kv.stats().blocks_pinned == 2
    s.finish_requests(["W"], RequestStatus.FINISHED_ABORTED)
    assert [s.kv.pool.ref_count(b) for b in (0, 1)] == [1, 1]
    s.finish_requests(["V"], RequestStatus.FINISHED_ABORTED)
    assert [s.kv.pool.ref_count(b) for b in (0, 1)] == [0, 0]
    assert s.kv.pool.cached_free_order()[-2:] == [1, 0]  # findable again, tail first
    assert s.kv.stats().blocks_pinned == 0 and s.kv.num_pinned_requests == 0
    s.kv.check_invariants()


def test_a_shrink_releases_every_pin_first() -> None:
    s = make(num_blocks=8, budget=64, max_num_seqs=1)
    cache_prefixes(s, range(9))
    s.add_request(request("R", range(200, 203), max_tokens=12))
    step(s)
    s.add_request(request("W", [*range(8), 50]))
    assert s.release_pins() == 1
    assert s.kv.pinned_block_ids("W") == [] and s.kv.pool.ref_count(0) == 0
    s.kv.check_invariants()


def test_manager_pins_count_as_references_and_go_at_admission() -> None:
    kv = KVCacheManager(8, 4, watermark=0.0)
    owner = request("A", range(9))
    kv.allocate_slots(owner, 9, kv.get_computed_blocks(owner))
    owner.num_computed_tokens = 9
    kv.cache_full_blocks(owner)
    kv.free(owner)
    waiting = request("W", [*range(8), 7])
    assert kv.pin_prefix(waiting) == 2
    assert kv.pool.num_free_blocks == 6 and kv.pool.num_cached_free_blocks == 0
    assert kv.evict_cached_blocks() == 0  # nothing evictable: the prefix is pinned
    hit = kv.get_computed_blocks(waiting)
    assert hit.block_ids == (0, 1)
    assert kv.blocks_to_allocate(waiting, 1, hit) == 1  # pinned blocks are not revived
    kv.allocate_slots(waiting, 1, hit)
    assert kv.block_table("W") == [0, 1, 3]
    assert [kv.pool.ref_count(b) for b in (0, 1, 3)] == [1, 1, 1]
    assert kv.stats().prefix_hits_tokens == 8
    kv.check_invariants()
    kv.free(waiting)
    assert kv.pool.num_free_blocks == 8
    kv.check_invariants()


class SchedulerPinMachine(RuleBasedStateMachine):
    """Requests of a few tenants arrive (pinning their cached prefix), steps run with
    fabricated tokens, requests are aborted wherever they are, cached blocks are
    evicted behind the scheduler's back. After every rule: ref counts equal the tables
    plus the pins, only waiting requests hold pins; and everything always finishes (a
    pin never blocks admission, growth or a swap-in)."""

    @initialize(
        num_blocks=st.integers(6, 10),
        budget=st.sampled_from([4, 8, 64]),
        max_num_seqs=st.integers(1, 4),
        mode=st.sampled_from(["recompute", "swap"]),
    )
    def setup(self, num_blocks, budget, max_num_seqs, mode) -> None:
        kv = KVCacheManager(
            num_blocks, 2, num_host_blocks=num_blocks if mode == "swap" else 0, watermark=0.1
        )
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=12,
            preemption_mode=mode,
        )
        self.s = Scheduler(config, kv)
        self.next_id = 0

    @rule(
        tenant=st.integers(0, 2),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=4),
        max_tokens=st.integers(1, 4),
        priority=st.sampled_from([0, 0, -1]),
    )
    def arrive(self, tenant, suffix, max_tokens, priority) -> None:
        self.next_id += 1
        tokens = [*range(10 * tenant, 10 * tenant + 6), *suffix]
        new = request(f"r{self.next_id}", tokens, max_tokens, priority=priority)
        try:
            self.s.add_request(new)
        except ValueError:
            return  # larger than the whole cache
        if self.s.kv.pinned_block_ids(new.request_id):
            event("pinned on arrival")

    @rule()
    def step(self) -> None:
        before = self.s.stats()
        output = self.s.schedule()
        self.s.update(output, run_model(output))
        after = self.s.stats()
        if after.num_pins_given_up > before.num_pins_given_up:
            event("pins given up")
        if after.num_preemptions > before.num_preemptions:
            event("preempted")

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        assert self.s.kv.pinned_block_ids(request_id) == []

    @rule(n=st.integers(1, 4))
    def evict(self, n) -> None:
        self.s.kv.evict_cached_blocks(n)

    @rule()
    def drain(self) -> None:
        for _ in range(300):
            if not self.s.has_unfinished_requests():
                break
            output = self.s.schedule()
            self.s.update(output, run_model(output))
            self.s.kv.check_invariants()
        assert not self.s.has_unfinished_requests(), "requests never finished"
        assert self.s.kv.num_pinned_requests == 0
        assert self.s.kv.pool.num_used_blocks == 0

    @invariant()
    def pins_are_exact(self) -> None:
        kv = self.s.kv
        kv.check_invariants()  # ref counts == tables + pins
        waiting = {r.request_id for r in self.s.waiting}
        for request_id in self.s.requests:
            if kv.pinned_block_ids(request_id):
                assert request_id in waiting, f"{request_id} pinned but not waiting"
        stats = kv.stats()
        assert stats.blocks_pinned <= stats.blocks_used
        assert (
            stats.blocks_used + stats.blocks_cached_free + stats.blocks_free + stats.blocks_retired
            == stats.blocks_total
        )


SchedulerPinMachine.TestCase.settings = settings(
    max_examples=300 if os.environ.get("CI") else 60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerPins = SchedulerPinMachine.TestCase
