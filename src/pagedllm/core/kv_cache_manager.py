"""The KV cache manager: the scheduler's only door to blocks.

A request's block table maps logical block i (tokens ``i*B .. i*B+B-1``) to a
physical block. After ``allocate_slots(request, k, computed)`` the table covers::

    |<- computed.num_tokens ->|<- num_computed_tokens ->|<- k new ->|
    |  prefix hit (admission) |   already in the cache  |  to write |
    |<-------- slots the table must hold (rounded up to blocks) --------->|

(at admission ``num_computed_tokens`` is 0, otherwise ``computed`` is empty).
Full blocks are immutable and shared by reference count; a shared *partial*
block is replaced by a private copy before it is written (copy-on-write), and
the ``(src, dst)`` copy travels to the worker.

Swapping moves a preempted request's blocks to the host tier (``tiers.HostSwapTier``,
a second pool with no prefix index, which keeps its own books). A physical block
shared by several swapped requests takes one host block and is moved once; so is a
host block on the way back.

With a disk tier (``tiers.DiskTier``), every block registered in the prefix index is
also stored on disk in the background, and a prefix lookup goes on past the last
block found in RAM through the hashes the disk holds::

    |<- RAM hits (block_ids) ->|<- disk hits (num_disk_blocks) ->|<- computed ... ->|

Admission allocates fresh blocks for the disk hits, indexes them at once and plans
their loads (``take_disk_ops``); a load the worker cannot do is handed back through
``loads_failed``, which takes those blocks out of the index.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.cache_events import CacheEventLog
from pagedllm.core.compaction import CompactionPlan, plan_compaction, remap_table, settle_limit
from pagedllm.core.hashing import hash_block_tokens
from pagedllm.core.request import Request
from pagedllm.core.tiers import NO_DISK_OPS, DiskOps, DiskTier, HostSwapTier, SwapPlan


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """The longest cached prefix of a request: full blocks only. ``block_ids`` are found
    in RAM; the next ``num_disk_blocks`` blocks are on disk (loaded at admission);
    ``num_tokens`` covers both."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    num_disk_blocks: int = 0
    # A grouped manager's hit (``core/hybrid_kv.py``): the tables of groups 1.. start so.
    group_block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Allocation:
    """What ``allocate_slots`` did: blocks it handed out (copy-on-write destinations
    included) and the ``(src, dst)`` copies the worker must do before the forward pass."""

    new_block_ids: tuple[int, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class GroupCacheStats:
    """One KV cache group of a grouped manager: its window (None: full attention), the
    distinct blocks its tables hold now, and those its window released so far."""

    sliding_window: int | None
    blocks_used: int
    window_freed_blocks: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot; ``blocks_used + blocks_cached_free + blocks_free + blocks_retired ==
    blocks_total``.

    Prefix queries and hits are counted in tokens once per successful admission
    (an ``allocate_slots`` call given ``computed_blocks`` for a request holding no
    blocks), so a request that waits several steps for room counts once.
    """

    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_cached_free: int
    blocks_free: int
    host_blocks_total: int
    host_blocks_used: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int  # from either tier
    # Free blocks held back during a shrink (``core/compaction.py``): never handed out,
    # released when it ends; counted in ``blocks_total``, not in ``blocks_free``.
    blocks_retired: int = 0
    # Of blocks_used: held only by waiting requests' pins (cached-free but for them; any
    # allocation that needs them gets them: see ``DevicePoolViews``).
    blocks_pinned: int = 0
    disk_blocks_total: int = 0  # the disk tier's capacity (0: no disk tier)
    disk_blocks_used: int = 0
    prefix_disk_hits_tokens: int = 0  # the share of prefix_hits_tokens loaded from disk
    # Sliding-window models: the window, and the blocks released so far because they fell
    # out of it (see ``KVCacheManager.release_out_of_window``).
    sliding_window: int | None = None
    window_freed_blocks: int = 0
    # Models whose layers are grouped by attention kind: one entry per group.
    groups: tuple[GroupCacheStats, ...] = ()

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hits_tokens / self.prefix_queries_tokens
            if self.prefix_queries_tokens
            else 0.0
        )


class _AllocationPlan(NamedTuple):
    table: list[int] | None
    start: int  # first token to write (after a prefix hit)
    total: int  # tokens the table must hold
    hit_ids: tuple[int, ...]
    num_loads: int
    num_new_blocks: int
    cow_indices: tuple[int, ...]
    num_blocks: int  # free blocks it takes


_NO_HIT = ComputedBlocks()
_NOTHING_NEW = Allocation()


def check_held(pool: BlockPool, held: Counter[int]) -> None:
    """Raise AssertionError unless each block's ref count is how often it is ``held``."""
    for block_id in range(pool.num_blocks):
        assert pool.ref_count(block_id) == held[block_id], (
            f"block {block_id}: ref_count {pool.ref_count(block_id)}, "
            f"held by {held[block_id]} tables"
        )


class DevicePoolViews:
    """What a manager does with its device pool alone: the elastic pool's shrink and
    grow, eviction, counts, pins (shared by ``KVCacheManager`` and the grouped manager).

    A *pin* is one reference a waiting request holds on each block of its cached prefix
    (``pin_prefix``, when it arrives), so that eviction cannot take them while it waits
    behind others: a pinned block is referenced, not cached-free. The pin ends when the
    request is admitted (its table takes its own references first), leaves
    (``release_pin``, ``free``), or gives way to an allocation that needs the room
    (``give_up_pins``)::

        arrives   pin_prefix     b0 b1 b2 cached -> ref +1 each (pinned)
        waits                    eviction takes other blocks; b0..b2 stay
        admitted  allocate_slots table [b0 b1 b2 new..]: ref +1, then the pin's -1
    """

    pool: BlockPool
    host_pool: BlockPool
    num_blocks: int
    watermark: float
    null_block: int | None
    _pins: dict[str, list[int]]  # request id -> the blocks its pin holds

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

    # ---- pins: a waiting request's cached prefix -----------------------------------

    def pin_prefix(self, request: Request) -> int:
        """Pin the device blocks of the request's cached prefix (the blocks admission
        would find now: ``get_computed_blocks``); returns how many. For a request that
        holds no blocks yet."""
        request_id = request.request_id
        if request_id in self._pins:
            raise ValueError(f"request {request_id!r} is already pinned")
        hit = self.get_computed_blocks(request)
        null = self.null_block
        block_ids = [
            b for table in (hit.block_ids, *hit.group_block_ids) for b in table if b != null
        ]
        if block_ids:
            self.pool.incref(block_ids)
            self._pins[request_id] = block_ids
        return len(block_ids)

    def release_pin(self, request: Request) -> int:
        """End the request's pin (none: nothing happens); returns how many blocks it
        held. A block nobody else holds becomes cached-free again, tail blocks first."""
        block_ids = self._pins.pop(request.request_id, None)
        if block_ids is None:
            return 0
        self.pool.decref(reversed(block_ids))
        return len(block_ids)

    def give_up_pins(self, requests: Iterable[Request], num_free_blocks: int) -> int:
        """Release the pins of ``requests``, in the order given, until ``num_free_blocks``
        blocks are free; returns how many pins it released. None when that many are free
        already, or when even all of theirs would not make them free (a pin gives way
        only where that makes the room)."""
        pool = self.pool
        if pool.num_free_blocks >= num_free_blocks:
            return 0
        pinned = [r for r in requests if r.request_id in self._pins]
        if pool.num_free_blocks + self._num_freed_by(pinned) < num_free_blocks:
            return 0
        released = 0
        for request in pinned:
            self.release_pin(request)
            released += 1
            if pool.num_free_blocks >= num_free_blocks:
                break
        return released

    @property
    def num_pinned_requests(self) -> int:
        return len(self._pins)

    def pinned_block_ids(self, request_id: str) -> list[int]:
        """The blocks the request's pin holds (a copy; empty if none)."""
        return list(self._pins.get(request_id, ()))

    def check_pins(self, held: Counter[int]) -> None:
        """A pinned request holds no table and no block twice; adds the pins' blocks to
        ``held`` (``check_invariants``)."""
        tables = self.live_block_tables()
        for request_id, block_ids in self._pins.items():
            assert request_id not in tables, f"{request_id}: pinned and admitted"
            assert block_ids and len(set(block_ids)) == len(block_ids), f"{request_id}: pin"
            held.update(block_ids)

    def live_block_tables(self) -> dict[str, list[int]]:
        raise NotImplementedError

    @property
    def num_pinned_only_blocks(self) -> int:
        """Blocks held by pins alone (cached-free but for them)."""
        return self._num_freed_by_pins(self._pins.values())

    def _num_freed_by(self, requests: Sequence[Request]) -> int:
        """Blocks that releasing these requests' pins would make free."""
        return self._num_freed_by_pins(self._pins[r.request_id] for r in requests)

    def _num_freed_by_pins(self, pins: Iterable[list[int]]) -> int:
        counts = Counter(b for block_ids in pins for b in block_ids)
        ref_count = self.pool.ref_count
        return sum(1 for b, n in counts.items() if ref_count(b) == n)

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
        for block_ids in self._pins.values():
            remap_table(block_ids, mapping)
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


class KVCacheManager(DevicePoolViews):
    """Block tables, prefix lookup, copy-on-write, fork, free; asks the tiers below.

    ``disk``: a ``DiskTier`` (None: no disk tier)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        watermark: float = 0.01,
        disk: DiskTier | None = None,
        sliding_window: int | None = None,
        pool: BlockPool | None = None,
        null_block: int | None = None,
        hash_salt: tuple = (),
        max_cached_first_blocks: int | None = None,
    ) -> None:
        """``max_cached_first_blocks``: ``BlockPool``'s bound on cached-free first blocks
        (a quantized cache that keeps first blocks in full precision). ``pool``,
        ``null_block``, ``hash_salt``: for one group of a model whose layers
        are grouped (``core/hybrid_kv.py``): the pool every group shares, its window
        placeholder, and what tells this group's block hashes from the others' (the same
        tokens hold other layers' K/V in each group)."""
        if pool is not None:
            num_blocks = pool.num_blocks
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self.watermark = watermark
        # The device pool's prefix index changes, for routers (core/cache_events.py).
        if pool is None:
            self.events = CacheEventLog()
            pool = BlockPool(
                num_blocks,
                events=self.events,
                track_released=True,
                max_cached_first_blocks=max_cached_first_blocks,
            )
        else:
            self.events = pool.events if pool.events is not None else CacheEventLog()
        self.pool = pool
        self._hash_salt = tuple(hash_salt)
        # Read-only alias of the pool's ref counts (the list is never replaced): the
        # decode fast path runs for every sequence every step.
        self._ref_counts = self.pool._ref_counts
        self.swap = HostSwapTier(num_host_blocks)
        self.disk = disk if enable_prefix_caching else None
        self._loads_in_flight: dict[int, bytes] = {}  # device block -> hash, last disk ops
        self._tables: dict[str, list[int]] = {}
        # Tuple views of `_tables`, built on demand and dropped when a table changes: the
        # same object step after step while a table is unchanged (see `block_table_tuple`).
        self._table_tuples: dict[str, tuple[int, ...]] = {}
        self._num_slots: dict[str, int] = {}  # tokens each table must hold
        # Full-block hashes, grown lazily, of requests holding blocks; a request still
        # waiting keeps its hashes in the one-entry `_pending_hashes` between
        # get_computed_blocks and allocate_slots, so a waiting request that is dropped
        # without free() leaves nothing behind.
        self._block_hashes: dict[str, list[bytes]] = {}
        self._pending_hashes: tuple[Request, list[bytes]] | None = None
        self._num_registered: dict[str, int] = {}  # leading table blocks offered to the index
        self._pins: dict[str, list[int]] = {}
        self._prefix_queries_tokens = 0
        self._prefix_hits_tokens = 0
        self._prefix_disk_hits_tokens = 0
        self._init_window(sliding_window, null_block)

    # ---- prefix lookup and allocation ----------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of full blocks, capped at ``num_tokens - 1`` tokens
        so that at least one token is computed (its logits are needed); none for a
        request that wants every prompt position's logprobs."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return _NO_HIT
        bs = self.block_size
        hashes = self._ensure_hashes(request)
        tokens = request.all_token_ids
        max_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        block_ids = []
        for i in range(max_blocks):
            block_id = self.pool.lookup(hashes[i], tokens[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            block_ids.append(block_id)
        num_disk = 0
        disk = self.disk
        if disk is not None:
            while (
                len(block_ids) + num_disk < max_blocks and hashes[len(block_ids) + num_disk] in disk
            ):
                num_disk += 1
        if not block_ids and not num_disk:
            return _NO_HIT
        return ComputedBlocks(tuple(block_ids), (len(block_ids) + num_disk) * bs, num_disk)

    def block_hashes(self, request: Request) -> Sequence[bytes]:
        """Hashes of the request's full blocks (all known tokens), in table order."""
        return self._ensure_hashes(request)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
        *,
        admission: bool = False,
    ) -> Allocation | None:
        """Grow the request's table to hold ``num_computed_tokens`` (+ the prefix hit)
        + ``num_new_tokens`` tokens.

        ``computed_blocks`` (from ``get_computed_blocks``, only for a request holding no
        blocks) become the start of the table. A shared block the new tokens would
        write into is replaced by a fresh one; if it holds computed tokens, the copy is
        in ``block_copies``. ``admission=True`` also keeps ``watermark`` of all blocks
        free. Returns ``None`` when there is no room, and then nothing has changed.
        """
        request_id = request.request_id
        if computed_blocks is None and self._fits_private_blocks(request, num_new_tokens):
            # The decode fast path: the tokens land in private blocks the table holds.
            total = request.num_computed_tokens + num_new_tokens
            if total > self._num_slots.get(request_id, 0):
                self._num_slots[request_id] = total
            return _NOTHING_NEW
        plan = self._plan_allocation(request, num_new_tokens, computed_blocks)
        table, start, total = plan.table, plan.start, plan.total
        hit_ids, num_loads, num_new_blocks = plan.hit_ids, plan.num_loads, plan.num_new_blocks
        cow_indices = plan.cow_indices
        bs = self.block_size
        num_hit = len(hit_ids) + num_loads

        if not num_hit and not num_new_blocks and not cow_indices:
            if table is None:
                self._count_prefix_query(request, computed_blocks)
                self._tables[request_id] = []
                self._table_changed(request_id)
                self._adopt_pending_hashes(request)
                self.release_pin(request)
            if total > self._num_slots.get(request_id, 0):
                self._num_slots[request_id] = total
            return _NOTHING_NEW

        free_after = self.pool.num_free_blocks - plan.num_blocks
        if free_after < 0 or (admission and free_after < self.watermark_blocks):
            return None

        if table is None:
            self._count_prefix_query(request, computed_blocks)
        if num_hit:
            self.pool.incref(hit_ids)  # before allocating, so they cannot be evicted
            table = list(hit_ids)
            self._num_registered[request_id] = num_hit
        elif table is None:
            table = []
        new_ids = self._allocate_device(num_loads + len(cow_indices) + num_new_blocks)
        if num_loads:
            self._plan_loads(request, len(table), new_ids[:num_loads])
            table.extend(new_ids[:num_loads])
        rest = new_ids[num_loads:]
        copies = []
        for idx, dst in zip(cow_indices, rest, strict=False):
            src = table[idx]
            table[idx] = dst
            self.pool.decref((src,))
            if idx * bs < start:  # the block holds computed tokens that must survive
                copies.append((src, dst))
        table.extend(rest[len(cow_indices) :])
        self._tables[request_id] = table
        self._table_changed(request_id)
        self._adopt_pending_hashes(request)
        self.release_pin(request)  # after the table took its references
        self._num_slots[request_id] = max(total, self._num_slots.get(request_id, 0))
        return Allocation(tuple(new_ids), tuple(copies))

    def blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
    ) -> int:
        """Free blocks ``allocate_slots`` with these arguments would take (fresh ones,
        copy-on-write copies, disk loads, cached-free hits revived); changes nothing."""
        if computed_blocks is None and self._fits_private_blocks(request, num_new_tokens):
            return 0
        return self._plan_allocation(request, num_new_tokens, computed_blocks).num_blocks

    def _fits_private_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """The decode fast path's test: the new tokens land in blocks the request's table
        already holds, each referenced by this table alone (nothing to allocate or copy)."""
        if num_new_tokens <= 0:
            return False
        table = self._tables.get(request.request_id)
        if table is None:
            return False
        start = request.num_computed_tokens
        bs = self.block_size
        last = (start + num_new_tokens - 1) // bs
        if last >= len(table):
            return False
        ref_counts = self._ref_counts
        first = start // bs
        return ref_counts[table[first]] == 1 and (
            first == last or all(ref_counts[b] == 1 for b in table[first + 1 : last + 1])
        )

    def _plan_allocation(
        self, request: Request, num_new_tokens: int, computed_blocks: ComputedBlocks | None
    ) -> _AllocationPlan:
        request_id = request.request_id
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if self.swap.holds(request_id):
            raise ValueError(f"request {request_id!r} is swapped out; swap_in first")
        bs = self.block_size
        table = self._tables.get(request_id)
        start = request.num_computed_tokens
        hit_ids: tuple[int, ...] = ()
        num_loads = 0
        if computed_blocks is not None and computed_blocks.num_tokens:
            if table:
                raise ValueError(f"request {request_id!r} already holds blocks")
            hit_ids, num_loads = computed_blocks.block_ids, computed_blocks.num_disk_blocks
            if computed_blocks.num_tokens != (len(hit_ids) + num_loads) * bs:
                raise ValueError(
                    "computed_blocks.num_tokens must be "
                    "(len(block_ids) + num_disk_blocks) * block_size"
                )
            self._check_hit(request, hit_ids, num_loads)
            start += computed_blocks.num_tokens
        num_hit = len(hit_ids) + num_loads
        num_held = num_hit if num_hit else (len(table) if table else 0)
        total = start + num_new_tokens
        num_new_blocks = max(0, -(-total // bs) - num_held)
        cow_indices = self._cow_indices(table, start, total) if table and num_new_tokens else ()
        num_revived = sum(1 for b in hit_ids if self.pool.ref_count(b) == 0)
        return _AllocationPlan(
            table,
            start,
            total,
            hit_ids,
            num_loads,
            num_new_blocks,
            cow_indices,
            num_revived + num_loads + num_new_blocks + len(cow_indices),
        )

    def release_unverified(self, request: Request) -> int:
        """Speculative decoding's rollback, by the computed length alone: the table forgets
        its slots past ``num_computed_tokens`` (a rejected draft's K/V stays where it was
        written and is overwritten when that position is computed again), and each block
        holding no computed token goes back to the pool, the tail first. Returns how many
        blocks left the table. Those blocks were never registered: a block is published
        to the prefix index (and so to the disk tier and the router's events) only once
        ``num_computed_tokens`` covers it, and drafts never count as computed::

            before   |b0 x x x x|b1 x t d1 d2|b3 d3 d4 .. |   t and d1 verified
            after    |b0 x x x x|b1 x t d1   |                b3 back to the pool
        """
        request_id = request.request_id
        computed = request.num_computed_tokens
        if self._num_slots.get(request_id, 0) > computed:
            self._num_slots[request_id] = computed
        table = self._tables.get(request_id)
        keep = -(-computed // self.block_size)
        if table is None or len(table) <= keep:
            return 0
        dropped = table[keep:]
        del table[keep:]
        self.pool.decref(reversed(dropped))
        self._table_changed(request_id)
        return len(dropped)

    def lookup_blocks(self, request: Request, num_blocks: int) -> list[int | None]:
        """For each of the request's first ``num_blocks`` full blocks, the device block
        holding it in the prefix index, or None (a sliding group needs only the blocks
        its window reaches, not an unbroken prefix). RAM only; fewer entries when the
        request has fewer full blocks."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = self._ensure_hashes(request)
        tokens = request.all_token_ids
        lookup = self.pool.lookup
        return [
            lookup(hashes[i], tokens[i * bs : (i + 1) * bs])
            for i in range(min(num_blocks, len(hashes)))
        ]

    def cache_full_blocks(self, request: Request) -> None:
        """Register in the prefix index the blocks made full by ``num_computed_tokens``."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        bs = self.block_size
        done = self._num_registered.get(request_id, 0)
        if request.num_computed_tokens // bs <= done:
            return  # nothing new is full: the common decode case
        table = self._tables.get(request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // bs, len(table))
        if num_full <= done:
            return
        hashes = self._ensure_hashes(request)
        tokens = request.all_token_ids
        extra_keys = self._extra_keys(request)
        disk = self.disk
        for i in range(done, num_full):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            registered = self.pool.register(
                table[i],
                hashes[i],
                block_tokens,
                parent_hash=hashes[i - 1] if i else None,
                extra_keys=extra_keys,
            )
            if registered and disk is not None:
                disk.block_registered(table[i], hashes[i], block_tokens)
        self._num_registered[request_id] = num_full

    # ---- sliding windows ------------------------------------------------------------

    def _init_window(self, sliding_window: int | None, null_block: int | None) -> None:
        """With a window (every layer of the model, or of this group, slides), one block
        is held by the manager for good (or by the grouped manager above it:
        ``null_block``): the placeholder every table points at in place of a block
        released out of the window (the worker never reads it, and slots stay
        ``table[p // block_size]``)."""
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        self.null_block: int | None = null_block
        self._window_freed = 0
        if sliding_window is not None and null_block is None:
            self.null_block = self.pool.allocate(1)[0]

    def release_out_of_window(self, request: Request) -> int:
        """Release the request's blocks that no later query can read: every position up
        to ``num_computed_tokens - sliding_window`` (the next query, at
        ``num_computed_tokens``, sees the ``sliding_window`` positions ending at itself).
        Their table entries become the placeholder; full hashed blocks stay findable
        as cached-free. Returns how many blocks were released (0 without a window)."""
        window = self.sliding_window
        if window is None:
            return 0
        table = self._tables.get(request.request_id)
        dead = max(0, request.num_computed_tokens - window + 1) // self.block_size
        null = self.null_block
        if not table or dead == 0 or table[min(dead, len(table)) - 1] == null:
            return 0
        released = [b for b in table[:dead] if b != null]
        for i in range(min(dead, len(table))):
            table[i] = null
        self.pool.incref([null] * len(released))
        self.pool.decref(released)
        self._table_changed(request.request_id)
        self._window_freed += len(released)
        return len(released)

    def _holds_placeholder(self, request: Request) -> bool:
        null = self.null_block
        return null is not None and null in self._tables.get(request.request_id, ())

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` cached tokens holds at its peak when each
        step computes at most ``max_step_tokens``: all of them without a window; with
        one, those a step's queries can see (the window before the step's first query,
        the step's own tokens) plus one for a window that does not start on a block, and
        the placeholder the manager holds."""
        full = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return full
        seen = self.sliding_window - 1 + max_step_tokens
        return min(full, -(-seen // self.block_size) + 1) + 1

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's table; every block gains one reference."""
        child_id, parent_id = child.request_id, parent.request_id
        if child_id in self._tables or self.swap.holds(child_id):
            raise ValueError(f"request {child_id!r} already holds blocks")
        if self.swap.holds(parent_id):
            raise ValueError(f"request {parent_id!r} is swapped out")
        table = self._tables.get(parent_id, [])
        self.pool.incref(table)
        self._tables[child_id] = list(table)
        self._table_changed(child_id)
        self._num_slots[child_id] = self._num_slots.get(parent_id, 0)
        self._num_registered[child_id] = self._num_registered.get(parent_id, 0)
        parent_hashes = self._block_hashes.get(parent_id)
        if parent_hashes:
            # Reuse the parent's hashes only where the child's tokens agree.
            bs = self.block_size
            n = min(len(parent_hashes), child.num_tokens // bs)
            p_tokens, c_tokens = parent.all_token_ids, child.all_token_ids
            while n and p_tokens[: n * bs] != c_tokens[: n * bs]:
                n -= 1
            self._block_hashes[child_id] = parent_hashes[:n]

    def free(self, request: Request) -> None:
        """Release every block of the request (device or host), tail first, and forget
        it. Full hashed blocks stay findable as cached-free until evicted. Safe to call
        on a request that holds nothing."""
        request_id = request.request_id
        self.release_pin(request)
        table = self._tables.pop(request_id, None)
        self._table_changed(request_id)
        if table:
            self.pool.decref(reversed(table))
        self.swap.release(request_id)
        self._num_slots.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        if self._pending_hashes is not None and self._pending_hashes[0] is request:
            self._pending_hashes = None
        self._num_registered.pop(request_id, None)

    # ---- the disk tier ------------------------------------------------------------

    def take_disk_ops(self) -> DiskOps:
        """The disk I/O planned since the last call, for this step's worker."""
        if self.disk is None:
            return NO_DISK_OPS
        ops = self.disk.take_ops()
        self._loads_in_flight = {block_id: block_hash for block_id, block_hash, _ in ops.loads}
        return ops

    def loads_failed(self, block_ids: set[int]) -> None:
        """The worker could not load these blocks of the last disk ops (file missing,
        truncated or corrupt): they leave the prefix index and the disk tier. Their
        holders must be freed and recomputed (``Scheduler.reject_loads``)."""
        for block_id in block_ids:
            block_hash = self._loads_in_flight.get(block_id)
            if block_hash is None:
                raise ValueError(f"block {block_id} was not loaded from disk in the last step")
            if self.pool.block_hash(block_id) == block_hash:
                self.pool.discard(block_id)
            if self.disk is not None:
                self.disk.discard(block_hash)

    # ---- swapping -----------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        """Room on the host for the request's blocks; False for a table holding the
        window placeholder (such a request is preempted by recompute)."""
        if self._holds_placeholder(request):
            return False
        _, num_new = self._plan_swap_out(request)
        return num_new <= self.swap.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier and release the device blocks.

        Returns the ``(device, host)`` moves the worker must perform, or ``None`` (no
        change) when the host tier lacks room.
        """
        request_id = request.request_id
        if self._holds_placeholder(request):
            return None
        plan, _ = self._plan_swap_out(request)
        moves = self.swap.move_out(request_id, plan)
        if moves is None:
            return None
        table = self._tables.pop(request_id, [])
        self._table_changed(request_id)
        self.pool.decref(reversed(table))
        self._num_registered[request_id] = 0
        return moves

    def can_swap_in(self, request: Request) -> bool:
        return self.blocks_to_swap_in(request) <= self.pool.num_free_blocks

    def blocks_to_swap_in(self, request: Request) -> int:
        """Free device blocks ``swap_in`` takes (fresh ones, cached-free ones revived)."""
        _, num_new, num_revived = self._plan_swap_in(request)
        return num_new + num_revived

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back to the device; returns the ``(host, device)``
        moves, or ``None`` (no change) when the device lacks room. Full blocks still
        cached on the device are reused instead of moved.

        The host blocks are released at once, and the worker runs a step's swap-outs
        before its swap-ins: so never ``swap_out`` after ``swap_in`` within one step
        (a swap-out could overwrite a host block before it is read back).
        """
        request_id = request.request_id
        if not self.swap.holds(request_id):
            raise ValueError(f"request {request_id!r} is not swapped out")
        plan, num_new, num_revived = self._plan_swap_in(request)
        if num_new + num_revived > self.pool.num_free_blocks:
            return None
        reused = [device for _, device, _ in plan if device is not None]
        self.pool.incref(reused)  # before allocating, so they cannot be evicted
        new_device = iter(self._allocate_device(num_new))
        copies, table = [], []
        for host, device, fill in plan:
            if device is None:
                device = next(new_device)
                copies.append((host, device, fill))
            table.append(device)
        self.swap.moved_in(request_id, copies)
        self._tables[request_id] = table
        self._table_changed(request_id)
        self._num_registered[request_id] = 0
        self.cache_full_blocks(request)
        return [(host, device) for host, device, _ in copies]

    # ---- resizing (the elastic pool; core/compaction.py plans the moves) ------------

    def _blocks_relocated(self, mapping: dict[int, int]) -> None:
        """Every block table and the swap tier's record of which blocks copy which."""
        self.remap_tables(mapping)
        self.swap.device_blocks_relocated(mapping)

    def remap_tables(self, mapping: dict[int, int]) -> None:
        """Rename blocks in every table after the pool moved them (compaction)."""
        for request_id, table in self._tables.items():
            if remap_table(table, mapping):
                self._table_changed(request_id)
        if self.null_block is not None:
            self.null_block = mapping.get(self.null_block, self.null_block)

    def pool_resized(self) -> None:
        """The shared pool grew or shrank (a grouped manager resized it)."""
        self._resized()

    def _tail_dropped(self, block_ids: range) -> None:
        # Their content is gone, as a re-allocated block's is.
        self.swap.device_blocks_allocated(block_ids)

    # ---- views --------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """The request's device block table (a copy; empty if it holds none)."""
        return list(self._tables.get(request_id, ()))

    def block_table_tuple(self, request_id: str) -> tuple[int, ...]:
        """The request's device block table as a tuple (empty if it holds none): the same
        object from call to call until the table changes, so a worker can tell an
        unchanged table by identity and skip rewriting it."""
        view = self._table_tuples.get(request_id)
        if view is None:
            table = self._tables.get(request_id)
            if table is None:
                return ()
            view = self._table_tuples[request_id] = tuple(table)
        return view

    def group_block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The tables of other KV cache groups: none here, this manager is one group (see
        ``core/hybrid_kv.py``)."""
        return ()

    def host_block_table(self, request_id: str) -> list[int]:
        return self.swap.table(request_id)

    def is_swapped(self, request_id: str) -> bool:
        return self.swap.holds(request_id)

    @property
    def host_pool(self) -> BlockPool:
        """The swap tier's pool (read it; the tier keeps its books)."""
        return self.swap.pool

    def num_slots(self, request_id: str) -> int:
        """How many tokens the request's table was last asked to hold."""
        return self._num_slots.get(request_id, 0)

    @property
    def num_free_host_blocks(self) -> int:
        return self.swap.num_free_blocks

    def stats(self) -> CacheStats:
        used = self.pool.num_used_blocks
        cached = self.pool.num_cached_free_blocks
        retired = self.pool.num_retired_blocks
        return CacheStats(
            block_size=self.block_size,
            blocks_total=self.num_blocks,
            blocks_used=used,
            blocks_cached_free=cached,
            blocks_free=self.num_blocks - used - cached - retired,
            host_blocks_total=self.num_host_blocks,
            host_blocks_used=self.swap.pool.num_used_blocks,
            prefix_queries_tokens=self._prefix_queries_tokens,
            prefix_hits_tokens=self._prefix_hits_tokens,
            blocks_retired=retired,
            blocks_pinned=self.num_pinned_only_blocks,
            disk_blocks_total=self.disk.capacity if self.disk is not None else 0,
            disk_blocks_used=len(self.disk) if self.disk is not None else 0,
            prefix_disk_hits_tokens=self._prefix_disk_hits_tokens,
            sliding_window=self.sliding_window,
            window_freed_blocks=self._window_freed,
        )

    def num_blocks_held(self) -> int:
        """Distinct blocks this manager's tables hold, the placeholder aside."""
        held = {b for table in self._tables.values() for b in table}
        held.discard(self.null_block)  # type: ignore[arg-type]
        return len(held)

    def live_block_tables(self) -> dict[str, list[int]]:
        """Every device block table, by request id (copies)."""
        return {rid: list(table) for rid, table in self._tables.items()}

    def live_group_block_tables(self) -> list[dict[str, list[int]]]:
        """``live_block_tables`` of each KV cache group: this manager is one."""
        return [self.live_block_tables()]

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each KV cache group's window (None: full attention): this manager is one."""
        return (self.sliding_window,)

    def live_host_block_tables(self) -> dict[str, list[int]]:
        """Every host (swap tier) block table, by request id (copies)."""
        return self.swap.tables()

    def check_invariants(self) -> None:
        """Raise AssertionError unless pools, tables and the prefix index agree."""
        bs = self.block_size
        self.pool.check_invariants(bs, verify_hashes=True)
        self.swap.check_invariants(self.num_slots, bs)
        if self.disk is not None:
            self.disk.check_invariants()
        assert not any(self.swap.holds(rid) for rid in self._tables), "request on both tiers"
        held: Counter[int] = Counter()
        if self.null_block is not None:
            held[self.null_block] = 1  # the manager's own reference
        self.check_tables(held)
        self.check_pins(held)
        check_held(self.pool, held)

    def check_tables(self, held: Counter[int]) -> None:
        """The checks of ``check_invariants`` on this manager's own tables; adds how many
        times each block is held to ``held`` (a grouped manager sums its groups')."""
        bs = self.block_size
        for request_id, table in self._tables.items():
            blocks = [b for b in table if b != self.null_block]
            assert len(set(blocks)) == len(blocks), f"{request_id}: block twice in a table"
            assert len(table) * bs >= self._num_slots.get(request_id, 0), (
                f"{request_id}: table too short for its slots"
            )
            held.update(table)
        for request_id, view in self._table_tuples.items():
            assert view == tuple(self._tables.get(request_id, ())), (
                f"{request_id}: stale block table tuple"
            )
        for request_id, table in self._tables.items():
            hashes = self._block_hashes.get(request_id, ())
            for i, block_id in enumerate(table[: len(hashes)]):
                block_hash = self.pool.block_hash(block_id)
                assert block_hash is None or block_hash == hashes[i], (
                    f"{request_id}: block {block_id} at {i} registered under another hash"
                )

    # ---- internal -------------------------------------------------------------------

    def _resized(self) -> None:
        self.num_blocks = self.pool.num_blocks

    def _ensure_hashes(self, request: Request) -> list[bytes]:
        """The request's full-block hashes, extended incrementally as tokens arrive."""
        request_id = request.request_id
        hashes = self._block_hashes.get(request_id)
        if hashes is None:
            pending = self._pending_hashes
            hashes = pending[1] if pending is not None and pending[0] is request else []
            if request_id in self._tables or self.swap.holds(request_id):
                self._block_hashes[request_id] = hashes
                if pending is not None and pending[0] is request:
                    self._pending_hashes = None
            else:
                self._pending_hashes = (request, hashes)
        bs = self.block_size
        num_full = request.num_tokens // bs
        if len(hashes) < num_full:
            tokens, extra_keys = request.all_token_ids, self._extra_keys(request)
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_full):
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra_keys)
                hashes.append(parent)
        return hashes

    def _extra_keys(self, request: Request) -> tuple:
        salt = self._hash_salt
        return request.extra_keys + salt if salt else request.extra_keys

    def _table_changed(self, request_id: str) -> None:
        """Drop the tuple view of a table just created, changed or released."""
        self._table_tuples.pop(request_id, None)

    def _count_prefix_query(self, request: Request, computed: ComputedBlocks | None) -> None:
        # Counted at admission, not in get_computed_blocks: a scheduler asks again every
        # step while a request waits for room, and that must not inflate the hit rate.
        if computed is not None and self.enable_prefix_caching:
            self._prefix_queries_tokens += request.num_tokens
            self._prefix_hits_tokens += computed.num_tokens
            self._prefix_disk_hits_tokens += computed.num_disk_blocks * self.block_size

    def _adopt_pending_hashes(self, request: Request) -> None:
        pending = self._pending_hashes
        if pending is not None and pending[0] is request:
            self._block_hashes[request.request_id] = pending[1]
            self._pending_hashes = None

    def _check_hit(self, request: Request, hit_ids: tuple[int, ...], num_loads: int) -> None:
        hashes = self._ensure_hashes(request)
        if len(hit_ids) + num_loads > len(hashes):
            raise ValueError("computed_blocks cover more than the request's full blocks")
        null = self.null_block  # a grouped window's hit starts with placeholders
        stale = any(
            self.pool.block_hash(b) != hashes[i] for i, b in enumerate(hit_ids) if b != null
        )
        if num_loads:
            disk = self.disk
            end = len(hit_ids) + num_loads
            stale = stale or disk is None or any(h not in disk for h in hashes[len(hit_ids) : end])
        if stale:
            raise ValueError(
                "stale computed_blocks: call get_computed_blocks right before allocate_slots"
            )

    def _plan_loads(self, request: Request, first: int, block_ids: list[int]) -> None:
        """Index fresh device blocks under the request's disk hits from block ``first`` on
        and plan their loads."""
        assert self.disk is not None
        bs = self.block_size
        hashes = self._ensure_hashes(request)
        tokens, extra_keys = request.all_token_ids, self._extra_keys(request)
        for i, block_id in enumerate(block_ids, start=first):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            self.pool.register(
                block_id,
                hashes[i],
                block_tokens,
                parent_hash=hashes[i - 1] if i else None,
                extra_keys=extra_keys,
            )
            self.disk.load(block_id, hashes[i], block_tokens)

    def _cow_indices(self, table: list[int], start: int, total: int) -> tuple[int, ...]:
        """Indices of shared blocks the tokens ``start .. total-1`` would write into."""
        bs = self.block_size
        first, end = start // bs, min(len(table), -(-total // bs))
        ref_count = self.pool.ref_count
        return tuple(i for i in range(first, end) if ref_count(table[i]) > 1)

    def _fill(self, request: Request, index: int) -> int:
        """Computed tokens of the request that live in its block ``index``."""
        return max(0, min(self.block_size, request.num_computed_tokens - index * self.block_size))

    def _plan_swap_out(self, request: Request) -> tuple[SwapPlan, int]:
        table = self._tables.get(request.request_id, ())
        return self.swap.plan_out(table, [self._fill(request, i) for i in range(len(table))])

    def _plan_swap_in(self, request: Request) -> tuple[SwapPlan, int, int]:
        bs = self.block_size
        hashes = self._ensure_hashes(request) if self.enable_prefix_caching else ()
        tokens = request.all_token_ids
        plan: SwapPlan = []
        num_new = num_revived = 0
        is_held = self._is_held
        for i, host in enumerate(self.swap.table(request.request_id)):
            fill = self._fill(request, i)
            device = None
            if fill == bs and i < len(hashes):
                device = self.pool.lookup(hashes[i], tokens[i * bs : (i + 1) * bs])
                if device is not None and self.pool.ref_count(device) == 0:
                    num_revived += 1
            if device is None:
                device = self.swap.reusable_device_copy(host, fill, is_held)
            if device is None:
                num_new += 1
            plan.append((host, device, fill))
        return plan, num_new, num_revived

    def _is_held(self, block_id: int) -> bool:
        return self._ref_counts[block_id] > 0

    def _allocate_device(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        assert blocks is not None, "caller checked there was room"
        self.swap.device_blocks_allocated(blocks)
        return blocks
