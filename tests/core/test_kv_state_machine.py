"""A Hypothesis state machine over the KV cache manager.

It drives allocate / append / speculate (draft slots, then a rollback to the accepted
ones) / fork / copy-on-write / free / swap_out / swap_in / evict, and pins (a request arriving pins its cached prefix, waits, then is admitted,
aborted, or gives its pin up), in random orders, keeps a fake KV store (one token id per slot, on both
tiers, plus a disk of whole blocks by hash) that applies every copy, move, store and
load the manager asks for, and after every rule checks the manager's invariants and
that every request's computed tokens can be read back through its block table on its
tier. Disk files get lost at random: a load of one is a miss the manager is told of.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedllm.core.accounting import waste
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.tiers import DiskTier

from .conftest import copy_blocks

# A few shared prefixes over a tiny alphabet, so hits, collisions of content
# across tenants and shared partial blocks all happen often.
PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5])
TOKENS = st.integers(0, 3)


def snapshot(kv: KVCacheManager, request_ids) -> tuple:
    return (
        kv.pool.free_queue_order(),
        kv.pool.cached_free_order(),
        [kv.pool.ref_count(b) for b in range(kv.num_blocks)],
        kv.pool.hashed_blocks(),
        kv.live_block_tables(),
        {rid: kv.host_block_table(rid) for rid in request_ids},
        kv.host_pool.free_queue_order(),
        [kv.host_pool.ref_count(b) for b in range(kv.num_host_blocks)],
        kv.stats(),
    )


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.running: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}  # arrived, pinned (maybe), not admitted
        self.disk: dict[bytes, dict[int, int]] = {}  # block hash -> slot offset -> token
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(3, 32),
        block_size=st.sampled_from([1, 2, 4]),
        num_host_blocks=st.integers(0, 32),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1, 0.3]),
        num_disk_blocks=st.sampled_from([0, 0, 2, 8, 64]),
        window=st.sampled_from([None, None, 1, 3, 6]),
        first_cap=st.sampled_from([None, None, 0, 1, 3]),
    )
    def setup(
        self,
        num_blocks,
        block_size,
        num_host_blocks,
        caching,
        watermark,
        num_disk_blocks,
        window,
        first_cap,
    ) -> None:
        self.window = window
        self.kv = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=caching,
            num_host_blocks=num_host_blocks,
            watermark=watermark,
            disk=DiskTier(num_disk_blocks) if num_disk_blocks else None,
            sliding_window=window,
            max_cached_first_blocks=first_cap,
        )
        self.readable: set[int] = set()  # referenced or cached-free after the last rule
        self.disk: dict[bytes, dict[int, int]] = {}  # block hash -> slot offset -> token
        self.bs = block_size
        # The fake KV cache: slot -> token id. Freed blocks keep stale contents,
        # as real memory does, so a wrong reuse shows up as a wrong token.
        self.device: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}

    # ---- helpers ----------------------------------------------------------------

    def all_ids(self) -> list[str]:
        return [*self.running, *self.swapped]

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def write(self, request: Request, start: int, end: int) -> None:
        table = self.kv.block_table(request.request_id)
        for pos in range(start, end):
            self.device[table[pos // self.bs], pos % self.bs] = request.all_token_ids[pos]

    def copy_blocks(self, pairs, src_tier, dst_tier) -> None:
        copy_blocks(pairs, src_tier, dst_tier, self.bs)

    def disk_io(self) -> set[int]:
        """Do the disk I/O the manager planned; the device blocks that failed to load."""
        ops = self.kv.take_disk_ops()
        failed = set()
        for block_id, block_hash, _ in ops.stores:
            self.disk[block_hash] = {
                off: self.device[block_id, off]
                for off in range(self.bs)
                if (block_id, off) in self.device
            }
        for block_id, block_hash, _ in ops.loads:
            content = self.disk.get(block_hash)
            if content is None:
                failed.add(block_id)
                continue
            event("disk load")
            for off in range(self.bs):
                self.device.pop((block_id, off), None)
            for off, token in content.items():
                self.device[block_id, off] = token
        for block_hash in ops.drops:
            self.disk.pop(block_hash, None)
        if failed:
            event("disk load failed")
            self.kv.loads_failed(failed)
        return failed

    def compute(self, request: Request, num_new: int, allocation) -> None:
        if allocation.block_copies:
            event("copy-on-write")
        for _, dst in allocation.block_copies:
            assert self.kv.pool.ref_count(dst) == 1, "copy-on-write target is shared"
        self.copy_blocks(allocation.block_copies, self.device, self.device)
        start = request.num_computed_tokens
        self.write(request, start, start + num_new)
        request.num_computed_tokens += num_new
        self.kv.cache_full_blocks(request)
        if self.kv.release_out_of_window(request):
            event("released out of the window")
        self.disk_io()

    # ---- rules ------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(TOKENS, min_size=1, max_size=10),
        salt=st.sampled_from([None, None, "tenant"]),
        chunk=st.integers(1, 20),
        admission=st.booleans(),
    )
    def add_request(self, prefix, suffix, salt, chunk, admission) -> None:
        request = Request(self.new_id(), [*prefix, *suffix], cache_salt=salt)
        hit = self.kv.get_computed_blocks(request)
        assert hit.num_tokens < request.num_tokens
        for i, block_id in enumerate(hit.block_ids):
            tokens = request.all_token_ids[i * self.bs : (i + 1) * self.bs]
            assert self.kv.pool.block_token_ids(block_id) == tuple(tokens)
        num_new = min(chunk, request.num_tokens - hit.num_tokens)
        if hit.num_tokens:
            event("prefix hit")
        before = snapshot(self.kv, self.all_ids())
        allocation = self.kv.allocate_slots(request, num_new, hit, admission=admission)
        if allocation is None:
            event("admission refused")
            assert snapshot(self.kv, self.all_ids()) == before
            self.kv.free(request)  # drops the hashes get_computed_blocks kept
            return
        if hit.num_disk_blocks:
            event("disk hit")
        if self.disk_io():
            self.kv.free(request)  # as Scheduler.reject_loads does; it will be recomputed
            return
        request.num_computed_tokens = hit.num_tokens
        self.compute(request, num_new, allocation)
        self.running[request.request_id] = request

    # ---- pins: arrive (pin), admit, abort, give up ---------------------------------

    @rule(
        data=st.data(),
        suffix=st.lists(TOKENS, min_size=1, max_size=10),
        salt=st.sampled_from([None, None, "tenant"]),
    )
    def arrive(self, data, suffix, salt) -> None:
        # Often a running request's prompt: its blocks are cached, so there is a pin.
        prompts = [r.prompt_token_ids for _, r in sorted(self.running.items())]
        prefix = data.draw(st.sampled_from([*PREFIXES, *prompts]))
        request = Request(self.new_id(), [*prefix, *suffix], cache_salt=salt)
        expected = self.kv.get_computed_blocks(request).block_ids
        assert self.kv.pin_prefix(request) == len(expected)
        assert self.kv.pinned_block_ids(request.request_id) == list(expected)
        if expected:
            event("pinned a prefix")
        self.waiting[request.request_id] = request

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 20), admission=st.booleans())
    def admit(self, data, chunk, admission) -> None:
        request = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        pinned = self.kv.pinned_block_ids(request.request_id)
        hit = self.kv.get_computed_blocks(request)
        assert list(hit.block_ids[: len(pinned)]) == pinned, "a pinned block was lost"
        num_new = min(chunk, request.num_tokens - hit.num_tokens)
        before = snapshot(self.kv, self.all_ids())
        allocation = self.kv.allocate_slots(request, num_new, hit, admission=admission)
        if allocation is None:
            assert snapshot(self.kv, self.all_ids()) == before
            assert self.kv.pinned_block_ids(request.request_id) == pinned
            return
        del self.waiting[request.request_id]
        assert self.kv.pinned_block_ids(request.request_id) == []
        if pinned:
            event("admitted on a pinned prefix")
        if self.disk_io():
            self.kv.free(request)
            return
        request.num_computed_tokens = hit.num_tokens
        self.compute(request, num_new, allocation)
        self.running[request.request_id] = request

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), by_free=st.booleans())
    def abort_waiting(self, data, by_free) -> None:
        request = self.waiting.pop(data.draw(st.sampled_from(sorted(self.waiting))))
        if by_free:
            self.kv.free(request)
        else:
            self.kv.release_pin(request)
        assert self.kv.pinned_block_ids(request.request_id) == []

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def give_up_pins(self, data) -> None:
        order = data.draw(st.permutations(sorted(self.waiting)))
        requests = [self.waiting[rid] for rid in order]
        pins = {rid: self.kv.pinned_block_ids(rid) for rid in order}
        free_before = self.kv.pool.num_free_blocks
        # Up to one block more than all the pins would free.
        extra = data.draw(st.integers(0, self.freed_by(*pins.values()) + 1))
        target = free_before + extra
        released = self.kv.give_up_pins(requests, target)
        pinned_in_order = [rid for rid in order if pins[rid]]
        gone = [rid for rid in order if pins[rid] and not self.kv.pinned_block_ids(rid)]
        assert gone == pinned_in_order[:released], "pins given up out of order"
        if released:
            event("gave up pins")
            assert self.kv.pool.num_free_blocks >= target
            # The last pin released held the blocks now unreferenced among its own.
            last = sum(1 for b in pins[gone[-1]] if self.kv.pool.ref_count(b) == 0)
            assert self.kv.pool.num_free_blocks - last < target, "one pin too many given up"
        else:
            assert self.kv.pool.num_free_blocks == free_before
            # Either nothing was needed, or all of them would not have been enough.
            kept = [pins[rid] for rid in pinned_in_order]
            assert extra == 0 or free_before + self.freed_by(*kept) < target

    def freed_by(self, *pins: list[int]) -> int:
        """Blocks that releasing these pins would free: those only they hold."""
        counts = Counter(b for pin in pins for b in pin)
        return sum(1 for b, n in counts.items() if self.kv.pool.ref_count(b) == n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=TOKENS, chunk=st.integers(1, 6))
    def step(self, data, token, chunk) -> None:
        """Compute the next chunk of a prompt, or append a sampled token (maybe CoW)."""
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(token)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        before = snapshot(self.kv, self.all_ids())
        allocation = self.kv.allocate_slots(request, num_new)
        if allocation is None:
            assert snapshot(self.kv, self.all_ids()) == before
            return
        self.compute(request, num_new, allocation)

    @precondition(lambda self: self.running)
    @rule(
        data=st.data(),
        token=TOKENS,
        drafts=st.lists(TOKENS, min_size=1, max_size=6),
        accepted=st.integers(0, 6),
        bonus=TOKENS,
    )
    def speculate(self, data, token, drafts, accepted, bonus) -> None:
        """A decode with drafts: slots for the token and every draft, all written; then
        the first ``accepted`` drafts and one more token are kept and the rest rolled back
        (``release_unverified``). The token after the accepted drafts differs from the
        rejected draft there, so a rejected draft taken for computed K/V, or published,
        shows as a wrong token."""
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(token)
        if request.num_tokens - request.num_computed_tokens != 1:
            return  # a prompt still being computed takes no drafts
        before = snapshot(self.kv, self.all_ids())
        allocation = self.kv.allocate_slots(request, 1 + len(drafts))
        if allocation is None:
            assert snapshot(self.kv, self.all_ids()) == before
            return
        for _, dst in allocation.block_copies:
            assert self.kv.pool.ref_count(dst) == 1, "copy-on-write target is shared"
        self.copy_blocks(allocation.block_copies, self.device, self.device)
        start = request.num_computed_tokens
        table = self.kv.block_table(request.request_id)
        for offset, tok in enumerate([request.all_token_ids[start], *drafts]):
            pos = start + offset
            self.device[table[pos // self.bs], pos % self.bs] = tok
        accepted = min(accepted, len(drafts))
        if accepted < len(drafts) and bonus == drafts[accepted]:
            bonus = (bonus + 1) % 4
        request.append_output_token_ids([*drafts[:accepted], bonus])
        request.num_computed_tokens += 1 + accepted
        self.kv.cache_full_blocks(request)
        self.kv.release_out_of_window(request)
        released = self.kv.release_unverified(request)
        if released:
            event("rolled back a draft block")
        if accepted < len(drafts):
            event("rejected a draft")
        computed = request.num_computed_tokens
        assert len(self.kv.block_table(request.request_id)) == -(-computed // self.bs)
        assert self.kv.num_slots(request.request_id) == computed
        self.disk_io()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if parent.num_computed_tokens < parent.num_tokens:
            return  # the scheduler forks only after a step computed every token
        child = Request(
            self.new_id(),
            list(parent.prompt_token_ids),
            output_token_ids=list(parent.output_token_ids),
            cache_salt=parent.cache_salt,
        )
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        assert self.kv.block_table(child.request_id) == self.kv.block_table(parent.request_id)
        self.running[child.request_id] = child

    @precondition(lambda self: self.running or self.swapped)
    @rule(data=st.data())
    def free(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.all_ids())))
        request = self.running.pop(request_id, None) or self.swapped.pop(request_id)
        self.kv.free(request)
        assert self.kv.block_table(request_id) == []
        assert not self.kv.is_swapped(request_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        before = snapshot(self.kv, self.all_ids())
        can = self.kv.can_swap_out(request)
        moves = self.kv.swap_out(request)
        assert can == (moves is not None)
        if moves is None:
            assert snapshot(self.kv, self.all_ids()) == before
            return
        devices = [d for d, _ in moves]
        assert len(set(devices)) == len(devices), "a physical block moved twice"
        if len(moves) < len(self.kv.host_block_table(request.request_id)):
            event("swap_out shared a host block")
        self.copy_blocks(moves, self.device, self.host)
        self.swapped[request.request_id] = self.running.pop(request.request_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        request = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        before = snapshot(self.kv, self.all_ids())
        can = self.kv.can_swap_in(request)
        moves = self.kv.swap_in(request)
        assert can == (moves is not None)
        if moves is None:
            assert snapshot(self.kv, self.all_ids()) == before
            return
        if len(moves) < len(self.kv.block_table(request.request_id)):
            event("swap_in reused a device block")
        self.copy_blocks(moves, self.host, self.device)
        self.disk_io()
        self.running[request.request_id] = self.swapped.pop(request.request_id)

    @precondition(lambda self: self.disk)
    @rule(data=st.data())
    def lose_disk_file(self, data) -> None:
        """A file goes missing or corrupt behind the manager's back."""
        del self.disk[data.draw(st.sampled_from(sorted(self.disk)))]

    @rule(n=st.integers(1, 4))
    def evict(self, n) -> None:
        cached = self.kv.pool.num_cached_free_blocks
        assert self.kv.evict_cached_blocks(n) == min(n, cached)

    # ---- the elastic pool: shrink in slices, settle, grow -------------------------

    @rule(fraction=st.floats(0.0, 1.0))
    def begin_shrink(self, fraction) -> None:
        if self.kv.shrink_pending:
            return
        self.kv.begin_shrink(max(1, round(fraction * self.kv.num_blocks)))

    @rule(max_moves=st.one_of(st.none(), st.integers(1, 3)))
    def compact(self, max_moves) -> None:
        plan = self.kv.plan_compaction(max_moves)
        limit = self.kv.usable_blocks
        assert all(dst < limit <= src for src, dst in plan.moves)
        if plan.moves:
            event("compaction moved blocks")
        self.copy_blocks(plan.moves, self.device, self.device)
        self.kv.apply_compaction(plan)

    @rule(settle=st.booleans())
    def finish_shrink(self, settle) -> None:
        if self.kv.shrink_pending and not settle:
            return
        before = self.kv.num_blocks
        assert self.kv.finish_shrink(settle=settle) <= before
        if self.kv.num_blocks < before:
            event("pool shrank")

    @rule(extra=st.integers(1, 8))
    def grow(self, extra) -> None:
        self.kv.grow(self.kv.num_blocks + extra)

    # ---- invariants -------------------------------------------------------------

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        """A block found by its hash holds the tokens the index says (moves included)."""
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        for block_id in pool.hashed_blocks():
            stored = tuple(self.device.get((block_id, off)) for off in range(self.bs))
            assert stored == pool.block_token_ids(block_id), f"cached block {block_id}"

    @invariant()
    def blocks_nobody_reads_are_released(self) -> None:
        """A block that stopped being readable (referenced or cached-free) is among the
        blocks the worker is told were released since (it drops their staging slots)."""
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        released = set(self.kv.take_released_block_ids())
        readable = {
            b for b in range(pool.num_blocks) if pool.ref_count(b) or pool.is_cached_free(b)
        }
        assert self.readable - readable <= released, (self.readable - readable, released)
        self.readable = readable

    @invariant()
    def pinned_blocks_hold_the_prefix(self) -> None:
        """A waiting request's pinned blocks hold its tokens, moves and evictions aside,
        and are referenced (``manager_consistent`` counts the pins among the holders)."""
        for request_id, request in self.waiting.items():
            for i, block_id in enumerate(self.kv.pinned_block_ids(request_id)):
                assert self.kv.pool.ref_count(block_id) > 0
                tokens = tuple(request.all_token_ids[i * self.bs : (i + 1) * self.bs])
                stored = tuple(self.device.get((block_id, off)) for off in range(self.bs))
                assert stored == tokens, f"{request_id}: pinned block {block_id}"

    @invariant()
    def only_computed_blocks_are_published(self) -> None:
        """A block in the prefix index (and so on disk and in the router's events) that a
        running request holds lies wholly within its computed tokens: never a draft's."""
        if not hasattr(self, "kv"):
            return
        for request_id, request in self.running.items():
            for i, block_id in enumerate(self.kv.block_table(request_id)):
                if self.kv.pool.block_hash(block_id) is not None:
                    assert (i + 1) * self.bs <= request.num_computed_tokens, (
                        f"{request_id}: block {block_id} published past the computed tokens"
                    )

    @invariant()
    def manager_consistent(self) -> None:
        if hasattr(self, "kv"):
            self.kv.check_invariants()

    @invariant()
    def no_tokens_lost(self) -> None:
        """Every computed token reads back through the block table on its tier."""
        for requests, tier, table_of in (
            (self.running, getattr(self, "device", {}), self.kv_table),
            (self.swapped, getattr(self, "host", {}), self.host_table),
        ):
            for request in requests.values():
                table = table_of(request.request_id)
                for pos in range(self.first_visible(request), request.num_computed_tokens):
                    slot = (table[pos // self.bs], pos % self.bs)
                    assert tier.get(slot) == request.all_token_ids[pos], (
                        f"{request.request_id} lost token {pos}"
                    )

    @invariant()
    def waste_is_consistent(self) -> None:
        if not hasattr(self, "kv"):
            return
        tokens = {rid: r.all_token_ids for rid, r in self.running.items()}
        report = waste(self.kv, tokens, next_request_len=5)
        placeholder = self.kv.null_block is not None
        pinned_only = self.kv.num_pinned_only_blocks
        assert self.kv.stats().blocks_pinned == pinned_only
        assert (
            report.allocated_slots
            == (self.kv.pool.num_used_blocks - placeholder - pinned_only) * self.bs
        )
        assert 0 <= report.internal_tokens <= report.allocated_slots
        assert 0 <= report.duplication_tokens <= report.filled_slots
        assert report.external_tokens == 0
        assert report.headroom_tokens == (self.kv.pool.num_free_blocks + pinned_only) * self.bs
        assert self.kv.stats().blocks_free + self.kv.stats().blocks_retired == (
            self.kv.num_blocks - self.kv.pool.num_used_blocks - self.kv.pool.num_cached_free_blocks
        )
        # Brute force: physical slots written vs distinct (position, prefix) stored.
        slots, prefixes = set(), set()
        for request_id, request in self.running.items():
            table = self.kv.block_table(request_id)
            for pos in range(self.kv.num_slots(request_id)):
                if table[pos // self.bs] == self.kv.null_block:
                    continue
                slots.add((table[pos // self.bs], pos % self.bs))
                prefixes.add(tuple(request.all_token_ids[: pos + 1]))
        assert report.filled_slots == len(slots)
        assert report.duplication_tokens == len(slots) - len(prefixes)

    def first_visible(self, request: Request) -> int:
        """The first position a later query can read: 0 without a window; with one, the
        start of the first block the window has not passed."""
        if self.window is None:
            return 0
        dead = max(0, request.num_computed_tokens - self.window + 1) // self.bs
        return dead * self.bs

    def kv_table(self, request_id: str) -> list[int]:
        return self.kv.block_table(request_id)

    def host_table(self, request_id: str) -> list[int]:
        return self.kv.host_block_table(request_id)


KVCacheMachine.TestCase.settings = settings(
    max_examples=500 if os.environ.get("CI") else 100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
