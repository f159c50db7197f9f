"""A Hypothesis state machine over the grouped KV manager (one table per KV cache group).

It drives admission with prefix hits, chunked prefill, decode, fork with copy-on-write,
free, eviction and the elastic pool's shrink/compact/grow in random orders over random
group windows, keeps a fake KV store (each slot holds its group and token id, so a block
that changed groups or a hit handed to the wrong group shows up) that applies every copy
and move, and after every rule checks the manager's invariants (ref counts = tables of
every group holding a block, no block in two groups), that every computed token each
group can still read is there, and that waste adds up over the groups.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core.accounting import group_wastes, waste
from pagedllm.core.hybrid_kv import HybridKVCacheManager
from pagedllm.core.request import Request

from .conftest import copy_blocks

PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5])
TOKENS = st.integers(0, 3)


def snapshot(kv: HybridKVCacheManager) -> tuple:
    return (
        kv.pool.free_queue_order(),
        kv.pool.cached_free_order(),
        kv.pool.ref_counts(),
        kv.pool.hashed_blocks(),
        kv.live_group_block_tables(),
        kv.stats(),
    )


class HybridKVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.running: dict[str, Request] = {}
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(4, 40),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1]),
        windows=st.lists(st.sampled_from([None, 1, 3, 6]), min_size=2, max_size=4),
    )
    def setup(self, num_blocks, block_size, caching, watermark, windows) -> None:
        self.kv = HybridKVCacheManager(
            num_blocks,
            block_size,
            windows,
            enable_prefix_caching=caching,
            watermark=watermark,
        )
        self.bs = block_size
        # The fake KV cache: (block, offset) -> (group, token id). Freed blocks keep
        # stale contents, as real memory does.
        self.device: dict[tuple[int, int], tuple[int, int]] = {}

    # ---- helpers ----------------------------------------------------------------

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def group_tables(self, request_id: str) -> list[list[int]]:
        return [self.kv.block_table(request_id), *map(list, self.kv.group_block_tables(request_id))]

    def compute(self, request: Request, num_new: int, allocation) -> None:
        if allocation.block_copies:
            event("copy-on-write")
        copy_blocks(allocation.block_copies, self.device, self.device, self.bs)
        start = request.num_computed_tokens
        for group, table in enumerate(self.group_tables(request.request_id)):
            for pos in range(start, start + num_new):
                block = table[pos // self.bs]
                assert block != self.kv.null_block, "a token written to the placeholder"
                self.device[block, pos % self.bs] = (group, request.all_token_ids[pos])
        request.num_computed_tokens += num_new
        self.kv.cache_full_blocks(request)
        if self.kv.release_out_of_window(request):
            event("released out of the window")

    def first_visible(self, window: int | None, request: Request) -> int:
        if window is None:
            return 0
        return max(0, request.num_computed_tokens - window + 1) // self.bs * self.bs

    # ---- rules ------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(TOKENS, min_size=1, max_size=10),
        chunk=st.integers(1, 20),
        admission=st.booleans(),
    )
    def add_request(self, prefix, suffix, chunk, admission) -> None:
        request = Request(self.new_id(), [*prefix, *suffix])
        hit = self.kv.get_computed_blocks(request)
        assert hit.num_tokens < request.num_tokens
        if hit.num_tokens:
            event("prefix hit")
            # Each group's hit holds its own K/V of these tokens where its window reaches.
            first = hit.num_tokens  # the first token computed
            for group, (window, ids) in enumerate(
                zip(self.kv.windows, (hit.block_ids, *hit.group_block_ids), strict=True)
            ):
                assert len(ids) * self.bs == hit.num_tokens
                start = 0 if window is None else max(0, first - window + 1)
                for pos in range(start, hit.num_tokens):
                    stored = self.device.get((ids[pos // self.bs], pos % self.bs))
                    assert stored == (group, request.all_token_ids[pos]), f"hit at {pos}"
        num_new = min(chunk, request.num_tokens - hit.num_tokens)
        before = snapshot(self.kv)
        allocation = self.kv.allocate_slots(request, num_new, hit, admission=admission)
        if allocation is None:
            event("admission refused")
            assert snapshot(self.kv) == before
            self.kv.free(request)
            return
        request.num_computed_tokens = hit.num_tokens
        self.compute(request, num_new, allocation)
        self.running[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=TOKENS, chunk=st.integers(1, 6))
    def step(self, data, token, chunk) -> None:
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(token)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        before = snapshot(self.kv)
        allocation = self.kv.allocate_slots(request, num_new)
        if allocation is None:
            assert snapshot(self.kv) == before
            return
        self.compute(request, num_new, allocation)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if parent.num_computed_tokens < parent.num_tokens:
            return
        child = Request(
            self.new_id(),
            list(parent.prompt_token_ids),
            output_token_ids=list(parent.output_token_ids),
        )
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        assert self.group_tables(child.request_id) == self.group_tables(parent.request_id)
        self.running[child.request_id] = child

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data) -> None:
        request = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.kv.free(request)
        assert self.group_tables(request.request_id) == [[]] * len(self.kv.groups)

    @rule(n=st.integers(1, 4))
    def evict(self, n) -> None:
        cached = self.kv.pool.num_cached_free_blocks
        assert self.kv.evict_cached_blocks(n) == min(n, cached)

    @rule(fraction=st.floats(0.0, 1.0))
    def begin_shrink(self, fraction) -> None:
        if not self.kv.shrink_pending:
            self.kv.begin_shrink(max(1, round(fraction * self.kv.num_blocks)))

    @rule(max_moves=st.one_of(st.none(), st.integers(1, 3)))
    def compact(self, max_moves) -> None:
        plan = self.kv.plan_compaction(max_moves)
        copy_blocks(plan.moves, self.device, self.device, self.bs)
        if plan.moves:
            event("compaction moved blocks")
        self.kv.apply_compaction(plan)

    @rule(settle=st.booleans())
    def finish_shrink(self, settle) -> None:
        if self.kv.shrink_pending and not settle:
            return
        self.kv.finish_shrink(settle=settle)

    @rule(extra=st.integers(1, 8))
    def grow(self, extra) -> None:
        self.kv.grow(self.kv.num_blocks + extra)

    # ---- invariants -------------------------------------------------------------

    @invariant()
    def manager_consistent(self) -> None:
        if hasattr(self, "kv"):
            self.kv.check_invariants()

    @invariant()
    def no_tokens_lost(self) -> None:
        """Every computed token a group can still read is in its block, tagged with it."""
        for request in self.running.values():
            tables = self.group_tables(request.request_id)
            for group, (window, table) in enumerate(zip(self.kv.windows, tables, strict=True)):
                for pos in range(self.first_visible(window, request), request.num_computed_tokens):
                    slot = (table[pos // self.bs], pos % self.bs)
                    assert self.device.get(slot) == (group, request.all_token_ids[pos]), (
                        f"{request.request_id} group {group} lost token {pos}"
                    )

    @invariant()
    def sliding_groups_hold_a_window(self) -> None:
        """A sliding group's table holds no real block wholly before its window."""
        for request in self.running.values():
            tables = self.group_tables(request.request_id)
            for window, table in zip(self.kv.windows, tables, strict=True):
                dead = self.first_visible(window, request) // self.bs
                assert all(b == self.kv.null_block for b in table[:dead])

    @invariant()
    def waste_adds_up_over_groups(self) -> None:
        if not hasattr(self, "kv"):
            return
        tokens = {rid: r.all_token_ids for rid, r in self.running.items()}
        reports = group_wastes(self.kv, tokens, next_request_len=5)
        total = waste(self.kv, tokens, next_request_len=5)
        placeholder = self.kv.null_block is not None
        assert total.allocated_slots == (self.kv.pool.num_used_blocks - placeholder) * self.bs
        assert total.allocated_slots == sum(r.allocated_slots for r in reports)
        assert 0 <= total.internal_tokens <= total.allocated_slots
        assert 0 <= total.duplication_tokens <= total.filled_slots
        assert [g.blocks_used for g in self.kv.stats().groups] == [
            r.allocated_slots // self.bs for r in reports
        ]


HybridKVMachine.TestCase.settings = settings(
    max_examples=300 if os.environ.get("CI") else 100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHybridKVMachine = HybridKVMachine.TestCase
