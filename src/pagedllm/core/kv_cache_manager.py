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

With a disk tier, a prefix lookup goes on past the last block found in RAM through
the hashes the disk holds::

    |<- RAM hits (block_ids) ->|<- disk hits (num_disk_blocks) ->|<- computed ... ->|

The manager keeps the tables; each other job has a collaborator owning its state:

    device_pool.DevicePoolViews   base class: elastic shrink/grow, eviction, counts, pins
    pins.Pins                     waiting requests' references on their cached prefix
    request_hashes.RequestHashes  each request's full-block hashes (prefix index keys)
    disk_loads.DiskLoads          disk hits, the loads admission plans, failed loads
    window_release.WindowRelease  sliding-window release and its peak block count
    tiers.HostSwapTier            the host pool swapped requests live in
    kv_records                    ComputedBlocks, Allocation, CacheStats (what it returns)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.cache_events import CacheEventLog
from pagedllm.core.compaction import remap_table
from pagedllm.core.device_pool import DevicePoolViews
from pagedllm.core.disk_loads import DiskLoads
from pagedllm.core.kv_records import Allocation, CacheStats, ComputedBlocks, check_held
from pagedllm.core.pins import Pins
from pagedllm.core.request import Request
from pagedllm.core.request_hashes import RequestHashes
from pagedllm.core.tiers import DiskOps, DiskTier, HostSwapTier, SwapPlan
from pagedllm.core.window_release import WindowRelease


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
        # Read-only alias of the pool's ref counts (the list is never replaced): the
        # decode fast path runs for every sequence every step.
        self._ref_counts = self.pool._ref_counts
        self.swap = HostSwapTier(num_host_blocks)
        self.disk = disk if enable_prefix_caching else None
        self.disk_loads = DiskLoads(pool, self.disk)
        self._tables: dict[str, list[int]] = {}
        # Tuple views of `_tables`, built on demand and dropped when a table changes: the
        # same object step after step while a table is unchanged (see `block_table_tuple`).
        self._table_tuples: dict[str, tuple[int, ...]] = {}
        self._num_slots: dict[str, int] = {}  # tokens each table must hold
        self.hashes = RequestHashes(block_size, self._holds_blocks, hash_salt)
        self._num_registered: dict[str, int] = {}  # leading table blocks offered to the index
        self.pins = Pins(pool)
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
        hashes = self.hashes.ensure(request)
        tokens = request.all_token_ids
        max_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        block_ids = []
        for i in range(max_blocks):
            block_id = self.pool.lookup(hashes[i], tokens[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            block_ids.append(block_id)
        num_disk = self.disk_loads.num_hits(hashes, len(block_ids), max_blocks)
        if not block_ids and not num_disk:
            return _NO_HIT
        return ComputedBlocks(tuple(block_ids), (len(block_ids) + num_disk) * bs, num_disk)

    def block_hashes(self, request: Request) -> Sequence[bytes]:
        """Hashes of the request's full blocks (all known tokens), in table order."""
        return self.hashes.ensure(request)

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
                self.hashes.adopt_pending(request)
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
            hashes = self.hashes.ensure(request)
            tokens, extra_keys = request.all_token_ids, self.hashes.extra_keys(request)
            self.disk_loads.plan(new_ids[:num_loads], len(table), hashes, tokens, extra_keys, bs)
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
        self.hashes.adopt_pending(request)
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
        hashes = self.hashes.ensure(request)
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
        hashes = self.hashes.ensure(request)
        tokens = request.all_token_ids
        extra_keys = self.hashes.extra_keys(request)
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
        """With a window (``core/window_release.py``), one block is held by the manager
        for good (or by the grouped manager above it: ``null_block``): the placeholder
        every table points at in place of a block released out of the window."""
        self.window = WindowRelease(sliding_window, self.block_size)
        self.null_block: int | None = null_block
        if sliding_window is not None and null_block is None:
            self.null_block = self.pool.allocate(1)[0]

    @property
    def sliding_window(self) -> int | None:
        return self.window.sliding_window

    def release_out_of_window(self, request: Request) -> int:
        """Release the request's blocks that no later query can read (their table
        entries become the placeholder; full hashed blocks stay findable as
        cached-free). Returns how many blocks were released (0 without a window)."""
        table = self._tables.get(request.request_id)
        released = self.window.release(
            table,
            request.num_computed_tokens,
            self.null_block,  # type: ignore[arg-type]
            self.pool,
        )
        if released:
            self._table_changed(request.request_id)
        return released

    def _holds_placeholder(self, request: Request) -> bool:
        null = self.null_block
        return null is not None and null in self._tables.get(request.request_id, ())

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """``WindowRelease.blocks_needed``: the most blocks a sequence holds at once."""
        return self.window.blocks_needed(num_tokens, max_step_tokens)

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
        self.hashes.fork(parent, child)

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
        self.hashes.forget(request)
        self._num_registered.pop(request_id, None)

    # ---- the disk tier ------------------------------------------------------------

    def take_disk_ops(self) -> DiskOps:
        """The disk I/O planned since the last call, for this step's worker."""
        return self.disk_loads.take_ops()

    def loads_failed(self, block_ids: set[int]) -> None:
        """The worker could not load these blocks of the last disk ops (file missing,
        truncated or corrupt): they leave the prefix index and the disk tier. Their
        holders must be freed and recomputed (``Scheduler.reject_loads``)."""
        self.disk_loads.failed(block_ids)

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
            window_freed_blocks=self.window.num_freed,
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
            hashes = self.hashes.by_request.get(request_id, ())
            for i, block_id in enumerate(table[: len(hashes)]):
                block_hash = self.pool.block_hash(block_id)
                assert block_hash is None or block_hash == hashes[i], (
                    f"{request_id}: block {block_id} at {i} registered under another hash"
                )

    # ---- internal -------------------------------------------------------------------

    def _resized(self) -> None:
        self.num_blocks = self.pool.num_blocks

    def _holds_blocks(self, request_id: str) -> bool:
        return request_id in self._tables or self.swap.holds(request_id)

    @property
    def _block_hashes(self) -> dict[str, list[bytes]]:
        """The kept hashes by request id (``RequestHashes.by_request``; tests read it)."""
        return self.hashes.by_request

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

    def _check_hit(self, request: Request, hit_ids: tuple[int, ...], num_loads: int) -> None:
        hashes = self.hashes.ensure(request)
        if len(hit_ids) + num_loads > len(hashes):
            raise ValueError("computed_blocks cover more than the request's full blocks")
        null = self.null_block  # a grouped window's hit starts with placeholders
        stale = any(
            self.pool.block_hash(b) != hashes[i] for i, b in enumerate(hit_ids) if b != null
        )
        if num_loads:
            end = len(hit_ids) + num_loads
            stale = stale or not self.disk_loads.holds_all(hashes[len(hit_ids) : end])
        if stale:
            raise ValueError(
                "stale computed_blocks: call get_computed_blocks right before allocate_slots"
            )

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
        hashes = self.hashes.ensure(request) if self.enable_prefix_caching else ()
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
