"""One block table per KV cache group for models mixing full and sliding-window layers.

Each group (``core/kv_groups.py``) is a ``KVCacheManager`` of its own over the one shared
``BlockPool``: its own block tables, hashes salted with the group's index (the same
tokens hold other layers' K/V in each group), its window. The sliding groups release
what fell out of their window (their entries become the shared placeholder block, as in
a uniform-window manager) while the full group keeps every block::

    request r, block size 4, window 8, 30 tokens computed
    group 0 (full)      [ 7  3  9 12 15  4 21 30]
    group 1 (window 8)  [ N  N  N  N  N 18  2 11]     N: the placeholder

Everything a request does happens in every group or in none: ``allocate_slots`` counts
the blocks all groups need before any group takes one; a prefix hit is a length every
group can serve (the full groups need every block before it, a sliding group only those
its window reaches from the first token computed). Requests preempted from such a model
are recomputed: swapping, the disk tier and per-request block hashes for routers stay with
the uniform manager (``can_swap_out`` is False, so the scheduler recomputes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.cache_events import CacheEventLog
from pagedllm.core.device_pool import DevicePoolViews
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_records import (
    Allocation,
    CacheStats,
    ComputedBlocks,
    GroupCacheStats,
    check_held,
)
from pagedllm.core.pins import Pins
from pagedllm.core.request import Request
from pagedllm.core.tiers import NO_DISK_OPS, DiskOps

_NO_HIT = ComputedBlocks()


class HybridKVCacheManager(DevicePoolViews):
    """Block tables per KV cache group over one shared pool; the scheduler's view is
    ``KVCacheManager``'s. ``windows``: each group's window (None: full attention), group
    0 first: its tables are ``block_table``'s, the others' ``group_block_tables``'."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: Sequence[int | None],
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        if len(windows) < 2:
            raise ValueError("a grouped manager needs at least two groups")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.events = CacheEventLog()
        self.pool = BlockPool(num_blocks, events=self.events, track_released=True)
        self.null_block: int | None = None
        if any(w is not None for w in windows):
            self.null_block = self.pool.allocate(1)[0]
        self.groups = [
            KVCacheManager(
                num_blocks,
                block_size,
                enable_prefix_caching=enable_prefix_caching,
                watermark=watermark,
                sliding_window=window,
                pool=self.pool,
                null_block=self.null_block if window is not None else None,
                hash_salt=("kv-group", index) if index else (),
            )
            for index, window in enumerate(windows)
        ]
        self.disk = None
        self.num_host_blocks = 0
        self.pins = Pins(self.pool)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.sliding_window for group in self.groups)

    @property
    def sliding_window(self) -> int | None:
        """The narrowest window of any group (for reports)."""
        return min((w for w in self.windows if w is not None), default=None)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # ---- prefix lookup and allocation ----------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix every group can serve, capped at ``num_tokens - 1``
        tokens. A full group needs each block before it; a sliding group those its
        window reaches from the first token to compute (the earlier entries are the
        placeholder). ``block_ids`` are group 0's, ``group_block_ids`` the others'."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return _NO_HIT
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        found = [group.lookup_blocks(request, max_blocks) for group in self.groups]
        num = min(len(f) for f in found)
        for group, blocks in zip(self.groups, found, strict=True):
            if group.sliding_window is None:
                num = min(num, blocks.index(None) if None in blocks else len(blocks))
        while num and not all(
            None not in blocks[self._first_needed(group, num) : num]
            for group, blocks in zip(self.groups, found, strict=True)
        ):
            num -= 1
        if not num:
            return _NO_HIT
        tables = []
        for group, blocks in zip(self.groups, found, strict=True):
            first = self._first_needed(group, num)
            tables.append((self.null_block,) * first + tuple(blocks[first:num]))  # type: ignore[arg-type]
        return ComputedBlocks(tables[0], num * bs, group_block_ids=tuple(tables[1:]))

    def _first_needed(self, group: KVCacheManager, num_blocks: int) -> int:
        """The first of ``num_blocks`` cached blocks the group reads when computing from
        the token after them (all of them for a full group)."""
        window = group.sliding_window
        if window is None:
            return 0
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def block_hashes(self, request: Request) -> Sequence[bytes]:
        """Group 0's block hashes (unsalted: the same as a uniform manager's)."""
        return self.groups[0].block_hashes(request)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
        *,
        admission: bool = False,
    ) -> Allocation | None:
        """``KVCacheManager.allocate_slots`` in every group, or (None) in none."""
        hits = self._group_hits(computed_blocks)
        free_after = self.pool.num_free_blocks - self._blocks_to_allocate(
            request, num_new_tokens, hits
        )
        if free_after < 0 or (admission and free_after < self.watermark_blocks):
            return None
        # The hits are held while the groups allocate: a block one group takes from
        # the cached-free list must not be another group's hit.
        hit_ids = [b for hit in hits if hit is not None for b in hit.block_ids]
        self.pool.incref(hit_ids)
        try:
            done = [
                group.allocate_slots(request, num_new_tokens, hit)
                for group, hit in zip(self.groups, hits, strict=True)
            ]
        finally:
            self.pool.decref(hit_ids)
        assert all(a is not None for a in done), "counted room before allocating"
        self.release_pin(request)  # the tables hold their own references now
        return Allocation(
            tuple(b for a in done for b in a.new_block_ids),  # type: ignore[union-attr]
            tuple(c for a in done for c in a.block_copies),  # type: ignore[union-attr]
        )

    def _group_hits(self, computed: ComputedBlocks | None) -> list[ComputedBlocks | None]:
        if computed is None:
            return [None] * len(self.groups)
        if not computed.num_tokens:
            return [computed] * len(self.groups)
        if len(computed.group_block_ids) != len(self.groups) - 1 or computed.num_disk_blocks:
            raise ValueError("computed_blocks do not come from this manager's lookup")
        tables = (computed.block_ids, *computed.group_block_ids)
        return [ComputedBlocks(table, computed.num_tokens) for table in tables]

    def blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
    ) -> int:
        return self._blocks_to_allocate(request, num_new_tokens, self._group_hits(computed_blocks))

    def _blocks_to_allocate(
        self, request: Request, num_new_tokens: int, hits: list[ComputedBlocks | None]
    ) -> int:
        return sum(
            group.blocks_to_allocate(request, num_new_tokens, hit)
            for group, hit in zip(self.groups, hits, strict=True)
        )

    def cache_full_blocks(self, request: Request) -> None:
        for group in self.groups:
            group.cache_full_blocks(request)

    def release_out_of_window(self, request: Request) -> int:
        """Release, in each sliding group, the blocks its window passed; how many."""
        return sum(group.release_out_of_window(request) for group in self.groups)

    def release_unverified(self, request: Request) -> int:
        """``KVCacheManager.release_unverified`` in every group."""
        return sum(group.release_unverified(request) for group in self.groups)

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` cached tokens holds at its peak in all
        groups together (``KVCacheManager.blocks_needed`` per group), the placeholder
        counted once."""
        total = sum(group.blocks_needed(num_tokens, max_step_tokens) for group in self.groups)
        num_sliding = sum(w is not None for w in self.windows)
        return total - num_sliding + (num_sliding > 0)

    def fork(self, parent: Request, child: Request) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def free(self, request: Request) -> None:
        self.release_pin(request)
        for group in self.groups:
            group.free(request)

    # ---- tiers a grouped manager does not keep ----------------------------------------

    def take_disk_ops(self) -> DiskOps:
        return NO_DISK_OPS

    def loads_failed(self, block_ids: set[int]) -> None:
        if block_ids:
            raise ValueError("a grouped KV cache has no disk tier: nothing was loaded")

    def can_swap_out(self, request: Request) -> bool:
        """Always False: a request of a grouped model is preempted by recompute."""
        return False

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        return None

    def can_swap_in(self, request: Request) -> bool:
        return False

    def blocks_to_swap_in(self, request: Request) -> int:
        raise ValueError(f"request {request.request_id!r} is not swapped out")

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        raise ValueError(f"request {request.request_id!r} is not swapped out")

    def is_swapped(self, request_id: str) -> bool:
        return False

    # ---- resizing -----------------------------------------------------------------

    def _blocks_relocated(self, mapping: dict[int, int]) -> None:
        for group in self.groups:
            group.remap_tables(mapping)
        if self.null_block is not None:
            self.null_block = mapping.get(self.null_block, self.null_block)

    def _resized(self) -> None:
        for group in self.groups:
            group.pool_resized()

    # ---- views --------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return self.groups[0].block_table(request_id)

    def block_table_tuple(self, request_id: str) -> tuple[int, ...]:
        """Group 0's table (see ``KVCacheManager.block_table_tuple``)."""
        return self.groups[0].block_table_tuple(request_id)

    def group_block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The tables of groups 1.. (each the same object while unchanged)."""
        return tuple(group.block_table_tuple(request_id) for group in self.groups[1:])

    def host_block_table(self, request_id: str) -> list[int]:
        return []

    @property
    def host_pool(self) -> BlockPool:
        return self.groups[0].host_pool

    def num_slots(self, request_id: str) -> int:
        return self.groups[0].num_slots(request_id)

    @property
    def num_free_host_blocks(self) -> int:
        return 0

    def stats(self) -> CacheStats:
        per_group = [group.stats() for group in self.groups]
        first = per_group[0]
        used = self.pool.num_used_blocks
        cached = self.pool.num_cached_free_blocks
        retired = self.pool.num_retired_blocks
        groups = tuple(
            GroupCacheStats(
                sliding_window=group.sliding_window,
                blocks_used=group.num_blocks_held(),
                window_freed_blocks=stats.window_freed_blocks,
            )
            for group, stats in zip(self.groups, per_group, strict=True)
        )
        return CacheStats(
            block_size=self.block_size,
            blocks_total=self.num_blocks,
            blocks_used=used,
            blocks_cached_free=cached,
            blocks_free=self.num_blocks - used - cached - retired,
            host_blocks_total=0,
            host_blocks_used=0,
            prefix_queries_tokens=first.prefix_queries_tokens,
            prefix_hits_tokens=first.prefix_hits_tokens,
            blocks_retired=retired,
            blocks_pinned=self.num_pinned_only_blocks,
            sliding_window=self.sliding_window,
            window_freed_blocks=sum(g.window_freed_blocks for g in groups),
            groups=groups,
        )

    def live_block_tables(self) -> dict[str, list[int]]:
        """Group 0's tables (``live_group_block_tables``: every group's)."""
        return self.groups[0].live_block_tables()

    def live_group_block_tables(self) -> list[dict[str, list[int]]]:
        """Every group's tables, by request id, in group order (copies)."""
        return [group.live_block_tables() for group in self.groups]

    def live_host_block_tables(self) -> dict[str, list[int]]:
        return {}

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool, every group's tables and the prefix
        index agree: a block's ref count is the number of tables (of any group) holding
        it, and no block is in two groups."""
        self.pool.check_invariants(self.block_size, verify_hashes=True)
        held: Counter[int] = Counter()
        if self.null_block is not None:
            held[self.null_block] = 1  # the manager's own reference
        owner: dict[int, int] = {}
        for index, group in enumerate(self.groups):
            assert group.null_block in (None, self.null_block), f"group {index}: placeholder"
            group.check_tables(held)
            for table in group.live_block_tables().values():
                for block_id in table:
                    if block_id != self.null_block:
                        assert owner.setdefault(block_id, index) == index, (
                            f"block {block_id} in groups {owner[block_id]} and {index}"
                        )
        self.check_pins(held)
        check_held(self.pool, held)
