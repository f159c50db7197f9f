"""What a KV cache manager does with its device pool alone: the elastic pool's shrink
and grow (``core/compaction.py`` plans the moves), eviction, counts, and the pins of
waiting requests (``core/pins.py``). The base of ``KVCacheManager`` and of the grouped
manager (``core/hybrid_kv.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.compaction import CompactionPlan, plan_compaction, settle_limit
from pagedllm.core.kv_records import ComputedBlocks
from pagedllm.core.pins import Pins
from pagedllm.core.request import Request


class DevicePoolViews:
    """What a manager does with its device pool alone: the elastic pool's shrink and
    grow, eviction, counts, pins (shared by ``KVCacheManager`` and the grouped manager).
    A waiting request's pin (``core/pins.py``) holds its cached prefix (``pin_prefix``,
    when it arrives) until it is admitted, leaves (``release_pin``, ``free``) or gives
    way to an allocation that needs the room (``give_up_pins``)."""

    pool: BlockPool
    host_pool: BlockPool
    num_blocks: int
    watermark: float
    null_block: int | None
    pins: Pins

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        raise NotImplementedError

    def blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
    ) -> int:
        raise NotImplementedError

    @property
    def watermark_blocks(self) -> int:
        """Free blocks an admission leaves (``watermark`` of the pool as it is now)."""
        return int(self.watermark * self.num_blocks)

    def free_blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
        *,
        admission: bool = False,
    ) -> int:
        """Free blocks ``allocate_slots`` with these arguments needs to succeed: those it
        takes, plus the watermark on admission (0: it takes none)."""
        num_blocks = self.blocks_to_allocate(request, num_new_tokens, computed_blocks)
        if not num_blocks:
            return 0
        return num_blocks + (self.watermark_blocks if admission else 0)

    # ---- pins: a waiting request's cached prefix (``core/pins.py``) ---------------

    def pin_prefix(self, request: Request) -> int:
        """Pin the device blocks of the request's cached prefix (the blocks admission
        would find now: ``get_computed_blocks``); returns how many. For a request that
        holds no blocks yet."""
        if self.pins.holds(request.request_id):
            raise ValueError(f"request {request.request_id!r} is already pinned")
        hit = self.get_computed_blocks(request)
        null = self.null_block
        block_ids = [
            b for table in (hit.block_ids, *hit.group_block_ids) for b in table if b != null
        ]
        return self.pins.pin(request.request_id, block_ids)

    def release_pin(self, request: Request) -> int:
        """End the request's pin (``Pins.release``); returns how many blocks it held."""
        return self.pins.release(request.request_id)

    def give_up_pins(self, requests: Iterable[Request], num_free_blocks: int) -> int:
        """``Pins.give_up``: release pins until ``num_free_blocks`` blocks are free."""
        return self.pins.give_up(requests, num_free_blocks)

    @property
    def num_pinned_requests(self) -> int:
        return self.pins.num_requests

    def pinned_block_ids(self, request_id: str) -> list[int]:
        """The blocks the request's pin holds (a copy; empty if none)."""
        return self.pins.block_ids(request_id)

    def check_pins(self, held: Counter[int]) -> None:
        """A pinned request holds no table and no block twice; adds the pins' blocks to
        ``held`` (``check_invariants``)."""
        self.pins.check(self.live_block_tables(), held)

    def live_block_tables(self) -> dict[str, list[int]]:
        raise NotImplementedError

    @property
    def num_pinned_only_blocks(self) -> int:
        """Blocks held by pins alone (cached-free but for them)."""
        return self.pins.num_pinned_only_blocks

    # ---- counts, eviction, resizing ------------------------------------------------

    def take_released_block_ids(self) -> tuple[int, ...]:
        """Device blocks released since the last call (nobody reads their contents any
        more: the ref count reached zero, or for a hashed block, it left the prefix index):
        the worker drops per-block state it keeps outside the pool (a quantized cache's
        staging slots)."""
        return self.pool.take_released()

    def evict_cached_blocks(self, num_blocks: int | None = None) -> int:
        """Drop up to ``num_blocks`` (default all) cached-free blocks from the prefix
        index, least recently used first; returns how many were evicted."""
        return len(self.pool.evict(num_blocks))

    def begin_shrink(self, num_blocks: int) -> None:
        """Start shrinking the device tier to ``num_blocks``: allocation comes from below
        it from now on; compaction slices empty the tail; ``finish_shrink`` drops it."""
        if not 0 < num_blocks <= self.num_blocks:
            raise ValueError(f"num_blocks must be in [1, {self.num_blocks}], got {num_blocks}")
        self.pool.set_limit(num_blocks)

    def plan_compaction(self, max_moves: int | None = None) -> CompactionPlan:
        """The next slice of the shrink in progress (changes nothing)."""
        return plan_compaction(self.pool, max_moves=max_moves)

    def apply_compaction(self, plan: CompactionPlan) -> None:
        """Move the books as ``plan`` says, once the worker has copied its blocks: the
        pool (ref counts, prefix index, LRU order), then whatever names blocks by id
        (``_blocks_relocated``)."""
        self.pool.drop(plan.drops)
        if not plan.moves:
            return
        mapping = plan.mapping()
        self.pool.relocate(plan.moves)
        self.pins.remap(mapping)
        self._blocks_relocated(mapping)

    def _blocks_relocated(self, mapping: dict[int, int]) -> None:
        """Rename moved blocks (old id -> new id) everywhere the manager keeps ids."""
        raise NotImplementedError

    def finish_shrink(self, *, settle: bool = False) -> int:
        """Drop the tail; returns the new number of blocks. With ``settle``, stop where
        compaction got to: past the highest block still holding data."""
        pool = self.pool
        if settle:
            pool.set_limit(settle_limit(pool))
        self._tail_dropped(range(pool.limit, pool.num_blocks))
        pool.truncate()
        self._resized()
        return self.num_blocks

    def _tail_dropped(self, block_ids: range) -> None:
        """The blocks ``finish_shrink`` is about to drop (nothing to do here)."""

    @property
    def shrink_pending(self) -> bool:
        """A shrink is under way: blocks at or above the limit still hold data."""
        return bool(self.pool.occupied_above(self.pool.limit))

    def grow(self, num_blocks: int) -> None:
        """Add free device blocks up to ``num_blocks`` (ends a shrink in progress)."""
        self.pool.grow(num_blocks)
        self._resized()

    def _resized(self) -> None:
        """The pool grew or shrank: update what is derived from its size."""

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usable_blocks(self) -> int:
        """Device blocks allocation may use: all of them, or the target of a shrink."""
        return self.pool.limit

    @property
    def usage(self) -> float:
        """Fraction of device blocks held by live requests."""
        return self.pool.num_used_blocks / self.num_blocks

    def block_states(self, *, host: bool = False) -> list[int]:
        """Each device (or host) block's state by id: ``block_pool.BLOCK_FREE``,
        ``BLOCK_CACHED_FREE`` or ``BLOCK_USED`` (a new list)."""
        return (self.host_pool if host else self.pool).block_states()

    def block_ref_counts(self, *, host: bool = False) -> list[int]:
        """Each device (or host) block's ref count by id (a new list)."""
        return (self.host_pool if host else self.pool).ref_counts()
